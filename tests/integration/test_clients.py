"""The shipped clients against the real server: the example Python client
(client/python/moh_client.py, with stubs from gen_stubs.sh) and the moh-client
command-line tool, over gRPC and (chat) the OpenAI-compatible HTTP API."""
import importlib
import json
import os
import subprocess
import sys
import urllib.request

import grpc
import pytest

import moh_testlib as lib

with open(os.path.join(lib.LM_DIR, "golden.json")) as f:
    _LM = json.load(f)
with open(os.path.join(lib.VIT_DIR, "golden.json")) as f:
    _VIT = json.load(f)


@pytest.fixture(scope="module")
def moh_client(api):
    sys.path.insert(0, os.path.join(lib.SOURCE_DIR, "client", "python"))
    try:
        return importlib.import_module("moh_client")
    finally:
        sys.path.pop(0)


@pytest.fixture
def client(moh_client, main_server, api):
    with moh_client.MohClient(main_server.target, timeout=lib.RPC_TIMEOUT,
                              stub_dir=api.stub_dir) as c:
        yield c


def test_python_client_all_rpcs(api, client, main_server, decoder, tmp_path):
    # ListModels.
    models = {m.name: m for m in client.list_models()}
    assert sorted(models) == ["demo-lm", "demo-vit"]
    assert all(m.state == client.pb.ModelInfo.READY for m in models.values())
    # Generate, streaming: the golden continuation, then a text prompt.
    case = next(c for c in _LM["cases"] if c["ratio"] == 0.5)
    messages = list(client.generate(token_ids=_LM["prompts"][case["prompt"]],
                                    model="demo-lm", max_new_tokens=8,
                                    temperature=0.0, ratio=0.5))
    assert lib.token_ids_of(messages) == case["greedy"]
    assert messages[-1].effective_activation_ratio == pytest.approx(0.5)
    messages = list(client.generate("Once upon a time", model="demo-lm",
                                    max_new_tokens=6))
    assert len(messages) > 1
    assert "".join(m.text for m in messages) == decoder.decode(
        lib.token_ids_of(messages))
    assert messages[-1].finish_reason == client.pb.LENGTH
    # Classify: a PNG made here, and text + labels.
    pixels = _VIT["pixels"][0]
    response = client.classify(image=lib.encode_png(pixels), model="demo-vit")
    assert len(response.classes) == 5
    assert response.classes[0].label == "two"  # the golden's class
    response = client.classify(text="the cat sat", labels=["a", "b"],
                               model="demo-lm", top_n=1)
    assert len(response.classes) == 1 and response.classes[0].label in "ab"
    # Classify with pixels: moh_client.py has no helper for it; the same
    # generated module and the grpc stubs from gen_stubs.sh do it.
    stub = api.grpc.InferenceStub(main_server.channel())
    request = api.pb.ClassifyRequest(model="demo-vit")
    request.pixels.shape.extend([3, 16, 16])
    request.pixels.data.extend(v for c in pixels for row in c for v in row)
    by_pixels = stub.Classify(request, timeout=lib.RPC_TIMEOUT)
    assert [c.index for c in by_pixels.classes][:1] == [2]


def test_python_client_samples_and_logprobs(client):
    samples = client.generate_samples("Once upon a time", model="demo-lm",
                                      max_new_tokens=5, temperature=1.0,
                                      seed=7, n=3, logprobs=2)
    assert [s.index for s in samples] == [0, 1, 2]
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) == 5
        assert [e.token_id for e in s.logprobs] == s.token_ids
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0
                   for e in s.logprobs)
        assert s.last.finish_reason == client.pb.LENGTH
    # Sample i is what seed 7 + i generates alone.
    alone = client.generate_samples("Once upon a time", model="demo-lm",
                                    max_new_tokens=5, temperature=1.0, seed=8)
    assert alone[0].token_ids == samples[1].token_ids
    # A bias of 100 on one token makes it every token, greedy or not.
    forced = client.generate_samples("Once upon a time", model="demo-lm",
                                     max_new_tokens=4, temperature=1.0, seed=7,
                                     logit_bias={alone[0].token_ids[0]: 100})
    assert forced[0].token_ids == [alone[0].token_ids[0]] * 4


def test_python_client_cancel_and_errors(client):
    call = client.generate("Once upon a time", model="demo-lm",
                           max_new_tokens=200)
    first = next(call)
    assert first.token_ids
    call.cancel()
    with pytest.raises(grpc.RpcError) as error:
        list(call)
    assert error.value.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(grpc.RpcError) as error:
        list(client.generate("hi", model="nope"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(ValueError):
        client.generate("hi", token_ids=[1])  # checked before sending


def test_python_client_as_a_program(main_server, api):
    script = os.path.join(lib.SOURCE_DIR, "client", "python", "moh_client.py")

    def run(*args):
        return subprocess.run(
            [sys.executable, script, "--server=" + main_server.target,
             "--timeout=60", "--stubs=" + api.stub_dir] + list(args),
            capture_output=True, text=True, timeout=120)

    result = run("models")
    assert result.returncode == 0, result.stderr
    assert "demo-lm" in result.stdout and "READY" in result.stdout
    result = run("generate", "Once upon a time", "--model=demo-lm",
                 "--max_new_tokens=4")
    assert result.returncode == 0, result.stderr
    assert "finish_reason: LENGTH" in result.stderr
    result = run("generate", "Once upon a time", "--model=demo-lm",
                 "--max_new_tokens=3", "--n=2", "--logprobs=1")
    assert result.returncode == 0, result.stderr
    assert "[0] " in result.stdout and "[1] " in result.stdout
    assert result.stderr.count("finish_reason: LENGTH, 3 tokens") == 2
    result = run("generate", "hi", "--model=nope")
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr and "nope" in result.stderr


# --- moh-client ---


def cli(server, *args, timeout=120):
    return subprocess.run([lib.CLIENT, "--server=" + server.target,
                           "--timeout=60"] + list(args),
                          capture_output=True, text=True, timeout=timeout)


def test_cli_models(main_server):
    result = cli(main_server, "models")
    assert result.returncode == 0, result.stderr
    for word in ("demo-lm", "demo-vit", "READY", "llama", "vit", "learned"):
        assert word in result.stdout, result.stdout


def test_cli_generate_prints_the_text(api, stub, main_server):
    request = lib.generate_request(api.pb, prompt="Once upon a time",
                                   max_new_tokens=8)
    expected = "".join(m.text for m in lib.run_generate(stub, request))
    result = cli(main_server, "generate", "Once upon a time",
                 "--model=demo-lm", "--max_new_tokens=8")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected  # not a terminal: the text as is
    assert "finish_reason: LENGTH" in result.stderr
    assert "completion_tokens 8" in result.stderr


def test_cli_generate_token_ids_with_routing(main_server, decoder):
    case = next(c for c in _LM["cases"] if c["ratio"] == 1.0)
    ids = ",".join(str(t) for t in _LM["prompts"][case["prompt"]])
    result = cli(main_server, "generate", "--token_ids=" + ids,
                 "--max_new_tokens=8", "--ratio=1.0", "--temperature=0",
                 "--routing")
    assert result.returncode == 0, result.stderr
    assert result.stdout == decoder.decode(case["greedy"])
    assert "head load" in result.stderr
    assert "effective 1.000" in result.stderr


def test_cli_generate_samples_and_logprobs(api, stub, main_server):
    request = lib.generate_request(api.pb, prompt="Once upon a time",
                                   model="demo-lm", max_new_tokens=4,
                                   temperature=1.0, seed=11, logprobs=2)
    request.n = 2
    messages = lib.run_generate(stub, request)
    texts = ["".join(m.text for m in messages if m.index == i) for i in (0, 1)]
    entries = [e for m in messages if m.index == 0 for e in m.logprobs]
    result = cli(main_server, "generate", "Once upon a time", "--model=demo-lm",
                 "--max_new_tokens=4", "--temperature=1", "--seed=11", "--n=2",
                 "--logprobs=2", "--priority=3", "--min_p=0.01")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[0] %s\n[1] %s\n" % tuple(texts)
    assert result.stderr.count("finish_reason: LENGTH") == 2
    assert "[1] usage: prompt_tokens" in result.stderr
    rows = [line.split() for line in result.stderr.splitlines()
            if line.startswith("  ")]
    assert [int(r[0]) for r in rows[:4]] == [e.token_id for e in entries]
    assert [float(r[2]) for r in rows[:4]] == pytest.approx(
        [e.logprob for e in entries], abs=1e-4)
    result = cli(main_server, "generate", "hi", "--model=demo-lm", "--n=20")
    assert result.returncode == 1
    assert "n must be in [1, 16], got 20" in result.stderr
    # --logit_bias: as over gRPC.
    request = lib.generate_request(api.pb, prompt="Once upon a time",
                                   model="demo-lm", max_new_tokens=4,
                                   temperature=1.0, seed=11)
    request.sampling.logit_bias[entries[0].token_id] = -100
    request.sampling.logit_bias[7] = 2.5
    biased = "".join(m.text for m in lib.run_generate(stub, request))
    result = cli(main_server, "generate", "Once upon a time", "--model=demo-lm",
                 "--max_new_tokens=4", "--temperature=1", "--seed=11",
                 "--logit_bias=%d:-100,7:2.5" % entries[0].token_id)
    assert result.returncode == 0, result.stderr
    assert result.stdout == biased
    result = cli(main_server, "generate", "hi", "--logit_bias=7")
    assert result.returncode == 2
    assert "--logit_bias: '7' is not TOKEN_ID:BIAS" in result.stderr


def test_cli_classify_png_file(main_server, tmp_path):
    path = tmp_path / "image.png"
    path.write_bytes(lib.encode_png(_VIT["pixels"][0]))
    result = cli(main_server, "classify", str(path), "--model=demo-vit",
                 "--top_n=2")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0][:3] == ["LABEL", "INDEX", "SCORE"]
    assert [r[0] for r in rows[1:]] == ["two", "four"]  # golden's top 2


def test_cli_classify_text(main_server):
    result = cli(main_server, "classify", "--text=the cat sat",
                 "--labels=yes,no", "--model=demo-lm")
    assert result.returncode == 0, result.stderr
    assert sorted(line.split()[0] for line in
                  result.stdout.splitlines()[1:]) == ["no", "yes"]


def test_cli_health(main_server, server_factory, workdir):
    result = cli(main_server, "health")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "SERVING"
    result = cli(main_server, "health", "--service=moh.v1.Inference")
    assert (result.returncode, result.stdout.strip()) == (0, "SERVING")
    broken = server_factory("cli_broken", [
        ("broken", os.path.join(workdir, "no_such_model"), "")
    ], wait_serving=False, metrics=False)
    result = cli(broken, "health")
    assert result.returncode == 1
    assert result.stdout.strip() == "NOT_SERVING"


def test_cli_errors_exit_nonzero_with_the_server_message(main_server):
    result = cli(main_server, "generate", "hi", "--model=nope")
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr
    assert "model 'nope' is not served here" in result.stderr
    result = cli(main_server, "generate", "hi", "--ratio=1.5")
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr
    assert "activation.ratio" in result.stderr
    result = cli(main_server, "classify", "--text=x", "--labels=a",
                 "--model=demo-vit")
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr and "text" in result.stderr


# --- moh-client chat (the OpenAI-compatible HTTP API) ---

DEMO_LM = os.path.join(lib.SOURCE_DIR, "models", "demo-lm")  # a chat template


@pytest.fixture(scope="module")
def http_server(start_server):
    return start_server("chat", [("demo-lm", DEMO_LM, "")], http=True)


def chat(server, lines, *args, timeout=120):
    return subprocess.run(
        [lib.CLIENT, "chat", "--http=127.0.0.1:%d" % server.http_port,
         "--timeout=60"] + list(args),
        input="".join(line + "\n" for line in lines),
        capture_output=True, text=True, timeout=timeout)


def chat_completion(server, messages, **fields):
    """The reply of one whole (not streamed) POST /v1/chat/completions."""
    body = dict(model="demo-lm", messages=messages, **fields)
    request = urllib.request.Request(
        "http://127.0.0.1:%d/v1/chat/completions" % server.http_port,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=lib.RPC_TIMEOUT) as response:
        return json.load(response)["choices"][0]["message"]["content"]


def test_cli_chat_keeps_the_conversation(http_server):
    system = "Answer as the Preacher."
    turns = ["What profit hath a man?", "And the sun?"]
    result = chat(http_server, turns, "--system=" + system,
                  "--max_new_tokens=12", "--temperature=0", "--ratio=0.5")
    assert result.returncode == 0, result.stderr
    sampling = dict(max_tokens=12, temperature=0, activation_ratio=0.5)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": turns[0]}]
    first = chat_completion(http_server, messages, **sampling)
    # The second turn is sent with the first one and its reply.
    messages += [{"role": "assistant", "content": first},
                 {"role": "user", "content": turns[1]}]
    second = chat_completion(http_server, messages, **sampling)
    assert result.stdout == first + "\n" + second + "\n"
    # Usage and the ratios after each turn, on stderr only.
    assert result.stderr.count("finish_reason: length") == 2
    assert result.stderr.count("completion_tokens 12") == 2
    assert result.stderr.count("activation: effective 0.500, applied ratio "
                               "0.500") == 2
    prompts = [int(line.split("prompt_tokens ")[1].split(",")[0])
               for line in result.stderr.splitlines()
               if line.startswith("usage:")]
    assert prompts[1] > prompts[0] + 12  # the whole conversation
    assert "> " not in result.stderr  # stdin is not a terminal: no prompt
    # --logit_bias goes as OpenAI's field.
    result = chat(http_server, turns[:1], "--max_new_tokens=5",
                  "--temperature=0", "--logit_bias=65:100,66:-3.5")
    assert result.returncode == 0, result.stderr
    biased = chat_completion(http_server,
                             [{"role": "user", "content": turns[0]}],
                             max_tokens=5, temperature=0,
                             logit_bias={"65": 100, "66": -3.5})
    assert result.stdout == biased + "\n"


def test_cli_chat_eof_exits_zero(http_server):
    result = chat(http_server, [])
    assert (result.returncode, result.stdout) == (0, "")
    result = chat(http_server, ["", ""])  # empty lines are not sent
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_cli_chat_server_errors_exit_nonzero(http_server):
    result = chat(http_server, ["hi", "never sent"], "--ratio=2")
    assert result.returncode == 1
    assert result.stdout == ""
    assert ("moh-client: INVALID_ARGUMENT: HTTP 400 invalid_request_error: "
            "activation_ratio must be in [0, 1], got 2") in result.stderr
    result = chat(http_server, ["hi"], "--model=nope")
    assert result.returncode == 1
    assert "HTTP 404" in result.stderr and "'nope'" in result.stderr
    # Nothing listens on port 1.
    result = subprocess.run([lib.CLIENT, "chat", "--http=127.0.0.1:1"],
                            input="hi\n", capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr
    # gRPC's address flag is not chat's.
    result = chat(http_server, ["hi"], "--server=127.0.0.1:1")
    assert result.returncode == 2
    assert "--server does not apply to chat" in result.stderr
