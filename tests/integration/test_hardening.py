"""Hostile inputs through the real server (issue 13): a model directory built
to crash the loader is a FAILED model with a reason, and the other models
keep serving; a checkpoint whose vocabulary is padded beyond its tokenizer
never streams an id the tokenizer cannot decode."""
import json
import os
import shutil
import struct

import grpc
import pytest
import numpy as np

import moh_testlib as lib


def _nested_normalizer(depth):
    return ('{"type":"Sequence","normalizers":[' * depth +
            '{"type":"Lowercase"}' + "]}" * depth)


def test_deeply_nested_tokenizer_json_fails_its_model_only(
        api, server_factory, workdir):
    hostile = os.path.join(workdir, "nested_tokenizer_lm")
    shutil.copytree(lib.LM_DIR, hostile, dirs_exist_ok=True)
    path = os.path.join(hostile, "tokenizer.json")
    with open(path) as f:
        text = f.read()
    # The same tokenizer with 100000 nested normalizer Sequences in front
    # (a later "normalizer" key would win: drop it).
    text = text.replace('"normalizer"', '"unused_normalizer"', 1)
    with open(path, "w") as f:
        f.write('{"normalizer": ' + _nested_normalizer(100000) + "," +
                text.lstrip()[1:])
    server = server_factory("nested_tokenizer", [
        ("hostile", hostile, ""),
        ("demo-vit", lib.VIT_DIR, ""),
    ], wait_serving=False, metrics=False)
    stub = api.grpc.InferenceStub(server.channel())

    models = lib.wait_models_loaded(api, server)
    assert server.proc.poll() is None, server.log()
    assert models["hostile"].state == api.pb.ModelInfo.FAILED
    assert "nest at most 16 deep" in models["hostile"].failure_reason
    assert models["demo-vit"].state == api.pb.ModelInfo.READY
    request = api.pb.ClassifyRequest(model="demo-vit")
    request.pixels.shape.extend([3, 16, 16])
    request.pixels.data.extend([0.5] * 768)
    assert len(stub.Classify(request, timeout=lib.RPC_TIMEOUT).classes) == 5


def _pad_vocabulary(src, dst, extra):
    """A copy of the tied-embedding LM `src` whose embedding has `extra` rows
    beyond the tokenizer, built to win every argmax: +-100 x random
    directions."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    path = os.path.join(dst, "model.safetensors")
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    name = "model.embed_tokens.weight"
    begin, end = header[name]["data_offsets"]
    vocab, width = header[name]["shape"]
    embed = np.frombuffer(data[begin:end], dtype="<f4").reshape(vocab, width)
    directions = np.random.default_rng(7).standard_normal(
        (extra // 2, width)).astype("<f4")
    padded = np.concatenate([embed, 100 * directions, -100 * directions])
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    out, offset = b"", 0
    new_header = {"__metadata__": header.get("__metadata__", {})}
    for key in sorted(tensors, key=lambda k: tensors[k]["data_offsets"][0]):
        raw = (padded.tobytes() if key == name else
               data[tensors[key]["data_offsets"][0]:
                    tensors[key]["data_offsets"][1]])
        shape = list(padded.shape) if key == name else tensors[key]["shape"]
        new_header[key] = {"dtype": tensors[key]["dtype"], "shape": shape,
                           "data_offsets": [offset, offset + len(raw)]}
        out += raw
        offset += len(raw)
    encoded = json.dumps(new_header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + out)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["vocab_size"] = vocab + extra
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return vocab


def test_padded_vocabulary_rows_are_never_sampled(api, server_factory,
                                                  workdir):
    padded = os.path.join(workdir, "padded_vocab_lm")
    vocab = _pad_vocabulary(lib.LM_DIR, padded, 16)
    server = server_factory("padded_vocab", [
        ("plain", lib.LM_DIR, ""),
        ("padded", padded, ""),
    ], metrics=False)
    stub = api.grpc.InferenceStub(server.channel())
    greedy = {}
    for name in ("plain", "padded"):
        messages = lib.run_generate(stub, lib.generate_request(
            api.pb, model=name, prompt="The owl", max_new_tokens=12))
        greedy[name] = lib.token_ids_of(messages)
    # The padded rows would win every argmax; masked, the output is the
    # plain model's.
    assert greedy["padded"] == greedy["plain"]
    # Hot sampling beside a greedy stream in one batch: every id decodable,
    # nobody fails.
    hot = stub.Generate(lib.generate_request(
        api.pb, model="padded", prompt="The owl", max_new_tokens=40,
        temperature=50.0, seed=3), timeout=lib.RPC_TIMEOUT)
    calm = lib.run_generate(stub, lib.generate_request(
        api.pb, model="padded", prompt="The owl", max_new_tokens=12))
    hot_ids = lib.token_ids_of(list(hot))
    assert hot_ids and max(hot_ids) < vocab
    assert lib.token_ids_of(calm) == greedy["plain"]


def test_requests_that_reach_no_model_are_counted(api, server_factory):
    server = server_factory("unrouted", [("demo-lm", lib.LM_DIR, "")])
    stub = api.grpc.InferenceStub(server.channel())
    for _ in range(2):
        lib.rpc_error(lib.run_generate, stub,
                      lib.generate_request(api.pb, model="nope", prompt="hi"))
    lib.rpc_error(stub.Classify, api.pb.ClassifyRequest(model="nope", text="x"),
                  timeout=lib.RPC_TIMEOUT)
    samples = server.samples()
    assert lib.metric_value(samples, "moh_requests_total", model="",
                            rpc="Generate", code="NOT_FOUND") == 2
    assert lib.metric_value(samples, "moh_requests_total", model="",
                            rpc="Classify", code="NOT_FOUND") == 1


def test_a_request_over_max_message_mb_is_refused(api, server_factory):
    server = server_factory("small_messages", [("demo-lm", lib.LM_DIR, "")],
                            metrics=False, extra="max_message_mb: 1")
    stub = api.grpc.InferenceStub(server.channel())
    big = lib.generate_request(api.pb, prompt="x" * (2 << 20))
    error = lib.rpc_error(lib.run_generate, stub, big)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    ok = lib.generate_request(api.pb, prompt="hi", max_new_tokens=1)
    assert lib.run_generate(stub, ok)[-1].usage.completion_tokens == 1


def test_health_answers_within_a_second_under_a_flood_of_heavy_requests(
        api, server_factory):
    # Megabyte prompts to tokenize and 16-megapixel images to decode, from
    # more clients than the machine has cores, while a probe checks health
    # every 100 ms with Kubernetes' default probe timeout (1 s): request work
    # runs on the server's request workers, never on gRPC's own threads.
    import threading
    import time
    server = server_factory("flood", [("demo-lm", lib.LM_DIR, ""),
                                      ("demo-vit", lib.VIT_DIR, "")],
                            metrics=False)
    # Just under the 1 MiB prompt limit: each one tokenizes (the worker is
    # busy) before it is refused for the context.
    prompt = "the quick brown fox jumps over the lazy dog " * 23000
    image = lib.solid_png(4000, 4000)
    stop = threading.Event()
    codes = {}
    lock = threading.Lock()

    def flood(i):
        channel = server.new_channel()
        stub = api.grpc.InferenceStub(channel)
        while not stop.is_set():
            try:
                if i % 2:
                    lib.run_generate(stub, lib.generate_request(
                        api.pb, prompt=prompt, max_new_tokens=1), timeout=30)
                    code = "OK"
                else:
                    stub.Classify(api.pb.ClassifyRequest(model="demo-vit",
                                                         image=image),
                                  timeout=30)
                    code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            with lock:
                codes[code] = codes.get(code, 0) + 1
        channel.close()

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    probe = server.new_channel()
    failures, latencies = [], []
    try:
        time.sleep(2.0)  # the flood is under way
        for _ in range(60):
            begin = time.monotonic()
            try:
                status = lib.health_check(probe, timeout=1.0)
                if status != "SERVING":
                    failures.append(status)
            except grpc.RpcError as e:
                failures.append(e.code().name)
            latencies.append(time.monotonic() - begin)
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        probe.close()
    assert server.proc.poll() is None, server.log()
    # The flood really ran: heavy requests were answered meanwhile.
    assert sum(codes.values()) >= 12, codes
    assert not failures, (failures, max(latencies), codes)


def test_full_request_queue_is_resource_exhausted_and_harms_nothing(
        api, server_factory):
    # One request worker and room for one waiting request: a burst of heavy
    # requests overflows it; the overflow is told so (RESOURCE_EXHAUSTED
    # naming request_queue), the rest are answered, and the server serves on.
    import concurrent.futures
    server = server_factory("request_queue", [("demo-lm", lib.LM_DIR, "")],
                            metrics=False,
                            extra="request_threads: 1\nrequest_queue: 1")
    stub = api.grpc.InferenceStub(server.channel())
    # Just under the 1 MiB prompt limit: each one tokenizes (the worker is
    # busy) before it is refused for the context.
    prompt = "the quick brown fox jumps over the lazy dog " * 23000
    heavy = lib.generate_request(api.pb, prompt=prompt, max_new_tokens=1)

    def call(_):
        try:
            lib.run_generate(stub, heavy, timeout=60)
            return "OK", ""
        except grpc.RpcError as e:
            return e.code().name, e.details()

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(16)))
    exhausted = [d for c, d in results if c == "RESOURCE_EXHAUSTED"]
    assert exhausted, results
    assert all("request_queue" in d for d in exhausted), exhausted
    # The prompt is longer than the model's context: refused after tokenizing.
    assert {c for c, _ in results} <= {"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"}
    messages = lib.run_generate(
        stub, lib.generate_request(api.pb, prompt="hi", max_new_tokens=2))
    assert messages[-1].finish_reason != 0


def test_an_unparsable_request_is_invalid_argument_and_counted(
        api, server_factory):
    server = server_factory("unparsable", [("demo-lm", lib.LM_DIR, "")])
    channel = server.channel()
    # Field 1 (model, a string) whose length runs past the end of the message.
    garbage = b"\x0a\x7fshort"
    for method, count in (("Generate", 2), ("Classify", 1),
                          ("GenerateImage", 1)):
        for _ in range(count):
            if method != "Classify":
                call = channel.unary_stream("/moh.v1.Inference/" + method)
                with pytest.raises(grpc.RpcError) as e:
                    list(call(garbage, timeout=lib.RPC_TIMEOUT))
            else:
                call = channel.unary_unary("/moh.v1.Inference/Classify")
                with pytest.raises(grpc.RpcError) as e:
                    call(garbage, timeout=lib.RPC_TIMEOUT)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert ("not a valid moh.v1.%sRequest" % method) in e.value.details()
    samples = server.samples()
    assert lib.metric_value(samples, "moh_requests_total", model="",
                            rpc="Generate", code="INVALID_ARGUMENT") == 2
    assert lib.metric_value(samples, "moh_requests_total", model="",
                            rpc="Classify", code="INVALID_ARGUMENT") == 1
    assert lib.metric_value(samples, "moh_requests_total", model="",
                            rpc="GenerateImage", code="INVALID_ARGUMENT") == 1
    # The server goes on.
    stub = api.grpc.InferenceStub(channel)
    assert lib.run_generate(stub, lib.generate_request(
        api.pb, prompt="hi", max_new_tokens=1))


def test_label_scoring_stays_within_one_sequence_of_kv(api, server_factory):
    # Label scoring's cache is one sequence's worth (generation.max_seq_len
    # positions, besides the slots of Generate): text + label must fit in it,
    # and many labels are scored in groups that do.
    server = server_factory("label_kv", [
        ("demo-lm", lib.LM_DIR, "generation { max_seq_len: 24 }")],
        metrics=False)
    stub = api.grpc.InferenceStub(server.channel())
    long_text = api.pb.ClassifyRequest(model="demo-lm", text="word " * 40,
                                       labels=["a", "b"])
    e = lib.rpc_error(stub.Classify, long_text, timeout=lib.RPC_TIMEOUT)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must fit in 24 tokens" in e.details()
    labels = ["label %d" % i for i in range(64)]
    many = stub.Classify(api.pb.ClassifyRequest(
        model="demo-lm", text="The owl", labels=labels, top_n=64),
        timeout=lib.RPC_TIMEOUT)
    assert sorted(c.label for c in many.classes) == sorted(labels)
    assert abs(sum(c.score for c in many.classes) - 1.0) < 1e-4
def test_image_decode_memory_mb_bounds_decodes(api, server_factory):
    server = server_factory("small_decode_budget",
                            [("demo-vit", lib.VIT_DIR, "")], metrics=False,
                            extra="image_decode_memory_mb: 1")
    stub = api.grpc.InferenceStub(server.channel())
    # 300 x 300 RGB: 90000 pixels of 3 bytes and 12 float bytes, over 1 MiB.
    row = [0.5] * 300
    big = lib.encode_png([[row] * 300] * 3)
    error = lib.rpc_error(stub.Classify,
                          api.pb.ClassifyRequest(model="demo-vit", image=big),
                          timeout=lib.RPC_TIMEOUT)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert "image needs 1.3 MiB to decode" in error.details(), error.details()
    assert "image_decode_memory_mb: 1)" in error.details(), error.details()
    # The refusal held nothing: a small image decodes, again and again.
    small = lib.encode_png([[[0.5] * 16] * 16] * 3)
    for _ in range(3):
        response = stub.Classify(
            api.pb.ClassifyRequest(model="demo-vit", image=small),
            timeout=lib.RPC_TIMEOUT)
        assert len(response.classes) == 5
