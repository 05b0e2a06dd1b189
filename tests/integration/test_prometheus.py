"""Metrics: the raw /metrics page passes promtool, and a real Prometheus server
scraping moh-server sees counts equal to what the clients received.

The server here is this module's own, so every count is known exactly: the
requests sent below are the only traffic it has seen.
"""
import json
import os
import subprocess
import urllib.parse

import grpc
import pytest

import moh_testlib as lib

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"

# SPEC §5: family -> Prometheus type.
FAMILIES = {
    "moh_requests_total": "counter",
    "moh_request_duration_seconds": "histogram",
    "moh_queue_duration_seconds": "histogram",
    "moh_time_to_first_token_seconds": "histogram",
    "moh_inter_token_latency_seconds": "histogram",
    "moh_prompt_tokens_total": "counter",
    "moh_generated_tokens_total": "counter",
    "moh_images_generated_total": "counter",
    "moh_image_seconds": "histogram",
    "moh_diffusion_steps_total": "counter",
    "moh_batch_size": "histogram",
    "moh_requests_running": "gauge",
    "moh_requests_waiting": "gauge",
    "moh_kv_cache_usage_ratio": "gauge",
    "moh_kv_cache_config_info": "gauge",
    "moh_kv_blocks_in_use": "gauge",
    "moh_kv_blocks_cached": "gauge",
    "moh_prefix_cache_queries_total": "counter",
    "moh_prefix_cache_hits_total": "counter",
    "moh_activation_ratio": "histogram",
    "moh_head_tokens_total": "counter",
    "moh_activation_ratio_lowered_total": "counter",
    "moh_steps_retried_total": "counter",
    "moh_model_load_seconds": "gauge",
    "process_cpu_seconds_total": "counter",
    "process_resident_memory_bytes": "gauge",
}


class Traffic:
    """What the clients sent and received."""

    def __init__(self):
        self.generate_ok = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.classify_ok = {"demo-lm": 0, "demo-vit": 0}
        # (model, layer, head) -> tokens, summed over every response's routing
        self.head_tokens = {}
        self.routed_tokens = {"demo-lm": 0, "demo-vit": 0}

    def add_routing(self, model, routing):
        self.routed_tokens[model] += routing.tokens
        for layer in routing.layers:
            for head, n in enumerate(layer.head_tokens):
                key = (model, layer.layer, head)
                self.head_tokens[key] = self.head_tokens.get(key, 0) + n


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("prom", [("demo-lm", lib.LM_DIR, ""),
                                 ("demo-vit", lib.VIT_DIR, "")])


@pytest.fixture(scope="module")
def traffic(api, server, lm_golden, vit_golden):
    stub = api.grpc.InferenceStub(server.channel())
    t = Traffic()
    requests = [
        lib.generate_request(api.pb, token_ids=prompt, max_new_tokens=8,
                             ratio=ratio, include_routing=True)
        for prompt in lm_golden["prompts"] for ratio in (0.0, 0.5, 1.0)
    ]
    requests.append(
        lib.generate_request(api.pb, prompt="Once upon a time",
                             max_new_tokens=16, include_routing=True))
    for request in requests:
        last = lib.run_generate(stub, request)[-1]
        t.generate_ok += 1
        t.prompt_tokens += last.usage.prompt_tokens
        t.completion_tokens += last.usage.completion_tokens
        t.add_routing("demo-lm", last.routing)
    for _ in range(2):
        error = lib.rpc_error(lib.run_generate, stub,
                              lib.generate_request(api.pb, prompt="hi",
                                                   ratio=7.0))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    for pixels in vit_golden["pixels"]:
        request = api.pb.ClassifyRequest(model="demo-vit", include_routing=True)
        request.pixels.shape.extend([3, 16, 16])
        request.pixels.data.extend(v for c in pixels for row in c for v in row)
        response = stub.Classify(request, timeout=lib.RPC_TIMEOUT)
        t.classify_ok["demo-vit"] += 1
        t.add_routing("demo-vit", response.routing)
    error = lib.rpc_error(stub.Classify,
                          api.pb.ClassifyRequest(model="demo-vit", image=b"x"),
                          timeout=lib.RPC_TIMEOUT)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    for text in ("the cat sat", "Once upon a time"):
        response = stub.Classify(api.pb.ClassifyRequest(
            model="demo-lm", text=text, labels=["yes", "no", "maybe"],
            include_routing=True),
                                 timeout=lib.RPC_TIMEOUT)
        t.classify_ok["demo-lm"] += 1
        t.add_routing("demo-lm", response.routing)
    return t


def test_promtool_checks_the_raw_metrics(server, traffic):
    text = server.scrape()
    result = subprocess.run([PROMTOOL, "check", "metrics"],
                            input=text.encode(),
                            capture_output=True,
                            timeout=60)
    assert result.returncode == 0, (result.stdout.decode() +
                                    result.stderr.decode())
    for family, kind in FAMILIES.items():
        assert "# TYPE %s %s\n" % (family, kind) in text, family


def test_raw_metrics_count_the_traffic(api, server, traffic):
    samples = server.samples()

    def value(name, **labels):
        return lib.metric_value(samples, name, **labels)

    assert value("moh_generated_tokens_total",
                 model="demo-lm") == traffic.completion_tokens
    assert value("moh_prompt_tokens_total",
                 model="demo-lm") == traffic.prompt_tokens
    assert value("moh_time_to_first_token_seconds_count",
                 model="demo-lm") == traffic.generate_ok
    # One ratio observation per finished request (Generate and Classify).
    assert value("moh_activation_ratio_count", model="demo-lm") == (
        traffic.generate_ok + traffic.classify_ok["demo-lm"])
    assert value("moh_activation_ratio_count",
                 model="demo-vit") == traffic.classify_ok["demo-vit"]
    assert value("moh_batch_size_sum", model="demo-vit",
                 kind="classify") == traffic.classify_ok["demo-vit"]
    assert value("moh_requests_running", model="demo-lm") == 0
    assert value("moh_requests_waiting", model="demo-lm") == 0
    # The cache's shape, as ListModels gives it (the gateway's picker reads it).
    stub = api.grpc.InferenceStub(server.channel())
    info = next(m for m in stub.ListModels(api.pb.ListModelsRequest()).models
                if m.name == "demo-lm")
    assert value("moh_kv_cache_config_info", model="demo-lm",
                 block_size=str(info.kv_block_size),
                 num_gpu_blocks=str(info.kv_blocks)) == 1


def _query(port, expr):
    url = "http://127.0.0.1:%d/api/v1/query?query=%s" % (
        port, urllib.parse.quote(expr))
    body = json.loads(lib.http_get(url))
    assert body["status"] == "success", body
    return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]


@pytest.fixture(scope="module")
def prometheus(server, traffic, workdir):
    """A Prometheus server scraping `server` every second, started after the
    traffic; killed at teardown."""
    port = lib.free_port()
    base = os.path.join(workdir, "prometheus")
    os.makedirs(base, exist_ok=True)
    config = os.path.join(base, "prometheus.yml")
    with open(config, "w") as f:
        f.write("global:\n"
                "  scrape_interval: 1s\n"
                "  evaluation_interval: 1s\n"
                "scrape_configs:\n"
                "  - job_name: moh\n"
                "    scrape_interval: 1s\n"
                "    scrape_timeout: 1s\n"
                "    static_configs:\n"
                "      - targets: ['127.0.0.1:%d']\n" % server.metrics_port)
    log_path = os.path.join(base, "prometheus.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([
            PROMETHEUS, "--config.file=" + config,
            "--storage.tsdb.path=" + os.path.join(base, "data"),
            "--web.listen-address=127.0.0.1:%d" % port
        ],
                                stdout=log,
                                stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)

    def log():
        with open(log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    try:

        def ready():
            assert proc.poll() is None, "prometheus exited:\n" + log()
            try:
                lib.http_get("http://127.0.0.1:%d/-/ready" % port, timeout=2)
                return True
            except OSError:
                return False

        lib.wait_until(ready, 60, "prometheus ready", interval=0.2)
        # Samples of a scrape taken after all the traffic.
        expected = traffic.completion_tokens
        lib.wait_until(
            lambda: _query(port, 'up{job="moh"}') == [
                ({"__name__": "up", "instance": "127.0.0.1:%d" %
                  server.metrics_port, "job": "moh"}, 1.0)] and
            _query(port, 'moh_generated_tokens_total{model="demo-lm"}')[0][1]
            == expected,
            30, "prometheus samples of moh-server", interval=0.5)
        yield port
    except BaseException:
        print("prometheus log:\n" + log())
        raise
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_prometheus_scrapes_request_counts(prometheus, traffic):
    def count(model, rpc, code):
        result = _query(prometheus,
                        'moh_requests_total{model="%s",rpc="%s",code="%s"}' %
                        (model, rpc, code))
        assert len(result) == 1, (model, rpc, code, result)
        return result[0][1]

    assert count("demo-lm", "Generate", "OK") == traffic.generate_ok
    assert count("demo-lm", "Generate", "INVALID_ARGUMENT") == 2
    assert count("demo-lm", "Classify", "OK") == traffic.classify_ok["demo-lm"]
    assert count("demo-vit", "Classify",
                 "OK") == traffic.classify_ok["demo-vit"]
    assert count("demo-vit", "Classify", "INVALID_ARGUMENT") == 1
    # Every series is labelled with the model, rpc and code.
    for metric, _ in _query(prometheus, "moh_requests_total"):
        assert {"model", "rpc", "code"} <= set(metric), metric


def test_prometheus_scrapes_token_counts(prometheus, traffic):
    assert _query(prometheus,
                  'moh_generated_tokens_total{model="demo-lm"}')[0][1] == (
                      traffic.completion_tokens)
    assert _query(prometheus, 'moh_prompt_tokens_total{model="demo-lm"}'
                  )[0][1] == traffic.prompt_tokens
    assert _query(prometheus,
                  'moh_time_to_first_token_seconds_count{model="demo-lm"}'
                  )[0][1] == traffic.generate_ok


@pytest.mark.parametrize("model,layers,heads,shared", [
    ("demo-lm", 2, 8, [2, 2]),
    ("demo-vit", 3, 6, [2, 1, 6]),
])
def test_prometheus_scrapes_head_loads(prometheus, traffic, model, layers,
                                       heads, shared):
    result = _query(prometheus, 'moh_head_tokens_total{model="%s"}' % model)
    got = {(int(m["layer"]), int(m["head"])): v for m, v in result}
    # A series for every (layer, head), equal to the sum of the routing the
    # clients received.
    assert sorted(got) == [(l, h) for l in range(layers) for h in range(heads)]
    for (layer, head), value in got.items():
        assert value == traffic.head_tokens[(model, layer, head)], (layer, head)
    # Shared heads served every token.
    tokens = traffic.routed_tokens[model]
    assert tokens > 0
    for layer in range(layers):
        for head in range(shared[layer]):
            assert got[(layer, head)] == tokens, (layer, head)
        for head in range(shared[layer], heads):
            assert 0 <= got[(layer, head)] <= tokens


def test_prometheus_scrapes_the_rest(prometheus, server):
    for model in ("demo-lm", "demo-vit"):
        load = _query(prometheus,
                      'moh_model_load_seconds{model="%s"}' % model)
        assert len(load) == 1 and load[0][1] > 0, load
    memory = _query(prometheus,
                    'process_resident_memory_bytes{job="moh"}')
    assert memory and memory[0][1] > 1e6, memory
    for family in FAMILIES:
        series = family + ("_count" if FAMILIES[family] == "histogram" else "")
        assert _query(prometheus, series), family
