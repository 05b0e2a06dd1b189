"""Anthropic's Messages API (POST /v1/messages) on a real moh-server's HTTP
port (service/http/anthropic_api.h), driven by the official `anthropic` Python
client (PyPI, pinned in scripts/test_venv.env) and by raw HTTP where the client
hides the wire:

- the message equals the OpenAI chat endpoint's greedy completion of the same
  conversation (the model's chat template, system first), with usage, the
  `moh` object and stop reasons max_tokens, stop_sequence (naming the string)
  and end_turn;
- streamed (messages.stream and stream=True): Anthropic's events in order, the
  same text as the whole message, usage in message_delta;
- errors in Anthropic's shape, naming the field and its range; unknown fields
  and the ones this server cannot honour (tools, image blocks) refused by name;
- tokens (auth_token_file) as x-api-key or as a bearer token;
- metrics count the requests with rpc="Messages".
"""
import json
import os
import shutil

import pytest

import moh_testlib as lib

anthropic = lib.client_library("anthropic")

DEMO_LM = os.path.join(lib.SOURCE_DIR, "models", "demo-lm")
SYSTEM = "Answer as the Preacher."
USER = [{"role": "user", "content": "What profit hath a man?"}]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("anthropic", [("demo-lm", DEMO_LM, "")], http=True)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url="http://127.0.0.1:%d" % server.http_port,
                               api_key="unused", timeout=lib.RPC_TIMEOUT, max_retries=0)


def request(server, method, path, body=None, headers=None):
    """(status, parsed JSON or text) of one raw HTTP request."""
    status, _, parsed = lib.http_request(server, method, path, body, headers)
    return status, parsed


def chat_completion(server, max_tokens, **fields):
    """The OpenAI chat endpoint's greedy answer to SYSTEM and USER."""
    status, body = request(server, "POST", "/v1/chat/completions", dict(
        model="demo-lm", max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}] + USER, **fields))
    assert status == 200, body
    return body


def create(client, max_tokens=16, extra_body=None, **kwargs):
    """messages.create of SYSTEM and USER, greedy. The client (2.x) names no
    sampling field: temperature, top_p and top_k travel in extra_body."""
    return client.messages.create(
        model="demo-lm", max_tokens=max_tokens, system=SYSTEM, messages=USER,
        extra_body=dict({"temperature": 0}, **(extra_body or {})), **kwargs)


def test_message_equals_the_chat_completion(client, server):
    want = chat_completion(server, 16)
    got = create(client)
    assert got.id.startswith("msg_") and got.type == "message"
    assert got.role == "assistant" and got.model == "demo-lm"
    assert len(got.content) == 1 and got.content[0].type == "text"
    assert got.content[0].text == want["choices"][0]["message"]["content"]
    assert got.stop_reason == "max_tokens" and got.stop_sequence is None
    assert got.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.output_tokens == 16
    assert got.model_extra["moh"]["effective_activation_ratio"] == pytest.approx(
        want["moh"]["effective_activation_ratio"])
    # System as text blocks: the same conversation.
    blocks = client.messages.create(
        model="demo-lm", max_tokens=16, extra_body={"temperature": 0},
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": USER[0]["content"]}]}])
    assert blocks.content[0].text == got.content[0].text


def test_activation_ratio_is_a_request_field(client):
    half = create(client, extra_body={"activation_ratio": 0.5})
    assert half.model_extra["moh"]["activation_ratio"] == pytest.approx(0.5)
    default = create(client)
    assert (default.model_extra["moh"]["effective_activation_ratio"] >
            half.model_extra["moh"]["effective_activation_ratio"])


def test_stream_equals_the_whole_message(client, server):
    whole = create(client, max_tokens=20)
    with client.messages.stream(model="demo-lm", max_tokens=20, system=SYSTEM,
                                messages=USER, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.stop_sequence is None
    assert final.usage.output_tokens == 20
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.id.startswith("msg_")
    # The events through the client (which drops pings), in Anthropic's order.
    events = list(create(client, max_tokens=20, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    assert events[0].message.content == [] and events[0].message.role == "assistant"
    assert events[1].index == 0 and events[1].content_block.type == "text"
    assert "".join(e.delta.text for e in events[2:-3]) == whole.content[0].text
    assert all(e.delta.type == "text_delta" for e in events[2:-3])
    delta = events[-2]
    assert delta.delta.stop_reason == "max_tokens"
    assert delta.usage.output_tokens == 20
    assert delta.usage.input_tokens == whole.usage.input_tokens
    # On the wire: "event: <type>" and "data: <json of that type>", the ping
    # third.
    status, text = request(server, "POST", "/v1/messages", {
        "model": "demo-lm", "max_tokens": 4, "messages": USER, "stream": True})
    assert status == 200
    wire = [block.split("\n") for block in text.strip().split("\n\n")]
    assert all(len(b) == 2 and b[0].startswith("event: ") and b[1].startswith("data: ")
               for b in wire)
    assert all(json.loads(b[1][6:])["type"] == b[0][7:] for b in wire)
    assert [b[0][7:] for b in wire[:3]] == ["message_start", "content_block_start", "ping"]
    assert wire[-1][0] == "event: message_stop"


def test_stop_sequences(client):
    whole = create(client, max_tokens=24).content[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    cut = create(client, max_tokens=24, stop_sequences=["never-seen", stop])
    assert cut.content[0].text == whole[:whole.index(stop)]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    with client.messages.stream(model="demo-lm", max_tokens=24, system=SYSTEM,
                                messages=USER, extra_body={"temperature": 0},
                                stop_sequences=[stop, "never-seen"]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == cut.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_end_turn(api, server, server_factory, workdir):
    """A natural end (EOS) is end_turn: a copy of demo-lm whose
    generation_config.json makes EOS of the token greedy decoding writes first
    (read from gRPC's Generate of the rendered conversation)."""
    from test_openai_http import render_chat

    rendered, bos = render_chat([{"role": "system", "content": SYSTEM}] + USER)
    stub = api.grpc.InferenceStub(server.channel())
    first = lib.token_ids_of(lib.run_generate(stub, lib.generate_request(
        api.pb, prompt=rendered[len(bos):], model="demo-lm", temperature=0.0,
        max_new_tokens=1)))[0]
    path = os.path.join(workdir, "demo_lm_eos")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(DEMO_LM, path)
    config = os.path.join(path, "generation_config.json")
    with open(config) as f:
        generation = json.load(f)
    generation["eos_token_id"] = [generation["eos_token_id"], first]
    with open(config, "w") as f:
        json.dump(generation, f)
    eos = server_factory("anthropic_eos", [("demo-lm", path, "")], http=True,
                         metrics=False)
    eos_client = anthropic.Anthropic(base_url="http://127.0.0.1:%d" % eos.http_port,
                                     api_key="unused", max_retries=0)
    got = create(eos_client)
    assert got.stop_reason == "end_turn" and got.stop_sequence is None
    assert got.content[0].text == "" and got.usage.output_tokens == 1
    events = list(create(eos_client, stream=True))
    assert events[-2].delta.stop_reason == "end_turn"


def test_errors_are_anthropics_and_name_the_field(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, extra_body={"temperature": 1.5})
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature must be in [0, 1], got 1.5" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, extra_body={"bogus": 1})
    assert "\"bogus\" is not a field of this endpoint" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, tools=[{"name": "t", "input_schema": {"type": "object"}}])
    assert "tools is not supported by this server" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="demo-lm", max_tokens=4, messages=[{
            "role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert "messages[0].content[0].type is \"image\", which this server does not" in (
        e.value.message)
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, max_tokens=100000)
    assert "max_tokens must be in [1, " in e.value.message  # the model's limit
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    # What the client does not let one send.
    status, body = request(server, "POST", "/v1/messages",
                           {"model": "demo-lm", "messages": USER})
    assert status == 400 and body["type"] == "error"
    assert body["error"] == {"type": "invalid_request_error",
                             "message": "max_tokens is required"}
    status, body = request(server, "POST", "/v1/messages", b"{not json")
    assert status == 400 and body["error"]["message"].startswith(
        "the body must be JSON (parse error at line 1, column 3")
    status, body = request(server, "GET", "/v1/messages")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"
    status, body = request(server, "GET", "/v1/nothing")
    assert status == 404 and "POST /v1/messages" in body["error"]["message"]


def test_requests_are_counted_as_messages(client, server):
    def count(**labels):
        return lib.metric_value(server.samples(), "moh_requests_total",
                                rpc="Messages", **labels) or 0

    ok, refused = count(model="demo-lm", code="OK"), count(model="", code="INVALID_ARGUMENT")
    create(client, max_tokens=2)
    list(create(client, max_tokens=2, stream=True))
    with pytest.raises(anthropic.BadRequestError):
        create(client, extra_body={"top_p": 0})
    assert count(model="demo-lm", code="OK") == ok + 2
    # Refused before it reached a model: counted with model="".
    assert count(model="", code="INVALID_ARGUMENT") == refused + 1


def test_tokens_as_x_api_key_or_bearer(server_factory, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("sesame\n")
    server = server_factory("anthropic_auth", [("demo-lm", DEMO_LM, "")], http=True,
                            metrics=False, extra='auth_token_file: "%s"' % tokens)
    url = "http://127.0.0.1:%d" % server.http_port

    def client_with(**auth):
        return anthropic.Anthropic(base_url=url, max_retries=0, **auth)

    # The client (2.x) sends api_key and auth_token alike as a bearer token;
    # x-api-key, Anthropic's header, as a header of its own.
    for auth in ({"api_key": "sesame"}, {"auth_token": "sesame"},
                 {"api_key": None, "default_headers": {"X-Api-Key": "sesame"}}):
        assert create(client_with(**auth), max_tokens=2).usage.output_tokens == 2, auth
    for auth, message in (({"api_key": "wrong"}, "authorization: unknown token"),
                          ({"api_key": None, "default_headers": {"X-Api-Key": "wrong"}},
                           "x-api-key: unknown token")):
        with pytest.raises(anthropic.AuthenticationError) as e:
            create(client_with(**auth), max_tokens=2)
        assert e.value.body["error"]["type"] == "authentication_error"
        assert message in e.value.message
    status, body = request(server, "POST", "/v1/messages",
                           {"model": "demo-lm", "max_tokens": 2, "messages": USER})
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert "x-api-key: <token>" in body["error"]["message"]
    status, body = request(server, "POST", "/v1/messages",
                           {"model": "demo-lm", "max_tokens": 2, "messages": USER},
                           headers={"x-api-key": "sesame"})
    assert status == 200 and body["usage"]["output_tokens"] == 2
    assert request(server, "GET", "/health")[0] == 200
