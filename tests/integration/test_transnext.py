"""MoH-ViT TransNeXt (the released MoH-ViT layout) through the real server.

The tiny checkpoint of tests/reference/make_transnext_fixtures.py is served
twice: from its release training container (checkpoint.pth with optimizer
state and an argparse.Namespace, loaded directly) and from what moh-convert
writes out of that container. Pixels at several ratios give the Python
reference's probabilities and head loads per (stage, block, head); PNG and
JPEG images are preprocessed as the authors evaluated (PIL bicubic shorter
side, centre crop) and classified as the reference classifies the same image
preprocessed by PIL. A broken checkpoint fails its model only."""
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys

import pytest

import moh_testlib as lib

sys.path.insert(0, os.path.join(lib.SOURCE_DIR, "tests", "reference"))
import moh_transnext  # noqa: E402

TINY = os.path.join(lib.FIXTURES, "transnext_tiny")
PREPROCESS = os.path.join(lib.FIXTURES, "preprocess")
with open(os.path.join(TINY, "golden.json")) as f:
    GOLDEN = json.load(f)
with open(os.path.join(TINY, "config.json")) as f:
    CONFIG = json.load(f)
CONVERT = os.path.join(os.path.dirname(os.path.dirname(lib.SERVER)), "tools",
                       "moh-convert")


@pytest.fixture(scope="module")
def converted(workdir):
    """moh-convert's output for the tiny container and its config."""
    out = os.path.join(workdir, "transnext_converted")
    subprocess.run([CONVERT, "--input=" + os.path.join(TINY, "checkpoint.pth"),
                    "--output_dir=" + out,
                    "--config=" + os.path.join(TINY, "config.json")],
                   check=True, capture_output=True, timeout=60)
    return out


@pytest.fixture(scope="module")
def broken(workdir):
    """The tiny config beside a container whose pickle runs a command."""
    out = os.path.join(workdir, "transnext_broken")
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(TINY, "config.json"), out)
    with open(os.path.join(out, "checkpoint.pth"), "wb") as f:
        f.write(b"not a zip archive")
    return out


@pytest.fixture(scope="module")
def server(start_server, converted, broken):
    return start_server("transnext", [
        ("tiny", TINY, "batching { max_batch_size: 8 max_queue_delay_ms: 20 }"),
        ("converted", converted, ""),
        ("broken", broken, ""),
    ], wait_serving=False)


stub, models = lib.model_fixtures()


@pytest.fixture(scope="module")
def reference():
    return moh_transnext.load_model(TINY)


def softmax(logits):
    import math
    top = max(logits)
    e = [math.exp(v - top) for v in logits]
    return [v / sum(e) for v in e]


def pixels_request(api, model, pixels_u8, ratio=0.0, **fields):
    request = api.pb.ClassifyRequest(model=model, **fields)
    size = len(pixels_u8[0])
    request.pixels.shape.extend([3, size, size])
    request.pixels.data.extend(v / 255.0 for channel in pixels_u8
                               for row in channel for v in row)
    request.activation.ratio = ratio
    return request


def expect_probabilities(response, logits, labels):
    expected = softmax(logits)
    assert len(response.classes) == 5
    for c in response.classes:
        assert c.label == labels[c.index]
        assert c.score == pytest.approx(expected[c.index], abs=1e-4)
    assert [c.index for c in response.classes] == sorted(
        range(len(expected)), key=lambda i: -expected[i])[:5]


def test_list_models_shows_heads_per_stage(api, models):
    for name in ("tiny", "converted"):
        info = models[name]
        assert info.state == api.pb.ModelInfo.READY, info.failure_reason
        assert info.family == "transnext"
        assert list(info.labels) == CONFIG["labels"]
        layers = [(l.stage, l.block, l.num_heads, l.shared_heads,
                   l.default_top_k) for l in info.layers]
        assert layers == [(g["stage"] - 1, g["block"], g["num_heads"],
                           g["shared_heads"], g["trained_top_k"])
                          for g in GOLDEN["layers"]]
        assert info.max_seq_len == 16 * 16  # stage 1's tokens


def test_a_broken_checkpoint_fails_its_model_only(api, models):
    info = models["broken"]
    assert info.state == api.pb.ModelInfo.FAILED
    assert "checkpoint.pth" in info.failure_reason


@pytest.mark.parametrize("model", ["tiny", "converted"])
@pytest.mark.parametrize("case", GOLDEN["cases"],
                         ids=["ratio%g" % c["ratio"] for c in GOLDEN["cases"]])
def test_pixels_match_the_reference(api, stub, models, model, case):
    for image, pixels in enumerate(GOLDEN["pixels_u8"]):
        response = stub.Classify(
            pixels_request(api, model, pixels, ratio=case["ratio"],
                           include_routing=True), timeout=lib.RPC_TIMEOUT)
        expect_probabilities(response, case["logits"][image], CONFIG["labels"])
        routing = response.routing
        assert len(routing.layers) == len(GOLDEN["layers"])
        for l, layer in enumerate(routing.layers):
            golden = GOLDEN["layers"][l]
            assert (layer.layer, layer.stage, layer.block, layer.tokens) == (
                l, golden["stage"] - 1, golden["block"], golden["tokens"])
            assert list(layer.head_tokens) == \
                case["head_token_counts"][l][image]
        pairs = sum(g["tokens"] * g["num_heads"] for g in GOLDEN["layers"])
        served = sum(sum(c[image]) for c in case["head_token_counts"])
        assert response.effective_activation_ratio == pytest.approx(
            served / pairs,
            rel=1e-6)


def test_concurrent_requests_at_their_own_ratios(api, stub, models):
    mixed = GOLDEN["mixed"][0]
    requests = [pixels_request(api, "tiny", pixels, ratio=ratio)
                for pixels, ratio in zip(GOLDEN["pixels_u8"], mixed["ratios"])]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        responses = list(pool.map(
            lambda r: stub.Classify(r, timeout=lib.RPC_TIMEOUT), requests * 3))
    for i, response in enumerate(responses):
        expect_probabilities(response, mixed["logits"][i % len(requests)],
                             CONFIG["labels"])


def preprocess_cases():
    with open(os.path.join(PREPROCESS, "expected.json")) as f:
        return [image["file"] for image in json.load(f)["images"]]


@pytest.mark.parametrize("name", preprocess_cases())
def test_images_are_preprocessed_as_the_authors_evaluated(
        api, stub, models, reference, name):
    import torch
    from PIL import Image
    path = os.path.join(PREPROCESS, name)
    with Image.open(path) as img:
        pixels = moh_transnext.preprocess_image(img, CONFIG["resize_size"],
                                                CONFIG["image_size"])
    with torch.no_grad():
        logits = reference(pixels.unsqueeze(0), ratios=0.5)[0].tolist()
    with open(path, "rb") as f:
        request = api.pb.ClassifyRequest(model="tiny", image=f.read())
    request.activation.ratio = 0.5
    response = stub.Classify(request, timeout=lib.RPC_TIMEOUT)
    expect_probabilities(response, logits, CONFIG["labels"])


def test_head_metrics_cover_each_layers_heads(api, stub, server, models):
    stub.Classify(pixels_request(api, "tiny", GOLDEN["pixels_u8"][0]),
                  timeout=lib.RPC_TIMEOUT)
    series = lib.metric_series(server.samples(), "moh_head_tokens_total",
                               model="tiny")
    heads = {}
    for labels, _ in series:
        heads.setdefault(int(labels["layer"]), set()).add(int(labels["head"]))
    assert heads == {l: set(range(g["num_heads"]))
                     for l, g in enumerate(GOLDEN["layers"])}


def test_bad_pixels_name_the_field(api, stub, models):
    import grpc
    request = api.pb.ClassifyRequest(model="tiny")
    request.pixels.shape.extend([3, 32, 32])
    request.pixels.data.extend([0.5] * 3 * 32 * 32)
    with pytest.raises(grpc.RpcError) as error:
        stub.Classify(request, timeout=lib.RPC_TIMEOUT)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "pixels.shape must be [3, 64, 64]" in error.value.details()
