"""moh-bench against a real moh-server on the tiny fixture models.

Environment (CTest sets them):
  MOH_SERVER    path of moh-server
  MOH_BENCH     path of moh-bench
  MOH_FIXTURES  directory written by tests/reference/make_fixtures.py
Run with /usr/bin/python3 -m pytest (Debian's python3-grpcio is needed to wait
for the server's health). Every wait and every process is bounded in time.
"""
import json
import os
import pty
import signal
import socket
import subprocess
import time

import grpc
import pytest

SERVER = os.environ.get("MOH_SERVER", "")
BENCH = os.environ.get("MOH_BENCH", "")
FIXTURES = os.environ.get("MOH_FIXTURES", "")

BENCH_TIMEOUT = 60  # seconds for one moh-bench run
START_TIMEOUT = 60  # seconds for a server to become SERVING
MAX_NEW_TOKENS = 8
RATIOS = [0.5, 0.75, 1.0]


def _require_inputs():
    missing = [
        "%s=%r" % (name, path)
        for name, path in (("MOH_SERVER", SERVER), ("MOH_BENCH", BENCH))
        if not os.access(path, os.X_OK)
    ]
    for model in ("llama_learned", "vit_learned"):
        if not os.path.isdir(os.path.join(FIXTURES, model)):
            missing.append("MOH_FIXTURES=%r (no %s/)" % (FIXTURES, model))
    if missing:
        pytest.fail("bench_cli_test needs: " + ", ".join(missing))


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(address):
    """True when grpc.health.v1 Check answers SERVING (hand-encoded)."""
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            return check(b"", timeout=2.0) == b"\x08\x01"
        except grpc.RpcError:
            return False


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """start_server(model) -> "127.0.0.1:PORT" of a SERVING moh-server;
    start_server(model, http=True) -> its gRPC and HTTP (OpenAI API)
    addresses."""
    _require_inputs()
    procs = []

    def start(model, http=False):
        port = _free_port()
        http_port = _free_port() if http else -1
        log = tmp_path_factory.mktemp("server") / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([
                SERVER, "--model_dir=" + os.path.join(FIXTURES, model),
                "--port=%d" % port, "--metrics_port=-1",
                "--http_port=%d" % http_port, "--host=127.0.0.1",
                "--threads=1"
            ], stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        address = "127.0.0.1:%d" % port
        deadline = time.monotonic() + START_TIMEOUT
        while not _serving(address):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("moh-server %s did not become SERVING:\n%s" %
                            (model, log.read_text(errors="replace")[-4000:]))
            time.sleep(0.1)
        return (address, "127.0.0.1:%d" % http_port) if http else address

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def lm_server(start_server):
    return start_server("llama_learned")


@pytest.fixture(scope="module")
def lm_http_server(start_server):
    """(gRPC address, HTTP address) of one server of the LM."""
    return start_server("llama_learned", http=True)


@pytest.fixture(scope="module")
def vit_server(start_server):
    return start_server("vit_learned")


def run_bench(*args):
    return subprocess.run([BENCH, "--quiet"] + list(args),
                          capture_output=True,
                          text=True,
                          timeout=BENCH_TIMEOUT)


def run_bench_json(tmp_path, *args):
    path = tmp_path / "bench.json"
    proc = run_bench("--json=%s" % path, *args)
    assert proc.returncode == 0, proc.stderr
    with open(path) as f:
        return json.load(f), proc


def check_latency(summary, count):
    assert summary["count"] == count
    if count == 0:
        assert summary["p50"] is None and summary["max"] is None
        return
    assert 0 <= summary["p50"] <= summary["p90"] <= summary["p99"]
    assert summary["p99"] <= summary["max"] + 1e-9
    assert 0 < summary["mean"] <= summary["max"] + 1e-9


def check_consistent(result):
    """Invariants every result obeys."""
    assert result["schema_version"] == 1
    assert result["requests"] == result["completed"] + result["errors"]
    assert result["errors"] == sum(result["errors_by_code"].values())
    assert result["elapsed_s"] > 0
    check_latency(result["latency_ms"]["e2e"], result["completed"])
    ratios = result["ratios"]
    assert sum(r["requests"] for r in ratios) == result["requests"]
    assert sum(r["completed"] for r in ratios) == result["completed"]
    for r in ratios:
        assert r["requests"] == r["completed"] + r["errors"]
        check_latency(r["e2e_ms"], r["completed"])


def check_generate(result):
    check_consistent(result)
    assert result["errors"] == 0, result["errors_by_code"]
    completed = result["completed"]
    assert completed > 0
    # The fixture LM may emit its EOS (319) early; for the upper bound see
    # test_max_new_tokens_bounds_generated_tokens.
    assert result["generated_tokens"] > 0
    assert result["throughput"]["requests_per_s"] > 0
    assert result["throughput"]["tokens_per_s"] > 0
    latency = result["latency_ms"]
    assert 0 < latency["ttft"]["count"] <= completed
    check_latency(latency["ttft"], latency["ttft"]["count"])
    # One ITL sample per token after each request's first streamed message.
    assert latency["itl"]["count"] <= result["generated_tokens"]
    check_latency(latency["itl"], latency["itl"]["count"])
    assert latency["itl"]["count"] > 0
    assert [r["requested"] for r in result["ratios"]] == RATIOS
    for r in result["ratios"]:
        assert r["completed"] > 0
        assert 0 < r["mean_effective_activation_ratio"] <= 1.0 + 1e-6
        assert 0 < r["mean_activation_ratio"] <= r["requested"] + 1e-6
    effective = [r["mean_effective_activation_ratio"] for r in result["ratios"]]
    assert effective[0] <= effective[-1] + 1e-6


def test_generate_closed_loop(lm_server, tmp_path):
    result, proc = run_bench_json(tmp_path, "--server=" + lm_server,
                                  "--rpc=generate", "--concurrency=4",
                                  "--requests=20", "--warmup_requests=2",
                                  "--max_new_tokens=%d" % MAX_NEW_TOKENS,
                                  "--ratios=0.5,0.75,1.0")
    check_generate(result)
    assert result["requests"] == 20 and result["dropped"] == 0
    assert result["warmup"] == {"requests": 2, "errors": 0}
    assert [r["requests"] for r in result["ratios"]] == [7, 7, 6]
    config = result["config"]
    assert config["mode"] == "closed" and config["concurrency"] == 4
    assert config["served_model"] == "llama_learned"
    assert config["max_new_tokens"] == MAX_NEW_TOKENS
    # The human-readable report goes to stdout; no progress line (--quiet).
    for word in ("throughput", "TTFT", "inter-token", "end-to-end", "0.75"):
        assert word in proc.stdout
    assert "\r" not in proc.stderr


def test_generate_open_loop_json_to_stdout(lm_server):
    start = time.monotonic()
    proc = run_bench("--server=" + lm_server, "--rate=20", "--duration=2",
                     "--max_new_tokens=%d" % MAX_NEW_TOKENS,
                     "--prompt_tokens=12", "--ratios=0.5,0.75,1.0",
                     "--ratio_order=random", "--seed=7", "--json")
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 30
    result = json.loads(proc.stdout)  # Only JSON on stdout...
    assert "throughput" in proc.stderr  # ...the report on stderr.
    check_generate(result)
    assert result["config"]["mode"] == "open"
    assert result["config"]["rate"] == 20
    # About 40 Poisson arrivals in 2 s.
    arrivals = result["requests"] + result["dropped"]
    assert 15 <= arrivals <= 80
    assert 1.5 <= result["elapsed_s"] < 2 + 20


def test_max_new_tokens_bounds_generated_tokens(lm_server, tmp_path):
    result, _ = run_bench_json(tmp_path, "--server=" + lm_server,
                               "--requests=4",
                               "--max_new_tokens=%d" % MAX_NEW_TOKENS)
    assert result["completed"] == 4
    assert 0 < result["generated_tokens"] <= 4 * MAX_NEW_TOKENS


def test_classify_pixels(vit_server, tmp_path):
    result, _ = run_bench_json(tmp_path, "--server=" + vit_server,
                               "--rpc=classify", "--pixels_shape=3,16,16",
                               "--concurrency=2", "--requests=12",
                               "--ratios=0.5,1")
    check_consistent(result)
    assert result["completed"] == 12 and result["errors"] == 0
    assert result["generated_tokens"] == 0
    assert result["throughput"]["tokens_per_s"] is None
    assert result["latency_ms"]["ttft"] is None
    assert result["config"]["input"] == "pixels"
    for r in result["ratios"]:
        assert r["requests"] == 6
        assert 0 < r["mean_effective_activation_ratio"] <= 1.0 + 1e-6


def test_request_errors_are_reported_not_fatal(vit_server, tmp_path):
    # The ViT wants [3, 16, 16]: every request fails with INVALID_ARGUMENT.
    result, proc = run_bench_json(tmp_path, "--server=" + vit_server,
                                  "--rpc=classify", "--pixels_shape=1,8,8",
                                  "--requests=5")
    check_consistent(result)
    assert result["errors"] == 5 and result["completed"] == 0
    assert result["errors_by_code"] == {"INVALID_ARGUMENT": 5}
    assert "INVALID_ARGUMENT" in proc.stdout
    assert result["throughput"]["requests_per_s"] == 0


def test_progress_line_on_a_terminal(lm_server):
    master, slave = pty.openpty()
    try:
        proc = subprocess.run([
            BENCH, "--server=" + lm_server, "--concurrency=2",
            "--duration=1.2", "--max_new_tokens=4"
        ],
                              stdout=subprocess.PIPE,
                              stderr=slave,
                              timeout=BENCH_TIMEOUT)
        os.close(slave)
        slave = None
        progress = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the terminal is closed and drained.
                break
            if not chunk:
                break
            progress += chunk
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    assert proc.returncode == 0
    assert b"\rmeasure" in progress and b"req/s" in progress
    assert b"\r" not in proc.stdout  # The report itself stays clean.


def interrupted_bench(tmp_path, *address):
    """Runs moh-bench for 30 s, interrupts it after 1.5 s and checks that it
    exits 130 and reports what finished, in under 10 s."""
    path = tmp_path / "bench.json"
    proc = subprocess.Popen([BENCH, *address, "--concurrency=2",
                             "--duration=30", "--max_new_tokens=8",
                             "--json=%s" % path],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True)
    try:
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert "(interrupted)" in stdout
    with open(path) as f:
        result = json.load(f)
    assert result["interrupted"] is True
    check_consistent(result)
    assert result["completed"] > 0
    assert result["elapsed_s"] < 10


def test_interrupt_reports_what_finished(start_server, tmp_path):
    # A server of its own: cancelling streams must not disturb other tests.
    interrupted_bench(tmp_path, "--server=" + start_server("llama_learned"))


def test_unknown_model_fails_at_start(lm_server):
    proc = run_bench("--server=" + lm_server, "--model=nope", "--requests=1")
    assert proc.returncode == 1
    assert "'nope' is not served" in proc.stderr


def test_unreachable_server_fails_at_start():
    _require_inputs()
    # Privileged port: nothing listens there.
    proc = run_bench("--server=127.0.0.1:1", "--requests=1")
    assert proc.returncode == 1
    assert "cannot reach 127.0.0.1:1: UNAVAILABLE" in proc.stderr


@pytest.mark.parametrize("args, message", [
    ([], "give --requests and/or --duration"),
    (["--requests=1", "--concurrency=2", "--rate=5"], "not both"),
    (["--requests=0"], "--requests must be in"),
    (["--requests=2000000"], "--requests must be in"),
    (["--duration=4000"], "--duration must be in"),
    (["--requests=1", "--ratios=0.5,x"], "'x' is not a number"),
    (["--requests=1", "--ratios=1.5"], "each ratio must be in [0, 1]"),
    (["--requests=1", "--rpc=embed"], "expected generate or classify"),
    (["--requests=1", "--rpc=classify"], "exactly one of --image"),
    (["--requests=1", "--prompt=hi", "--prompt_tokens=3"], "not both"),
    (["--requests=1", "--pixels_shape=3,16"], "apply to --rpc=classify"),
    (["--requests=1", "--rpc=classify", "--image=/nonexistent.png"],
     "cannot read"),
    (["--requests=1", "extra"], "unexpected argument 'extra'"),
    (["--requests=1", "--no_such_flag=1"], "no_such_flag"),
])
def test_bad_usage_exits_nonzero(args, message):
    _require_inputs()
    # A dead server address: usage must be rejected before any RPC.
    proc = run_bench("--server=127.0.0.1:1", *args)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "cannot reach" not in proc.stderr


# --- --api=openai: the same load over the OpenAI-compatible HTTP API ---


def _fields(value, path=""):
    """Every key path of a JSON value (list items as [])."""
    if isinstance(value, dict):
        return {p for k, v in value.items()
                for p in {path + "/" + k} | _fields(v, path + "/" + k)}
    if isinstance(value, list):
        return {p for v in value for p in _fields(v, path + "[]")}
    return set()


def test_openai_api_reports_like_grpc(lm_http_server, tmp_path):
    grpc_address, http_address = lm_http_server
    args = ["--concurrency=2", "--requests=12", "--warmup_requests=1",
            "--max_new_tokens=%d" % MAX_NEW_TOKENS, "--temperature=0",
            "--ratios=0.5,0.75,1.0"]
    over_grpc, _ = run_bench_json(tmp_path, "--server=" + grpc_address, *args)
    over_http, proc = run_bench_json(tmp_path, "--api=openai",
                                     "--http=" + http_address, *args)
    check_generate(over_http)
    assert over_http["requests"] == 12 and over_http["completed"] == 12
    assert over_http["warmup"] == {"requests": 1, "errors": 0}
    assert [r["requests"] for r in over_http["ratios"]] == [4, 4, 4]
    assert over_http["config"]["api"] == "openai"
    assert over_http["config"]["server"] == http_address
    assert over_http["config"]["served_model"] == "llama_learned"
    assert over_grpc["config"]["api"] == "grpc"
    # The same report: every field, and the text report's sections.
    assert _fields(over_http) == _fields(over_grpc)
    for word in ("OpenAI HTTP API", "throughput", "TTFT", "inter-token",
                 "end-to-end", "0.75"):
        assert word in proc.stdout
    # Greedy, same prompts and ratios: the same tokens (usage's count) and
    # the same ratios as gRPC's streamed token ids.
    assert 0 < over_http["generated_tokens"] <= 12 * MAX_NEW_TOKENS
    assert over_http["generated_tokens"] == over_grpc["generated_tokens"]
    for h, g in zip(over_http["ratios"], over_grpc["ratios"]):
        assert h["mean_effective_activation_ratio"] == pytest.approx(
            g["mean_effective_activation_ratio"])
        assert h["mean_activation_ratio"] == pytest.approx(
            g["mean_activation_ratio"])


def test_openai_api_open_loop_synthetic_prompts(lm_http_server):
    _, http_address = lm_http_server
    proc = run_bench("--api=openai", "--http=" + http_address, "--rate=20",
                     "--duration=1.5", "--prompt_tokens=12",
                     "--max_new_tokens=%d" % MAX_NEW_TOKENS,
                     "--ratios=0.5,0.75,1.0", "--ratio_order=random", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    check_generate(result)
    assert result["config"]["mode"] == "open"
    assert result["config"]["prompt_tokens"] == 12


def test_openai_api_errors_by_code(lm_http_server, tmp_path):
    _, http_address = lm_http_server
    # Over the model's 256 positions: the server's 400, by its code.
    result, proc = run_bench_json(tmp_path, "--api=openai",
                                  "--http=" + http_address, "--requests=3",
                                  "--max_new_tokens=100000")
    check_consistent(result)
    assert result["errors_by_code"] == {"INVALID_ARGUMENT": 3}
    assert "INVALID_ARGUMENT" in proc.stdout


def test_openai_api_interrupt(start_server, tmp_path):
    _, http_address = start_server("llama_learned", http=True)
    interrupted_bench(tmp_path, "--api=openai", "--http=" + http_address)


def test_openai_api_unreachable_and_usage():
    _require_inputs()
    proc = run_bench("--api=openai", "--http=127.0.0.1:1", "--requests=1")
    assert proc.returncode == 1
    assert "cannot reach 127.0.0.1:1: UNAVAILABLE" in proc.stderr
    for args, message in [
        (["--api=openai", "--server=127.0.0.1:1"], "address as --http"),
        (["--http=127.0.0.1:1"], "--http applies to --api=openai"),
        (["--api=rest"], "expected grpc or openai"),
        (["--api=openai", "--http=127.0.0.1:1", "--rpc=classify",
          "--pixels_shape=3,16,16"], "generate only"),
    ]:
        proc = run_bench("--requests=1", *args)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr
