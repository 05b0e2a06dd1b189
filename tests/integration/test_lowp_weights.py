"""Linear weights held in bfloat16 (ModelConfig.weights) through the real
server: the model loads, generates, and its greedy tokens and label scores
stay close to the same model's float32 weights; a value not implemented
("int8" today) or unknown fails its model only, naming the field."""
import pytest

import moh_testlib as lib

LABELS = ["yes", "no", "maybe so", "once upon a time there was"]


server, stub, models = lib.lm_variant_fixtures("lowp_weights", [
    ("bf16", 'weights: "bfloat16" generation { max_running: 2 }'),
    ("int8", 'weights: "int8"'),
    ("bad", 'weights: "fp4"'),
])


def test_bfloat16_weights_load_and_others_fail_naming_the_field(
        api, models, server):
    assert server.proc.poll() is None, server.log()
    assert models["bf16"].state == api.pb.ModelInfo.READY
    assert models["bf16"].dtype == "float32"  # the activations
    for name in ("int8", "bad"):
        assert models[name].state == api.pb.ModelInfo.FAILED, name
        assert "weights" in models[name].failure_reason, name


def test_greedy_tokens_mostly_equal_float32(api, stub, models):
    tokens = {}
    for name in ("f32", "bf16"):
        request = lib.generate_request(api.pb, model=name,
                                       prompt="Once upon a time",
                                       max_new_tokens=24, temperature=0.0)
        messages = lib.run_generate(stub, request)
        assert messages[-1].usage.completion_tokens == 24
        tokens[name] = lib.token_ids_of(messages)
    # Greedy decoding diverges for good after the first token whose top two
    # logits are closer than bf16's rounding moves them: count the common
    # prefix, not the positions.
    same = 0
    for a, b in zip(tokens["f32"], tokens["bf16"]):
        if a != b:
            break
        same += 1
    assert same >= 8, tokens


def test_label_scores_close_to_float32(api, stub, models):
    scored = lib.label_scores(api.pb, stub, ("f32", "bf16"),
                              "Once upon a time", LABELS)
    for label in LABELS:
        f32, bf16 = scored["f32"][label], scored["bf16"][label]
        # bf16 weights round each weight by <= 2^-9 relative; measured on
        # this fixture: within 1e-2 (see the commit).
        assert bf16 == pytest.approx(f32, rel=3e-2, abs=3e-2), label
        assert bf16 != f32, "the weights were not rounded"
