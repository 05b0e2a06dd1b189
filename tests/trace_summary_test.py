"""bench/trace_summary.py on traces made here: the device's idle time set
against the host's moh:: phases (what the host does while the device waits),
and a CPU trace's phases without it."""
import gzip
import json
import os
import subprocess
import sys

SOURCE = os.environ.get("MOH_SOURCE_DIR", os.path.dirname(
    os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(SOURCE, "bench", "trace_summary.py")


def event(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
            "pid": 1, "tid": tid}


def summarise(tmp_path, events, *args):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = tmp_path / "summary.json"
    result = subprocess.run(
        [sys.executable, SCRIPT, str(path), "--json=%s" % out] + list(args),
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    with open(out) as f:
        return json.load(f), result.stdout


def test_device_idle_time_lies_in_the_host_phase_around_it(tmp_path):
    # Two steps of 150 µs: the host launches [0, 15), then waits in the
    # download while the device runs [0, 60) (a kernel and a copy
    # overlapping) and [70, 100); then it samples [100, 130) and builds the
    # next batch [130, 150) while the device waits. A GPU-side annotation
    # of the same name is not a host phase, nor another library's scope.
    events = []
    for step in (0, 150):
        events += [
            event("kernel", "gemm", step + 0, 40, tid=7),
            event("gpu_memcpy", "copy", step + 30, 30, tid=7),
            event("kernel", "norm", step + 70, 30, tid=7),
            event("user_annotation", "moh::layers", step, 15),
            event("user_annotation", "moh::download", step + 15, 85),
            event("user_annotation", "moh::sample", step + 100, 30),
            event("user_annotation", "moh::build_batch", step + 130, 20),
            event("gpu_user_annotation", "moh::sample", step, 100, tid=7),
            event("user_annotation", "other::scope", step + 100, 50),
        ]
    s, table = summarise(tmp_path, events, "--steps=2")
    # The window runs from the first kernel (0) to the last (250): 125 µs a
    # step; the device ran 90 of the first step's 100 and all of the second.
    assert s["wall_us_per_step"] == 125.0
    assert s["busy_us_per_step"] == 90.0
    assert s["idle_us_per_step"] == 35.0
    phases = {p["name"]: p for p in s["host_phases"]}
    assert sorted(phases) == ["moh::build_batch", "moh::download",
                              "moh::layers", "moh::sample"]
    # [60, 70) and [210, 220) idle inside download; [100, 150) inside
    # sample (30) and build_batch (20); the window ends at the last kernel.
    assert phases["moh::download"]["idle_us_per_step"] == 10.0
    assert phases["moh::sample"]["idle_us_per_step"] == 30.0 / 2
    assert phases["moh::build_batch"]["idle_us_per_step"] == 20.0 / 2
    assert phases["moh::layers"]["idle_us_per_step"] == 0.0
    assert phases["moh::sample"]["us_per_step"] == 30.0
    assert phases["moh::sample"]["per_step"] == 1.0
    assert "the device idle 35 µs a step, 35 µs of it inside them" in table
    assert "| `moh::sample` | 1.0 | 30.0 | 15.0 |" in table


def test_a_cpu_trace_lists_its_phases_without_idle_time(tmp_path):
    events = [event("cpu_op", "aten::mm", 0, 50),
              event("user_annotation", "moh::layers", 0, 60),
              event("user_annotation", "moh::sample", 60, 10)]
    s, table = summarise(tmp_path, events, "--label=prefill")
    assert "idle_us_per_step" not in s
    assert [p["name"] for p in s["host_phases"]] == ["moh::layers",
                                                    "moh::sample"]
    assert "| host phase | per step | µs per step |\n|---|---|---|" in table
    assert "| `moh::sample` | 1.0 | 10.0 |" in table
