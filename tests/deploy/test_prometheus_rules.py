"""The PrometheusRule's groups pass `promtool check rules` and the unit tests
in rules_test.yaml (`promtool test rules`)."""
import os
import shutil
import subprocess

import yaml

from conftest import need_tool, one

HERE = os.path.dirname(os.path.abspath(__file__))


def write_rule_groups(rendered, directory):
    """The cpu overlay's PrometheusRule spec.groups as a Prometheus rule file."""
    rule = one(rendered["cpu"], "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    path = os.path.join(directory, "moh-serve-rules.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"groups": rule["spec"]["groups"]}, f)
    return path


def test_overlays_ship_the_same_rules(rendered):
    assert (one(rendered["cpu"], "PrometheusRule")["spec"] ==
            one(rendered["gpu"], "PrometheusRule")["spec"])


def test_promtool_check_rules(rendered, tmp_path):
    promtool = need_tool("promtool")
    path = write_rule_groups(rendered, str(tmp_path))
    result = subprocess.run([promtool, "check", "rules", path],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = [r["alert"] for g in yaml.safe_load(open(path))["groups"]
              for r in g["rules"] if "alert" in r]
    for wanted in ("MohServeHighErrorRatio", "MohServeTimeToFirstTokenHigh",
                   "MohServeQueueTimeHigh", "MohServePodsNotReady"):
        assert wanted in alerts


def test_promtool_unit_tests(rendered, tmp_path):
    promtool = need_tool("promtool")
    write_rule_groups(rendered, str(tmp_path))
    test_file = str(tmp_path / "rules_test.yaml")
    shutil.copy(os.path.join(HERE, "rules_test.yaml"), test_file)
    result = subprocess.run([promtool, "test", "rules", test_file],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
