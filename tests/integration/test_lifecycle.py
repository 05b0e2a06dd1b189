"""Server lifecycle: health, ListModels states, reflection, command-line
configuration, and the graceful drain on SIGTERM/SIGINT."""
import os
import shutil
import signal
import time

import grpc
import pytest
from google.protobuf import descriptor_pb2

import moh_testlib as lib

SERVICE = "moh.v1.Inference"


def list_models(api, server):
    stub = api.grpc.InferenceStub(server.channel())
    response = stub.ListModels(api.pb.ListModelsRequest(), timeout=10)
    return {m.name: m for m in response.models}


def test_health_goes_serving_and_models_ready(api, server_factory):
    server = server_factory("health", [("demo-lm", lib.LM_DIR, ""),
                                       ("demo-vit", lib.VIT_DIR, "")],
                            wait_serving=False, metrics=False)
    seen = []

    def serving():
        try:
            status = lib.health_check(server.channel(), timeout=2)
        except grpc.RpcError as e:
            # Only while the port is not open yet.
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            return False
        seen.append(status)
        return status == "SERVING"

    lib.wait_until(serving, lib.START_TIMEOUT, "SERVING", interval=0.005)
    # Before SERVING the server may only have said NOT_SERVING.
    assert set(seen[:-1]) <= {"NOT_SERVING"}, seen
    assert lib.health_check(server.channel(), SERVICE) == "SERVING"
    models = list_models(api, server)
    assert sorted(models) == ["demo-lm", "demo-vit"]
    assert all(m.state == api.pb.ModelInfo.READY for m in models.values())
    assert "ready" in server.log()


def test_health_of_an_unknown_service_is_not_found(main_server):
    with pytest.raises(grpc.RpcError) as error:
        lib.health_check(main_server.channel(), "no.such.Service")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_list_models_describes_the_models(api, main_server):
    models = list_models(api, main_server)
    lm, vit = models["demo-lm"], models["demo-vit"]
    assert lm.state == vit.state == api.pb.ModelInfo.READY
    assert (lm.family, lm.router) == ("llama", "learned")
    assert [(l.num_heads, l.shared_heads, l.routed_heads, l.default_top_k)
            for l in lm.layers] == [(8, 2, 6, 3), (8, 2, 6, 2)]
    assert lm.default_ratio == pytest.approx((5 + 4) / 16)
    # Lowest ratio: shared heads only.
    assert lm.min_ratio == pytest.approx(2 / 8)
    assert lm.max_seq_len == 256
    assert (lm.device, lm.dtype) == ("cpu", "float32")
    assert (vit.family, vit.router) == ("vit", "learned")
    assert [(l.num_heads, l.shared_heads, l.routed_heads, l.default_top_k)
            for l in vit.layers] == [(6, 2, 4, 2), (6, 1, 5, 3), (6, 6, 0, 0)]
    assert list(vit.labels) == ["zero", "one", "two", "three", "four"]
    assert not lm.failure_reason and not vit.failure_reason


def test_bad_model_dir_stays_not_serving_and_reports_failed(
        api, server_factory, workdir):
    corrupt = os.path.join(workdir, "corrupt_model")
    os.makedirs(corrupt, exist_ok=True)
    with open(os.path.join(corrupt, "config.json"), "w") as f:
        f.write("{ this is not json")
    missing = os.path.join(workdir, "no_such_model_dir")
    # A sound model whose generation_config.json is not.
    bad_sampling = os.path.join(workdir, "bad_sampling_model")
    shutil.rmtree(bad_sampling, ignore_errors=True)
    shutil.copytree(lib.LM_DIR, bad_sampling)
    with open(os.path.join(bad_sampling, "generation_config.json"), "w") as f:
        f.write('{"do_sample": true, "temperature": "hot"}')
    # A checkpoint whose pickle names a global with a byte that is not
    # UTF-8: its error quotes the name, and ListModels must still parse.
    bad_bytes = os.path.join(workdir, "bad_bytes_model")
    shutil.rmtree(bad_bytes, ignore_errors=True)
    shutil.copytree(lib.FIXTURES + "/llama_learned_bin", bad_bytes)
    weights = os.path.join(bad_bytes, "pytorch_model.bin")
    with open(weights, "rb") as f:
        data = f.read()
    assert data.count(b"torch._utils") == 1
    with open(weights, "wb") as f:
        f.write(data.replace(b"torch._utils", b"torch._\xc8tils"))
    server = server_factory("bad_models", [
        ("good", lib.LM_DIR, ""),
        ("missing", missing, ""),
        ("corrupt", corrupt, ""),
        ("bad_sampling", bad_sampling, ""),
        ("bad_bytes", bad_bytes, ""),
    ], wait_serving=False, metrics=False)

    models = lib.wait_models_loaded(api, server)
    assert models["good"].state == api.pb.ModelInfo.READY
    for name in ("missing", "corrupt", "bad_sampling", "bad_bytes"):
        assert models[name].state == api.pb.ModelInfo.FAILED, models[name]
        assert models[name].failure_reason, models[name]
    assert "config.json" in models["corrupt"].failure_reason
    assert ("generation_config.json: field 'temperature' must be a number in [0, 100]"
            in models["bad_sampling"].failure_reason)
    assert missing in models["missing"].failure_reason
    assert "'torch._\ufffdtils._rebuild_tensor_v2'" in models[
        "bad_bytes"].failure_reason
    # It stays NOT_SERVING (polled over a while), but keeps running.
    for _ in range(10):
        assert lib.health_check(server.channel()) == "NOT_SERVING"
        assert lib.health_check(server.channel(), SERVICE) == "NOT_SERVING"
        time.sleep(0.1)
    assert server.proc.poll() is None
    stub = api.grpc.InferenceStub(server.channel())
    # The failed model answers with why; the good one still works.
    error = lib.rpc_error(lib.run_generate, stub,
                          lib.generate_request(api.pb, model="missing",
                                               prompt="hi"))
    assert error.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.UNAVAILABLE), error
    assert "missing" in error.details() and "fail" in error.details()
    messages = lib.run_generate(
        stub, lib.generate_request(api.pb, model="good", prompt="hi",
                                   max_new_tokens=2))
    assert messages[-1].usage.completion_tokens == 2
    assert "FAILED" in server.log()


def test_a_lost_device_fails_its_model_and_the_health(api, server_factory):
    """A step that leaves its model's device lost (on a GPU: a CUDA context
    lost to an illegal memory access or an ECC error; injected here through
    $MOH_TEST_DEVICE_LOST_AFTER_STEPS, since the CPU never loses it) ends the
    model's requests UNAVAILABLE naming the loss, makes it FAILED with the
    reason, and the server NOT_SERVING (so that an orchestrator restarts
    it); the other models keep answering meanwhile."""
    server = server_factory("device_lost", [
        ("lm", lib.LM_DIR, "generation { max_running: 4 }"),
        ("vit", lib.VIT_DIR, ""),
    ], metrics=False, env={"MOH_TEST_DEVICE_LOST_AFTER_STEPS": "3"})
    assert lib.health_check(server.channel()) == "SERVING"
    stub = api.grpc.InferenceStub(server.channel())
    request = lib.generate_request(api.pb, model="lm", token_ids=[5, 9, 17],
                                   max_new_tokens=8)
    tokens, error = lib.stream_until_error(stub, request)
    # Three steps ran (the prompt's, then two decode steps), the fourth failed.
    assert len(tokens) == 3, tokens
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == (
        "model 'lm': device lost (injected: $MOH_TEST_DEVICE_LOST_AFTER_STEPS)")
    models = list_models(api, server)
    assert models["lm"].state == api.pb.ModelInfo.FAILED
    assert "device lost" in models["lm"].failure_reason
    assert models["vit"].state == api.pb.ModelInfo.READY
    lib.wait_until(lambda: lib.health_check(server.channel()) == "NOT_SERVING",
                   10, "NOT_SERVING after the loss")
    assert lib.health_check(server.channel(), SERVICE) == "NOT_SERVING"
    later = lib.rpc_error(lib.run_generate, stub, request)
    assert later.code() == grpc.StatusCode.UNAVAILABLE
    assert "device lost" in later.details()
    # The other model still answers, and the server keeps running.
    classify = api.pb.ClassifyRequest(model="vit")
    classify.pixels.shape.extend([3, 16, 16])
    classify.pixels.data.extend([0.5] * (3 * 16 * 16))
    response = stub.Classify(classify, timeout=lib.RPC_TIMEOUT)
    assert len(response.classes) == 5
    assert server.proc.poll() is None
    assert "lost its device" in server.log()


def test_a_step_out_of_memory_fails_its_requests_retryably(api, server_factory):
    """A step the device has no memory for (on a GPU: CUDA's allocator out
    of memory for a batch's activations; injected here through
    $MOH_TEST_OUT_OF_MEMORY_AT_STEP) ends its requests RESOURCE_EXHAUSTED,
    which a client may retry; the device is sound, so the model stays READY,
    the server SERVING, and the same request then runs to its end."""
    server = server_factory("out_of_memory", [
        ("lm", lib.LM_DIR, "generation { max_running: 4 }"),
    ], metrics=False, env={"MOH_TEST_OUT_OF_MEMORY_AT_STEP": "2"})
    stub = api.grpc.InferenceStub(server.channel())
    request = lib.generate_request(api.pb, model="lm", token_ids=[5, 9, 17],
                                   max_new_tokens=8)
    tokens, error = lib.stream_until_error(stub, request)
    # Two steps ran (the prompt's, then one decode step), the third failed.
    assert len(tokens) == 2, tokens
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == (
        "model error: out of memory: injected: "
        "$MOH_TEST_OUT_OF_MEMORY_AT_STEP=2")
    assert list_models(api, server)["lm"].state == api.pb.ModelInfo.READY
    assert lib.health_check(server.channel()) == "SERVING"
    messages = lib.run_generate(stub, request)
    assert messages[-1].usage.completion_tokens == 8
    assert sum(len(m.token_ids) for m in messages) == 8
    assert server.proc.poll() is None


def test_a_step_out_of_memory_runs_again_in_smaller_steps(api, server_factory):
    """A step that runs out of memory before any of its rows took a token
    is computed again in steps of at most half its tokens, so that its
    requests (here one prompt of 6 tokens, the first step) run to their end
    with the tokens they would have had; the metrics and log say so."""
    server = server_factory("out_of_memory_retry", [
        ("lm", lib.LM_DIR, "generation { max_running: 4 }"),
    ], env={"MOH_TEST_OUT_OF_MEMORY_AT_STEP": "0"})
    stub = api.grpc.InferenceStub(server.channel())
    request = lib.generate_request(api.pb, model="lm",
                                   token_ids=[5, 9, 17, 33, 2, 61],
                                   max_new_tokens=8, temperature=0.0)
    tokens = [lib.run_generate(stub, request) for _ in range(2)]
    ids = [[t for m in messages for t in m.token_ids] for messages in tokens]
    assert len(ids[0]) == 8 and ids[0] == ids[1], ids
    assert tokens[0][-1].usage.prompt_tokens == 6
    samples = server.samples()
    assert lib.metric_value(samples, "moh_steps_retried_total",
                            model="lm") == 1
    # Both requests' prompts counted once each, the failed step's not at all.
    assert lib.metric_value(samples, "moh_prompt_tokens_total",
                            model="lm") == 12
    assert ("model lm: step failed: out of memory: injected: "
            "$MOH_TEST_OUT_OF_MEMORY_AT_STEP=0; its 6 tokens run again, in "
            "steps of at most 3 tokens for a while") in server.log()


def test_reflection_lists_and_describes_the_service(main_server):
    # ServerReflectionRequest{list_services: ""} (field 7) and
    # {file_containing_symbol: "moh.v1.Inference"} (field 4).
    responses = lib.reflection_request(main_server.channel(), [
        lib.encode_string_field(7, ""),
        lib.encode_string_field(4, SERVICE),
    ])
    assert len(responses) == 2
    # ServerReflectionResponse.list_services_response (6) -> service (1) ->
    # name (1).
    listed = [
        dict(lib.decode_fields(service))[1].decode()
        for field, body in lib.decode_fields(responses[0]) if field == 6
        for f, service in lib.decode_fields(body) if f == 1
    ]
    assert SERVICE in listed, listed
    assert "grpc.health.v1.Health" in listed, listed
    # file_descriptor_response (4) -> file_descriptor_proto (1, repeated).
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(proto)
        for field, body in lib.decode_fields(responses[1]) if field == 4
        for f, proto in lib.decode_fields(body) if f == 1
    ]
    service = [(f.package, s) for f in files for s in f.service
               if f.name == "moh/v1/inference.proto"]
    assert service, [f.name for f in files]
    package, inference = service[0]
    assert package == "moh.v1" and inference.name == "Inference"
    methods = {m.name: m for m in inference.method}
    assert sorted(methods) == ["Classify", "Generate", "GenerateImage",
                               "ListModels"]
    assert methods["Generate"].server_streaming
    assert not methods["Classify"].server_streaming


def test_command_line_flags_serve_one_model(api, server_factory):
    server = server_factory("flags", [], flags=[
        "--model_dir=" + lib.LM_DIR, "--model_name=flagged", "--port={port}",
        "--metrics_port={metrics_port}", "--host=127.0.0.1", "--threads=1"
    ])
    assert list(list_models(api, server)) == ["flagged"]
    stub = api.grpc.InferenceStub(server.channel())
    messages = lib.run_generate(
        stub, lib.generate_request(api.pb, model="", prompt="hi",
                                   max_new_tokens=2))
    assert messages[-1].usage.completion_tokens == 2
    assert 'model="flagged"' in server.scrape()


def test_demo_dir_serves_the_demo_models(api, server_factory):
    server = server_factory("demo", [], metrics=False, flags=[
        "--demo_dir=" + os.path.join(lib.SOURCE_DIR, "models"), "--port={port}", "--metrics_port=-1",
        "--host=127.0.0.1", "--threads=1"
    ])
    models = list_models(api, server)
    assert sorted(models) == ["demo-dit", "demo-lm", "demo-lm@0.5", "demo-lm@1.0",
                              "demo-vit"]
    assert models["demo-lm"].family == "llama"
    assert models["demo-lm@0.5"].alias_of == "demo-lm"
    assert models["demo-lm@0.5"].default_ratio == 0.5
    assert models["demo-lm@1.0"].default_ratio == 1.0
    assert models["demo-vit"].family == "vit"
    assert models["demo-dit"].family == "dit"


def test_verbose_logs_requests(api, server_factory):
    server = server_factory("verbose", [], flags=[
        "--model_dir=" + lib.LM_DIR, "--model_name=chatty", "--port={port}",
        "--metrics_port=-1", "--host=127.0.0.1", "--threads=1", "--verbose"
    ], metrics=False)
    stub = api.grpc.InferenceStub(server.channel())
    before = len(server.log())
    lib.run_generate(stub, lib.generate_request(api.pb, prompt="hi",
                                                model="chatty",
                                                max_new_tokens=2))
    lib.rpc_error(lib.run_generate, stub,
                  lib.generate_request(api.pb, prompt="hi", model="chatty",
                                       ratio=7.0))
    logged = server.log()[before:]
    assert "Generate" in logged, logged
    assert "INVALID_ARGUMENT" in logged or "activation.ratio" in logged


@pytest.fixture
def drain_server(server_factory, long_lm_dir):
    return server_factory("drain", [
        ("long", long_lm_dir, "generation { max_running: 4 max_seq_len: 8192 }")
    ], drain_timeout=60)


def long_request(api, tokens):
    return lib.generate_request(api.pb, model="long", prompt="Once upon a time",
                                max_new_tokens=tokens)


def test_sigterm_drains_running_streams_then_exits_0(api, drain_server):
    server = drain_server
    stub = api.grpc.InferenceStub(server.new_channel())
    tokens = 6000
    streams = [lib.Occupant(stub, long_request(api, tokens)) for _ in range(2)]
    assert not any(s.done.is_set() for s in streams)
    server.proc.send_signal(signal.SIGTERM)
    lib.wait_until(lambda: lib.health_check(server.channel()) == "NOT_SERVING",
                   30, "NOT_SERVING after SIGTERM")
    assert lib.health_check(server.channel(), SERVICE) == "NOT_SERVING"
    # New work is refused while the streams still run.
    error = lib.rpc_error(lib.run_generate, stub, long_request(api, 2))
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert not all(s.done.is_set() for s in streams), (
        "both streams ended before the checks: nothing was drained")
    for s in streams:
        messages = s.join()
        assert s.error is None, s.error
        assert messages[-1].finish_reason == api.pb.LENGTH
        assert messages[-1].usage.completion_tokens == tokens
        assert len(lib.token_ids_of(messages)) == tokens
    assert server.proc.wait(timeout=60) == 0
    assert "draining" in server.log()


def test_every_request_during_shutdown_gets_unavailable(api, server_factory):
    # Requests keep coming on one connection while an idle server drains:
    # each must get UNAVAILABLE (retryable), never CANCELLED. gRPC itself
    # cancels calls that arrive while it shuts down (grpc/grpc#41785), so the
    # server shuts gRPC down only once its clients have gone quiet (lame
    # duck), and then exits promptly.
    codes = {}
    for trial in range(3):
        server = server_factory("shutdown%d" % trial, [("demo-lm", lib.LM_DIR,
                                                        "")], metrics=False)
        channel = server.new_channel()
        stub = api.grpc.InferenceStub(channel)
        request = lib.generate_request(api.pb, prompt="hi", max_new_tokens=1)
        lib.run_generate(stub, request)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2
        # When this client sent the last call the server answered (a call
        # made once gRPC shut down fails in the client, never reaching it).
        answered = time.monotonic()
        trial_codes = []  # in order
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                # Only once this client was quiet for the server's 250 ms (a
                # loaded machine can starve this loop that long: seen in CI).
                assert time.monotonic() - answered >= 0.25, \
                    "exited while clients called"
                break
            try:
                sent = time.monotonic()
                lib.run_generate(stub, request, timeout=2)
                code = "OK"  # arrived before the signal was handled
                answered = sent
            except grpc.RpcError as e:
                code = "%s: %s" % (e.code().name, e.details())
                if "draining" in (e.details() or ""):
                    answered = sent
                elif sent - answered >= 0.25:
                    # This client had gone quiet for the server's 250 ms
                    # (starved): gRPC may cancel a call reaching its
                    # shutdown. Only a client that keeps calling is promised
                    # UNAVAILABLE.
                    code = "AFTER_QUIET " + code
            except lib.ClientHang:
                code = "CLIENT_HANG"  # not the server's (lib.drain_stream)
            trial_codes.append(code)
        # A call cancelled after the last one the server answered reached
        # gRPC's own shutdown (the client starved between taking `sent` and
        # sending: seen under CI load); one cancelled while the server still
        # answered later calls is the server's fault.
        last = max([i for i, c in enumerate(trial_codes)
                    if c == "OK" or "draining" in c] or [-1])
        for i, code in enumerate(trial_codes):
            if i > last and code.startswith("CANCELLED"):
                code = "AT_SHUTDOWN " + code
            codes[code] = codes.get(code, 0) + 1
        quiet = time.monotonic()
        assert server.proc.wait(timeout=30) == 0
        assert time.monotonic() - quiet < 10, "no prompt exit once quiet"
        server.kill()
        channel.close()
    bad = {c: n for c, n in codes.items()
           if c not in ("OK", "CLIENT_HANG") and
           not c.startswith(("UNAVAILABLE", "AFTER_QUIET", "AT_SHUTDOWN"))}
    assert not bad, codes
    assert sum(n for c, n in codes.items() if c.startswith("UNAVAILABLE")) > 0


def test_sigint_on_an_idle_server_exits_0(server_factory):
    server = server_factory("sigint", [("demo-lm", lib.LM_DIR, "")],
                            metrics=False)
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=60) == 0


def test_drain_timeout_cuts_long_streams_and_exits_0(api, server_factory,
                                                     long_lm_dir):
    server = server_factory("drain_timeout", [
        ("long", long_lm_dir, "generation { max_running: 2 max_seq_len: 8192 }")
    ], drain_timeout=0.2)
    stub = api.grpc.InferenceStub(server.new_channel())
    stream = lib.Occupant(stub, long_request(api, 8000))
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    stream.join()
    # Cut short: an error status or a CANCELLED finish, never 8000 tokens.
    if stream.error is None:
        last = stream.messages[-1]
        assert last.finish_reason == api.pb.CANCELLED, last
        assert last.usage.completion_tokens < 8000
    else:
        assert stream.error.code() in (grpc.StatusCode.UNAVAILABLE,
                                       grpc.StatusCode.CANCELLED), stream.error
    assert "drain timeout" in server.log()


def test_sigterm_while_models_load_skips_the_rest_and_exits_0(server_factory):
    models = [("m%02d" % i, lib.LM_DIR, "") for i in range(40)]
    server = server_factory("stop_loading", models, wait_serving=False,
                            metrics=False)
    lib.wait_until(lambda: ": READY" in server.log(), lib.START_TIMEOUT,
                   "the first model READY")
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    log = server.log()
    assert "not loaded (the server is stopping)" in log
    assert log.count(": READY") < len(models)
