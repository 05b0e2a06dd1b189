"""The KV cache's element type (generation.kv_cache_dtype) through the real
server: a bfloat16 cache is reported by ListModels, generates and scores
labels close to the float32 cache of the same model, and a bad value fails
its model only, naming the field and the allowed values."""
import re

import pytest

import moh_testlib as lib

LABELS = ["yes", "no", "maybe so", "once upon a time there was"]


server, stub, models = lib.lm_variant_fixtures("kv_cache", [
    ("bf16", 'generation { max_running: 2 kv_cache_dtype: "bfloat16" }'),
    ("bad", 'generation { kv_cache_dtype: "int8" }'),
])


def test_list_models_reports_the_cache_type(api, models):
    assert models["f32"].state == api.pb.ModelInfo.READY
    assert models["f32"].kv_cache_dtype == "float32"
    assert models["bf16"].state == api.pb.ModelInfo.READY
    assert models["bf16"].kv_cache_dtype == "bfloat16"
    assert models["bf16"].dtype == "float32"  # the weights are unchanged


def test_a_bad_cache_type_fails_its_model_only(api, models, server):
    assert server.proc.poll() is None, server.log()
    bad = models["bad"]
    assert bad.state == api.pb.ModelInfo.FAILED
    assert "generation.kv_cache_dtype must be" in bad.failure_reason
    assert '"bfloat16"' in bad.failure_reason and "int8" in bad.failure_reason


def test_bfloat16_cache_scores_labels_close_to_float32(api, stub, models):
    scored = lib.label_scores(api.pb, stub, ("f32", "bf16"),
                              "Once upon a time", LABELS)
    assert scored["f32"].keys() == scored["bf16"].keys() == set(LABELS)
    for label in LABELS:
        f32, bf16 = scored["f32"][label], scored["bf16"][label]
        # bfloat16 keeps 8 bits of mantissa: the keys and values move by
        # <= 2^-9 relative, the log-likelihoods by a little more.
        assert bf16 == pytest.approx(f32, rel=2e-2, abs=2e-2), label
        assert bf16 != f32, "the cache did not round anything"


def test_bfloat16_cache_generates(api, stub, models):
    request = lib.generate_request(api.pb, model="bf16",
                                   prompt="Once upon a time",
                                   max_new_tokens=12)
    messages = lib.run_generate(stub, request)
    assert messages[-1].finish_reason == api.pb.LENGTH
    assert messages[-1].usage.completion_tokens == 12
    assert len(lib.token_ids_of(messages)) == 12


def test_moh_client_lists_the_cache_type(server, models):
    lines = lib.client_models_table(server)
    table = "\n".join(lines)
    assert "DTYPE" in lines[0] and "KV_DTYPE" in lines[0], table
    rows = {line.split()[0]: line for line in lines[1:]}
    # DTYPE, WEIGHTS (as dtype here), then KV_DTYPE.
    assert re.search(r"\bfloat32\s+bfloat16\b", rows["bf16"]), table
    assert re.search(r"\bfloat32\s+float32\b", rows["f32"]), table
