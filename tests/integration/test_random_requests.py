"""Random requests through the real server, drawn by hypothesis: every field
of Generate, Classify and GenerateImage, and the bodies of the HTTP API's
completions, chat completions and messages, from valid and invalid values
alike (NaN, infinities, negative and huge numbers, wrong types, wrong
shapes, unknown models, random bytes for images).

Whatever arrives, the server keeps its promises:
- each answer is a result or a client's error: never INTERNAL, UNKNOWN or a
  deadline passed (gRPC), never a 5xx (HTTP), and the process lives on;
- an INVALID_ARGUMENT names a field of the request, an HTTP 4xx carries a
  JSON error with a message;
- a result is well formed: tokens in the vocabulary, no more of them than
  max_new_tokens, one finish reason a sequence, finite log-probabilities
  and scores, a PNG of the size it says;
- afterwards the same greedy request gives the same tokens as before, the
  health service says SERVING.
The draws are derandomized: the same examples in every run.
MOH_RANDOM_EXAMPLES sets how many requests each test draws (default 40);
raise it for a longer search by hand.
"""
import functools
import io
import math
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moh_testlib as lib

DIT = os.path.join(lib.FIXTURES, "dit_tiny")
CHAT_LM = os.path.join(lib.SOURCE_DIR, "models", "demo-lm")  # a chat template
EXAMPLES = int(os.environ.get("MOH_RANDOM_EXAMPLES", "40"))
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
LM_MAX_SEQ_LEN = 256
VIT_CLASSES = 5

# What a client's mistake may be answered with; anything else (INTERNAL,
# UNKNOWN, DEADLINE_EXCEEDED, UNAVAILABLE, ...) is the server's fault.
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED,
}

random_settings = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("random", [
        ("demo-lm", lib.LM_DIR, "generation { max_running: 4 }"),
        ("demo-vit", lib.VIT_DIR, ""),
        ("dit", DIT, "generation { max_running: 4 }"),
        ("chat", CHAT_LM, "generation { max_running: 4 }"),
    ], wait_serving=False, http=True)


stub, models = lib.model_fixtures()

REFERENCE = dict(prompt="Once upon a time", max_new_tokens=12)


@pytest.fixture(scope="module")
def reference(api, stub, models):
    """The greedy tokens of one request before any random one arrived."""
    return lib.token_ids_of(lib.run_generate(
        stub, lib.generate_request(api.pb, **REFERENCE)))


def expect_unharmed(api, server, stub, reference):
    """The server answers as before, and once the last request has ended no
    request is counted running or waiting and no KV block is held (the
    prefix cache's free blocks aside): errors and cancellations leak
    nothing."""
    assert server.proc.poll() is None, "moh-server exited"
    again = lib.token_ids_of(lib.run_generate(
        stub, lib.generate_request(api.pb, **REFERENCE)))
    assert again == reference
    assert lib.health_check(server.channel()) == "SERVING"

    def held():
        samples = server.samples()
        return [(name, labels, value)
                for name in ("moh_requests_running", "moh_requests_waiting",
                             "moh_kv_blocks_in_use")
                for labels, value in lib.metric_series(samples, name)
                if value != 0]

    deadline = time.monotonic() + 30
    while held() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not held(), held()


# --- values ---
#
# Each request is drawn valid first (every field optional, each within its
# range), then up to two of its fields are drawn again from anything their
# type holds: mostly answers to follow, and every field wrong at times, alone
# or beside another.


@st.composite
def mixed(draw, valid, wild, required=()):
    """A dict: `required`'s keys and some of `valid`'s, each from its valid
    strategy, then up to two keys of `wild` from their wild ones."""
    chosen = draw(st.fixed_dictionaries(
        {k: valid[k] for k in required},
        optional={k: v for k, v in valid.items() if k not in required}))
    for key in draw(st.lists(st.sampled_from(sorted(wild)), max_size=2,
                             unique=True)):
        chosen[key] = draw(wild[key])
    return chosen


def int32s(small=(-3, 40)):
    return st.one_of(
        st.integers(*small),
        st.sampled_from([INT32_MIN, INT32_MAX, -1, 0, 1, 255, 256, 1 << 20]),
        st.integers(INT32_MIN, INT32_MAX))


def float32s():
    return st.one_of(
        st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, -1.0, 1e-30, 3.4e38,
                         math.nan, math.inf, -math.inf]),
        st.floats(-4, 4, width=32), st.floats(width=32))


def valid_ratios():
    return st.sampled_from([0.0, 0.25, 0.5, 0.625, 0.75, 0.875, 1.0])


def texts(max_size=24, min_size=0):
    return st.one_of(
        st.text(min_size=min_size, max_size=max_size),
        st.sampled_from(["Once upon a time", "\x00", "\ufffd" * 3,
                         "{\"a\": [1, 2]}", "\n\n", "<|endoftext|>"]))


# Strategies take named functions, not lambdas: hypothesis describes each
# draw's functions, a lambda by reading its source file again.
def repeat(piece, times):
    return piece * times


def as_pixels(data):
    return "pixels", ([3, 16, 16], data)


def tag(rpc, request):
    return rpc, request


def long_texts():
    """Up to a few thousand characters (more tokens than the demo LM's
    256 positions hold)."""
    return st.builds(repeat, st.text(min_size=1, max_size=8),
                     st.integers(1, 600))


def token_ids(valid=True):
    if valid:
        return st.lists(st.integers(0, lib.LM_VOCAB - 1), min_size=1,
                        max_size=60)
    ids = st.one_of(st.integers(0, lib.LM_VOCAB - 1),
                    st.integers(-3, lib.LM_VOCAB + 3), int32s())
    return st.lists(ids, max_size=300)


ACTIVATION_VALID = {"ratio": valid_ratios(), "min_ratio": valid_ratios()}
ACTIVATION_WILD = {"ratio": float32s(), "min_ratio": float32s()}


def set_activation(request, fields):
    for name in ("ratio", "min_ratio"):
        if name in fields:
            setattr(request.activation, name, fields[name])


# --- gRPC ---

SAMPLING_VALID = {
    "max_new_tokens": st.integers(1, 40),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(0, 50),
    "top_p": st.floats(0.05, 1),
    "seed": st.integers(0, (1 << 64) - 1),
    "stop": st.lists(texts(6, min_size=1), max_size=3),
    "repetition_penalty": st.floats(0.5, 2),
    "stop_token_ids": st.lists(st.integers(0, lib.LM_VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logprobs": st.integers(0, 5),
    "prompt_logprobs": st.integers(0, 5),
    "logit_bias": st.dictionaries(st.integers(0, lib.LM_VOCAB - 1),
                                  st.floats(-100, 100), max_size=4),
}
SAMPLING_WILD = {
    "max_new_tokens": int32s(),
    "temperature": float32s(),
    "top_k": int32s(),
    "top_p": float32s(),
    "stop": st.lists(texts(6), max_size=20),
    "repetition_penalty": float32s(),
    "stop_token_ids": st.lists(st.integers(-3, lib.LM_VOCAB + 3),
                               max_size=70),
    "min_tokens": int32s(),
    "min_p": float32s(),
    "presence_penalty": float32s(),
    "frequency_penalty": float32s(),
    "logprobs": int32s((-2, 25)),
    "prompt_logprobs": int32s((-2, 25)),
    "logit_bias": st.dictionaries(int32s((-3, lib.LM_VOCAB + 3)), float32s(),
                                  max_size=4),
}
SCHEMAS = [
    '{"type": "object", "properties": {"a": {"type": "integer"}}}',
    '{"type": "array", "items": {"type": "string"}, "maxItems": 2}',
    '{"enum": ["yes", "no"]}',
]


def generate_requests(pb):
    valid = dict(SAMPLING_VALID, **ACTIVATION_VALID, **{
        "model": st.just("demo-lm"),
        "input": st.one_of(st.tuples(st.just("prompt"), texts(min_size=1)),
                           st.tuples(st.just("token_ids"), token_ids())),
        "response_format": st.one_of(st.just("json_object"),
                                     st.sampled_from(SCHEMAS)),
        "include_routing": st.booleans(),
        "n": st.integers(1, 3),
        "priority": st.integers(-5, 5),
    })
    wild = dict(SAMPLING_WILD, **ACTIVATION_WILD, **{
        "model": st.sampled_from(["demo-vit", "dit", "nope", ""]),
        "input": st.one_of(
            st.just(None), st.tuples(st.just("prompt"), long_texts()),
            st.tuples(st.just("token_ids"), token_ids(valid=False)),
            st.tuples(st.just("both"), texts())),
        "response_format": st.one_of(texts(), st.sampled_from(
            ['{"type": "nonsense"}', "[]", '{"$ref": "#/nowhere"}',
             '{"type": "string", "pattern": "(("}'])),
        "n": int32s((-1, 20)),
        "priority": int32s(),
    })

    def build(fields):
        request = pb.GenerateRequest(
            model=fields["model"],
            include_routing=fields.get("include_routing", False))
        kind, value = fields["input"] or (None, None)
        if kind in ("prompt", "both"):
            request.prompt = value
        if kind == "token_ids":
            request.token_ids.extend(value)
        if kind == "both":
            request.token_ids.extend([1, 2])
        for name in SAMPLING_VALID:
            if name not in fields:
                continue
            value, field = fields[name], getattr(request.sampling, name)
            if name == "logit_bias":
                for token, bias in value.items():
                    field[token] = bias
            elif isinstance(value, list):
                field.extend(value)
            else:
                setattr(request.sampling, name, value)
        set_activation(request, fields)
        form = fields.get("response_format")
        if form == "json_object":
            request.response_format.json_object.SetInParent()
        elif form is not None:
            request.response_format.json_schema.schema = form
        for name in ("n", "priority"):
            if name in fields:
                setattr(request, name, fields[name])
        return request

    return mixed(valid, wild, required=("model", "input")).map(build)


def field_names(descriptor, seen=None):
    """The names of every field a message type has, nested types' too (both
    'sampling' and 'temperature' for GenerateRequest)."""
    seen = set() if seen is None else seen
    if descriptor.full_name in seen:
        return set()
    seen.add(descriptor.full_name)
    names = set()
    for field in descriptor.fields:
        names.add(field.name)
        if field.message_type is not None:
            names |= field_names(field.message_type, seen)
    return names


def expect_client_error(error, request):
    code, details = error.code(), error.details()
    assert code in CLIENT_ERRORS, (code, details)
    assert details, code
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        named = [f for f in field_names(request.DESCRIPTOR)
                 if re.search(r"\b%s\b" % f, details)]
        assert named, ("names no field of %s" % request.DESCRIPTOR.name,
                       details)


def outcome(call):
    """(the result of call(), None) or (None, its grpc.RpcError): checked
    outside the except clause, so that a failed check does not chain the
    RPC's exception (whose traceback differs from call to call)."""
    try:
        return call(), None
    except grpc.RpcError as error:
        return None, error


def expect_generation(request, messages):
    sampling = request.sampling
    finished, counts = {}, {}
    for m in messages:
        assert m.index not in finished, ("a message after the finish", m.index)
        assert all(0 <= t < lib.LM_VOCAB for t in m.token_ids), m.token_ids
        counts[m.index] = counts.get(m.index, 0) + len(m.token_ids)
        if sampling.HasField("logprobs"):
            assert [p.token_id for p in m.logprobs] == list(m.token_ids)
        else:
            assert not m.logprobs
        for p in m.logprobs:
            assert p.logprob <= 1e-4 and not math.isnan(p.logprob), p
            assert len(p.top_logprobs) <= sampling.logprobs, p
        if m.finish_reason:
            finished[m.index] = m
    sequences = max(1, request.n)
    assert set(finished) == set(range(sequences)), (sorted(finished),
                                                    sequences)
    for index, m in finished.items():
        count = counts[index]
        assert m.usage.completion_tokens == count, (index, m.usage, count)
        assert m.usage.prompt_tokens + count <= LM_MAX_SEQ_LEN, m.usage
        if sampling.HasField("max_new_tokens"):
            assert count <= sampling.max_new_tokens, count
            if m.finish_reason == api_pb(request).LENGTH:
                assert (count == sampling.max_new_tokens or
                        m.usage.prompt_tokens + count == LM_MAX_SEQ_LEN), (
                            count, m.usage)
        if m.finish_reason == api_pb(request).EOS:
            assert not sampling.ignore_eos
            assert count >= sampling.min_tokens, count


def api_pb(message):
    """The generated module a message comes from (its enums)."""
    import sys
    return sys.modules[type(message).__module__]


def search(api, server, stub, reference, requests, call, expect):
    """Draws `requests`, answers each with call(request): a client's error
    or a result that expect(request, result) accepts; then the server is
    unharmed."""
    @random_settings
    @given(requests)
    def check(request):
        answer, error = outcome(lambda: call(request))
        if error is not None:
            expect_client_error(error, request)
        else:
            expect(request, answer)
        assert server.proc.poll() is None, "moh-server exited"

    check()
    expect_unharmed(api, server, stub, reference)


def test_random_generate_requests(api, server, stub, models, reference):
    search(api, server, stub, reference, generate_requests(api.pb),
           lambda r: lib.run_generate(stub, r), expect_generation)


def pngs(cut=False):
    """PNG bytes of a random size (cut: sometimes cut short)."""
    from PIL import Image

    def encode(width, height, mode, cut):
        out = io.BytesIO()
        Image.new(mode, (width, height), 100).save(out, format="PNG")
        data = out.getvalue()
        return data[:cut] if cut else data

    return st.builds(encode, st.integers(1, 64), st.integers(1, 64),
                     st.sampled_from(["RGB", "L", "RGBA", "1", "I;16"]),
                     st.integers(1, 200) if cut else st.none())


def pixel_data(specials=0):
    """768 pixels in [0, 1] from a drawn seed (a small example), with up to
    `specials` of them set to any float32 (NaN, infinities, huge)."""
    def build(seed, special):
        import numpy as np
        data = np.random.default_rng(seed).random(768, dtype=np.float32)
        for at, value in special:
            data[at] = value
        return data.tolist()

    return st.builds(build, st.integers(0, (1 << 32) - 1), st.lists(
        st.tuples(st.integers(0, 767), float32s()), max_size=specials))


def classify_requests(pb):
    pixels = st.builds(as_pixels, pixel_data())
    valid = dict(ACTIVATION_VALID, **{
        "model": st.just("demo-vit"),
        "input": st.one_of(pixels, st.tuples(st.just("image"), pngs())),
        "top_n": st.integers(0, 6),
        "include_routing": st.booleans(),
    })
    any_shape = st.tuples(
        st.lists(st.one_of(st.integers(-2, 20), st.sampled_from(
            [1 << 31, 1 << 40, (1 << 63) - 1])), max_size=5),
        st.lists(st.floats(-2, 2, width=32), max_size=800))
    wild = dict(ACTIVATION_WILD, **{
        "model": st.sampled_from(["demo-lm", "dit", "nope"]),
        "input": st.one_of(
            st.just(None),
            st.tuples(st.just("image"), st.one_of(pngs(cut=True),
                                                  st.binary(max_size=64))),
            st.tuples(st.just("pixels"), any_shape),
            st.builds(as_pixels, pixel_data(specials=4)),
            st.tuples(st.just("text"), st.one_of(texts(), long_texts()))),
        "labels": st.lists(texts(12), max_size=6),
        "top_n": int32s((-2, 8)),
    })

    def build(fields):
        request = pb.ClassifyRequest(
            model=fields["model"], top_n=fields.get("top_n", 0),
            include_routing=fields.get("include_routing", False))
        kind, value = fields["input"] or (None, None)
        if kind == "pixels":
            request.pixels.shape.extend(value[0])
            request.pixels.data.extend(value[1])
        elif kind is not None:
            setattr(request, kind, value)
        request.labels.extend(fields.get("labels", []))
        set_activation(request, fields)
        return request

    labels = st.fixed_dictionaries({
        "model": st.just("demo-lm"),
        "input": st.tuples(st.just("text"), texts(min_size=1)),
        "labels": st.lists(texts(12, min_size=1), min_size=1, max_size=4,
                           unique=True)})
    return st.one_of(mixed(valid, wild, required=("model", "input")),
                     labels).map(build)


def expect_classes(request, response):
    classes = list(response.classes)
    assert classes, "an answer without classes"
    if request.top_n > 0:
        assert len(classes) <= request.top_n
    for c in classes:
        assert math.isfinite(c.score) and math.isfinite(c.log_likelihood), c
    if request.labels:
        assert {c.label for c in classes} <= set(request.labels)
    else:
        assert all(0 <= c.index < VIT_CLASSES for c in classes), classes


def test_random_classify_requests(api, server, stub, models, reference):
    search(api, server, stub, reference, classify_requests(api.pb),
           lambda r: stub.Classify(r, timeout=lib.RPC_TIMEOUT), expect_classes)


def image_requests(pb):
    valid = dict(ACTIVATION_VALID, **{
        "model": st.just("dit"),
        "condition": st.tuples(st.just("class_index"), st.integers(0, 9)),
        "seed": st.integers(0, (1 << 64) - 1),
        "steps": st.integers(0, 8),
        "guidance_scale": st.floats(1, 8),
        "include_routing": st.booleans(),
        "progress": st.booleans(),
    })
    wild = dict(ACTIVATION_WILD, **{
        "model": st.sampled_from(["demo-lm", "demo-vit", "nope"]),
        "condition": st.one_of(
            st.just(None), st.tuples(st.just("class_index"), int32s()),
            st.tuples(st.just("class_label"), texts(8))),
        "steps": int32s(),
        "guidance_scale": float32s(),
    })

    def build(fields):
        request = pb.GenerateImageRequest(
            model=fields["model"], steps=fields.get("steps", 0),
            include_routing=fields.get("include_routing", False),
            progress=fields.get("progress", False))
        if fields["condition"] is not None:
            setattr(request, *fields["condition"])
        for name in ("seed", "guidance_scale"):
            if name in fields:
                setattr(request, name, fields[name])
        set_activation(request, fields)
        return request

    return mixed(valid, wild, required=("model", "condition")).map(build)


def expect_image(request, messages):
    from PIL import Image
    final = messages[-1]
    assert final.png, "the last message has no image"
    assert all(not m.png for m in messages[:-1])
    with Image.open(io.BytesIO(final.png)) as image:
        assert image.size == (final.width, final.height)
    assert 0 < final.steps
    if request.steps > 0:
        assert final.steps == request.steps
    for m in messages[:-1]:
        assert 0 < m.step <= final.steps, (m.step, final.steps)


def test_random_generate_image_requests(api, server, stub, models, reference):
    search(api, server, stub, reference, image_requests(api.pb),
           lambda r: lib.drain_stream(
               stub.GenerateImage(r, timeout=lib.RPC_TIMEOUT),
               lib.RPC_TIMEOUT), expect_image)


def test_random_requests_at_once(api, server, stub, models, reference):
    """Two to five random requests of every kind in flight together, some
    of the streams cancelled after their first message, some with
    deadlines of a millisecond to half a second (which may pass in the
    queue, mid-step or mid-stream): every answer neither cancelled nor
    past its deadline keeps the promises above."""
    checks = {"Generate": expect_generation, "Classify": expect_classes,
              "GenerateImage": expect_image}
    calls = st.one_of(
        generate_requests(api.pb).map(functools.partial(tag, "Generate")),
        classify_requests(api.pb).map(functools.partial(tag, "Classify")),
        image_requests(api.pb).map(functools.partial(tag, "GenerateImage")))
    ends = st.sampled_from(["whole", "whole", "cancel", "deadline"])

    def run(rpc, request, end, timeout, barrier):
        if end != "deadline":
            timeout = lib.RPC_TIMEOUT
        if rpc == "Classify":
            future = stub.Classify.future(request, timeout=timeout)
            barrier.wait()
            return outcome(future.result)
        call = getattr(stub, rpc)(request, timeout=timeout)
        barrier.wait()
        if end != "cancel":
            return outcome(lambda: lib.drain_stream(call, timeout))
        messages, error = outcome(lambda: [next(call, None)])
        call.cancel()
        return None, error  # cancelled: no answer to check

    @random_settings
    @given(st.lists(st.tuples(calls, ends, st.floats(0.001, 0.5)),
                    min_size=2, max_size=5))
    def check(drawn):
        barrier = threading.Barrier(len(drawn), timeout=30)
        with ThreadPoolExecutor(len(drawn)) as pool:
            answers = list(pool.map(
                lambda d: run(d[0][0], d[0][1], d[1], d[2], barrier), drawn))
        for ((rpc, request), end, _), (answer, error) in zip(drawn, answers):
            if (error is not None and end == "deadline" and
                    error.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
                continue
            if error is not None:
                expect_client_error(error, request)
            elif answer is not None:
                checks[rpc](request, answer)
        assert server.proc.poll() is None, "moh-server exited"

    check()
    expect_unharmed(api, server, stub, reference)


@st.composite
def request_bytes(draw, pb):
    """(method, bytes): a drawn request's wire bytes with a few bytes
    overwritten, cut short or extended, or bytes from nowhere."""
    method, request = draw(st.sampled_from([
        ("Generate", generate_requests(pb)),
        ("Classify", classify_requests(pb)),
        ("GenerateImage", image_requests(pb))]))
    data = bytearray(draw(request).SerializeToString())
    how = draw(st.sampled_from(["overwrite", "cut", "extend", "random"]))
    if how == "random" or not data:
        return method, draw(st.binary(max_size=64))
    if how == "cut":
        return method, bytes(data[:draw(st.integers(0, len(data) - 1))])
    if how == "extend":
        return method, bytes(data) + draw(st.binary(min_size=1, max_size=16))
    for _ in range(draw(st.integers(1, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return method, bytes(data)


def test_random_request_bytes(api, server, stub, models, reference):
    """Wire bytes that may not parse as the method's message at all: the
    answer is a result, or a client's error (INVALID_ARGUMENT naming the
    message type when they do not parse), never INTERNAL."""
    channel = server.channel()
    responses = {"Generate": api.pb.GenerateResponse,
                 "Classify": api.pb.ClassifyResponse,
                 "GenerateImage": api.pb.GenerateImageResponse}

    def call(method, data):
        path = "/moh.v1.Inference/" + method
        parse = responses[method].FromString
        if method == "Classify":
            return channel.unary_unary(path, response_deserializer=parse)(
                data, timeout=lib.RPC_TIMEOUT)
        return lib.drain_stream(channel.unary_stream(
            path, response_deserializer=parse)(data, timeout=lib.RPC_TIMEOUT),
            lib.RPC_TIMEOUT)

    @random_settings
    @given(request_bytes(api.pb))
    def check(drawn):
        method, data = drawn
        _, error = outcome(lambda: call(method, data))
        if error is not None:
            code, details = error.code(), error.details()
            assert code in CLIENT_ERRORS, (code, details)
            assert details, code
        assert server.proc.poll() is None, "moh-server exited"

    check()
    expect_unharmed(api, server, stub, reference)


# --- HTTP ---


def json_values():
    """Any JSON value (no NaN: JSON has none)."""
    leaves = st.one_of(st.none(), st.booleans(),
                       st.integers(-(1 << 70), 1 << 70),
                       st.floats(allow_nan=False, allow_infinity=False),
                       st.text(max_size=12))
    return st.recursive(leaves, json_containers, max_leaves=8)


def json_containers(inner):
    return st.one_of(st.lists(inner, max_size=4),
                     st.dictionaries(st.text(max_size=8), inner, max_size=4))


def numbers():
    return st.one_of(st.integers(-3, 40), st.floats(-3, 3),
                     st.sampled_from([1 << 31, -(1 << 31) - 1, 1 << 64,
                                      1e308, -1e308, 0.0]))


def wild(strategy):
    """A field's wild values: its own type out of range, or any JSON."""
    return st.one_of(strategy, json_values())


def chat_messages(valid, roles=("user", "assistant", "system")):
    role = st.sampled_from(roles)
    content = st.one_of(texts(min_size=1), st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": texts(min_size=1)}), min_size=1,
        max_size=2))
    if not valid:
        role = wild(st.sampled_from(["tool", "developer", "nobody", ""]))
        content = wild(st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", "image", "x"]),
             "text": texts()}), max_size=2))
    message = st.fixed_dictionaries({"role": role, "content": content})
    return st.lists(message, min_size=1, max_size=3)


# Valid fields, and wild ones, of each endpoint's body.
HTTP_COMMON = ({
    "model": st.just("chat"),
    "temperature": st.floats(0, 1),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 40),
    "stream": st.booleans(),
    "activation_ratio": valid_ratios(),
}, {
    "model": wild(st.sampled_from(["demo-lm", "demo-vit", "dit", "nope",
                                   ""])),
    "temperature": wild(numbers()),
    "top_p": wild(numbers()),
    "top_k": wild(numbers()),
    "stream": json_values(),
    "activation_ratio": wild(numbers()),
    "min_activation_ratio": wild(numbers()),
})
OPENAI = ({
    "max_tokens": st.integers(1, 24),
    "n": st.integers(1, 3),
    "stop": st.one_of(texts(6, min_size=1),
                      st.lists(texts(6, min_size=1), max_size=3)),
    "seed": st.integers(0, 1 << 40),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "min_p": st.floats(0, 1),
    "logit_bias": st.dictionaries(st.integers(0, lib.LM_VOCAB - 1).map(str),
                                  st.floats(-100, 100), max_size=3),
    "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans()}),
    "user": texts(),
}, {
    "max_tokens": wild(numbers()),
    "max_completion_tokens": wild(numbers()),
    "n": wild(st.integers(-1, 40)),
    "stop": wild(st.lists(texts(6), max_size=20)),
    "seed": wild(numbers()),
    "logprobs": wild(numbers()),
    "top_logprobs": wild(numbers()),
    "presence_penalty": wild(numbers()),
    "min_p": wild(numbers()),
    "logit_bias": wild(st.dictionaries(st.text(max_size=4), json_values(),
                                       max_size=3)),
    "response_format": wild(st.sampled_from(
        [{"type": "json_object"}, {"type": "text"},
         {"type": "json_schema", "json_schema": {"name": "x", "schema": {
             "type": "object"}}}, {"type": "json_schema"}])),
    "stream_options": json_values(),
    "priority": wild(numbers()),
    "best_of": wild(numbers()),
    "tools": json_values(),
})
ANTHROPIC = ({
    "max_tokens": st.integers(1, 24),
    "stop_sequences": st.lists(texts(6, min_size=1), max_size=3),
    "system": texts(),
}, {
    "max_tokens": wild(numbers()),
    "stop_sequences": wild(st.lists(texts(6), max_size=20)),
    "system": json_values(),
    "metadata": json_values(),
    "thinking": json_values(),
})


def endpoint(path, own, extra_valid, extra_wild, required):
    valid = dict(HTTP_COMMON[0], **own[0], **extra_valid)
    wild_fields = dict(HTTP_COMMON[1], **own[1], **extra_wild)
    return st.tuples(st.just(path), mixed(valid, wild_fields, required))


def http_requests():
    completions = endpoint(
        "/v1/completions", OPENAI,
        {"prompt": st.one_of(texts(min_size=1), token_ids()),
         "echo": st.booleans(), "logprobs": st.integers(0, 5)},
        {"prompt": wild(st.one_of(long_texts(), st.lists(texts(), max_size=3),
                                  token_ids(valid=False))),
         "suffix": json_values()},
        required=("model", "prompt"))
    chat = endpoint(
        "/v1/chat/completions", OPENAI,
        {"messages": chat_messages(True), "logprobs": st.booleans(),
         "top_logprobs": st.integers(0, 5)},
        {"messages": wild(chat_messages(False))},
        required=("model", "messages"))
    messages = endpoint(
        "/v1/messages", ANTHROPIC,
        {"messages": chat_messages(True, roles=("user", "assistant"))},
        {"messages": wild(chat_messages(False))},
        required=("model", "messages", "max_tokens"))
    model = (st.just("chat"), wild(st.sampled_from(["demo-vit", "nope", ""])))
    tokenize = st.tuples(st.just("/tokenize"), mixed(
        {"model": model[0], "prompt": texts(min_size=1),
         "add_special_tokens": st.booleans(),
         "return_token_strs": st.booleans()},
        {"model": model[1], "prompt": wild(long_texts()),
         "messages": wild(chat_messages(True)),
         "add_generation_prompt": json_values(),
         "add_special_tokens": json_values()},
        required=("model", "prompt")))
    detokenize = st.tuples(st.just("/detokenize"), mixed(
        {"model": model[0], "tokens": st.lists(st.integers(0, 767),
                                               max_size=40)},
        {"model": model[1], "tokens": wild(token_ids(valid=False))},
        required=("model", "tokens")))
    return st.one_of(completions, chat, messages, tokenize, detokenize)


def expect_http_answer(path, body, status, text):
    assert status < 500, (status, text)
    if status != 200:
        assert isinstance(text, dict), (status, text)
        error = text.get("error")
        assert isinstance(error, dict) and error.get("message"), text
        return
    if body.get("stream") is True:
        assert isinstance(text, str) and ("data:" in text or
                                          "event:" in text), text
    elif path == "/tokenize":
        assert text["count"] == len(text["tokens"]), text
        assert all(0 <= t < 768 for t in text["tokens"]), text
    elif path == "/detokenize":
        assert isinstance(text["prompt"], str), text
    elif path == "/v1/messages":
        assert text["type"] == "message" and text["stop_reason"], text
    else:
        assert text["choices"], text


def test_random_http_requests(api, server, stub, models, reference):
    @random_settings
    @given(http_requests())
    def check(request):
        path, body = request
        status, _, text = lib.http_request(server, "POST", path, body=body, headers={
            "Content-Type": "application/json"})
        expect_http_answer(path, body, status, text)
        assert server.proc.poll() is None, "moh-server exited"

    check()
    expect_unharmed(api, server, stub, reference)
