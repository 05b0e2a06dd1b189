"""The OpenAI-compatible HTTP API of a real moh-server (service/http/openai_http.h),
driven by the official `openai` Python client (PyPI, pinned in
scripts/test_venv.env) and by raw HTTP where the client hides the wire:

- GET /v1/models, POST /v1/completions streamed and not: the same tokens as
  gRPC's Generate for the same request, usage, finish reasons, and the `moh`
  object with the effective activation ratio; activation_ratio changes it;
- errors in OpenAI's format with the HTTP status of the gRPC code, naming the
  OpenAI field; unknown model, path and method; a body over max_message_mb;
- bearer tokens (auth_token_file) on /v1/*, not on /health;
- a client that disconnects cancels its generation (streamed or not);
- metrics count the requests with rpc="Completions".
"""
import http.client
import json
import os
import re
import shutil
import socket

import grpc
import pytest

import moh_testlib as lib

openai = lib.client_library("openai")

DEMO_LM = os.path.join(lib.SOURCE_DIR, "models", "demo-lm")
ALIAS = 'aliases { name: "demo-lm@0.5" activation_ratio: 0.5 }'
PROMPT = "In the beginning"


@pytest.fixture(scope="module")
def min_p_lm_dir(workdir):
    """The fixture LM whose generation_config.json samples hot (temperature
    1.5) but with min_p 1: only the most likely token survives."""
    path = os.path.join(workdir, "llama_min_p")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(lib.LM_DIR, path)
    config = os.path.join(path, "generation_config.json")
    with open(config) as f:
        generation = json.load(f)
    generation.update({"do_sample": True, "temperature": 1.5, "min_p": 1.0})
    with open(config, "w") as f:
        json.dump(generation, f)
    return path


@pytest.fixture(scope="module")
def server(start_server, long_lm_dir, min_p_lm_dir):
    return start_server("openai", [("demo-lm", DEMO_LM, ALIAS),
                                   ("long", long_lm_dir,
                                    "generation { max_seq_len: 8192 }"),
                                   ("min_p", min_p_lm_dir, "")], http=True)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % server.http_port,
                         api_key="unused", timeout=lib.RPC_TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def stub(server, api):
    return api.grpc.InferenceStub(server.channel())


request = lib.http_request


def grpc_greedy(api, stub, prompt, n, ratio=0.0):
    messages = lib.run_generate(stub, lib.generate_request(
        api.pb, prompt=prompt, model="demo-lm", temperature=0.0,
        max_new_tokens=n, ratio=ratio))
    return "".join(m.text for m in messages), messages[-1]


def test_models_lists_every_hosted_model(client, server):
    ids = sorted(m.id for m in client.models.list())
    assert ids == ["demo-lm", "demo-lm@0.5", "long", "min_p"]
    status, _, body = request(server, "GET", "/v1/models")
    assert status == 200
    lm = next(m for m in body["data"] if m["id"] == "demo-lm")
    assert lm["object"] == "model"
    assert lm["moh"]["family"] == "llama" and lm["moh"]["state"] == "READY"
    assert lm["moh"]["default_activation_ratio"] == pytest.approx(0.75)


def test_completion_equals_grpc_generate(api, client, stub):
    want, last = grpc_greedy(api, stub, PROMPT, 12)
    got = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=12,
                                    temperature=0)
    assert got.object == "text_completion" and got.id.startswith("cmpl-")
    assert got.model == "demo-lm"
    assert got.choices[0].text == want
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == last.usage.prompt_tokens
    assert got.usage.completion_tokens == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12
    moh = got.model_extra["moh"]
    assert moh["effective_activation_ratio"] == pytest.approx(
        last.effective_activation_ratio, abs=1e-6)


def test_activation_ratio_is_a_request_field(api, client, stub):
    want, last = grpc_greedy(api, stub, PROMPT, 8, ratio=0.5)
    got = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=8,
                                    temperature=0, extra_body={"activation_ratio": 0.5})
    assert got.choices[0].text == want
    moh = got.model_extra["moh"]
    assert moh["activation_ratio"] == pytest.approx(0.5)
    assert moh["effective_activation_ratio"] == pytest.approx(
        last.effective_activation_ratio, abs=1e-6)
    default = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=8,
                                        temperature=0)
    assert (default.model_extra["moh"]["effective_activation_ratio"] >
            moh["effective_activation_ratio"])


def test_streamed_completion_equals_the_whole_one(client):
    whole = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=16,
                                      temperature=0)
    chunks = list(client.completions.create(
        model="demo-lm", prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
    assert finishing[0].model_extra["moh"]["effective_activation_ratio"] == pytest.approx(
        whole.model_extra["moh"]["effective_activation_ratio"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert len({c.id for c in chunks}) == 1


def test_stop_and_seed(client):
    whole = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=24,
                                      temperature=0).choices[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    cut = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=24,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].text == whole[:whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=12,
                                      temperature=1.0, seed=7).choices[0].text
            for _ in range(2))
    assert a == b


def test_generation_config_defaults_fill_unset_fields(api, client, stub):
    """demo-lm's generation_config.json samples at temperature 0.8, top_p 0.95
    (and Hugging Face's top_k 50 when do_sample leaves it out): requests that
    leave those out, over gRPC and HTTP alike, sample so."""
    def grpc_text(**sampling):
        return "".join(m.text for m in lib.run_generate(stub, lib.generate_request(
            api.pb, prompt=PROMPT, model="demo-lm", max_new_tokens=16, seed=3,
            **sampling)))

    explicit = grpc_text(temperature=0.8, top_p=0.95, top_k=50)
    assert grpc_text() == explicit
    http = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=16, seed=3)
    assert http.choices[0].text == explicit
    http_explicit = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=16,
                                              seed=3, temperature=0.8, top_p=0.95,
                                              extra_body={"top_k": 50})
    assert http_explicit.choices[0].text == explicit
    # A field the request sets wins: greedy.
    greedy, _ = grpc_greedy(api, stub, PROMPT, 16)
    assert client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=16,
                                     temperature=0).choices[0].text == greedy


def test_token_id_prompts(api, client, stub):
    messages = lib.run_generate(stub, lib.generate_request(
        api.pb, token_ids=[5, 6, 7], model="demo-lm", temperature=0.0, max_new_tokens=6))
    got = client.completions.create(model="demo-lm", prompt=[5, 6, 7], max_tokens=6,
                                    temperature=0)
    assert got.choices[0].text == "".join(m.text for m in messages)


def test_errors_are_openais_and_name_the_field(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo-lm", prompt=PROMPT, temperature=3)
    assert e.value.status_code == 400
    assert "temperature must be in [0, 2], got 3" in e.value.message
    assert e.value.body["code"] == "INVALID_ARGUMENT"
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=100000)
    assert "max_tokens must be in [1, " in e.value.message  # the model's limit
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo-lm", prompt=PROMPT, extra_body={
            "activation_ratio": 0.5, "min_activation_ratio": 0.9})
    # The model's check, in the HTTP API's names.
    assert "min_activation_ratio must be 0 (off) or in (0, 0.5]" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo-lm", prompt=PROMPT,
                                  extra_body={"best_of": 3})
    assert "best_of is not supported by this server yet" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPT)
    assert "nope" in e.value.message
    status, _, body = request(server, "POST", "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["message"] == (
        "the body must be JSON (parse error at line 1, column 3: syntax error "
        "while parsing object key - invalid literal)")
    status, _, body = request(server, "POST", "/v1/completions",
                              b'{"temperature": 1e999}')
    assert status == 400 and body["error"]["message"] == (
        "the body must be JSON (number overflow parsing '1e999')")
    status, _, body = request(server, "GET", "/v1/completions")
    assert status == 405 and "takes POST" in body["error"]["message"]
    status, _, body = request(server, "GET", "/v2/things")
    assert status == 404 and "no such endpoint: /v2/things" in body["error"]["message"]


def test_request_ids_are_echoed_and_logged(api, server, stub, server_factory):
    status, response, _ = request(server, "GET", "/v1/models",
                                  headers={"X-Request-Id": "trace-42"})
    assert status == 200 and response.getheader("X-Request-Id") == "trace-42"
    status, response, _ = request(server, "POST", "/v1/completions",
                                  {"model": "demo-lm", "prompt": "x", "top_p": 7})
    assert status == 400
    assert re.fullmatch(r"[0-9a-f]{16}", response.getheader("X-Request-Id"))
    # Unprintable or oversized ids are replaced.
    _, response, _ = request(server, "GET", "/health", headers={"X-Request-Id": "a" * 200})
    assert re.fullmatch(r"[0-9a-f]{16}", response.getheader("X-Request-Id"))
    # gRPC: the x-request-id metadata, in the initial metadata and the log.
    responses = stub.Generate(lib.generate_request(api.pb, prompt=PROMPT, model="demo-lm",
                                                   max_new_tokens=2),
                              metadata=[("x-request-id", "grpc-7")], timeout=lib.RPC_TIMEOUT)
    assert dict(responses.initial_metadata())["x-request-id"] == "grpc-7"
    list(responses)
    lib.wait_until(lambda: "request_id=grpc-7" in server.log(), 10, "the log line")
    # The access log: info-level lines.
    quiet = server_factory("openai_access", [("demo-lm", DEMO_LM, "")], http=True,
                           metrics=False, extra="access_log: true")
    request(quiet, "POST", "/v1/completions", {"model": "demo-lm", "prompt": "x",
                                              "max_tokens": 1},
            headers={"X-Request-Id": "access-1"})
    lib.wait_until(lambda: "request_id=access-1" in quiet.log(), 10, "the access line")
    line = next(l for l in quiet.log().splitlines() if "request_id=access-1" in l)
    assert " I Completions model=demo-lm code=OK " in line


def test_health(server):
    status, _, body = request(server, "GET", "/health")
    assert (status, body) == (200, {"status": "ok"})


def wait_for(predicate, what, timeout=30):
    lib.wait_until(predicate, timeout, what, interval=0.05)


def running(server, model):
    return lib.metric_value(server.samples(), "moh_requests_running", model=model) or 0


def cancelled(server, model):
    return lib.metric_value(server.samples(), "moh_requests_total", model=model,
                            rpc="Completions", code="CANCELLED") or 0


def generated(server, model):
    return lib.metric_value(server.samples(), "moh_generated_tokens_total", model=model) or 0


def test_a_client_that_leaves_a_stream_cancels_it(server):
    before, tokens = cancelled(server, "long"), generated(server, "long")
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": "long", "prompt": [1, 2, 3], "max_tokens": 8000, "temperature": 0,
        "stream": True}), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Type") == "text/event-stream"
    assert response.readline().startswith(b"data: {")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_for(lambda: cancelled(server, "long") == before + 1, "the stream's cancellation")
    wait_for(lambda: running(server, "long") == 0, "the slot to be free")
    assert generated(server, "long") - tokens < 8000


def test_a_client_that_leaves_a_whole_request_cancels_it(server):
    before, tokens = cancelled(server, "long"), generated(server, "long")
    body = json.dumps({"model": "long", "prompt": [1, 2, 3], "max_tokens": 8000,
                       "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))
        wait_for(lambda: running(server, "long") == 1, "the request to run")
    wait_for(lambda: cancelled(server, "long") == before + 1, "the cancellation")
    wait_for(lambda: running(server, "long") == 0, "the slot to be free")
    assert generated(server, "long") - tokens < 8000


def test_requests_are_counted_by_endpoint(client, server):
    ok = lib.metric_value(server.samples(), "moh_requests_total", model="demo-lm",
                          rpc="Completions", code="OK") or 0
    client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo-lm", prompt=PROMPT, top_p=0)
    samples = server.samples()
    assert lib.metric_value(samples, "moh_requests_total", model="demo-lm",
                            rpc="Completions", code="OK") == ok + 1
    # Rejected before it reached a model: counted with model="".
    assert lib.metric_value(samples, "moh_requests_total", model="",
                            rpc="Completions", code="INVALID_ARGUMENT") >= 1


def test_body_over_the_limit_is_refused(server_factory):
    server = server_factory("openai_small", [("demo-lm", DEMO_LM, "")], http=True,
                            metrics=False, extra="max_message_mb: 1")
    status, _, body = request(server, "POST", "/v1/completions",
                              json.dumps({"prompt": "x" * (2 << 20)}).encode())
    assert status == 413
    assert "larger than 1 MiB (max_message_mb)" in body["error"]["message"]


def test_bearer_tokens_guard_v1_not_health(server_factory, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("sesame\n")
    server = server_factory("openai_auth", [("demo-lm", DEMO_LM, "")], http=True,
                            metrics=False, extra='auth_token_file: "%s"' % tokens)
    url = "http://127.0.0.1:%d/v1" % server.http_port
    anonymous = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        anonymous.models.list()
    assert "unknown token" in e.value.message
    status, _, body = request(server, "POST", "/v1/completions", {"prompt": "x"})
    assert status == 401 and "Authorization: Bearer" in body["error"]["message"]
    allowed = openai.OpenAI(base_url=url, api_key="sesame", max_retries=0)
    assert [m.id for m in allowed.models.list()] == ["demo-lm"]
    assert allowed.completions.create(model="demo-lm", prompt=PROMPT,
                                      max_tokens=2).usage.completion_tokens == 2
    assert request(server, "GET", "/health")[0] == 200


def render_chat(messages, add_generation_prompt=True):
    """demo-lm's chat template rendered by jinja2 as transformers does."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    with open(os.path.join(DEMO_LM, "tokenizer_config.json")) as f:
        config = json.load(f)

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(config["chat_template"]).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=config["bos_token"], eos_token=config["eos_token"]), config["bos_token"]


CHAT = [{"role": "system", "content": "Answer as the Preacher."},
        {"role": "user", "content": "What profit hath a man?"}]


def test_chat_completion_renders_the_models_template(client):
    rendered, bos = render_chat(CHAT)
    assert rendered.startswith(bos)
    # The same tokens as a completion of the rendered text (its BOS added by
    # the tokenizer instead of written by the template).
    want = client.completions.create(model="demo-lm", prompt=rendered[len(bos):],
                                     max_tokens=16, temperature=0)
    got = client.chat.completions.create(model="demo-lm", messages=CHAT, max_tokens=16,
                                         temperature=0)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.choices[0].text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.model_extra["moh"]["effective_activation_ratio"] > 0
    chunks = list(client.chat.completions.create(
        model="demo-lm", messages=CHAT, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].text
    assert chunks[-1].usage.completion_tokens == 16


def test_chat_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="demo-lm", messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}])
    assert "roles are system, user and assistant" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="long", messages=CHAT)
    assert "model 'long' has no chat template" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo-lm", messages=[])
    assert "messages must be a non-empty list" in e.value.message


def test_stop_token_ids_ignore_eos_and_min_tokens(api, client, stub):
    ids = lib.token_ids_of(lib.run_generate(stub, lib.generate_request(
        api.pb, prompt=PROMPT, model="demo-lm", temperature=0.0, max_new_tokens=12)))
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])

    got = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=12,
                                    temperature=0, extra_body={"stop_token_ids": [ids[k]]})
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == k + 1  # the stop token counts
    request = lib.generate_request(api.pb, prompt=PROMPT, model="demo-lm", temperature=0.0,
                                   max_new_tokens=12)
    request.sampling.stop_token_ids.append(ids[k])
    messages = lib.run_generate(stub, request)
    assert got.choices[0].text == "".join(m.text for m in messages)
    assert messages[-1].finish_reason == api.pb.STOP
    later = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=12,
                                      temperature=0, extra_body={
                                          "stop_token_ids": [ids[k]], "min_tokens": k + 1})
    assert later.usage.completion_tokens > k + 1
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo-lm", prompt=PROMPT,
                                  extra_body={"stop_token_ids": [10 ** 6]})
    assert "stop_token_ids must be in [0, 768)" in e.value.message
    ignored = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=4,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert ignored.usage.completion_tokens == 4


def grpc_messages(api, stub, **fields):
    request = lib.generate_request(api.pb, prompt=PROMPT, model="demo-lm",
                                   temperature=0.0, max_new_tokens=8)
    for name, value in fields.items():
        if name in ("n", "priority"):
            setattr(request, name, value)
        else:
            setattr(request.sampling, name, value)
    return lib.run_generate(stub, request)


def test_n_choices_whole_and_streamed(api, client, stub):
    want, _ = grpc_greedy(api, stub, PROMPT, 8)
    got = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=8,
                                    temperature=0, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert all(c.text == want and c.finish_reason == "length" for c in got.choices)
    assert got.usage.completion_tokens == 24
    # Seeded samples: choice i is gRPC's sample i (seed + i).
    sampled = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=8,
                                        temperature=1.0, seed=3, n=2)
    messages = grpc_messages(api, stub, temperature=1.0, seed=3, n=2)
    for i in range(2):
        assert sampled.choices[i].text == "".join(
            m.text for m in messages if m.index == i)
    chunks = list(client.chat.completions.create(
        model="demo-lm", messages=[{"role": "user", "content": "hello"}],
        max_tokens=6, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True}))
    texts, finished = {0: "", 1: ""}, []
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.append(choice.index)
    assert sorted(finished) == [0, 1]
    assert texts[0] == texts[1] and texts[0]
    assert chunks[-1].usage.completion_tokens == 12
    whole = client.chat.completions.create(
        model="demo-lm", messages=[{"role": "user", "content": "hello"}],
        max_tokens=6, temperature=0)
    assert whole.choices[0].message.content == texts[0]


def test_completion_logprobs_equal_grpcs(api, client, stub):
    messages = grpc_messages(api, stub, logprobs=2, prompt_logprobs=1)
    entries = [e for m in messages for e in m.logprobs]
    got = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=8,
                                    temperature=0, logprobs=2,
                                    extra_body={"prompt_logprobs": 1})
    lp = got.choices[0].logprobs
    assert lp.tokens == [e.token for e in entries]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in entries])
    for top, e in zip(lp.top_logprobs, entries):
        assert top == pytest.approx({t.token: t.logprob for t in e.top_logprobs})
    assert lp.text_offset == [sum(len(x.token.encode()) for x in entries[:i])
                              for i in range(len(entries))]
    prompt = got.choices[0].model_extra["prompt_logprobs"]
    want = messages[0].prompt_logprobs
    assert prompt[0] is None and len(prompt) == len(want) + 1
    for position, e in zip(prompt[1:], want):
        assert position[str(e.token_id)]["logprob"] == pytest.approx(e.logprob)
        assert position[str(e.token_id)]["rank"] == e.rank
    streamed = list(client.completions.create(
        model="demo-lm", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
        stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs(client):
    messages = [{"role": "user", "content": "hello"}]
    got = client.chat.completions.create(model="demo-lm", messages=messages,
                                         max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model="demo-lm", messages=messages,
                                           max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo-lm", messages=messages,
                                       top_logprobs=2)
    assert 'top_logprobs needs "logprobs": true' in e.value.message


def test_penalties_min_p_and_priority_equal_grpcs(api, client, stub):
    fields = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "min_p": 0.2}
    messages = grpc_messages(api, stub, temperature=0.9, seed=5, **fields)
    got = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=8,
                                    temperature=0.9, seed=5,
                                    presence_penalty=1.5, frequency_penalty=0.5,
                                    extra_body={"min_p": 0.2, "priority": 7})
    assert got.choices[0].text == "".join(m.text for m in messages)
    for field, value, message in (
            ("presence_penalty", 3, "presence_penalty must be in [-2, 2], got 3"),
            ("priority", 5000, "priority must be in [-1000, 1000], got 5000"),
            ("n", 0, "n must be in [1, 16], got 0")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="demo-lm", prompt=PROMPT,
                                      extra_body={field: value})
        assert message in e.value.message


def test_logit_bias_steers_the_draw_as_over_grpc(api, client, stub):
    def grpc_ids(bias=None, **fields):
        request = lib.generate_request(api.pb, prompt=PROMPT, model="demo-lm",
                                       temperature=0.0, max_new_tokens=6)
        for name, value in fields.items():
            setattr(request.sampling, name, value)
        for token, value in (bias or {}).items():
            request.sampling.logit_bias[token] = value
        messages = lib.run_generate(stub, request)
        return ([t for m in messages for t in m.token_ids],
                "".join(m.text for m in messages))

    plain, _ = grpc_ids()
    # -100 bans the greedy first token; +100 makes another every token.
    banned, _ = grpc_ids({plain[0]: -100.0})
    assert banned[0] != plain[0]
    forced = plain[1] if plain[1] != plain[0] else banned[0]
    ids, text = grpc_ids({forced: 100.0})
    assert ids == [forced] * 6
    got = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=6,
                                    temperature=0.0,
                                    logit_bias={str(forced): 100})
    assert got.choices[0].text == text
    # Sampled: the same draws over both doors (the bias changes them).
    bias = {plain[0]: 3.0, banned[0]: -2.5}
    _, sampled = grpc_ids(bias, temperature=1.0, seed=11)
    got = client.completions.create(
        model="demo-lm", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11,
        logit_bias={str(k): v for k, v in bias.items()})
    assert got.choices[0].text == sampled
    chat = client.chat.completions.create(
        model="demo-lm", messages=[{"role": "user", "content": "hi"}],
        max_tokens=3, temperature=0.0, logit_bias={str(forced): 100})
    assert chat.usage.completion_tokens == 3
    assert chat.choices[0].message.content * 2 == text
    for bias, message in (
            ({"abc": 1}, 'logit_bias keys must be token ids (integers >= 0), '
                         'got "abc"'),
            ({"5": 101}, "logit_bias must be biases in [-100, 100], got 101"),
            ({"5": "x"}, "logit_bias values must be numbers in [-100, 100], "
                         "got string for token 5"),
            ({"99999": 1}, "logit_bias token ids must be in [0, 768), got "
                           "99999")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="demo-lm", prompt=PROMPT,
                                      logit_bias=bias)
        assert message in e.value.message
        assert e.value.body["param"] == "logit_bias"
    with pytest.raises(grpc.RpcError) as e:
        grpc_ids({99999: 1.0})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == (
        "sampling.logit_bias token ids must be in [0, 768), got 99999")


def test_generation_config_min_p(api, client, stub):
    # min_p 1 from generation_config.json makes hot sampling greedy; a
    # request's own min_p (HTTP 0, or gRPC's nonzero value) wins.
    request = lib.generate_request(api.pb, prompt=PROMPT, model="min_p",
                                   max_new_tokens=12)
    greedy = lib.token_ids_of(lib.run_generate(stub, lib.generate_request(
        api.pb, prompt=PROMPT, model="min_p", max_new_tokens=12,
        temperature=0.0)))
    for seed in (1, 2, 3):
        request.sampling.seed = seed
        assert lib.token_ids_of(lib.run_generate(stub, request)) == greedy
    texts = {client.completions.create(model="min_p", prompt=PROMPT, max_tokens=12,
                                       seed=seed, extra_body={"min_p": 0}).choices[0].text
             for seed in (1, 2, 3)}
    assert len(texts) > 1  # sampling at temperature 1.5 again
    request.sampling.min_p = 0.001
    outputs = set()
    for seed in (1, 2, 3):
        request.sampling.seed = seed
        outputs.add(tuple(lib.token_ids_of(lib.run_generate(stub, request))))
    assert len(outputs) > 1


def test_echo_returns_the_prompt_and_its_logprobs(api, client, stub):
    """lm-evaluation-harness's log-likelihood request: a prompt of token ids,
    echo, one alternative, one token; the prompt's entries are gRPC's
    prompt_logprobs (which test_generate.py checks against the reference)."""
    ids = [5, 6, 7, 8, 9]
    request = lib.generate_request(api.pb, token_ids=ids, model="demo-lm",
                                   temperature=0.0, max_new_tokens=1)
    request.sampling.logprobs = 1
    request.sampling.prompt_logprobs = 1
    messages = lib.run_generate(stub, request)
    want = list(messages[0].prompt_logprobs) + [
        e for m in messages for e in m.logprobs]
    for attempt in range(2):  # the second finds the prompt in the prefix cache
        got = client.completions.create(model="demo-lm", prompt=[ids], max_tokens=1,
                                        temperature=0, logprobs=1, echo=True,
                                        seed=1234)
        choice = got.choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1, attempt
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in want])
        for top, e in zip(lp.top_logprobs[1:], want):
            assert len(top) == 1
            assert list(top.values())[0] == pytest.approx(e.top_logprobs[0].logprob)
        assert lp.tokens[-1] == messages[-1].text or messages[-1].text == ""
        assert choice.text.endswith("".join(m.text for m in messages))
        assert lp.text_offset == [sum(len(t.encode()) for t in lp.tokens[:i])
                                  for i in range(len(lp.tokens))]
        assert "prompt_logprobs" not in (choice.model_extra or {})
        assert got.usage.prompt_tokens == len(ids)
        assert got.usage.completion_tokens == 1


def test_echo_with_max_tokens_0_is_the_prompt_alone(client, server):
    whole = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=1,
                                      temperature=0, logprobs=2, echo=True)
    alone = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=0,
                                      temperature=0, logprobs=2, echo=True)
    assert alone.choices[0].text == PROMPT
    assert alone.choices[0].finish_reason == "length"
    assert alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.tokens == whole.choices[0].logprobs.tokens[:-1]
    assert (alone.choices[0].logprobs.token_logprobs ==
            whole.choices[0].logprobs.token_logprobs[:-1])
    # Echo without log-probabilities: the text only, a token-id prompt decoded.
    text = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=3,
                                     temperature=0, echo=True)
    plain = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=3,
                                      temperature=0)
    assert text.choices[0].text == PROMPT + plain.choices[0].text
    assert text.choices[0].logprobs is None
    # Streamed: the echo leads the choice's first chunk.
    chunks = list(client.completions.create(
        model="demo-lm", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
        echo=True, stream=True))
    once = client.completions.create(model="demo-lm", prompt=PROMPT, max_tokens=4,
                                     temperature=0, logprobs=2, echo=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == \
        once.choices[0].text
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == once.choices[0].logprobs.token_logprobs
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == once.choices[0].logprobs.text_offset
    status, _, body = request(server, "POST", "/v1/completions",
                              {"prompt": "x", "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    assert "0 only with \"echo\": true" in body["error"]["message"]


def test_an_alias_fixes_the_ratio(api, client, server, stub):
    """demo-lm@0.5 is demo-lm at activation_ratio 0.5, by name alone."""
    models = {m["id"]: m for m in request(server, "GET", "/v1/models")[2]["data"]}
    alias = models["demo-lm@0.5"]
    assert alias["parent"] == "demo-lm" and alias["root"] == "demo-lm"
    assert alias["moh"]["alias_of"] == "demo-lm"
    assert alias["moh"]["default_activation_ratio"] == pytest.approx(0.5)
    assert models["demo-lm"]["parent"] is None
    listed = {m.name: m for m in stub.ListModels(api.pb.ListModelsRequest()).models}
    assert listed["demo-lm@0.5"].alias_of == "demo-lm"
    assert listed["demo-lm@0.5"].default_ratio == pytest.approx(0.5)
    want, last = grpc_greedy(api, stub, PROMPT, 8, ratio=0.5)
    got = client.completions.create(model="demo-lm@0.5", prompt=PROMPT, max_tokens=8,
                                    temperature=0)
    assert got.model == "demo-lm@0.5"
    assert got.choices[0].text == want
    assert got.model_extra["moh"]["activation_ratio"] == pytest.approx(0.5)
    assert got.model_extra["moh"]["effective_activation_ratio"] == pytest.approx(
        last.effective_activation_ratio, abs=1e-6)
    # gRPC too; the same ratio may be sent, another is refused.
    messages = lib.run_generate(stub, lib.generate_request(
        api.pb, prompt=PROMPT, model="demo-lm@0.5", temperature=0.0,
        max_new_tokens=8, ratio=0.5))
    assert "".join(m.text for m in messages) == want
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo-lm@0.5", prompt=PROMPT, max_tokens=2,
                                  extra_body={"activation_ratio": 0.75})
    assert e.value.body["param"] == "activation_ratio"
    assert 'is 0.5 for model "demo-lm@0.5"' in e.value.message
    # Counted under the model it names.
    assert 'model="demo-lm@0.5"' not in server.scrape()


def test_a_list_of_prompts_is_a_request_each(api, client, stub, server):
    """OpenAI's batch form (lm-eval's batch_size > 1): prompt p's sample i is
    choice p * n + i; usage counts each prompt once."""
    first, last_a = grpc_greedy(api, stub, PROMPT, 6)
    ids = [5, 6, 7]
    second = "".join(m.text for m in lib.run_generate(stub, lib.generate_request(
        api.pb, token_ids=ids, model="demo-lm", temperature=0.0, max_new_tokens=6)))
    got = client.completions.create(model="demo-lm", prompt=[PROMPT, ids],
                                    max_tokens=6, temperature=0, n=2)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [first, first, second, second]
    assert got.usage.prompt_tokens == last_a.usage.prompt_tokens + len(ids)
    assert got.usage.completion_tokens == 24
    streamed = {}
    for chunk in client.completions.create(model="demo-lm", prompt=[PROMPT, ids],
                                           max_tokens=6, temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: first, 1: second}
    # lm-eval's log-likelihood requests, batched: each choice is its prompt's
    # answer alone.
    batch = [[5, 6, 7, 8], [9, 10, 11]]
    together = client.completions.create(model="demo-lm", prompt=batch, max_tokens=1,
                                         temperature=0, logprobs=1, echo=True)
    for i, prompt in enumerate(batch):
        alone = client.completions.create(model="demo-lm", prompt=prompt, max_tokens=1,
                                          temperature=0, logprobs=1, echo=True)
        assert together.choices[i].logprobs.tokens == alone.choices[0].logprobs.tokens
        # Batched with another row, the sums may round differently.
        assert together.choices[i].logprobs.token_logprobs[0] is None
        assert (together.choices[i].logprobs.token_logprobs[1:] ==
                pytest.approx(alone.choices[0].logprobs.token_logprobs[1:], abs=1e-4))
        assert together.choices[i].text == alone.choices[0].text
    # One bad prompt fails the request, naming it.
    status, _, body = request(server, "POST", "/v1/completions",
                              {"model": "demo-lm", "prompt": [[5, 6], [1 << 30]],
                               "max_tokens": 2})
    assert status == 400, body
    assert "prompt" in body["error"]["message"], body
