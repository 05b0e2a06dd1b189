"""Shared helpers of the deployment tests (no cluster, no Docker needed).

Environment (CTest sets it; defaults in parentheses):
  MOH_SOURCE_DIR  repository root (two levels above this file)
  MOH_SERVER      moh-server binary (SOURCE_DIR/build/service/moh-server)
  MOH_CLIENT      moh-client binary (next to moh-server: ../client/moh-client)
  MOH_FIXTURES    tests/reference/make_fixtures.py output (SOURCE_DIR/build/fixtures)
Tools: kubectl (kustomize) and promtool; tests that need a missing tool skip.
"""
import os
import re
import shutil
import subprocess

import pytest
import yaml

SOURCE_DIR = os.path.abspath(
    os.environ.get("MOH_SOURCE_DIR")
    or os.path.join(os.path.dirname(__file__), "..", ".."))
DEPLOY_DIR = os.path.join(SOURCE_DIR, "deploy")
OVERLAYS = ("cpu", "gpu", "tls")

# Health service names moh-server answers (service/main.cc).
HEALTH_SERVICES = ("", "moh.v1.Inference")
# Server defaults when neither the config file nor a flag sets them
# (service/config/server_config.cc ResolveServerConfig).
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9464
DEFAULT_DRAIN_SECONDS = 30.0
DEFAULT_HTTP_PORT = 8000  # -1: off


def need_tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.skip("%s is not installed" % name)
    return path


def render(overlay):
    """The objects `kubectl kustomize deploy/overlays/<overlay>` renders."""
    kubectl = need_tool("kubectl")
    out = subprocess.run(
        [kubectl, "kustomize", os.path.join(DEPLOY_DIR, "overlays", overlay)],
        check=True, capture_output=True, text=True).stdout
    return [o for o in yaml.safe_load_all(out) if o is not None]


@pytest.fixture(scope="session")
def rendered():
    """{overlay: [objects]} for every overlay."""
    return {overlay: render(overlay) for overlay in OVERLAYS}


def find(objects, kind, name=None):
    found = [o for o in objects if o["kind"] == kind and
             (name is None or o["metadata"]["name"] == name)]
    assert found, "no %s%s rendered" % (kind, "" if name is None else " " + name)
    return found


def one(objects, kind, name=None):
    found = find(objects, kind, name)
    assert len(found) == 1, "%d %s objects rendered, expected one" % (
        len(found), kind)
    return found[0]


def server_container(objects):
    deployment = one(objects, "Deployment", "moh-server")
    containers = {c["name"]: c for c in
                  deployment["spec"]["template"]["spec"]["containers"]}
    assert "moh-server" in containers, "no container named moh-server"
    return deployment, containers["moh-server"]


def flag(args, name):
    """Value of --name=VALUE in args (the last one wins, as in Abseil)."""
    value = None
    for arg in args:
        if arg.startswith("--%s=" % name):
            value = arg.split("=", 1)[1]
    return value


def mounted_config(objects):
    """The server.textproto the Deployment passes with --config: its text,
    found through the volume mounted at the file's directory."""
    deployment, container = server_container(objects)
    path = flag(container.get("args", []), "config")
    assert path, "moh-server gets no --config=FILE argument"
    directory, filename = os.path.split(path)
    mounts = [m for m in container.get("volumeMounts", [])
              if m["mountPath"].rstrip("/") == directory]
    assert mounts, "nothing is mounted at %s (--config=%s)" % (directory, path)
    volumes = {v["name"]: v for v in
               deployment["spec"]["template"]["spec"]["volumes"]}
    volume = volumes[mounts[0]["name"]]
    assert "configMap" in volume, "%s is not a ConfigMap volume" % directory
    config_map = one(objects, "ConfigMap", volume["configMap"]["name"])
    assert filename in config_map.get("data", {}), (
        "ConfigMap %s has no key %s" % (config_map["metadata"]["name"],
                                        filename))
    return config_map["data"][filename]


def top_level_field(textproto, field):
    """A scalar field at the top level of a text-format message (no nesting:
    only lines that start with `field:`)."""
    m = re.search(r"^%s\s*:\s*([^\s#]+)" % re.escape(field), textproto, re.M)
    return m.group(1) if m else None


def server_settings(objects):
    """(gRPC port, metrics port, drain seconds) moh-server gets from the
    rendered Deployment: the mounted config, overridden by flags."""
    _, container = server_container(objects)
    config = mounted_config(objects)
    args = container.get("args", [])

    def setting(field, flag_name, default, convert):
        value = flag(args, flag_name) or top_level_field(config, field)
        return convert(value) if value is not None else default

    return (setting("port", "port", DEFAULT_PORT, int),
            setting("metrics_port", "metrics_port", DEFAULT_METRICS_PORT, int),
            setting("drain_timeout_seconds", "drain_timeout",
                    DEFAULT_DRAIN_SECONDS, float))


def http_port(objects):
    """The OpenAI-compatible API's port moh-server gets (flag over config
    over default), or None when it is off."""
    _, container = server_container(objects)
    value = (flag(container.get("args", []), "http_port") or
             top_level_field(mounted_config(objects), "http_port"))
    port = int(value) if value is not None else DEFAULT_HTTP_PORT
    return None if port == -1 else port


def health_port(objects):
    """The plaintext health-only port the mounted config sets, or None."""
    value = top_level_field(mounted_config(objects), "health_port")
    return int(value) if value is not None and int(value) != 0 else None


def parse_metric_spec(spec):
    """(name, {label: value}) of an endpoint picker metric spec
    (deploy/gateway/epp-config.yaml), `name{label="value",...}`, values quoted
    or not, as the picker accepts."""
    m = re.fullmatch(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{([^}]*)\})?\s*", spec)
    assert m, "%r is not a metric spec" % spec
    labels = {}
    for pair in filter(None, (p.strip() for p in (m.group(2) or "").split(","))):
        lm = re.fullmatch(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"?([^"]*)"?', pair)
        assert lm, "bad label %r in %r" % (pair, spec)
        labels[lm.group(1)] = lm.group(2)
    return m.group(1), labels


# The metric fields of the endpoint picker's engine configurations.
ENGINE_SPEC_FIELDS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec",
                      "loraSpec", "cacheInfoSpec", "cacheBlockSizeSpec",
                      "cacheNumBlocksSpec")


def picker_metric_specs():
    """{where: spec} of every metric the endpoint picker's engine
    configurations in deploy/gateway/epp-config.yaml read."""
    with open(os.path.join(DEPLOY_DIR, "gateway", "epp-config.yaml")) as f:
        config = yaml.safe_load(f)
    specs = {}
    for plugin in config["plugins"]:
        if plugin["type"] != "core-metrics-extractor":
            continue
        for engine in plugin.get("parameters", {}).get("engineConfigs", []):
            for field in ENGINE_SPEC_FIELDS:
                if engine.get(field):
                    specs["engine %s %s" % (engine["name"], field)] = engine[field]
            for custom in engine.get("customMetrics", []):
                specs["engine %s %s" % (engine["name"], custom["attributeKey"])] = (
                    custom["metricSpec"])
    assert specs, "no engine configuration in deploy/gateway/epp-config.yaml"
    return specs


def adapter_rules():
    path = os.path.join(DEPLOY_DIR, "monitoring", "prometheus-adapter-rules.yaml")
    with open(path) as f:
        doc = yaml.safe_load(f)
    rules = doc["rules"]["custom"]
    assert rules, "no prometheus-adapter rules in " + path
    return rules


def dashboard_path():
    return os.path.join(DEPLOY_DIR, "grafana", "moh-serve-dashboard.json")
