"""Linear weights held in bfloat16 or int8 (ModelConfig.weights) through the
real server: each model loads, generates, and its greedy tokens and label
scores stay close to the same model's float32 weights; the ViT classifies
close to its float32 weights, the TransNeXt loads, and the demo MoH-DiT's
images stay within a few grey levels of its float32 weights'; ListModels
and moh-client report how each holds them; an unknown value fails that
model only, naming the field. The fixture LM pre-quantized
(quantization_config: int8 weights with their scales as llm-compressor and
bitsandbytes save them) serves as int8 and answers as `weights: "int8"`
does on the float32 LM."""
import io
import json
import os

import pytest

import moh_testlib as lib

LABELS = ["yes", "no", "maybe so", "once upon a time there was"]

# Per precision: the greedy tokens' common prefix with float32's (of 24) and
# the label scores' tolerance. bf16 rounds each weight by <= 2^-9 relative
# (measured: 24 tokens in common, label scores within 0.1%); int8 by <= half
# its row's largest / 127, about 3.7x bf16's error on this fixture
# (measured: 10 tokens, label scores within 3.1%).
PRECISIONS = {"bf16": (8, 3e-2), "int8": (6, 6e-2)}
# The ViT's class probabilities over the goldens' 12 (image, ratio) cases:
# the largest difference from float32's allowed (measured: 0.025 bf16, 0.081
# int8), the top class the same in every case (measured).
VIT_TOLERANCE = {"bf16": 0.05, "int8": 0.15}
# demo-dit's images (8 x 8 grey, 50 steps, guidance 2, the trained ratio),
# 3 per digit, against float32's: the largest difference of a pixel and the
# mean over every pixel allowed, in grey levels of 255 (measured over 5 per
# digit: 7 and 0.09 bf16, 8 and 0.25 int8).
DIT_TOLERANCE = {"bf16": (24, 1.0), "int8": (24, 1.5)}
DEMO_DIT = os.path.join(lib.SOURCE_DIR, "models", "demo-dit")

# tests/reference/make_fixtures.py's layouts of llama_learned pre-quantized.
PREQUANTIZED = ("compressed_tensors", "bitsandbytes")

server, stub, models = lib.lm_variant_fixtures("lowp_weights", [
    ("bf16", 'weights: "bfloat16" generation { max_running: 2 }'),
    ("int8", 'weights: "int8" generation { max_running: 2 }'),
    ("bad", 'weights: "fp4"'),
    ("vit-f32", lib.VIT_DIR, ""),
    ("vit-bf16", lib.VIT_DIR, 'weights: "bfloat16"'),
    ("vit-int8", lib.VIT_DIR, 'weights: "int8"'),
    ("transnext-int8", os.path.join(lib.FIXTURES, "transnext_tiny"),
     'weights: "int8"'),
    ("dit-f32", DEMO_DIT, ""),
    ("dit-bf16", DEMO_DIT, 'weights: "bfloat16"'),
    ("dit-int8", DEMO_DIT, 'weights: "int8"'),
] + [(layout, os.path.join(lib.FIXTURES, "llama_learned_int8_" + layout), "")
     for layout in PREQUANTIZED])

with open(os.path.join(lib.VIT_DIR, "golden.json")) as f:
    _VIT_GOLDEN = json.load(f)


def test_lowp_weights_load_and_others_fail_naming_the_field(
        api, models, server):
    assert server.proc.poll() is None, server.log()
    assert models["f32"].weights == "float32"
    assert models["vit-f32"].weights == "float32"
    held = {"bf16": "bfloat16", "int8": "int8"}
    assert models["dit-f32"].weights == "float32"
    for name in [prefix + p for prefix in ("", "vit-", "dit-")
                 for p in PRECISIONS] + ["transnext-int8"]:
        assert models[name].state == api.pb.ModelInfo.READY, name
        assert models[name].dtype == "float32"  # the activations
        assert models[name].weights == held[name.split("-")[-1]], name
    assert models["bad"].state == api.pb.ModelInfo.FAILED
    assert "weights" in models["bad"].failure_reason


def test_moh_client_lists_the_weights(server, models):
    lines = lib.client_models_table(server)
    # Columns are aligned (LAYERS has spaces): the value under the header.
    at = lines[0].index("WEIGHTS")
    rows = {line.split()[0]: line[at:].split()[0] for line in lines[1:]}
    for name, weights in (("f32", "float32"), ("bf16", "bfloat16"),
                          ("int8", "int8"), ("vit-int8", "int8"),
                          ("dit-int8", "int8")):
        assert rows[name] == weights, lines


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_greedy_tokens_mostly_equal_float32(api, stub, models, name):
    tokens = {}
    for model in ("f32", name):
        request = lib.generate_request(api.pb, model=model,
                                       prompt="Once upon a time",
                                       max_new_tokens=24, temperature=0.0)
        messages = lib.run_generate(stub, request)
        assert messages[-1].usage.completion_tokens == 24
        tokens[model] = lib.token_ids_of(messages)
    # Greedy decoding diverges for good after the first token whose top two
    # logits are closer than the rounding moves them: count the common
    # prefix, not the positions.
    same = 0
    for a, b in zip(tokens["f32"], tokens[name]):
        if a != b:
            break
        same += 1
    assert same >= PRECISIONS[name][0], tokens


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_label_scores_close_to_float32(api, stub, models, name):
    scored = lib.label_scores(api.pb, stub, ("f32", name),
                              "Once upon a time", LABELS)
    tolerance = PRECISIONS[name][1]
    for label in LABELS:
        f32, lowp = scored["f32"][label], scored[name][label]
        assert lowp == pytest.approx(f32, rel=tolerance, abs=tolerance), label
        assert lowp != f32, "the weights were not rounded"


def vit_probabilities(api, stub, model, pixels, ratio):
    request = api.pb.ClassifyRequest(model=model)
    request.pixels.shape.extend(
        [len(pixels), len(pixels[0]), len(pixels[0][0])])
    request.pixels.data.extend(
        v for channel in pixels for row in channel for v in row)
    request.activation.ratio = ratio
    response = stub.Classify(request, timeout=lib.RPC_TIMEOUT)
    return {c.index: c.score for c in response.classes}


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_vit_classifies_close_to_float32(api, stub, models, name):
    largest, same_top = 0.0, 0
    cases = _VIT_GOLDEN["cases"]
    for case in cases:
        pixels = _VIT_GOLDEN["pixels"][case["image"]]
        want = vit_probabilities(api, stub, "vit-f32", pixels, case["ratio"])
        got = vit_probabilities(api, stub, "vit-" + name, pixels,
                                case["ratio"])
        largest = max(largest, max(abs(want[i] - got[i]) for i in want))
        same_top += max(want, key=want.get) == max(got, key=got.get)
    assert largest <= VIT_TOLERANCE[name], largest
    assert largest > 0, "the weights were not rounded"
    assert same_top == len(cases), (same_top, len(cases))


def dit_pixels(api, stub, model):
    """The grey levels of 3 images of each digit (seeds 0-29) by `model`."""
    from PIL import Image
    pixels = []
    for seed in range(30):
        request = api.pb.GenerateImageRequest(model=model,
                                              class_index=seed // 3, seed=seed)
        last = list(stub.GenerateImage(request, timeout=lib.RPC_TIMEOUT))[-1]
        pixels.append(list(Image.open(io.BytesIO(last.png)).getdata()))
    return pixels


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_dit_images_close_to_float32(api, stub, models, name):
    want = dit_pixels(api, stub, "dit-f32")
    got = dit_pixels(api, stub, "dit-" + name)
    diffs = [abs(a - b) for w, g in zip(want, got) for a, b in zip(w, g)]
    largest, mean = DIT_TOLERANCE[name]
    assert max(diffs) <= largest, max(diffs)
    assert sum(diffs) / len(diffs) <= mean, sum(diffs) / len(diffs)
    assert max(diffs) > 0, "the weights were not rounded"


@pytest.mark.parametrize("layout", PREQUANTIZED)
def test_prequantized_checkpoints_serve_as_int8(api, stub, models, layout):
    # They hold what load-time quantization makes of the float32 LM: the
    # same greedy tokens and label scores as the "int8" variant.
    assert models[layout].state == api.pb.ModelInfo.READY, models[layout]
    assert models[layout].weights == "int8"
    tokens = {}
    for model in ("int8", layout):
        request = lib.generate_request(api.pb, model=model,
                                       prompt="Once upon a time",
                                       max_new_tokens=24, temperature=0.0)
        tokens[model] = lib.token_ids_of(lib.run_generate(stub, request))
    assert tokens[layout] == tokens["int8"]
    scored = lib.label_scores(api.pb, stub, ("int8", layout),
                              "Once upon a time", LABELS)
    for label in LABELS:
        assert scored[layout][label] == pytest.approx(
            scored["int8"][label], rel=1e-5, abs=1e-5), label


def test_bfloat16_activations_on_a_cpu_without_avx512_bf16_are_warned_of(
        server_factory):
    """A model with bfloat16 activations on a CPU whose kernels have no
    AVX512_BF16 (forced here: MOH_CPU_ISA=avx2) runs LibTorch's generic
    bfloat16 kernels, many times slower than float32: its load says so and
    names the configuration that holds the weights at the same size; float32
    activations over bfloat16 weights load without it."""
    server = server_factory("bf16_activations", [
        ("act-bf16", lib.LM_DIR, 'dtype: "bfloat16"'),
        ("weights-bf16", lib.LM_DIR, 'weights: "bfloat16"'),
    ], metrics=False, env={"MOH_CPU_ISA": "avx2"})
    log = server.log()
    assert ("model act-bf16: bfloat16 activations on a CPU without AVX512_BF16 "
            "run LibTorch's generic bfloat16 kernels" in log), log
    assert 'dtype: "float32" with weights: "bfloat16"' in log
    assert "model weights-bf16: bfloat16 activations" not in log
