"""The shipped demo models (models/demo-lm, models/demo-vit) through a real moh-server.

- moh-server with no model flags serves both, READY, at their trained ratios;
- the served outputs equal the Python model's (golden.json written by the training
  recipe: greedy tokens, label log-likelihoods, digit probabilities);
- the digit classifier still reaches the held-out accuracy recorded in
  models/demo-vit/metadata.json, and the LM its recorded held-out bits per byte, so a
  regression in the serving math shows up as a quality drop;
- moh-client works out of the box: `generate "Once upon a time"` and
  `classify models/demo-vit/samples/digit-N.png`.
"""
import os
import subprocess
import sys

import pytest

import moh_testlib as lib

MODELS = os.path.join(lib.SOURCE_DIR, "models")
LM_DIR = os.path.join(MODELS, "demo-lm")
VIT_DIR = os.path.join(MODELS, "demo-vit")
sys.path.insert(0, os.path.join(lib.SOURCE_DIR, "training"))
import demo_eval  # noqa: E402

PROB_TOLERANCE = 1e-4
LOG_LIKELIHOOD_TOLERANCE = 2e-3  # nats, over a few tokens
# The server may differ from Python on an image whose top two classes are within
# float error; allow one such image of the 360.
ACCURACY_TOLERANCE = 1.5 / 360
BITS_PER_BYTE_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def server(start_server, api):
    return start_server("demo_models", [("demo-lm", LM_DIR, ""),
                                        ("demo-vit", VIT_DIR, "")], metrics=False, threads=2)


@pytest.fixture(scope="module")
def stub(server, api):
    return api.grpc.InferenceStub(server.channel())


def test_no_flags_serves_the_shipped_demo_models(api, server_factory):
    server = server_factory("demo_default", [], metrics=False, flags=[
        "--port={port}", "--metrics_port=-1", "--host=127.0.0.1", "--threads=1"])
    stub = api.grpc.InferenceStub(server.channel())
    models = {m.name: m for m in
              stub.ListModels(api.pb.ListModelsRequest(), timeout=10).models}
    assert sorted(models) == ["demo-lm", "demo-vit"]
    lm, vit = models["demo-lm"], models["demo-vit"]
    assert (lm.family, lm.router) == ("llama", "learned")
    assert (vit.family, vit.router) == ("vit", "learned")
    assert lm.state == api.pb.ModelInfo.READY and vit.state == api.pb.ModelInfo.READY
    lm_meta = demo_eval.read_json(LM_DIR, "metadata.json")
    vit_meta = demo_eval.read_json(VIT_DIR, "metadata.json")
    assert lm.default_ratio == pytest.approx(lm_meta["default_ratio"])
    assert vit.default_ratio == pytest.approx(vit_meta["default_ratio"])


def test_lm_greedy_tokens_match_python(api, stub):
    golden = demo_eval.read_json(LM_DIR, "golden.json")
    for case in golden["cases"]:
        for ratio, want in case["greedy"].items():
            messages = lib.run_generate(stub, lib.generate_request(
                api.pb, prompt=case["prompt"], ratio=float(ratio), temperature=0.0,
                max_new_tokens=golden["new_tokens"]))
            assert messages[-1].usage.prompt_tokens == len(case["prompt_ids"])
            got = lib.token_ids_of(messages)
            assert got[:len(want)] == want, (case["prompt"], ratio)


def test_lm_label_log_likelihoods_match_python(api, stub):
    golden = demo_eval.read_json(LM_DIR, "golden.json")
    for case in golden["cases"]:
        for ratio, want in case["label_log_likelihoods"].items():
            request = api.pb.ClassifyRequest(model="demo-lm", text=case["prompt"])
            request.labels.extend(case["labels"])
            request.activation.ratio = float(ratio)
            response = stub.Classify(request, timeout=lib.RPC_TIMEOUT)
            got = {c.index: c.log_likelihood for c in response.classes}
            for i, w in enumerate(want):
                assert got[i] == pytest.approx(w, abs=LOG_LIKELIHOOD_TOLERANCE), (
                    case["prompt"], ratio, case["labels"][i])


def test_lm_heldout_bits_per_byte_as_recorded(api, server):
    chunks = demo_eval.read_json(LM_DIR, "eval_chunks.json")
    bpb, effective = demo_eval.bits_per_byte(server.channel(), api.pb, chunks, 0.0)
    want = chunks["python_bits_per_byte"]["0.0"]
    assert bpb == pytest.approx(want, abs=BITS_PER_BYTE_TOLERANCE)
    assert bpb < chunks["unigram_bits_per_byte"] - 1.0
    assert effective == pytest.approx(demo_eval.read_json(LM_DIR, "metadata.json")["default_ratio"])


def test_vit_probabilities_match_python(api, stub):
    golden = demo_eval.read_json(VIT_DIR, "golden.json")
    images, labels = demo_eval.heldout_digits(MODELS)
    for case in golden["cases"]:
        i = case["heldout_index"]
        assert labels[i] == case["label"]
        for ratio, want in case["probabilities"].items():
            response = stub.Classify(
                demo_eval.pixels_request(api.pb, images[i], float(ratio), top_n=10),
                timeout=lib.RPC_TIMEOUT)
            got = {c.index: c.score for c in response.classes}
            assert [got[k] for k in range(10)] == pytest.approx(want, abs=PROB_TOLERANCE), (i, ratio)


def test_vit_heldout_accuracy_as_recorded(api, server):
    meta = demo_eval.read_json(VIT_DIR, "metadata.json")
    images, labels = demo_eval.heldout_digits(MODELS)
    accuracy, effective = demo_eval.digits_accuracy(server.channel(), api.pb, images, labels, 0.0)
    assert accuracy >= meta["heldout_accuracy"] - ACCURACY_TOLERANCE, accuracy
    assert accuracy >= 0.95
    assert effective == pytest.approx(meta["default_ratio"])


def test_client_generate_and_classify_sample_pngs(server):
    """The README's commands, with no --model: the server picks the model by kind."""
    client = [lib.CLIENT, "--server=" + server.target, "--timeout=60"]
    golden = demo_eval.read_json(LM_DIR, "golden.json")
    case = next(c for c in golden["cases"] if c["prompt"] == "Once upon a time")
    want = lib.ByteLevelDecoder(os.path.join(LM_DIR, "tokenizer.json")).decode(
        case["greedy"]["0.0"])
    out = subprocess.run(client + ["generate", "Once upon a time", "--temperature=0",
                                   "--max_new_tokens=%d" % len(case["greedy"]["0.0"])],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want, (out.stdout, want)
    samples = demo_eval.read_json(VIT_DIR, "metadata.json")["samples"]
    assert len(samples) == 10
    for name, sample in sorted(samples.items()):
        out = subprocess.run(client + ["classify", os.path.join(VIT_DIR, "samples", name),
                                       "--top_n=1"],
                             capture_output=True, text=True, timeout=90)
        assert out.returncode == 0, out.stderr
        rows = [line.split() for line in out.stdout.splitlines()]
        assert rows[0][:3] == ["LABEL", "INDEX", "SCORE"], out.stdout
        assert rows[1][0] == sample["label"], (name, out.stdout)
