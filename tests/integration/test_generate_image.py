"""GenerateImage through the real server: the tiny MoH-DiT of
tests/reference/make_dit_fixtures.py, in latent space with its VAE (served
from the release container's "ema") and in pixel space. Each request's PNG
equals the reference's image for its class, seed, steps, guidance and ratio
(tests/reference/moh_dit.py), alone and when requests share steps; progress
messages; fields checked with their ranges; cancellation and deadlines end
one request; the other families answer that they do not generate images."""
import concurrent.futures
import io
import json
import os

import grpc
import pytest

import moh_testlib as lib

TINY = os.path.join(lib.FIXTURES, "dit_tiny")
PIXELS = os.path.join(lib.FIXTURES, "dit_tiny_pixels")


def golden(directory):
    with open(os.path.join(directory, "golden.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("dit", [
        ("dit", TINY, "generation { max_running: 8 }"),
        ("pixels", PIXELS, ""),
        ("lm", lib.LM_DIR, ""),
    ], wait_serving=False)


stub, models = lib.model_fixtures()


def request_of(api, model, sample, **fields):
    request = api.pb.GenerateImageRequest(
        model=model, class_index=sample["class"], seed=sample["seed"],
        steps=sample["steps"], guidance_scale=sample["guidance"], **fields)
    request.activation.ratio = sample["ratio"]
    return request


def run(stub, request, timeout=lib.RPC_TIMEOUT):
    return list(stub.GenerateImage(request, timeout=timeout))


def pixels_of(png):
    from PIL import Image
    with Image.open(io.BytesIO(png)) as image:
        return image.mode, image.size, list(image.getdata())


def expect_image(response, sample):
    mode, size, data = pixels_of(response.png)
    want = sample["image_u8"]  # [C][H][W]
    channels, height, width = len(want), len(want[0]), len(want[0][0])
    assert size == (width, height) == (response.width, response.height)
    assert mode == ("L" if channels == 1 else "RGB")
    for i, value in enumerate(data):
        y, x = divmod(i, width)
        pixel = value if channels > 1 else (value,)
        for c in range(channels):
            assert abs(pixel[c] - want[c][y][x]) <= 1, (c, y, x)


def test_list_models_describes_the_generator(api, models):
    info = models["dit"]
    assert info.state == api.pb.ModelInfo.READY, info.failure_reason
    assert info.family == "dit"
    layers = golden(TINY)["layers"]
    assert [(l.num_heads, l.shared_heads, l.default_top_k)
            for l in info.layers] == [(g["num_heads"], g["shared_heads"],
                                       g["trained_top_k"]) for g in layers]
    assert len(info.labels) == 10


@pytest.mark.parametrize("model, directory", [("dit", TINY),
                                              ("pixels", PIXELS)])
def test_images_equal_the_reference(api, stub, models, model, directory):
    for sample in golden(directory)["samples"]:
        messages = run(stub, request_of(api, model, sample))
        assert len(messages) == 1
        last = messages[-1]
        expect_image(last, sample)
        assert (last.class_index, last.seed, last.step, last.steps) == (
            sample["class"], sample["seed"], sample["steps"], sample["steps"])
        assert last.guidance_scale == pytest.approx(sample["guidance"])
        assert 0 < last.effective_activation_ratio <= 1


def test_requests_sharing_steps_get_their_own_images(api, stub, models):
    samples = golden(TINY)["samples"]
    with concurrent.futures.ThreadPoolExecutor(len(samples)) as pool:
        results = list(pool.map(
            lambda s: run(stub, request_of(api, "dit", s))[-1], samples * 2))
    for i, last in enumerate(results):
        expect_image(last, samples[i % len(samples)])


def test_progress_and_routing(api, stub, models):
    sample = golden(TINY)["samples"][1]  # guided, 4 steps
    messages = run(stub, request_of(api, "dit", sample, progress=True,
                                    include_routing=True))
    # Steps written while another message was in flight are coalesced into
    # the next one: increasing steps, the image last.
    steps = [m.step for m in messages]
    assert steps == sorted(set(steps)) and steps[-1] == sample["steps"]
    assert len(steps) >= 2 and steps[0] >= 1
    assert all(not m.png and m.steps == sample["steps"] for m in messages[:-1])
    routing = messages[-1].routing
    assert [list(l.head_tokens) for l in routing.layers] == \
        sample["head_token_counts"]


def test_a_class_by_label_and_a_random_seed_reproduce(api, stub, models):
    request = api.pb.GenerateImageRequest(model="pixels", class_label="7",
                                          steps=3)
    first = run(stub, request)[-1]
    assert first.class_index == 7
    again = api.pb.GenerateImageRequest(model="pixels", class_index=7, steps=3,
                                        seed=first.seed)
    assert run(stub, again)[-1].png == first.png


@pytest.mark.parametrize("fields, message", [
    (dict(class_index=3, steps=1), "steps must be in [2, 1000]"),
    (dict(class_index=3, guidance_scale=0.5), "guidance_scale must be in [1, 100]"),
    # Set to 0 is not unset: the same check names what it got.
    (dict(class_index=3, guidance_scale=0), "guidance_scale must be in [1, 100] "
     "(absent: the model's default, 2), got 0"),
    (dict(class_index=10), "class_index must be in [0, 10)"),
    (dict(class_label="cat"), "class_label must be one of the model's 10 labels"),
    (dict(), "class_index or class_label: exactly one must be set"),
])
def test_bad_fields_are_named(api, stub, models, fields, message):
    with pytest.raises(grpc.RpcError) as error:
        run(stub, api.pb.GenerateImageRequest(model="pixels", **fields))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()


def test_cancellation_and_deadline_end_one_request(api, stub, models):
    long = api.pb.GenerateImageRequest(model="pixels", class_index=1,
                                       steps=1000, seed=5, progress=True)
    call = stub.GenerateImage(long, timeout=lib.RPC_TIMEOUT)
    next(call)  # it runs
    call.cancel()
    with pytest.raises(grpc.RpcError) as error:
        run(stub, long, timeout=0.3)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The model goes on serving.
    sample = golden(PIXELS)["samples"][0]
    expect_image(run(stub, request_of(api, "pixels", sample))[-1], sample)


def test_other_families_do_not_generate_images(api, stub, models):
    with pytest.raises(grpc.RpcError) as error:
        run(stub, api.pb.GenerateImageRequest(model="lm", class_index=1))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not serve GenerateImage" in error.value.details()
    request = api.pb.ClassifyRequest(model="dit", text="x", labels=["a"])
    with pytest.raises(grpc.RpcError) as error:
        stub.Classify(request, timeout=lib.RPC_TIMEOUT)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_moh_client_writes_the_png(api, stub, server, models, tmp_path):
    import subprocess
    out = tmp_path / "three.png"
    result = subprocess.run(
        [lib.CLIENT, "--server=127.0.0.1:%d" % server.port, "generate-image",
         "--model=pixels", "--class=3", "--seed=11", "--steps=5",
         "--out=%s" % out, "--progress"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "wrote %s: 8x8 PNG, class 3, seed 11, 5 steps" % out in result.stderr
    assert "step 1/5" in result.stderr
    direct = run(stub, api.pb.GenerateImageRequest(
        model="pixels", class_index=3, seed=11, steps=5))[-1]
    assert out.read_bytes() == direct.png
    bad = subprocess.run(
        [lib.CLIENT, "--server=127.0.0.1:%d" % server.port, "generate-image",
         "--model=pixels", "--out=%s" % out], capture_output=True, text=True,
        timeout=60)
    assert bad.returncode != 0
    assert "generate-image needs --class" in bad.stderr
