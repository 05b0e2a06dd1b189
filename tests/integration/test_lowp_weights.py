"""Linear weights held in bfloat16 or int8 (ModelConfig.weights) through the
real server: each model loads, generates, and its greedy tokens and label
scores stay close to the same model's float32 weights; an unknown value, or
any value on an image model, fails that model only, naming the field."""
import subprocess

import pytest

import moh_testlib as lib

LABELS = ["yes", "no", "maybe so", "once upon a time there was"]

# Per precision: the greedy tokens' common prefix with float32's (of 24) and
# the label scores' tolerance. bf16 rounds each weight by <= 2^-9 relative
# (measured: 24 tokens in common, label scores within 0.1%); int8 by <= half
# its row's largest / 127, about 3.7x bf16's error on this fixture
# (measured: 10 tokens, label scores within 3.1%).
PRECISIONS = {"bf16": (8, 3e-2), "int8": (6, 6e-2)}

server, stub, models = lib.lm_variant_fixtures("lowp_weights", [
    ("bf16", 'weights: "bfloat16" generation { max_running: 2 }'),
    ("int8", 'weights: "int8" generation { max_running: 2 }'),
    ("bad", 'weights: "fp4"'),
    ("vit-int8", lib.VIT_DIR, 'weights: "int8"'),
])


def test_lowp_weights_load_and_others_fail_naming_the_field(
        api, models, server):
    assert server.proc.poll() is None, server.log()
    assert models["f32"].weights == "float32"
    for name, weights in (("bf16", "bfloat16"), ("int8", "int8")):
        assert models[name].state == api.pb.ModelInfo.READY, name
        assert models[name].dtype == "float32"  # the activations
        assert models[name].weights == weights
    for name in ("bad", "vit-int8"):
        assert models[name].state == api.pb.ModelInfo.FAILED, name
        assert "weights" in models[name].failure_reason, name
    assert "language models only" in models["vit-int8"].failure_reason


def test_moh_client_lists_the_weights(server, models):
    result = subprocess.run([lib.CLIENT, "--server=" + server.target,
                             "--timeout=60", "models"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    columns = lines[0].split()
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    at = columns.index("WEIGHTS")
    assert rows["int8"][at] == "int8", result.stdout
    assert rows["bf16"][at] == "bfloat16", result.stdout


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
