"""Every metric the alerts, the HPA's adapter rule, the Grafana dashboard and
the inference gateway's endpoint picker query exists in a live scrape of the
real moh-server, and every label they group or filter by is on those metrics
(or is a target label Prometheus adds). The server runs with each overlay's rendered server.textproto, so a
config the server cannot read fails here too."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import (SOURCE_DIR, adapter_rules, dashboard_path,
                      mounted_config, one, parse_metric_spec,
                      picker_metric_specs)

# The integration suite's helpers (standard library only).
sys.path.insert(0, os.path.join(SOURCE_DIR, "tests", "integration"))
from moh_testlib import free_ports  # noqa: E402

SERVER = os.environ.get("MOH_SERVER",
                        os.path.join(SOURCE_DIR, "build/service/moh-server"))
CLIENT = os.environ.get("MOH_CLIENT") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(SERVER))), "client",
    "moh-client")
FIXTURES = os.environ.get("MOH_FIXTURES",
                          os.path.join(SOURCE_DIR, "build/fixtures"))
MODEL_DIR = os.path.join(FIXTURES, "llama_learned")

NAME = re.compile(r"\b((?:moh|process)_[a-z0-9_]+)\b")
# Labels Prometheus (ServiceMonitor relabelling) or kube-state-metrics add.
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "endpoint",
                 "container", "deployment", "le", "__name__"}
# Exported only on CUDA (service/metrics/metrics.h), with its label.
CUDA_ONLY = {"moh_gpu_memory_bytes": {"device"},
             "moh_gpu_memory_limit_bytes": {"device"}}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def inputs_or_skip():
    if not os.access(SERVER, os.X_OK):
        if "MOH_SERVER" in os.environ:
            pytest.fail("MOH_SERVER=%s is not executable" % SERVER)
        pytest.skip("no moh-server at %s (set MOH_SERVER)" % SERVER)
    assert os.access(CLIENT, os.X_OK), "no moh-client at %s (set MOH_CLIENT)" % CLIENT
    assert os.path.isfile(os.path.join(MODEL_DIR, "config.json")), (
        "no test model at %s (set MOH_FIXTURES)" % MODEL_DIR)


class Server:
    """moh-server with an overlay's config file, on free loopback ports,
    serving the test model (--model_dir replaces the config's models)."""

    def __init__(self, config_text, workdir, extra_args=()):
        self.port, self.metrics_port = free_ports(2)
        config = os.path.join(workdir, "server.textproto")
        with open(config, "w") as f:
            f.write(config_text)
        self.log_path = os.path.join(workdir, "moh-server.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [SERVER, "--config=" + config, "--model_dir=" + MODEL_DIR,
             "--host=127.0.0.1", "--port=%d" % self.port,
             "--metrics_port=%d" % self.metrics_port, "--http_port=-1", "--threads=1",
             "--device=cpu", "--dtype=float32", *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT)

    def logs(self):
        with open(self.log_path) as f:
            return f.read()

    def client(self, *args, server=None):
        return subprocess.run(
            [CLIENT, *args, "--server=" + (server or "127.0.0.1:%d" % self.port)],
            capture_output=True, text=True, timeout=60)

    def wait_serving(self, timeout=120):
        """Polls the Dockerfile's HEALTHCHECK command (with `localhost`, as
        there) until SERVING."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, (
                "moh-server exited with %s:\n%s" % (self.proc.returncode,
                                                    self.logs()))
            if self.client("health", server="localhost:%d" % self.port
                           ).returncode == 0:
                return
            time.sleep(0.3)
        pytest.fail("moh-server not SERVING after %d s:\n%s" % (timeout,
                                                                self.logs()))

    def scrape(self):
        url = "http://127.0.0.1:%d/metrics" % self.metrics_port
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    def stop(self):
        """SIGTERM: the drain the Deployment's grace period relies on."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def parse_exposition(text):
    """({family: type}, {family or sample name: {label names}})."""
    types, labels = {}, {}
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m:
            types[m.group(1)] = m.group(2)
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s", line)
        if m and not line.startswith("#"):
            names = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)=\"", m.group(2) or ""))
            labels.setdefault(m.group(1), set()).update(names)
    return types, labels


def queries(rendered):
    """{where: PromQL text} of the alerts, the adapter rule and the dashboard."""
    out = {}
    rule = one(rendered["cpu"], "PrometheusRule")
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            out["alert " + r.get("alert", r.get("record", "?"))] = r["expr"]
    for i, r in enumerate(adapter_rules()):
        out["adapter rule %d seriesQuery" % i] = r["seriesQuery"]
        out["adapter rule %d metricsQuery" % i] = r["metricsQuery"]
    with open(dashboard_path()) as f:
        dashboard = json.load(f)

    def walk(node, where):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    out["dashboard #%d %r %s" % (len(out), where, key)] = value
                else:
                    walk(value, node.get("title", node.get("name", where)))
        elif isinstance(node, list):
            for item in node:
                walk(item, where)

    walk(dashboard, "")
    assert sum(k.startswith("dashboard") for k in out) == sum(
        1 for _ in re.finditer(r'"(?:expr|definition)":', json.dumps(dashboard)))
    return out


def labels_used(promql):
    """Label names a PromQL expression groups by or matches on."""
    names = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", promql):
        names.update(n.strip() for n in group.split(",") if n.strip())
    for selector in re.findall(r"\{([^{}]*)\}", promql):
        names.update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector))
    return {n for n in names if re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", n)}


def family_of(name, types):
    if name in types:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name[:-len(suffix)] if name.endswith(suffix) else None
        if base and types.get(base) in ("histogram", "summary"):
            return base
    return None


@pytest.fixture(scope="module")
def live_scrape(rendered, tmp_path_factory):
    inputs_or_skip()
    server = Server(mounted_config(rendered["cpu"]),
                    str(tmp_path_factory.mktemp("cpu")))
    try:
        server.wait_serving()
        for args in (["models"],
                     ["generate", "hello", "--max_new_tokens=3", "--ratio=0.5"],
                     ["generate", "x", "--max_new_tokens=0"]):
            server.client(*args)
        text = server.scrape()
    finally:
        code = server.stop()
    assert code == 0, "moh-server exited %s after SIGTERM:\n%s" % (
        code, server.logs())
    return text


def test_queries_use_only_exported_metrics(rendered, live_scrape):
    types, sample_labels = parse_exposition(live_scrape)
    assert "moh_requests_waiting" in types and "process_resident_memory_bytes" in types
    metrics_source = open(os.path.join(SOURCE_DIR, "service/metrics/metrics.cc")).read()
    problems = []
    for where, promql in queries(rendered).items():
        metric_labels = set()
        for name in set(NAME.findall(promql)):
            if name in CUDA_ONLY:
                assert '"%s"' % name in metrics_source, name
                metric_labels |= CUDA_ONLY[name]
                continue
            family = family_of(name, types)
            if family is None:
                problems.append("%s: %s is not exported" % (where, name))
                continue
            for sample, names in sample_labels.items():
                if sample == family or (sample.startswith(family) and
                                        sample[len(family):] in HISTOGRAM_SUFFIXES):
                    metric_labels |= names
        if not NAME.search(promql):
            continue  # up / kube_* only: not moh-server's
        unknown = labels_used(promql) - metric_labels - TARGET_LABELS
        if unknown:
            problems.append("%s: labels %s are on none of its metrics" %
                            (where, sorted(unknown)))
    assert not problems, "\n".join(problems)


def test_the_endpoint_picker_reads_exported_gauges(live_scrape):
    # The picker reads one sample's value, of a gauge or a counter, selected by
    # its labels.
    types, sample_labels = parse_exposition(live_scrape)
    problems = []
    for where, spec in picker_metric_specs().items():
        name, labels = parse_metric_spec(spec)
        if types.get(name) not in ("gauge", "counter"):
            problems.append("%s: %s is %s" % (where, name, types.get(name, "not exported")))
        elif not set(labels) <= sample_labels.get(name, set()):
            problems.append("%s: %s has no labels %s" % (
                where, name, sorted(set(labels) - sample_labels.get(name, set()))))
    assert not problems, "\n".join(problems)


def test_every_histogram_panel_has_buckets(live_scrape):
    # histogram_quantile needs _bucket series with `le`.
    types, sample_labels = parse_exposition(live_scrape)
    for family, kind in types.items():
        if kind == "histogram" and family + "_bucket" in sample_labels:
            assert "le" in sample_labels[family + "_bucket"], family


def test_gpu_config_is_accepted(rendered, tmp_path):
    """The gpu overlay's server.textproto parses and resolves (its models are
    replaced by the test model and the device by the CPU)."""
    inputs_or_skip()
    server = Server(mounted_config(rendered["gpu"]), str(tmp_path))
    try:
        server.wait_serving()
    finally:
        code = server.stop()
    assert code == 0, server.logs()
