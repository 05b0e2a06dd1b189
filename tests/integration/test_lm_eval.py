"""EleutherAI's lm-evaluation-harness, unmodified, against a real moh-server.

- Completions' `echo` with `logprobs` (lm-eval's log-likelihood request: the
  prompt's tokens and log-probabilities, then the one generated token) equals
  the independent Python reference's logits (the goldens of make_fixtures.py)
  at every ratio the goldens hold;
- training/lm_eval_vs_ratio.py runs the real `lm_eval` (pinned in
  scripts/eval_requirements.txt) with the tasks of lm_eval_tasks/ (one
  multiple-choice task scored by log-likelihood, one generate_until task) at
  ratios 0.5 and 1.0 through model aliases (demo-lm@0.5, demo-lm@1), with the
  server's own tokenizer (/tokenize), four prompts per request (lm-eval's
  batch form): every sample's log-likelihood and generation, and so every
  score, equal the same computation through gRPC.
"""
import glob
import json
import math
import os
import subprocess

import pytest

import moh_testlib as lib

DEMO_LM = os.path.join(lib.SOURCE_DIR, "models", "demo-lm")
TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
RATIOS = (0.5, 1.0)

with open(os.path.join(lib.FIXTURES, "llama_learned", "golden.json")) as f:
    _GOLDEN = json.load(f)


def eval_python():
    """The lm-eval environment's Python (scripts/test_venv.env)."""
    out = subprocess.run(
        ["bash", "-c", '. "%s/scripts/test_venv.env"; echo "$MOH_EVAL_VENV"' % lib.SOURCE_DIR],
        capture_output=True, text=True, check=True).stdout.strip()
    python = os.path.join(out, "bin", "python")
    if not os.access(python, os.X_OK):
        if os.environ.get("CI") == "true":
            pytest.fail("no lm-eval environment at %s (scripts/install_deps.sh --test)" % out)
        pytest.skip("no lm-eval environment: bash scripts/install_deps.sh --test")
    return python


@pytest.fixture(scope="module")
def server(start_server):
    aliases = "".join(' aliases { name: "demo-lm@%g" activation_ratio: %g }' % (r, r)
                      for r in RATIOS)
    return start_server("lm_eval", [("demo-lm", DEMO_LM, aliases),
                                    ("golden", lib.LM_DIR, "")], http=True)


@pytest.fixture(scope="module")
def stub(server, api):
    return api.grpc.InferenceStub(server.channel())


def log_softmax(row):
    top = max(row)
    log_z = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - log_z for x in row]


@pytest.mark.parametrize("case", [c for c in _GOLDEN["cases"] if c["prompt"] == 0],
                         ids=lambda c: "ratio%g" % c["ratio"])
def test_echo_equals_the_reference(server, case):
    prompt = _GOLDEN["prompts"][0]
    body = {"model": "golden", "prompt": [prompt], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "echo": True, "seed": 1234, "activation_ratio": case["ratio"]}
    status, _, got = lib.http_request(server, "POST", "/v1/completions", body)
    assert status == 200, got
    lp = got["choices"][0]["logprobs"]
    reference = [log_softmax(row) for row in case["logits"]]
    assert len(lp["tokens"]) == len(prompt) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # Position p + 1 is predicted by the reference's logits at p; the last
    # one is the greedy token, predicted by the prompt's last position.
    targets = prompt[1:] + [case["greedy"][0]]
    for p, (target, row) in enumerate(zip(targets, reference)):
        assert lp["token_logprobs"][p + 1] == pytest.approx(row[target], abs=2e-4), p
        (best,) = lp["top_logprobs"][p + 1].values()
        assert best == pytest.approx(max(row), abs=2e-4), p
    assert got["usage"]["completion_tokens"] == 1
    # max_tokens 0: the prompt alone, the same numbers.
    body["max_tokens"] = 0
    status, _, alone = lib.http_request(server, "POST", "/v1/completions", body)
    assert status == 200, alone
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]
    assert alone["usage"]["completion_tokens"] == 0


@pytest.fixture(scope="module")
def evaluated(server, tmp_path_factory):
    """The chart script's run of lm_eval at RATIOS against `server`."""
    out = str(tmp_path_factory.mktemp("lm_eval"))
    subprocess.run([eval_python(), os.path.join(lib.SOURCE_DIR, "training", "lm_eval_vs_ratio.py"),
                    "--url", "http://127.0.0.1:%d" % server.http_port, "--model", "demo-lm",
                    "--ratios", ",".join("%g" % r for r in RATIOS),
                    "--tasks", "moh_kjv_next_word,moh_kjv_continue", "--include_path", TASKS,
                    "--log_samples", "--batch_size", "4", "--timeout", "600", "--out", out],
                   check=True, timeout=900)
    return out


def samples(out, ratio, task):
    (path,) = glob.glob(os.path.join(out, "%g" % ratio, "*", "samples_%s_*.jsonl" % task))
    with open(path) as f:
        return [json.loads(line) for line in f]


def tokenize(server, text):
    status, _, body = lib.http_request(server, "POST", "/tokenize",
                                       {"prompt": text, "add_special_tokens": False})
    assert status == 200, body
    return body["tokens"]


def grpc_loglikelihood(api, stub, server, context, continuation, ratio):
    """lm-eval's split of the pair (trailing spaces go to the continuation;
    the whole encoded, the context's length cut off), scored through gRPC's
    prompt log-probabilities."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenize(server, context + continuation)
    context_len = len(tokenize(server, context))
    request = lib.generate_request(api.pb, token_ids=whole, model="demo-lm", ratio=ratio,
                                   temperature=0.0, max_new_tokens=1)
    request.sampling.prompt_logprobs = 1
    entries = lib.run_generate(stub, request)[0].prompt_logprobs
    return sum(e.logprob for e in entries[context_len - 1:])


@pytest.mark.parametrize("ratio", RATIOS)
def test_lm_eval_log_likelihoods_equal_grpcs(api, stub, server, evaluated, ratio):
    docs = samples(evaluated, ratio, "moh_kjv_next_word")
    assert len(docs) == 32
    correct = 0
    for doc in docs:
        scores = []
        for i, args in enumerate(doc["arguments"].values()):
            want = grpc_loglikelihood(api, stub, server, args["arg_0"], args["arg_1"], ratio)
            got = float(doc["resps"][i][0][0])
            assert got == pytest.approx(want, abs=1e-3), (doc["doc_id"], i)
            scores.append(want)
        correct += scores.index(max(scores)) == doc["doc"]["answer"]
    with open(glob.glob(os.path.join(evaluated, "%g" % ratio, "*", "results_*.json"))[0]) as f:
        results = json.load(f)["results"]
    assert results["moh_kjv_next_word"]["acc,none"] == pytest.approx(correct / len(docs))


@pytest.mark.parametrize("ratio", RATIOS)
def test_lm_eval_generations_equal_grpcs(api, stub, server, evaluated, ratio):
    docs = samples(evaluated, ratio, "moh_kjv_continue")
    assert len(docs) == 16
    for doc in docs:
        context = doc["arguments"]["gen_args_0"]["arg_0"]
        request = lib.generate_request(api.pb, token_ids=tokenize(server, context),
                                       model="demo-lm", ratio=ratio, temperature=0.0,
                                       max_new_tokens=12, stop=["\n"])
        want = "".join(m.text for m in lib.run_generate(stub, request))
        assert doc["resps"][0][0] == want, doc["doc_id"]
        assert doc["exact_match"] == float(want == doc["target"])


def test_the_chart_script_draws_each_task(evaluated):
    with open(os.path.join(evaluated, "scores.json")) as f:
        scores = json.load(f)
    assert scores["ratios"] == list(RATIOS)
    assert set(scores["scores"]) == {"moh_kjv_next_word", "moh_kjv_continue"}
    assert len(scores["scores"]["moh_kjv_next_word"]["acc"]) == len(RATIOS)
    for task in scores["scores"]:
        with open(os.path.join(evaluated, task + ".png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
