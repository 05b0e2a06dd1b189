"""deploy/gateway renders, and fits what it routes to: the InferencePool
selects the moh-server pods of the overlays on their HTTP port, its endpoint
picker (llm-d-router's) is reachable, polls moh-server's metrics port (which
the NetworkPolicy opens to it) and reads, through its engine configuration,
metrics moh-server exports, and the HTTPRoute sends the OpenAI paths to the
pool."""
import os
import re
import subprocess

import pytest
import yaml

from conftest import (DEPLOY_DIR, OVERLAYS, SOURCE_DIR, find, flag, http_port,
                      ENGINE_SPEC_FIELDS, need_tool, one, parse_metric_spec,
                      server_container, server_settings)


@pytest.fixture(scope="module")
def gateway():
    kubectl = need_tool("kubectl")
    out = subprocess.run([kubectl, "kustomize", os.path.join(DEPLOY_DIR, "gateway")],
                         check=True, capture_output=True, text=True).stdout
    return [o for o in yaml.safe_load_all(out) if o is not None]


# llm-d-router's endpoint picker image, pinned to a release (deploy/README.md
# installs the CRDs of the same release).
EPP_IMAGE = re.compile(r"ghcr\.io/llm-d/llm-d-router-endpoint-picker:v\d+\.\d+\.\d+")
# Flags of the v1.0 picker that llm-d-router's refuses (metric names and the
# metrics port now live in the config file).
REMOVED_FLAGS = ("total-queued-requests-metric", "total-running-requests-metric",
                 "kv-cache-usage-percentage-metric", "lora-info-metric",
                 "cache-info-metric", "model-server-metrics-port",
                 "model-server-metrics-path", "model-server-metrics-scheme")
CLUSTER_SCOPED = ("ClusterRole", "ClusterRoleBinding")


def epp(gateway):
    deployment = one(gateway, "Deployment", "moh-serve-epp")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return deployment, container


def epp_config(gateway):
    """The EndpointPickerConfig the picker's --config-file names, read through
    the volume mounted at its directory."""
    deployment, container = epp(gateway)
    path = flag(container["args"], "config-file")
    assert path, "the picker gets no --config-file=FILE argument"
    directory, filename = os.path.split(path)
    mount = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    assert mount, "nothing mounted at %s" % directory
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    config_map = one(gateway, "ConfigMap", volumes[mount[0]["name"]]["configMap"]["name"])
    return yaml.safe_load(config_map["data"][filename])


def plugins_of_type(config, plugin_type):
    return [p for p in config["plugins"] if p["type"] == plugin_type]


def plugin_name(plugin):
    return plugin.get("name", plugin["type"])


def test_every_object_is_in_the_servers_namespace(gateway):
    kinds = {o["kind"] for o in gateway}
    assert {"InferencePool", "HTTPRoute", "Deployment", "Service", "ConfigMap",
            "ServiceAccount", "Role", "RoleBinding"} <= kinds, kinds
    for o in gateway:
        if o["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in o["metadata"], o["metadata"]
        else:
            assert o["metadata"]["namespace"] == "moh-serve", o["metadata"]
    for binding in find(gateway, "ClusterRoleBinding"):
        for subject in binding["subjects"]:
            assert subject.get("namespace") == "moh-serve", subject
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
    assert flag(container["args"], "pool-group") in (None, "inference.networking.k8s.io")


def test_the_picker_is_llm_d_routers_without_the_old_flags(gateway):
    _, container = epp(gateway)
    assert EPP_IMAGE.fullmatch(container["image"]), container["image"]
    for name in REMOVED_FLAGS:
        assert not any(a == "--" + name or a.startswith("--%s=" % name)
                       for a in container["args"]), name


def exported_metric_names():
    """The families service/metrics/metrics.cc registers."""
    with open(os.path.join(SOURCE_DIR, "service", "metrics", "metrics.cc")) as f:
        return set(re.findall(r'"(moh_[a-z_]+)"', f.read()))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_picker_polls_moh_servers_metrics_port(gateway, rendered, overlay):
    config = epp_config(gateway)
    sources = plugins_of_type(config, "metrics-data-source")
    assert len(sources) == 1, sources
    params = sources[0].get("parameters", {})
    _, metrics_port, _ = server_settings(rendered[overlay])
    assert params.get("port") == metrics_port, params
    assert params.get("path", "/metrics") == "/metrics"
    assert params.get("scheme", "http") == "http"
    # Wired to the extractor by its type name: the picker then adds no default
    # source (which would poll the pool's HTTP port).
    assert plugin_name(sources[0]) == "metrics-data-source"
    extractors = {plugin_name(p) for p in plugins_of_type(config, "core-metrics-extractor")}
    wired = {(s["pluginRef"], e["pluginRef"]) for s in config["dataLayer"]["sources"]
             for e in s["extractors"]}
    assert wired == {("metrics-data-source", e) for e in extractors}, wired


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pickers_engine_configuration_names_moh_servers_gauges(
        gateway, rendered, overlay):
    (extractor,) = plugins_of_type(epp_config(gateway), "core-metrics-extractor")
    params = extractor["parameters"]
    engines = {e["name"]: e for e in params["engineConfigs"]}
    # The server pods get the engine their label names, else the default.
    deployment, _ = server_container(rendered[overlay])
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    engine_name = labels.get(params.get("engineLabelKey", "llm-d.ai/engine-type"),
                             params["defaultEngine"])
    assert engine_name in engines, "no engine configuration %r" % engine_name
    engine = engines[engine_name]
    names = exported_metric_names()
    want = {"queuedRequestsSpec": "moh_requests_waiting",
            "runningRequestsSpec": "moh_requests_running",
            "kvUsageSpec": "moh_kv_cache_usage_ratio"}
    for field, name in want.items():
        assert parse_metric_spec(engine[field])[0] == name, (field, engine[field])
    assert set(engine) <= {"name", "customMetrics", "cacheBlockSizeLabelName",
                           "cacheNumBlocksLabelName"} | set(ENGINE_SPEC_FIELDS), engine
    specs = [engine[f] for f in ENGINE_SPEC_FIELDS if engine.get(f)]
    specs += [m["metricSpec"] for m in engine.get("customMetrics", [])]
    for spec in specs:
        name, spec_labels = parse_metric_spec(spec)
        assert name in names, "%s: moh-server exports no %s" % (spec, name)
        # The demo deployment's language model (service/config/server_config.cc).
        assert spec_labels == {"model": "demo-lm"}, spec


def test_the_servers_network_policy_lets_the_picker_scrape(gateway, rendered):
    _, container = epp(gateway)
    labels = epp(gateway)[0]["spec"]["template"]["metadata"]["labels"]
    policy = one(rendered["cpu"], "NetworkPolicy", "moh-server")
    metrics_rule = [r for r in policy["spec"]["ingress"]
                    if any(p["port"] == "metrics" for p in r["ports"])][0]
    assert any("podSelector" in peer and "namespaceSelector" not in peer and
               peer["podSelector"]["matchLabels"].items() <= labels.items()
               for peer in metrics_rule["from"]), metrics_rule


def test_the_pickers_config_is_consistent_and_its_rbac_sufficient(gateway):
    deployment, container = epp(gateway)
    config = epp_config(gateway)
    assert config["apiVersion"] == "llm-d.ai/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    declared = {plugin_name(p) for p in config["plugins"]}
    assert len(declared) == len(config["plugins"]), "duplicate plugin names"
    for profile in config["schedulingProfiles"]:
        for ref in profile["plugins"]:
            assert ref["pluginRef"] in declared, ref
    for source in config.get("dataLayer", {}).get("sources", []):
        assert source["pluginRef"] in declared, source
        for ref in source["extractors"]:
            assert ref["pluginRef"] in declared, ref
    # It can read what it watches.
    role = one(gateway, "Role")
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] if {"get", "list", "watch"} <= set(rule["verbs"])}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
            ("llm-d.ai", "inferenceobjectives"),
            ("llm-d.ai", "inferencemodelrewrites")} <= granted, granted
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    binding = one(gateway, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {"kind": "ServiceAccount", "name": account} in [
        {k: s[k] for k in ("kind", "name")} for s in binding["subjects"]]
    # Its /metrics checks scrapers' tokens (on unless --metrics-endpoint-auth=false).
    if flag(container["args"], "metrics-endpoint-auth") != "false":
        cluster_role = one(gateway, "ClusterRole")
        created = {(g, r) for rule in cluster_role["rules"] for g in rule["apiGroups"]
                   for r in rule["resources"] if "create" in rule["verbs"]}
        assert {("authentication.k8s.io", "tokenreviews"),
                ("authorization.k8s.io", "subjectaccessreviews")} <= created
        cluster_binding = one(gateway, "ClusterRoleBinding")
        assert cluster_binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
        assert {"kind": "ServiceAccount", "name": account, "namespace": "moh-serve"} in [
            {k: s.get(k) for k in ("kind", "name", "namespace")}
            for s in cluster_binding["subjects"]]


def test_the_route_sends_the_openai_paths_to_the_pool(gateway):
    route = one(gateway, "HTTPRoute")
    pool = one(gateway, "InferencePool")["metadata"]["name"]
    for rule in route["spec"]["rules"]:
        assert [(b["group"], b["kind"], b["name"]) for b in rule["backendRefs"]] == [
            ("inference.networking.k8s.io", "InferencePool", pool)]
    paths = [m["path"]["value"] for r in route["spec"]["rules"] for m in r["matches"]]
    assert "/v1/" in paths
