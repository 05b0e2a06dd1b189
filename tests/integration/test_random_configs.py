"""Random server configurations, drawn by hypothesis: a valid configuration
(the test LM, free ports) with one to three fields anywhere in the
ServerConfig tree, its models' batching, generation, adaptive, moh, cuda
paths and aliases included, set to values of their type from the
extremes (0, -1, 2^31 - 1, NaN, infinities, unknown devices and dtypes,
names with control characters).

The real moh-server either refuses the configuration at start, exiting
non-zero (never killed by a signal) with a message that names the field,
or it serves: its health answers, every model ends READY or FAILED with a
reason, a READY model answers a small request with a result or a client's
error (never INTERNAL or UNKNOWN), and SIGTERM ends it with exit status 0.
The draws are the same in every run: a third of MOH_RANDOM_EXAMPLES
(default 40) configurations, each a server start (about a second and a
half, many times that under AddressSanitizer).
"""
import importlib
import math
import os
import signal
import subprocess
import sys
import time
import types

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moh_testlib as lib

EXAMPLES = int(os.environ.get("MOH_RANDOM_EXAMPLES", "40"))
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
# Fields the test owns (where the server listens, what it reads): changing
# them tests the machine, not the server.
FIXED = {"port", "metrics_port", "http_port", "health_port", "host",
         "metrics_host", "model_dir", "tls", "auth_token_file", "models"}
STRINGS = {
    "device": ["cpu", "cuda", "cuda:0", "cpu:1", "tpu", ""],
    "dtype": ["float32", "bfloat16", "float16", "int8", "float64", ""],
    "weights": ["float32", "bfloat16", "int8", "int4", ""],
    "kv_cache_dtype": ["auto", "float32", "bfloat16", "float16", "int8", ""],
    "router": ["learned", "query_norm", "dense", "random", ""],
    "name": ["lm", "lm@0.5", "a b", "tab\there", "new\nline", ""],
}
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
}


def config_module(workdir):
    """moh.v1.server_config_pb2, generated into the session's stub folder."""
    out = os.path.join(workdir, "config_stubs")
    if not os.path.isdir(os.path.join(out, "moh")):
        os.makedirs(out, exist_ok=True)
        subprocess.run(["protoc", "--proto_path=" + os.path.join(
            lib.SOURCE_DIR, "proto"), "--python_out=" + out,
            "moh/v1/server_config.proto"], check=True, timeout=120)
    if out not in sys.path:
        sys.path.insert(0, out)
    importlib.invalidate_caches()
    return importlib.import_module("moh.v1.server_config_pb2")


def scalars(field):
    """Values of a scalar field's type, mostly from the edges."""
    t = field.type
    if t == field.TYPE_BOOL:
        return st.booleans()
    if t in (field.TYPE_INT32, field.TYPE_INT64):
        return st.one_of(st.sampled_from(
            [0, -1, 1, 2, 3, 7, 16, 4096, 1 << 20, INT32_MAX, INT32_MIN]),
            st.integers(-8, 300))
    if t in (field.TYPE_FLOAT, field.TYPE_DOUBLE):
        return st.one_of(st.sampled_from(
            [0.0, -1.0, 0.5, 1.0, 1e-9, 1e30, math.nan, math.inf,
             -math.inf]), st.floats(-10, 1000))
    if t == field.TYPE_STRING:
        return st.one_of(st.sampled_from(STRINGS.get(field.name, [""])),
                         st.text(max_size=8))
    raise AssertionError("no values for %s" % field.full_name)


def leaf_paths(descriptor, prefix=()):
    """(path of fields, field) for each field below `descriptor` that the
    test may change: scalars, repeated scalars; messages are walked."""
    for field in descriptor.fields:
        if field.name in FIXED and descriptor.name == "ServerConfig":
            continue
        if field.name in ("model_dir",):
            continue
        path = prefix + (field,)
        if field.message_type is None:
            yield path
        elif field.message_type.name == "ModelAlias":
            yield path  # a list of aliases, drawn whole
        else:
            yield from leaf_paths(field.message_type, path)


def values_for(field):
    if field.message_type is not None:  # aliases
        alias = st.fixed_dictionaries({
            "name": scalars(field.message_type.fields_by_name["name"]),
            "activation_ratio": scalars(
                field.message_type.fields_by_name["activation_ratio"]),
            "min_activation_ratio": scalars(
                field.message_type.fields_by_name["min_activation_ratio"])})
        return st.lists(alias, min_size=1, max_size=2)
    if field.label == field.LABEL_REPEATED:
        return st.lists(scalars(field), max_size=5)
    return scalars(field)


def path_name(path):
    """A drawn path's key ("model" or "server", then full field names)."""
    return (path[0],) + tuple(f.full_name for f in path[1:])


@st.composite
def changes(draw, pb):
    model_fields = list(leaf_paths(pb.ModelConfig.DESCRIPTOR))
    server_fields = list(leaf_paths(pb.ServerConfig.DESCRIPTOR))
    paths = [("server",) + p for p in server_fields] + [
        ("model",) + p for p in model_fields]
    chosen = draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3,
                           unique_by=path_name))
    return [(p, draw(values_for(p[-1]))) for p in chosen]


def build_config(pb, ports, drawn):
    config = pb.ServerConfig(
        port=ports[0], metrics_port=ports[1], http_port=ports[2],
        host="127.0.0.1", drain_timeout_seconds=20, log_requests=True)
    model = config.models.add(name="lm", model_dir=lib.LM_DIR)
    for path, value in drawn:
        message = config if path[0] == "server" else model
        for field in path[1:-1]:
            message = getattr(message, field.name)
        field = path[-1]
        if field.message_type is not None:
            for alias in value:
                message.aliases.add(**alias)
        elif field.label == field.LABEL_REPEATED:
            getattr(message, field.name).extend(value)
        else:
            setattr(message, field.name, value)
    return config


def describe(drawn):
    return ", ".join("%s = %r" % (".".join(f.name for f in p[1:]), v)
                     for p, v in drawn)


def wait_listening_or_exit(proc, log_path, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with open(log_path, "rb") as f:
            if b"listening on" in f.read():
                return True
        time.sleep(0.05)
    raise AssertionError("moh-server neither listened nor exited in %d s" %
                         timeout)


def check_serving(api, port):
    """Models loaded, READY ones answering; returns {name: ModelInfo}."""
    channel = grpc.insecure_channel("127.0.0.1:%d" % port)
    try:
        stub = api.grpc.InferenceStub(channel)
        # wait_models_loaded asks its server only for a channel.
        models = lib.wait_models_loaded(
            api, types.SimpleNamespace(channel=lambda: channel))
        assert lib.health_check(channel) in ("SERVING", "NOT_SERVING")
        for name, info in models.items():
            if info.state == api.pb.ModelInfo.FAILED:
                assert info.failure_reason, name
                continue
            try:
                lib.run_generate(stub, lib.generate_request(
                    api.pb, model=name, prompt="Once upon a time",
                    max_new_tokens=3))
            except grpc.RpcError as error:
                assert error.code() in CLIENT_ERRORS, (name, error.code(),
                                                       error.details())
        return models
    finally:
        channel.close()


def test_random_configs(api, workdir):
    pb = config_module(workdir)
    from google.protobuf import text_format
    runs = iter(range(1 << 30))

    @settings(max_examples=max(3, EXAMPLES // 3), deadline=None, derandomize=True,
              database=None, print_blob=False,
              suppress_health_check=[HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(changes(pb))
    def check(drawn):
        run = next(runs)
        config = build_config(pb, lib.free_ports(3), drawn)
        config_path = os.path.join(workdir, "random_config_%d.textproto" % run)
        log_path = os.path.join(workdir, "random_config_%d.log" % run)
        with open(config_path, "w") as f:
            f.write(text_format.MessageToString(config))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [lib.SERVER, "--config=" + config_path], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            listening = wait_listening_or_exit(proc, log_path)
            with open(log_path, "rb") as f:
                log_text = f.read().decode(errors="replace")
            if not listening:
                # Refused: a status, not a signal, and the field named.
                assert proc.returncode > 0, (proc.returncode, log_text)
                names = {p[-1].name for p, _ in drawn} | {
                    f.name for p, _ in drawn for f in p[1:]}
                assert any(n in log_text for n in names), (
                    describe(drawn), log_text[-2000:])
                return
            check_serving(api, config.port)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=90)
            assert code == 0, (code, describe(drawn))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)

    check()
