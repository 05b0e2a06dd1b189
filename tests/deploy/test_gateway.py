"""deploy/gateway renders, and fits what it routes to: the InferencePool
selects the moh-server pods of the overlays on their HTTP port, its endpoint
picker is reachable, scrapes metrics moh-server exports on its metrics port
(which the NetworkPolicy opens to it), and the HTTPRoute sends the OpenAI
paths to the pool."""
import os
import re
import subprocess

import pytest
import yaml

from conftest import (DEPLOY_DIR, OVERLAYS, SOURCE_DIR, flag, http_port,
                      need_tool, one, server_container, server_settings)


@pytest.fixture(scope="module")
def gateway():
    kubectl = need_tool("kubectl")
    out = subprocess.run([kubectl, "kustomize", os.path.join(DEPLOY_DIR, "gateway")],
                         check=True, capture_output=True, text=True).stdout
    return [o for o in yaml.safe_load_all(out) if o is not None]


def epp(gateway):
    deployment = one(gateway, "Deployment", "moh-serve-epp")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return deployment, container


def test_every_object_is_in_the_servers_namespace(gateway):
    kinds = {o["kind"] for o in gateway}
    assert {"InferencePool", "HTTPRoute", "Deployment", "Service", "ConfigMap",
            "ServiceAccount", "Role", "RoleBinding"} <= kinds, kinds
    for o in gateway:
        assert o["metadata"]["namespace"] == "moh-serve", o["metadata"]
    pool = one(gateway, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pool_selects_the_servers_http_port(gateway, rendered, overlay):
    objects = rendered[overlay]
    deployment, container = server_container(objects)
    pool = one(gateway, "InferencePool")["spec"]
    server_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= server_labels.items()
    epp_labels = epp(gateway)[0]["spec"]["template"]["metadata"]["labels"]
    assert not pool["selector"]["matchLabels"].items() <= epp_labels.items()
    port = http_port(objects)
    assert port is not None, "the %s overlay turns the HTTP API off" % overlay
    assert [p["number"] for p in pool["targetPorts"]] == [port]
    assert port in [p["containerPort"] for p in container["ports"]]


def test_the_picker_is_reachable_where_the_pool_says(gateway):
    ref = one(gateway, "InferencePool")["spec"]["endpointPickerRef"]
    service = one(gateway, "Service", ref["name"])
    deployment, container = epp(gateway)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    by_port = {p["port"]: p for p in service["spec"]["ports"]}
    assert ref["port"]["number"] in by_port
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    target = by_port[ref["port"]["number"]]["targetPort"]
    assert named.get(target, target) == int(flag(container["args"], "grpc-port"))
    health = int(flag(container["args"], "grpc-health-port"))
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == health
    assert flag(container["args"], "pool-name") == one(gateway, "InferencePool")[
        "metadata"]["name"]
    assert flag(container["args"], "pool-namespace") == "moh-serve"


def exported_metric_names():
    """The families service/metrics/metrics.cc registers."""
    with open(os.path.join(SOURCE_DIR, "service", "metrics", "metrics.cc")) as f:
        return set(re.findall(r'"(moh_[a-z_]+)"', f.read()))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_picker_scrapes_moh_servers_gauges(gateway, rendered, overlay):
    _, container = epp(gateway)
    args = container["args"]
    _, metrics_port, _ = server_settings(rendered[overlay])
    assert int(flag(args, "model-server-metrics-port")) == metrics_port
    assert flag(args, "model-server-metrics-path") == "/metrics"
    names = exported_metric_names()
    specs = {f: flag(args, f) for f in ("total-queued-requests-metric",
                                        "total-running-requests-metric",
                                        "kv-cache-usage-percentage-metric")}
    want = {"total-queued-requests-metric": "moh_requests_waiting",
            "total-running-requests-metric": "moh_requests_running",
            "kv-cache-usage-percentage-metric": "moh_kv_cache_usage_ratio"}
    for name, spec in specs.items():
        m = re.fullmatch(r'([a-z_:]+)\{model="([^"]+)"\}', spec or "")
        assert m, "%s=%r is not metric{model=\"NAME\"}" % (name, spec)
        assert m.group(1) == want[name] and m.group(1) in names, spec
        # The demo deployment's language model (service/config/server_config.cc).
        assert m.group(2) == "demo-lm", spec


def test_the_servers_network_policy_lets_the_picker_scrape(gateway, rendered):
    _, container = epp(gateway)
    labels = epp(gateway)[0]["spec"]["template"]["metadata"]["labels"]
    policy = one(rendered["cpu"], "NetworkPolicy", "moh-server")
    metrics_rule = [r for r in policy["spec"]["ingress"]
                    if any(p["port"] == "metrics" for p in r["ports"])][0]
    assert any("podSelector" in peer and "namespaceSelector" not in peer and
               peer["podSelector"]["matchLabels"].items() <= labels.items()
               for peer in metrics_rule["from"]), metrics_rule


def test_the_pickers_config_is_mounted_and_consistent(gateway):
    deployment, container = epp(gateway)
    path = flag(container["args"], "config-file")
    directory, filename = os.path.split(path)
    mount = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    assert mount, "nothing mounted at %s" % directory
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    config_map = one(gateway, "ConfigMap", volumes[mount[0]["name"]]["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][filename])
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        for ref in profile["plugins"]:
            assert ref["pluginRef"] in declared, ref
    # It can read what it needs.
    role = one(gateway, "Role")
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] if {"get", "list", "watch"} <= set(rule["verbs"])}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
    binding = one(gateway, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert {"kind": "ServiceAccount", "name": account} in [
        {k: s[k] for k in ("kind", "name")} for s in binding["subjects"]]


def test_the_route_sends_the_openai_paths_to_the_pool(gateway):
    route = one(gateway, "HTTPRoute")
    pool = one(gateway, "InferencePool")["metadata"]["name"]
    for rule in route["spec"]["rules"]:
        assert [(b["group"], b["kind"], b["name"]) for b in rule["backendRefs"]] == [
            ("inference.networking.k8s.io", "InferencePool", pool)]
    paths = [m["path"]["value"] for r in route["spec"]["rules"] for m in r["matches"]]
    assert "/v1/" in paths
