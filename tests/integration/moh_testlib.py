"""Helpers for the moh-server integration tests (used by conftest.py and the tests).

Everything here talks to real processes over loopback: MohServer starts the real
moh-server binary with a text-format config in a temporary directory, waits for
grpc.health.v1 SERVING, and keeps its log; the gRPC health and reflection
messages are hand-encoded (Debian's python3-grpcio ships neither grpc_health nor
grpc_reflection); /metrics is scraped and parsed into samples.

Every wait is bounded (wait_until) and every RPC carries a timeout.
"""
import json
import math
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from moh_testdata import (ByteLevelDecoder, encode_png, make_long_lm,
                          quantize, softmax, solid_png)

# Re-exported: the tests use them as lib.NAME.
_REEXPORTED = (ByteLevelDecoder, encode_png, make_long_lm, quantize, softmax,
               solid_png)

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.environ.get("MOH_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(HERE))
_BUILD = os.path.join(SOURCE_DIR, "build")
SERVER = os.environ.get("MOH_SERVER") or os.path.join(_BUILD, "service",
                                                      "moh-server")
CLIENT = os.environ.get("MOH_CLIENT") or os.path.join(_BUILD, "client",
                                                      "moh-client")
FIXTURES = os.environ.get("MOH_FIXTURES") or os.path.join(_BUILD, "fixtures")
LM_DIR = os.path.join(FIXTURES, "llama_learned")
VIT_DIR = os.path.join(FIXTURES, "vit_learned")

RPC_TIMEOUT = 60.0  # seconds; every RPC in the tests has a deadline
START_TIMEOUT = 90.0  # seconds for a server to become SERVING

# The tiny fixture LM (tests/reference/make_fixtures.py).
LM_VOCAB = 320
LM_BOS, LM_EOS = 318, 319
LM_LAYERS, LM_HEADS, LM_SHARED, LM_TOP_K = 2, 8, 2, (3, 2)


class Timeout(AssertionError):
    pass


def wait_until(predicate, timeout, what, interval=0.02):
    """Polls predicate() until it returns a truthy value (returned) or fails."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            raise Timeout("timed out after %.0f s waiting for %s (last: %r)" %
                          (timeout, what, last))
        time.sleep(interval)


def wait_models_loaded(api, server):
    """{name: ModelInfo} once no model of `server` is LOADING any more
    (ListModels answers while models load)."""
    import grpc

    def loaded():
        try:
            stub = api.grpc.InferenceStub(server.channel())
            listed = stub.ListModels(api.pb.ListModelsRequest(), timeout=10)
        except grpc.RpcError:
            return None
        models = {m.name: m for m in listed.models}
        if any(m.state == api.pb.ModelInfo.LOADING for m in models.values()):
            return None
        return models

    return wait_until(loaded, START_TIMEOUT, "models loaded")


def free_port():
    """A currently free loopback TCP port (bind to port 0)."""
    return free_ports(1)[0]


def free_ports(n):
    """n distinct, currently free loopback TCP ports: each socket stays bound
    until all are chosen, so the kernel cannot hand out one twice."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def generate_together(stub, requests):
    """Starts one Generate stream per request at the same moment (each waits
    for the others before reading, so all are in flight at once); returns
    each stream's messages, in order."""
    barrier = threading.Barrier(len(requests), timeout=30)

    def one(request):
        call = stub.Generate(request, timeout=RPC_TIMEOUT)
        barrier.wait()
        return list(call)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


# --- protobuf wire format, for the messages we have no generated code for ---


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_string_field(field, value):
    data = value.encode("utf-8") if isinstance(value, str) else value
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def decode_fields(data):
    """[(field_number, value)]: ints for varints, bytes for length-delimited."""
    fields, i = [], 0

    def read_varint():
        nonlocal i
        shift = result = 0
        while True:
            b = data[i]
            i += 1
            result |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return result

    while i < len(data):
        key = read_varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            fields.append((field, read_varint()))
        elif wire == 2:
            n = read_varint()
            fields.append((field, data[i:i + n]))
            i += n
        elif wire == 1:
            fields.append((field, data[i:i + 8]))
            i += 8
        elif wire == 5:
            fields.append((field, data[i:i + 4]))
            i += 4
        else:
            raise ValueError("unsupported wire type %d" % wire)
    return fields


HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING",
                 3: "SERVICE_UNKNOWN"}


def health_check(channel, service="", timeout=5.0):
    """grpc.health.v1.Health/Check -> "SERVING", "NOT_SERVING", ...

    Raises grpc.RpcError on RPC failure.
    """
    check = channel.unary_unary("/grpc.health.v1.Health/Check")
    request = encode_string_field(1, service) if service else b""
    response = check(request, timeout=timeout)
    status = 0
    for field, value in decode_fields(response):
        if field == 1:
            status = value
    return HEALTH_STATUS.get(status, str(status))


def reflection_request(channel, requests, timeout=10.0):
    """Sends encoded ServerReflectionRequests on one ServerReflectionInfo stream
    (v1alpha) and returns the raw responses."""
    info = channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    return list(info(iter(requests), timeout=timeout))


# --- Prometheus text format ---

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text):
    """{(name, frozenset(labels.items())): value} of a /metrics page."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise ValueError("unparsable metrics line: %r" % line)
        labels = frozenset(_LABEL.findall(m.group(2) or ""))
        samples[(m.group(1), labels)] = float(m.group(3))
    return samples


def metric_value(samples, name, **labels):
    """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items()
               if n == name and want <= set(ls))


def metric_series(samples, name, **labels):
    """[(labels dict, value)] of the samples of `name` including `labels`."""
    want = set(labels.items())
    return [(dict(ls), v) for (n, ls), v in samples.items()
            if n == name and want <= set(ls)]


def http_get(url, timeout=10.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode("utf-8")


def client_library(name):
    """The official client package `name` (openai, anthropic) of the test
    environment (scripts/install_deps.sh --test): required under CI, else the
    calling test module is skipped without it."""
    import importlib

    import pytest

    if os.environ.get("CI") == "true":
        return importlib.import_module(name)
    return pytest.importorskip(
        name, reason="the %s client: bash scripts/install_deps.sh --test" % name)


def http_request(server, method, path, body=None, headers=None):
    """(status, response, parsed JSON or text) of one raw request to a
    MohServer's HTTP API; `body`: bytes as they are, else sent as JSON."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.http_port,
                                      timeout=RPC_TIMEOUT)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body)
    try:
        conn.request(method, path, body=data, headers=headers or {})
        response = conn.getresponse()
        text = response.read().decode()
    finally:
        conn.close()
    try:
        return response.status, response, json.loads(text)
    except ValueError:
        return response.status, response, text


# --- moh-server processes ---


def _textproto_string(s):
    return json.dumps(s)  # a JSON string literal is a valid textproto one here


class MohServer:
    """One moh-server process on free loopback ports, configured by a file.

    models: list of (name, model_dir, extra textproto for the ModelConfig).
    flags: instead of a config file, these command-line flags (with
    "{port}", "{metrics_port}" and "{http_port}" in them replaced by the
    chosen ports; --http_port is added when absent).
    http: serve the OpenAI-compatible HTTP API on a free port (http_port);
    off otherwise.
    """

    def __init__(self, name, workdir, models, drain_timeout=60, threads=1,
                 metrics=True, extra="", flags=None, http=False, env=None):
        self.name = name
        self.env = env  # variables added to the server's environment
        self.workdir = workdir
        self.models = models
        self.drain_timeout = drain_timeout
        self.threads = threads
        self.metrics = metrics
        self.extra = extra
        self.flags = flags
        self.http = http
        self.proc = None
        self.port = self.metrics_port = self.http_port = None
        self.log_path = os.path.join(workdir, name + ".log")
        self.config_path = os.path.join(workdir, name + ".textproto")
        self._channel = None

    # Configuration and lifetime.

    def config_text(self):
        lines = [
            "port: %d" % self.port,
            "metrics_port: %d" % (self.metrics_port if self.metrics else -1),
            "http_port: %d" % (self.http_port if self.http else -1),
            'host: "127.0.0.1"',
            "drain_timeout_seconds: %g" % self.drain_timeout,
            "threads: %d" % self.threads,
            "log_requests: true",
        ]
        if self.extra:
            lines.append(self.extra)
        for name, model_dir, model_extra in self.models:
            lines.append("models { name: %s model_dir: %s %s }" %
                         (_textproto_string(name),
                          _textproto_string(model_dir), model_extra))
        return "\n".join(lines) + "\n"

    def start(self, wait_serving=True, attempts=3):
        """Starts the process; retries on a port taken in the meantime."""
        for attempt in range(attempts):
            self.port, metrics_port, http_port = free_ports(3)
            self.metrics_port = metrics_port if self.metrics else None
            self.http_port = http_port if self.http else None
            if self.flags is None:
                with open(self.config_path, "w") as f:
                    f.write(self.config_text())
                command = [SERVER, "--config=" + self.config_path]
            else:
                command = [SERVER] + [
                    f.format(port=self.port, metrics_port=self.metrics_port,
                             http_port=self.http_port)
                    for f in self.flags
                ]
                if not any(f.startswith("--http_port") for f in self.flags):
                    command.append("--http_port=%d" % (self.http_port or -1))
            offset = len(self.log())
            log = open(self.log_path, "ab")
            log.write(("=== %s (attempt %d): %s\n" %
                       (self.name, attempt + 1, " ".join(command))).encode())
            log.flush()
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(os.environ, **self.env) if self.env else None)
            log.close()
            wait_until(
                lambda: self.proc.poll() is not None or
                "listening on" in self.log()[offset:], 30,
                "%s to listen" % self.name)
            if self.proc.poll() is None:
                break
            if ("cannot listen" not in self.log()[offset:] or
                    attempt + 1 == attempts):
                raise AssertionError("%s exited with %s at start:\n%s" %
                                     (self.name, self.proc.returncode,
                                      self.log()))
        if wait_serving:
            self.wait_health("SERVING")
        return self

    def wait_health(self, want, timeout=START_TIMEOUT, service=""):
        def status():
            if self.proc.poll() is not None:
                raise AssertionError("%s exited with %s:\n%s" %
                                     (self.name, self.proc.returncode,
                                      self.log()))
            try:
                return health_check(self.channel(), service, timeout=2) == want
            except Exception:  # grpc.RpcError while the port opens
                return False

        wait_until(status, timeout, "%s health %s" % (self.name, want),
                   interval=0.05)

    def kill(self):
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def terminate_and_wait(self, timeout=90):
        """SIGTERM; returns the exit status (kills after `timeout` s)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            raise AssertionError("%s did not exit within %d s of SIGTERM" %
                                 (self.name, timeout))

    def log(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    # Clients.

    @property
    def target(self):
        return "127.0.0.1:%d" % self.port

    def channel(self):
        if self._channel is None:
            self._channel = self.new_channel()
        return self._channel

    def new_channel(self):
        """A channel of its own: no connection shared with other channels
        (gRPC shares them per target by default, also across servers that
        reuse a port)."""
        import grpc
        return grpc.insecure_channel(
            self.target, options=[("grpc.use_local_subchannel_pool", 1)])

    def scrape(self):
        return http_get("http://127.0.0.1:%d/metrics" % self.metrics_port)

    def samples(self):
        return parse_metrics(self.scrape())


def model_fixtures():
    """Module-scoped pytest fixtures (stub, models) for a test module that
    defines its own `server` fixture (a MohServer, usually started with
    wait_serving=False): stub is an InferenceStub on the server's channel,
    models is wait_models_loaded's {name: ModelInfo}. Use as
    `stub, models = lib.model_fixtures()`."""
    import pytest

    @pytest.fixture(scope="module")
    def stub(server, api):
        return api.grpc.InferenceStub(server.channel())

    @pytest.fixture(scope="module")
    def models(server, api):
        return wait_models_loaded(api, server)

    return stub, models


def lm_variant_fixtures(name, variants):
    """Module-scoped pytest fixtures (server, stub, models) for a test module
    that compares variants of the fixture LM with the LM as it is: server
    `name` serves "f32" (LM_DIR, generation { max_running: 2 }), then each
    (model name, ModelConfig textproto) of `variants`, all of LM_DIR (or
    (model name, directory, textproto)), without metrics and without waiting
    for SERVING (a variant may be meant to fail);
    stub and models are model_fixtures'. Use as
    `server, stub, models = lib.lm_variant_fixtures(name, variants)`."""
    import pytest

    @pytest.fixture(scope="module")
    def server(start_server):
        models = [("f32", LM_DIR, "generation { max_running: 2 }")]
        models += [(v[0], LM_DIR if len(v) == 2 else v[1], v[-1])
                   for v in variants]
        return start_server(name, models, wait_serving=False, metrics=False)

    stub, models = model_fixtures()
    return server, stub, models


# --- requests ---


def client_models_table(server):
    """`moh-client models` against `server`: its table's lines (header
    first), after asserting that it exited 0."""
    result = subprocess.run([CLIENT, "--server=" + server.target,
                             "--timeout=60", "models"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def label_scores(pb, stub, models, text, labels):
    """{model: {label: log-likelihood}}: a Classify of `text` against `labels`
    on each of `models`."""
    scores = {}
    for model in models:
        response = stub.Classify(pb.ClassifyRequest(
            model=model, text=text, labels=labels), timeout=RPC_TIMEOUT)
        scores[model] = {c.label: c.log_likelihood for c in response.classes}
    return scores


def generate_request(pb, prompt=None, token_ids=None, model="demo-lm",
                     ratio=0.0, min_ratio=0.0, include_routing=False,
                     **sampling):
    """A GenerateRequest; `sampling` sets SamplingParams fields (stop: list)."""
    request = pb.GenerateRequest(model=model, include_routing=include_routing)
    if prompt is not None:
        request.prompt = prompt
    if token_ids is not None:
        request.token_ids.extend(token_ids)
    for name, value in sampling.items():
        if name == "stop":
            request.sampling.stop.extend(value)
        else:
            setattr(request.sampling, name, value)
    request.activation.ratio = ratio
    request.activation.min_ratio = min_ratio
    return request


# grpcio 1.51 calls have been seen to outlive their deadline on a channel
# whose server had just exited; a watchdog cancels them so a test fails
# instead of hanging.
WATCHDOG_GRACE = 15.0


class ClientHang(AssertionError):
    pass


def drain_stream(call, timeout, sink=None):
    """Reads a response stream to its end (a list, or appended to sink);
    cancels it WATCHDOG_GRACE s after its deadline (raising ClientHang)."""
    fired = threading.Event()

    def fire():
        fired.set()
        call.cancel()

    watchdog = threading.Timer(timeout + WATCHDOG_GRACE, fire)
    watchdog.daemon = True
    watchdog.start()
    messages = [] if sink is None else sink
    try:
        for m in call:
            messages.append(m)
    except Exception:
        if fired.is_set():
            raise ClientHang("the stream outlived its %g s deadline by %g s "
                             "(client-side hang)" % (timeout, WATCHDOG_GRACE))
        raise
    finally:
        watchdog.cancel()
    return messages


def run_generate(stub, request, timeout=RPC_TIMEOUT):
    """All messages of one Generate stream (raises grpc.RpcError)."""
    return drain_stream(stub.Generate(request, timeout=timeout), timeout)


def token_ids_of(messages):
    return [t for m in messages for t in m.token_ids]


def stream_until_error(stub, request):
    """Generate's stream of `request`, which must end in an error: (the
    token ids streamed before it, the grpc.RpcError)."""
    import grpc
    tokens = []
    try:
        for message in stub.Generate(request, timeout=RPC_TIMEOUT):
            tokens += message.token_ids
    except grpc.RpcError as e:
        return tokens, e
    raise AssertionError("the stream ended without an error: %s" % tokens)


def rpc_error(call, *args, **kwargs):
    """The grpc.RpcError that call(*args) raises (consuming a stream); fails
    if it succeeds."""
    import grpc
    try:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not hasattr(result, "SerializeToString"):
            result = list(result)
    except grpc.RpcError as e:
        return e
    raise AssertionError("expected an RPC error, got %r" % (result,))


def expected_top_k(ratio, num_heads=LM_HEADS, shared=LM_SHARED,
                   trained=LM_TOP_K):
    """Per-layer K the server must use for `ratio` (SPEC §1)."""
    if ratio == 0:
        return list(trained)
    k = math.floor(ratio * num_heads + 0.5) - shared
    return [max(0, min(num_heads - shared, k))] * len(trained)


class _SignallingList(list):
    """A list that sets its owner's `started` event on the first append."""

    def __init__(self, owner):
        super().__init__()
        self._owner = owner

    def append(self, item):
        super().append(item)
        self._owner.started.set()


class Occupant:
    """A Generate stream read on a background thread (started: the first
    message arrived; done: the stream ended; error: its grpc.RpcError)."""

    def __init__(self, stub, request):
        self.call = stub.Generate(request, timeout=RPC_TIMEOUT)
        self.messages = _SignallingList(self)
        self.error = None
        self.started = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.started.wait(30), "the occupant produced nothing"

    def _read(self):
        try:
            drain_stream(self.call, RPC_TIMEOUT, sink=self.messages)
        except Exception as e:  # grpc.RpcError or ClientHang
            self.error = e
        finally:
            self.started.set()
            self.done.set()

    def join(self):
        self.thread.join(RPC_TIMEOUT + WATCHDOG_GRACE + 10)
        assert not self.thread.is_alive()
        return self.messages
