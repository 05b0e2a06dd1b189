"""The kustomize overlays render, and what they render fits moh-server: probes
on its gRPC health service, scrape on its metrics port, grace above its drain
timeout, GPUs where asked."""
import json
import os
import re

import pytest

from conftest import (DEPLOY_DIR, HEALTH_SERVICES, OVERLAYS, SOURCE_DIR,
                      adapter_rules, dashboard_path, find, flag, health_port,
                      http_port, mounted_config, one, server_container,
                      server_settings)

CLUSTER_SCOPED = {"Namespace"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_well_formed(rendered, overlay):
    objects = rendered[overlay]
    seen = set()
    for o in objects:
        assert o.get("apiVersion") and o.get("kind"), o
        name = o.get("metadata", {}).get("name")
        assert name, "%s without metadata.name" % o["kind"]
        key = (o["kind"], o["metadata"].get("namespace"), name)
        assert key not in seen, "%s rendered twice" % (key,)
        seen.add(key)
        if o["kind"] not in CLUSTER_SCOPED:
            assert o["metadata"].get("namespace") == "moh-serve", key
    kinds = {o["kind"] for o in objects}
    for kind in ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget",
                 "HorizontalPodAutoscaler", "ServiceMonitor", "PrometheusRule"):
        assert kind in kinds, "%s overlay renders no %s" % (overlay, kind)


def container_port(container, port):
    """A Service targetPort (number or name) as the container's port number."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port in named, "targetPort %r names no container port" % port
    return named[port]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_and_probes_match_the_server(rendered, overlay):
    objects = rendered[overlay]
    grpc_port, metrics_port, _ = server_settings(objects)
    deployment, container = server_container(objects)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports.get("grpc") == grpc_port
    assert ports.get("metrics") == metrics_port
    assert ports.get("http") == http_port(objects)

    # Probes go to the plaintext health-only port when there is one (gRPC
    # probes cannot speak TLS), else to the gRPC port.
    probe_port = health_port(objects) or grpc_port
    if probe_port != grpc_port:
        assert ports.get("health") == probe_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in container, "no %s" % probe
        grpc = container[probe].get("grpc")
        assert grpc, "%s is not a native gRPC probe" % probe
        assert grpc["port"] == probe_port, probe
        assert grpc.get("service", "") in HEALTH_SERVICES, probe
    # Traffic only to pods whose models are loaded and warmed up.
    assert container["readinessProbe"]["grpc"]["service"] == "moh.v1.Inference"

    labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = {s["metadata"]["name"]: s for s in find(objects, "Service")}
    for service in services.values():
        selector = service["spec"]["selector"]
        assert selector.items() <= labels.items(), service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            target = container_port(container, port.get("targetPort",
                                                         port["port"]))
            assert target == {"grpc": grpc_port, "metrics": metrics_port,
                              "http": http_port(objects)}[port["name"]], port
    headless = [s for s in services.values()
                if s["spec"].get("clusterIP") == "None"]
    regular = [s for s in services.values()
               if s["spec"].get("clusterIP") != "None"]
    assert headless and regular, "need a headless and a ClusterIP Service"

    # The ServiceMonitor scrapes a Service port that reaches --metrics_port.
    monitor = one(objects, "ServiceMonitor")
    match = monitor["spec"]["selector"]["matchLabels"]
    scraped = [s for s in services.values()
               if match.items() <= s["metadata"].get("labels", {}).items()]
    assert len(scraped) == 1, "the ServiceMonitor selects %d Services" % len(
        scraped)
    for endpoint in monitor["spec"]["endpoints"]:
        by_name = {p["name"]: p for p in scraped[0]["spec"]["ports"]}
        assert endpoint["port"] in by_name, endpoint
        port = by_name[endpoint["port"]]
        assert container_port(container, port["targetPort"]) == metrics_port
        assert endpoint.get("path", "/metrics") == "/metrics"
        # With TLS the server's /metrics is HTTPS (same certificate).
        if re.search(r"^tls\s*\{", mounted_config(objects), re.M):
            assert endpoint.get("scheme") == "https", endpoint
            assert endpoint["tlsConfig"]["ca"], endpoint
        else:
            assert endpoint.get("scheme", "http") == "http", endpoint


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_the_drain(rendered, overlay):
    objects = rendered[overlay]
    _, _, drain_seconds = server_settings(objects)
    deployment, container = server_container(objects)
    pre_stop = 0
    command = (container.get("lifecycle", {}).get("preStop", {})
               .get("exec", {}).get("command", []))
    if command[:1] == ["sleep"]:
        pre_stop = float(command[1])
    grace = deployment["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]
    assert grace > pre_stop + drain_seconds, (
        "terminationGracePeriodSeconds %s <= preStop %s s + drain %s s" %
        (grace, pre_stop, drain_seconds))
    # A draining pod (NOT_SERVING) must not be restarted by its liveness
    # probe before the drain ends.
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > drain_seconds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_runs_as_the_image_user(rendered, overlay):
    deployment, container = server_container(rendered[overlay])
    pod = deployment["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True
    with open(os.path.join(SOURCE_DIR, "Dockerfile")) as f:
        user = re.findall(r"^USER\s+(\S+)", f.read(), re.M)[-1]
    assert str(pod["runAsUser"]) == user.split(":")[0]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"] and container["resources"]["limits"]


def test_gpu_overlay_asks_for_a_gpu(rendered):
    deployment, container = server_container(rendered["gpu"])
    limits = container["resources"]["limits"]
    assert int(limits.get("nvidia.com/gpu", 0)) >= 1
    assert container["image"].endswith(":cuda")  # the CUDA LibTorch image
    assert flag(container["args"], "device") == "cuda"
    spec = deployment["spec"]["template"]["spec"]
    assert any(t.get("key") == "nvidia.com/gpu" for t in spec["tolerations"])
    assert spec.get("nodeSelector")
    # The weights come from the PersistentVolumeClaim the overlay renders.
    claims = {v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims and claims <= {p["metadata"]["name"] for p in
                                 find(rendered["gpu"], "PersistentVolumeClaim")}


def test_cpu_overlay_asks_for_no_gpu(rendered):
    _, container = server_container(rendered["cpu"])
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in container["resources"].get(section, {})
    assert flag(container["args"], "device") in (None, "cpu", "auto")
    assert container["image"].endswith(":cpu")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaling_and_disruption_target_the_server(rendered, overlay):
    objects = rendered[overlay]
    deployment, _ = server_container(objects)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()

    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "moh-server")
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # The HPA owns the replica count.
    assert "replicas" not in deployment["spec"]
    served = {r["name"]["as"] for r in adapter_rules()}
    pod_metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]
                   if m["type"] == "Pods"]
    assert pod_metrics, "no per-pod custom metric"
    for name in pod_metrics:
        assert name in served, (
            "HPA metric %s is not served by the prometheus-adapter rules" % name)


def test_adapter_rules_map_pods(rendered):
    for rule in adapter_rules():
        overrides = rule["resources"]["overrides"]
        assert overrides["pod"]["resource"] == "pod"
        assert overrides["namespace"]["resource"] == "namespace"
        for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert placeholder in rule["metricsQuery"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dashboard_config_map(rendered, overlay):
    config_map = one(rendered[overlay], "ConfigMap", "moh-serve-dashboard")
    assert config_map["metadata"]["labels"].get("grafana_dashboard") == "1"
    with open(dashboard_path()) as f:
        on_disk = json.load(f)
    assert json.loads(config_map["data"]["moh-serve-dashboard.json"]) == on_disk
    titles = " ".join(p["title"] for p in on_disk["panels"]).lower()
    for wanted in ("requests", "error", "duration", "first token",
                   "inter-token", "tokens / s", "batch", "waiting",
                   "activation ratio", "head load", "prefix cache",
                   "kv cache blocks", "images generated", "time per image",
                   "image step batch"):
        assert wanted in titles, "no %r panel" % wanted
    heatmaps = {p["title"] for p in on_disk["panels"] if p["type"] == "heatmap"}
    assert any("activation" in t.lower() for t in heatmaps)
    assert any("head load" in t.lower() for t in heatmaps)


def test_base_renders_alone():
    # Other kustomizations (e.g. a site's own overlay) may build on the base.
    from conftest import need_tool
    import subprocess
    kubectl = need_tool("kubectl")
    subprocess.run([kubectl, "kustomize", os.path.join(DEPLOY_DIR, "base")],
                   check=True, capture_output=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_opens_only_the_served_ports(rendered, overlay):
    objects = rendered[overlay]
    deployment, container = server_container(objects)
    policy = one(objects, "NetworkPolicy", "moh-server")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= (
        labels.items())
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    named = {p["name"] for p in container["ports"]}
    opened = [p["port"] for rule in policy["spec"]["ingress"]
              for p in rule["ports"]]
    assert sorted(opened) == ["grpc", "http", "metrics"] and set(opened) <= named
    metrics_rule = [r for r in policy["spec"]["ingress"]
                    if any(p["port"] == "metrics" for p in r["ports"])][0]
    assert metrics_rule.get("from"), "the metrics port is open to everyone"


def test_tls_overlay_serves_tls_and_tokens_from_secrets(rendered):
    objects = rendered["tls"]
    deployment, container = server_container(objects)
    config = mounted_config(objects)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in
               deployment["spec"]["template"]["spec"]["volumes"]}
    for field in ("cert_file", "key_file", "auth_token_file"):
        m = re.search(r'%s:\s*"([^"]+)"' % field, config)
        assert m, "the tls overlay's config sets no %s" % field
        directory = os.path.dirname(m.group(1))
        assert directory in mounts, "nothing mounted at %s" % directory
        assert "secret" in volumes[mounts[directory]], directory
    assert re.search(r"^reflection:\s*false", config, re.M)
