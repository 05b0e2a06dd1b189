"""Classify over the wire: the ViT against the reference goldens (pixels and
PNG), JPEG, image resizing, and label scoring with the LM."""
import json
import math
import os

import pytest

import moh_testlib as lib

with open(os.path.join(lib.VIT_DIR, "golden.json")) as f:
    _GOLDEN = json.load(f)
CASES = _GOLDEN["cases"]
LABELS = ["zero", "one", "two", "three", "four"]
VIT_LAYERS = [(6, 2, 2), (6, 1, 3), (6, 6, 0)]  # heads, shared, trained K
VIT_TOKENS = 1 + (16 // 4)**2  # class token + patches


def flat(pixels):
    return [v for channel in pixels for row in channel for v in row]


def pixels_request(api, pixels, ratio=0.0, **fields):
    request = api.pb.ClassifyRequest(model="demo-vit", **fields)
    request.pixels.shape.extend([3, len(pixels[0]), len(pixels[0][0])])
    request.pixels.data.extend(flat(pixels))
    request.activation.ratio = ratio
    return request


def scores(response):
    return {c.index: c.score for c in response.classes}


def vit_top_k(ratio):
    if ratio == 0:
        return [k for _, _, k in VIT_LAYERS]
    return [
        max(0, min(h - s, math.floor(ratio * h + 0.5) - s)) if h > s else 0
        for h, s, _ in VIT_LAYERS
    ]


@pytest.mark.parametrize("case", CASES,
                         ids=["ratio%g-image%d" % (c["ratio"], c["image"])
                              for c in CASES])
def test_pixels_match_the_reference(api, stub, case):
    # The goldens' "pixels" are the raw [0, 1] images; the server normalizes.
    response = stub.Classify(pixels_request(api,
                                            _GOLDEN["pixels"][case["image"]],
                                            ratio=case["ratio"],
                                            include_routing=True),
                             timeout=lib.RPC_TIMEOUT)
    expected = lib.softmax(case["logits"])
    # All 5 classes by default, best first, with their labels.
    assert [c.index for c in response.classes] == sorted(
        range(5), key=lambda i: -expected[i])
    for c in response.classes:
        assert c.label == LABELS[c.index]
        assert c.score == pytest.approx(expected[c.index], abs=1e-4)
    assert response.effective_activation_ratio == pytest.approx(
        case["effective_ratio"], abs=1e-5)
    routing = response.routing
    assert routing.tokens == VIT_TOKENS
    assert len(routing.layers) == 3
    for layer, (heads, shared, _), k in zip(routing.layers, VIT_LAYERS,
                                            vit_top_k(case["ratio"])):
        counts = list(layer.head_tokens)
        assert len(counts) == heads
        assert counts[:shared] == [VIT_TOKENS] * shared
        assert sum(counts) == VIT_TOKENS * (shared + k)


def test_top_n_returns_the_best_classes(api, stub):
    full = stub.Classify(pixels_request(api, _GOLDEN["pixels"][1]),
                         timeout=lib.RPC_TIMEOUT)
    top2 = stub.Classify(pixels_request(api, _GOLDEN["pixels"][1], top_n=2),
                         timeout=lib.RPC_TIMEOUT)
    assert len(full.classes) == 5
    assert list(top2.classes) == list(full.classes[:2])
    assert sum(c.score for c in full.classes) == pytest.approx(1.0, abs=1e-5)


def test_png_equals_its_decoded_pixels(api, stub):
    for pixels in _GOLDEN["pixels"]:
        png = stub.Classify(api.pb.ClassifyRequest(model="demo-vit",
                                                   image=lib.encode_png(pixels)),
                            timeout=lib.RPC_TIMEOUT)
        decoded = stub.Classify(pixels_request(api, lib.quantize(pixels)),
                                timeout=lib.RPC_TIMEOUT)
        assert [c.index for c in png.classes] == [
            c.index for c in decoded.classes]
        for index, score in scores(decoded).items():
            assert scores(png)[index] == pytest.approx(score, abs=1e-5)


def test_larger_png_is_resized_like_torch_antialiased_bilinear(api, stub):
    import torch
    import torch.nn.functional as F
    gen = torch.Generator().manual_seed(5)
    image = torch.rand(1, 3, 40, 40, generator=gen)
    image = (image * 255).round() / 255  # exactly representable in a PNG
    png = lib.encode_png(image[0].tolist())
    resized = F.interpolate(image, size=(16, 16), mode="bilinear",
                            antialias=True, align_corners=False)
    expected = stub.Classify(pixels_request(api,
                                            resized[0].clamp(0, 1).tolist()),
                             timeout=lib.RPC_TIMEOUT)
    got = stub.Classify(api.pb.ClassifyRequest(model="demo-vit", image=png),
                        timeout=lib.RPC_TIMEOUT)
    for index, score in scores(expected).items():
        assert scores(got)[index] == pytest.approx(score, abs=1e-3)


def test_jpeg_equals_its_decoded_pixels(api, stub):
    # Made with libjpeg-turbo, quality 100, greyscale: 8x8 quadrants of 60
    # (top left, bottom right) and 200, which decode exactly.
    with open(os.path.join(lib.SOURCE_DIR, "tests", "testdata",
                           "quadrants_16x16_grey.jpg"), "rb") as f:
        jpeg = f.read()
    got = stub.Classify(api.pb.ClassifyRequest(model="demo-vit", image=jpeg),
                        timeout=lib.RPC_TIMEOUT)
    grey = [[(60 if (x < 8) == (y < 8) else 200) / 255.0 for x in range(16)]
            for y in range(16)]
    expected = stub.Classify(pixels_request(api, [grey] * 3),
                             timeout=lib.RPC_TIMEOUT)
    assert [c.index for c in got.classes] == [c.index for c in expected.classes]
    for index, score in scores(expected).items():
        assert scores(got)[index] == pytest.approx(score, abs=1e-5)


def test_grayscale_png_is_three_equal_channels(api, stub):
    import struct
    import zlib
    size, value = 16, 77

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data +
                struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    raw = b"".join(b"\0" + bytes([value] * size) for _ in range(size))
    gray = (b"\x89PNG\r\n\x1a\n" +
            chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    got = stub.Classify(api.pb.ClassifyRequest(model="demo-vit", image=gray),
                        timeout=lib.RPC_TIMEOUT)
    rgb = [[[value / 255.0] * size for _ in range(size)] for _ in range(3)]
    expected = stub.Classify(pixels_request(api, rgb), timeout=lib.RPC_TIMEOUT)
    for index, score in scores(expected).items():
        assert scores(got)[index] == pytest.approx(score, abs=1e-5)


def test_concurrent_classify_requests_get_their_own_results(api, stub):
    from concurrent.futures import ThreadPoolExecutor
    requests = [(case, pixels_request(api, _GOLDEN["pixels"][case["image"]],
                                      ratio=case["ratio"])) for case in CASES]
    with ThreadPoolExecutor(len(requests)) as pool:
        responses = list(pool.map(
            lambda r: stub.Classify(r[1], timeout=lib.RPC_TIMEOUT), requests))
    for (case, _), response in zip(requests, responses):
        expected = lib.softmax(case["logits"])
        for c in response.classes:
            assert c.score == pytest.approx(expected[c.index], abs=1e-4)


def test_a_batch_out_of_memory_runs_again_in_halves(api, server_factory):
    """A Classify batch the device has no memory for (injected: batches of
    more than one image) runs again in halves, down to single images: every
    request gets its own result, and the metrics and log say so."""
    server = server_factory("classify_out_of_memory", [
        ("demo-vit", lib.VIT_DIR,
         "batching { max_batch_size: 4 max_queue_delay_ms: 10000 }"),
    ], env={"MOH_TEST_OUT_OF_MEMORY_OVER_BATCH": "1"})
    stub = api.grpc.InferenceStub(server.channel())
    from concurrent.futures import ThreadPoolExecutor
    cases = CASES[:4]
    requests = [pixels_request(api, _GOLDEN["pixels"][case["image"]],
                               ratio=case["ratio"]) for case in cases]
    with ThreadPoolExecutor(len(requests)) as pool:
        responses = list(pool.map(
            lambda r: stub.Classify(r, timeout=lib.RPC_TIMEOUT), requests))
    for case, response in zip(cases, responses):
        expected = lib.softmax(case["logits"])
        for c in response.classes:
            assert c.score == pytest.approx(expected[c.index], abs=1e-4)
    # The batch of 4 and its two halves of 2 ran out of memory.
    samples = server.samples()
    assert lib.metric_value(samples, "moh_steps_retried_total",
                            model="demo-vit") == 3
    assert lib.metric_value(samples, "moh_requests_total", model="demo-vit",
                            code="OK") == 4
    assert ("model demo-vit: a Classify batch of 4 failed: out of memory: "
            "injected: batch of 4 over $MOH_TEST_OUT_OF_MEMORY_OVER_BATCH; "
            "its halves run again") in server.log()


def test_lm_label_scoring(api, stub):
    labels = ["yes", "no", "maybe so"]
    response = stub.Classify(api.pb.ClassifyRequest(model="demo-lm",
                                                    text="Once upon a time",
                                                    labels=labels,
                                                    include_routing=True),
                             timeout=lib.RPC_TIMEOUT)
    classes = list(response.classes)
    assert sorted(c.label for c in classes) == sorted(labels)
    for c in classes:
        assert labels[c.index] == c.label
        assert c.log_likelihood < 0
    # Best first; scores are the likelihoods normalized over the labels.
    assert [c.score for c in classes] == sorted(
        (c.score for c in classes), reverse=True)
    expected = lib.softmax([c.log_likelihood for c in classes])
    for c, p in zip(classes, expected):
        assert c.score == pytest.approx(p, abs=1e-5)
    assert response.effective_activation_ratio == pytest.approx(9 / 16)
    assert response.routing.tokens > 0
    top1 = stub.Classify(api.pb.ClassifyRequest(model="demo-lm",
                                                text="Once upon a time",
                                                labels=labels, top_n=1),
                         timeout=lib.RPC_TIMEOUT)
    assert [c.label for c in top1.classes] == [classes[0].label]
