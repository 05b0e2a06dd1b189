"""Structured outputs (response_format) on a real moh-server with the demo
language model (models/demo-lm), through the official `openai` client on
/v1/chat/completions and /v1/completions, streamed and not, and through
gRPC's Generate (GenerateRequest.response_format):

- every output under a JSON schema parses and validates against it
  (`jsonschema`), at activation ratios 0.5, 0.75 and 1.0, greedy and sampled
  with seeds; json_object gives an object;
- constrained and unconstrained requests run in one batch, concurrently, and
  the unconstrained ones are token for token what they are alone (greedy);
- an unsatisfiable, a malformed and an oversized schema are 400s (gRPC:
  INVALID_ARGUMENT) naming response_format.json_schema.schema;
- max_tokens too small ends with finish_reason "length" (the JSON is then
  incomplete, as vLLM's).
"""
import json
import os

import pytest

import moh_testlib as lib

if os.environ.get("CI") == "true":
    import jsonschema
    import openai
else:
    jsonschema = pytest.importorskip("jsonschema",
                                     reason="python3-jsonschema")
    openai = pytest.importorskip(
        "openai", reason="the openai client: bash scripts/install_deps.sh --test")

DEMO_LM = os.path.join(lib.SOURCE_DIR, "models", "demo-lm")
MAX_TOKENS = 160  # bounds the schema's longest output (demo-lm: 256 positions)

# Every output of this schema is short: bounded strings, integers, arrays.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                 "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": SCHEMA,
                                 "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PROMPT = "A person, as JSON:"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("structured", [("demo-lm", DEMO_LM,
                                        "generation { max_running: 8 }")],
                        http=True)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % server.http_port,
                         api_key="unused", timeout=lib.RPC_TIMEOUT,
                         max_retries=0)


@pytest.fixture(scope="module")
def stub(server, api):
    return api.grpc.InferenceStub(server.channel())


def valid(text, schema=SCHEMA):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def complete(client, chat, response_format, stream=False, **kwargs):
    """(text, finish_reason) of one completion."""
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    extra = {"response_format": response_format}
    extra.update(kwargs.pop("extra_body", {}))
    if chat:
        result = client.chat.completions.create(
            model="demo-lm", messages=MESSAGES, stream=stream,
            extra_body=extra, **kwargs)
    else:
        result = client.completions.create(
            model="demo-lm", prompt=PROMPT, stream=stream, extra_body=extra,
            **kwargs)
    if not stream:
        choice = result.choices[0]
        return (choice.message.content if chat else choice.text,
                choice.finish_reason)
    text, finish = "", None
    for chunk in result:
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            text += piece or ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("ratio", [0.5, 0.75, 1.0])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_schema_outputs_validate(client, ratio, chat, stream):
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        text, finish = complete(
            client, chat, SCHEMA_FORMAT, stream=stream,
            temperature=temperature, seed=seed,
            extra_body={"activation_ratio": ratio})
        assert finish == "stop", (temperature, seed, text)
        keys = list(valid(text))
        # In the schema's order (the client's, not sorted).
        assert keys == [k for k in SCHEMA["properties"] if k in keys], text


def test_json_object(client):
    for seed in range(4):
        text, finish = complete(client, True, {"type": "json_object"},
                                temperature=1.0, seed=seed, max_tokens=120)
        assert text.startswith("{"), text
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert finish == "length"
    # Free text beside it: "text" is no constraint at all.
    free, _ = complete(client, False, {"type": "text"}, temperature=0.0,
                       max_tokens=8)
    plain = client.completions.create(model="demo-lm", prompt=PROMPT,
                                      temperature=0.0, max_tokens=8)
    assert free == plain.choices[0].text


def test_max_tokens_too_small_ends_with_length(client):
    for chat in (True, False):
        text, finish = complete(client, chat, SCHEMA_FORMAT, temperature=0.0,
                                max_tokens=3)
        assert finish == "length"
        assert text.startswith("{")


def grpc_request(api, schema=None, json_object=False, prompt=PROMPT,
                 **sampling):
    sampling.setdefault("max_new_tokens", MAX_TOKENS)
    request = lib.generate_request(api.pb, prompt=prompt, **sampling)
    if json_object:
        request.response_format.json_object.SetInParent()
    elif schema is not None:
        request.response_format.json_schema.name = "person"
        request.response_format.json_schema.schema = (
            schema if isinstance(schema, str) else json.dumps(schema))
    return request


def test_grpc_generate(api, stub):
    for ratio in (0.5, 1.0):
        for temperature, seed in ((0.0, 0), (1.0, 5)):
            request = grpc_request(api, SCHEMA, temperature=temperature,
                                   seed=seed)
            request.activation.ratio = ratio
            messages = lib.run_generate(stub, request)
            text = "".join(m.text for m in messages)
            assert messages[-1].finish_reason == api.pb.EOS, text
            valid(text)
    messages = lib.run_generate(stub, grpc_request(api, json_object=True,
                                                   max_new_tokens=4))
    assert "".join(m.text for m in messages).startswith("{")


def test_mixed_batch_unconstrained_rows_unchanged(api, stub):
    # Unconstrained greedy requests beside constrained ones, all in flight at
    # once: the unconstrained outputs are what they are alone.
    prompts = ["Once upon a time", "The weather today", "In the beginning",
               "A list of colours"]
    free = [grpc_request(api, prompt=p, temperature=0.0, max_new_tokens=40)
            for p in prompts]
    alone = [lib.token_ids_of(lib.run_generate(stub, r)) for r in free]
    constrained = [grpc_request(api, SCHEMA, prompt=p, temperature=1.0,
                                seed=i) for i, p in enumerate(prompts)]
    requests = [r for pair in zip(free, constrained) for r in pair]
    together = lib.generate_together(stub, requests)
    for i in range(len(prompts)):
        assert lib.token_ids_of(together[2 * i]) == alone[i], prompts[i]
        valid("".join(m.text for m in together[2 * i + 1]))


UNSATISFIABLE = {"type": "object",
                 "properties": {"n": {"type": "integer", "minimum": 5,
                                      "maximum": 1}},
                 "required": ["n"]}
OVERSIZED = {"type": "object",
             "properties": {"p%d" % i: {"type": "string",
                                        "description": "x" * 40}
                            for i in range(1000)}}


@pytest.mark.parametrize("schema", [UNSATISFIABLE, OVERSIZED, "not json"],
                         ids=["unsatisfiable", "oversized", "malformed"])
def test_bad_schemas_are_400_naming_the_field(client, server, api, stub,
                                              schema):
    field = "response_format.json_schema.schema"
    for chat in (True, False):
        if schema == "not json":
            fmt = {"type": "json_schema",
                   "json_schema": {"name": "x", "schema": "not json"}}
        else:
            fmt = {"type": "json_schema",
                   "json_schema": {"name": "x", "schema": schema}}
        with pytest.raises(openai.BadRequestError) as raised:
            complete(client, chat, fmt)
        error = raised.value.body
        assert error["param"] == field, error
        assert field in error["message"], error
    error = lib.rpc_error(stub.Generate,
                          grpc_request(api, schema if schema != "not json"
                                       else "{not json"),
                          timeout=lib.RPC_TIMEOUT)
    assert error.code().name == "INVALID_ARGUMENT"
    assert field in error.details()
    # The server goes on serving.
    text, finish = complete(client, False, SCHEMA_FORMAT, temperature=0.0)
    assert finish == "stop"
    valid(text)
