"""vLLM's tokenizer endpoints on the HTTP door of a real moh-server
(service/http/tokenize_http.h, tokenize_api.h), which lm-evaluation-harness
uses with `tokenizer_backend=remote` instead of a local Hugging Face tokenizer:

- POST /tokenize and POST /detokenize round-trip text (non-ASCII included);
  add_special_tokens adds the model's BOS; the ids are the ones generation
  uses (a completion of the ids equals the completion of the text, usage and
  prompt log-probabilities agree); chat messages tokenize as their template
  renders them;
- GET /tokenizer_info: the special tokens' text encodes to the model's ids;
- bad input is a 400 naming the field; a model that is not a language model,
  or not served, is refused by name; bearer tokens guard the endpoints;
  metrics count them (rpc="Tokenize", ...);
- lm-eval's own RemoteTokenizer and LocalCompletionsAPI (the pinned eval
  venv, scripts/test_venv.env) against the server.
"""
import json
import os
import subprocess

import pytest

import moh_testlib as lib

DEMO_LM = os.path.join(lib.SOURCE_DIR, "models", "demo-lm")
TEXT = "In the beginning, naïve café — 東京 🚀!"


def demo_config():
    with open(os.path.join(DEMO_LM, "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("tokenize", [("demo-lm", DEMO_LM, ""),
                                     ("demo-vit", lib.VIT_DIR, "")], http=True)


def request(server, method, path, body=None, headers=None):
    """(status, parsed JSON or text) of one raw HTTP request."""
    status, _, out = lib.http_request(server, method, path, body, headers)
    return status, out


def tokenize(server, **body):
    status, out = request(server, "POST", "/tokenize", body)
    assert status == 200, out
    return out


def detokenize(server, tokens, **body):
    status, out = request(server, "POST", "/detokenize", dict(tokens=tokens, **body))
    assert status == 200, out
    return out["prompt"]


def test_tokenize_and_detokenize_round_trip(server):
    out = tokenize(server, prompt=TEXT, add_special_tokens=False)
    assert set(out) == {"tokens", "count", "max_model_len"}
    assert out["count"] == len(out["tokens"]) > 0
    assert out["max_model_len"] == demo_config()["max_position_embeddings"]
    assert detokenize(server, out["tokens"]) == TEXT
    assert detokenize(server, out["tokens"], model="demo-lm") == TEXT
    assert detokenize(server, []) == ""
    # The model named, or left to the server: the same tokenizer.
    assert tokenize(server, prompt=TEXT, add_special_tokens=False,
                    model="demo-lm")["tokens"] == out["tokens"]


def test_add_special_tokens_adds_bos(server):
    bos = demo_config()["bos_token_id"]
    plain = tokenize(server, prompt=TEXT, add_special_tokens=False)["tokens"]
    assert tokenize(server, prompt=TEXT)["tokens"] == [bos] + plain  # default
    assert tokenize(server, prompt=TEXT, add_special_tokens=True)["tokens"] == (
        [bos] + plain)
    # Special tokens are kept when decoding, as vLLM's /detokenize does.
    assert detokenize(server, [bos] + plain) == "<|begin_of_text|>" + TEXT


def test_token_strs_when_asked(server):
    out = tokenize(server, prompt="a b", add_special_tokens=False,
                   return_token_strs=True)
    assert len(out["token_strs"]) == out["count"]
    assert "".join(out["token_strs"]) == "aĠb"  # byte-level tokens, raw


def test_ids_are_the_ones_generation_uses(server):
    """The ids of /tokenize (with BOS, as completions tokenize a text) sent
    as the prompt give the same greedy completion as the text, the same
    prompt_tokens, and prompt log-probabilities at exactly those ids."""
    ids = tokenize(server, prompt=TEXT)["tokens"]
    body = {"model": "demo-lm", "max_tokens": 6, "temperature": 0,
            "prompt_logprobs": 0}
    status, by_text = request(server, "POST", "/v1/completions",
                              dict(body, prompt=TEXT))
    assert status == 200, by_text
    status, by_ids = request(server, "POST", "/v1/completions",
                             dict(body, prompt=ids))
    assert status == 200, by_ids
    assert by_text["usage"]["prompt_tokens"] == len(ids)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    positions = by_text["choices"][0]["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    for position, token in zip(positions[1:], ids[1:]):
        assert str(token) in position


def test_chat_messages_tokenize_as_the_template_renders_them(server):
    messages = [{"role": "user", "content": "Hi"}]
    chat = tokenize(server, messages=messages)["tokens"]
    rendered = "<|begin_of_text|>Q: Hi\nA:"  # demo-lm's template
    assert chat == tokenize(server, prompt=rendered, add_special_tokens=False)["tokens"]
    no_prompt = tokenize(server, messages=messages, add_generation_prompt=False)
    assert no_prompt["tokens"] == tokenize(
        server, prompt="<|begin_of_text|>Q: Hi\n", add_special_tokens=False)["tokens"]


def test_tokenizer_info_names_the_special_tokens(server):
    status, info = request(server, "GET", "/tokenizer_info")
    assert status == 200, info
    config = demo_config()
    assert info["eos_token"] == "<|end_of_text|>"
    assert info["bos_token"] == "<|begin_of_text|>"
    assert info["pad_token"] is None
    assert info["tokenizer_class"]
    assert info["model_max_length"] == config["max_position_embeddings"]
    assert info["vocab_size"] == config["vocab_size"]
    assert "{{ bos_token }}" in info["chat_template"]
    # What lm-eval does: the first id of the token's text is the model's id.
    for token, want in ((info["eos_token"], config["eos_token_id"]),
                        (info["bos_token"], config["bos_token_id"])):
        assert tokenize(server, prompt=token, add_special_tokens=False)["tokens"] == [want]
    assert request(server, "GET", "/tokenizer_info?model=demo-lm")[1] == info


def error_of(server, method, path, body=None, want=400):
    status, out = request(server, method, path, body)
    assert status == want, out
    return out["error"]


@pytest.mark.parametrize("path,body,param,words", [
    ("/detokenize", {"tokens": [1, "2"]}, "tokens[1]", "must be an integer"),
    ("/detokenize", {"tokens": [5, 768]}, "tokens[1]", "[0, 768), got 768"),
    ("/detokenize", {"tokens": [-3]}, "tokens[0]", "got -3"),
    ("/detokenize", {}, "tokens", "is required"),
    ("/tokenize", {}, "prompt", "is required"),
    ("/tokenize", {"prompt": ["x"]}, "prompt", "must be a string"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"},
     "add_special_tokens", "true or false"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]},
     None, "roles are system, user and assistant"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param, words):
    error = error_of(server, "POST", path, body)
    assert error["param"] == param, error
    assert words in error["message"] and error["type"] == "invalid_request_error"


def test_unknown_fields_and_bodies_are_refused(server):
    error = error_of(server, "POST", "/tokenize", {"prompt": "x", "text": "y"})
    assert '"text" is not a field' in error["message"]
    error = error_of(server, "POST", "/detokenize", b"not json")
    assert "JSON" in error["message"]
    assert error_of(server, "GET", "/tokenize", want=405)["message"].endswith("POST")
    assert error_of(server, "POST", "/tokenizer_info", want=405)["message"].endswith("GET")


def test_models_without_a_tokenizer_or_unknown(server):
    error = error_of(server, "POST", "/tokenize", {"prompt": "x", "model": "demo-vit"})
    assert error["param"] == "model"
    assert "'demo-vit' (" in error["message"] and "has no tokenizer" in error["message"]
    error = error_of(server, "GET", "/tokenizer_info?model=demo-vit")
    assert "has no tokenizer" in error["message"]
    error = error_of(server, "POST", "/detokenize", {"tokens": [1], "model": "nope"},
                     want=404)
    assert "'nope' is not served here" in error["message"]


def test_metrics_count_the_tokenizer_requests(server):
    def count(rpc):
        return lib.metric_value(server.samples(), "moh_requests_total",
                                model="demo-lm", rpc=rpc, code="OK") or 0

    before = {rpc: count(rpc) for rpc in ("Tokenize", "Detokenize", "TokenizerInfo")}
    tokenize(server, prompt="x")
    detokenize(server, [5])
    assert request(server, "GET", "/tokenizer_info")[0] == 200
    for rpc, n in before.items():
        assert count(rpc) == n + 1, rpc
    assert (lib.metric_value(server.samples(), "moh_requests_total", model="demo-lm",
                             rpc="Detokenize", code="INVALID_ARGUMENT") or 0) >= 1


def test_bearer_tokens_guard_the_tokenizer_endpoints(server_factory, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("sesame\n")
    server = server_factory("tokenize_auth", [("demo-lm", DEMO_LM, "")], http=True,
                            metrics=False, extra='auth_token_file: "%s"' % tokens)
    for method, path, body in (("POST", "/tokenize", {"prompt": "x"}),
                               ("POST", "/detokenize", {"tokens": [5]}),
                               ("GET", "/tokenizer_info", None)):
        status, out = request(server, method, path, body)
        assert status == 401 and "Authorization: Bearer" in out["error"]["message"]
        status, out = request(server, method, path, body,
                              {"Authorization": "Bearer wrong"})
        assert status == 401, out
        status, out = request(server, method, path, body,
                              {"Authorization": "Bearer sesame"})
        assert status == 200, out
    # lm-eval passes its auth_token to the remote tokenizer.
    out = run_lm_eval(server, auth_token="sesame")
    assert out["decoded"] == TEXT


LM_EVAL_CLIENT = r"""
import json, sys
from lm_eval.utils import RemoteTokenizer
from lm_eval.models.openai_completions import LocalCompletionsAPI

url, text, token = sys.argv[1], sys.argv[2], sys.argv[3] or None
tok = RemoteTokenizer(url, auth_token=token)
ids = tok.encode(text)
out = {"ids": ids, "decoded": tok.decode(ids),
       "batch": tok.batch_decode([ids[:1], ids]),
       "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
       "bos_token_id": tok.bos_token_id}
model = LocalCompletionsAPI(base_url=url, model="demo-lm",
                            tokenizer_backend="remote", auth_token=token)
out["model"] = {"tok_encode": model.tok_encode(text),
                "eot_token_id": model.eot_token_id,
                "prefix_token_id": model.prefix_token_id,
                "eos_string": model.eos_string}
print(json.dumps(out))
"""


def eval_python():
    venv = subprocess.run(
        ["bash", "-c", ". '%s'; echo \"$MOH_EVAL_VENV\"" %
         os.path.join(lib.SOURCE_DIR, "scripts", "test_venv.env")],
        capture_output=True, text=True, check=True).stdout.strip()
    python = os.path.join(venv, "bin", "python")
    if not os.access(python, os.X_OK):
        if os.environ.get("CI") == "true":
            pytest.fail("no lm-eval venv at %s under CI" % venv)
        pytest.skip("lm-evaluation-harness is not installed (%s): "
                    "bash scripts/install_deps.sh --test" % venv)
    return python


def run_lm_eval(server, auth_token=""):
    url = "http://127.0.0.1:%d/v1/completions" % server.http_port
    done = subprocess.run([eval_python(), "-c", LM_EVAL_CLIENT, url, TEXT, auth_token],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_lm_evals_remote_tokenizer(server):
    out = run_lm_eval(server)
    config = demo_config()
    assert out["ids"] == tokenize(server, prompt=TEXT, add_special_tokens=False)["tokens"]
    assert out["decoded"] == TEXT
    assert out["batch"] == [detokenize(server, out["ids"][:1]), TEXT]
    assert out["eos_token"] == "<|end_of_text|>"
    assert out["eos_token_id"] == config["eos_token_id"]
    assert out["bos_token_id"] == config["bos_token_id"]
    model = out["model"]
    assert model["tok_encode"] == out["ids"]
    assert model["eot_token_id"] == config["eos_token_id"]
    assert model["prefix_token_id"] == config["bos_token_id"]
    assert model["eos_string"] == "<|end_of_text|>"
