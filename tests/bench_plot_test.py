"""The benchmark suite's plots: bench/plot.py draws every plot from a results
dict shaped like the one bench/suite.py writes, and the suite's RESULTS.md
shows only plots that were drawn, saying so when matplotlib is missing.

Drawing needs matplotlib, which only the bench virtual environment has
(`scripts/install_deps.sh --bench`; Debian's python3 here has none): those
tests use that environment's python and are skipped, with the reason, where
it is not installed (CI). The rest run everywhere.

Environment (CTest sets it): MOH_SOURCE_DIR (the repository). Run with
/usr/bin/python3 -m pytest -rs.
"""
import json
import os
import subprocess
import sys

import pytest

SOURCE = os.environ.get("MOH_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SOURCE, "bench"))
import plot  # noqa: E402  (bench/plot.py)
import suite  # noqa: E402  (bench/suite.py)

RATIOS = [0.5, 0.625, 0.75, 0.875, 1.0]
CONCURRENCY = [1, 2, 4, 8, 16, 32]
PEER_ROWS = ["decode\nbatch 1, 1 thread", "prefill 512\nbatch 16, 2 threads"]
VIT_CONFIGS = ["default", "0.5", "0.25", "1.0", "dense"]
DIT_CONFIGS = ["0.75", "0.5", "1.0", "dense"]


def synthetic_results():
    """Every section bench/plot.py draws, with made-up numbers."""
    def rising(start, step, n):
        return [start + step * i for i in range(n)]
    return {
        "schema_version": 1,
        "title": "bench_plot_test: synthetic numbers",
        "attention": {
            "threads": 2, "layer": "One MoH attention layer",
            "model": "4-layer MoH-LLaMA", "ratios": RATIOS,
            "layer_ms": {phase: {"dense": [400.0] * 5,
                                 "head-sparse": rising(100.0, 20.0, 5)}
                         for phase in ("prefill", "decode")},
            "model_tokens_per_s": {
                phase: {"every head": [1000.0] * 5,
                        "head-sparse": rising(1800.0, -150.0, 5)}
                for phase in ("prefill", "decode")},
        },
        "concurrency": {
            "threads": 1, "concurrency": CONCURRENCY,
            "Generate": {"model": "demo-lm",
                         "requests_per_s": rising(190.0, 100.0, 6),
                         "tokens_per_s": rising(3000.0, 1600.0, 6),
                         "ttft_p50_ms": rising(1.0, 0.5, 6),
                         "e2e_p50_ms": rising(5.0, 6.0, 6),
                         "e2e_p99_ms": rising(7.0, 7.0, 6)},
            "Classify": {"model": "demo-vit",
                         "requests_per_s": rising(300.0, 700.0, 6),
                         "e2e_p50_ms": rising(3.0, 0.8, 6),
                         "e2e_p99_ms": rising(4.0, 1.5, 6)},
        },
        "peer": {
            "model": "bench-lm", "rows": PEER_ROWS,
            "kv": [{"label": label,
                    "tokens_per_s": {"llama.cpp": [289.0, 3244.0],
                                     "moh 1.0": [236.0, 2626.0],
                                     "moh 0.5": [265.0, 3240.0]}}
                   for label in ("default", "f32")],
        },
        "prefix_cache": {"model": "bench-lm", "threads": None,
                         "on": {"requests_per_s": 42.8, "ttft_p50_ms": 44.1},
                         "off": {"requests_per_s": 4.3,
                                 "ttft_p50_ms": 456.5}},
        "serving_ratio": {
            "model": "bench-lm", "threads": 1, "ratios": RATIOS,
            "ttft_p50_ms": rising(56.0, 2.0, 5),
            "ttft_p99_ms": rising(60.0, 3.0, 5),
            "itl_p50_ms": rising(3.1, 0.05, 5),
            "itl_p99_ms": rising(3.9, 0.1, 5),
            "e2e_p50_ms": rising(157.0, 1.0, 5),
            "tokens_per_s": {"1": rising(203.0, -1.0, 5),
                             "8": rising(321.0, -2.0, 5)}},
        "vit_throughput": {
            "threads": 2, "batches": [1, 32], "seconds": 900.0,
            "configs": VIT_CONFIGS,
            "shapes": [{"label": label, "variant": variant,
                        "images_per_s": {"1": [4.0, 4.3, 4.6, 3.9, 3.3],
                                         "32": [2.7, 2.9, 3.1, 2.5, 1.2]},
                        "effective_ratio": {b: [0.88, 0.78, 0.66, 1.0, 1.0]
                                            for b in ("1", "32")},
                        "selected_ratio": {b: [0.88, 0.78, 0.66, 1.0, 0.88]
                                           for b in ("1", "32")}}
                       for label, variant in (
                           ("S", "moh_transnext_small_75"),
                           ("B", "moh_transnext_base_75"))]},
        "dit": {
            "seconds": 280.0,
            "step": {
                "threads": 2, "configs": VIT_CONFIGS[:1] + DIT_CONFIGS,
                "shapes": [{"label": "XL", "variant": "MoH-DiT-XL/2-90",
                            "input_size": 32, "rows": 2, "timed_steps": 1,
                            "step_seconds": [3.1, 3.05, 2.9, 3.3, 3.6],
                            "effective_ratio": [0.90, 0.88, 0.84, 1.0, 1.0],
                            "selected_ratio": [0.90, 0.88, 0.84, 1.0,
                                               0.90]}]},
            "batching": {"model": "MoH-DiT-S/2-90, 16 × 16 pixels",
                         "requests": 8, "steps": 10, "threads": 2,
                         "modes": ["one at a time", "8 at once"],
                         "images_per_s": {"in process": [1.2, 1.4],
                                          "moh-server": [1.0, 1.2]},
                         "gain": {"in process": 1.17, "moh-server": 1.2},
                         "latency_p50_s": [0.9, 6.3],
                         "identical_images": True}},
    }


def bench_python_with_matplotlib():
    """The bench environment's python; skips the test where it lacks
    matplotlib."""
    py = suite.bench_venv_python()[0]
    if not os.access(py, os.X_OK):
        pytest.skip("no bench environment (%s): `bash scripts/install_deps.sh "
                    "--bench` installs it with matplotlib" % py)
    if subprocess.run([py, "-c", "import matplotlib"],
                      capture_output=True).returncode != 0:
        pytest.skip("no matplotlib in %s: `bash scripts/install_deps.sh "
                    "--bench` adds it" % py)
    return py


def assert_pngs(directory, names):
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        width = int.from_bytes(data[16:20], "big")
        height = int.from_bytes(data[20:24], "big")
        assert width >= 400 and height >= 300, (name, width, height)
        assert len(data) > 10000, (name, len(data))  # more than a blank


def test_every_section_is_drawn(tmp_path):
    py = bench_python_with_matplotlib()
    results = tmp_path / "results.json"
    results.write_text(json.dumps(synthetic_results()))
    drawn, skipped = plot.draw_plots(str(results), str(tmp_path / "plots"),
                                     [py])
    assert skipped is None
    names = {name for _, name, _ in plot.PLOTS}
    assert drawn == names
    assert sorted(os.listdir(tmp_path / "plots")) == sorted(names)
    assert_pngs(tmp_path / "plots", names)


def test_sections_that_did_not_run_are_not_drawn(tmp_path):
    py = bench_python_with_matplotlib()
    partial = synthetic_results()
    del partial["peer"], partial["attention"]
    results = tmp_path / "results.json"
    results.write_text(json.dumps(partial))
    drawn, skipped = plot.draw_plots(str(results), str(tmp_path / "plots"),
                                     [py])
    assert skipped is None
    assert drawn == {"concurrency.png", "prefix_cache.png",
                     "ratio_serving.png", "vit_throughput.png", "dit.png"}
    assert_pngs(tmp_path / "plots", drawn)


def test_committed_results_are_drawn(tmp_path):
    """The numbers of the last full run (bench/results.json), when there."""
    committed = os.path.join(SOURCE, "bench", "results.json")
    if not os.path.exists(committed):
        pytest.skip("no bench/results.json yet")
    py = bench_python_with_matplotlib()
    drawn, skipped = plot.draw_plots(committed, str(tmp_path), [py])
    assert skipped is None and drawn
    assert_pngs(tmp_path, drawn)


def test_a_plot_that_fails_skips_the_plots_with_its_error(tmp_path):
    py = bench_python_with_matplotlib()
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"schema_version": 1, "attention": {}}))
    drawn, skipped = plot.draw_plots(str(results), str(tmp_path / "plots"),
                                     [py])
    assert drawn == set()
    assert skipped.startswith("bench/plot.py failed: KeyError"), skipped


def test_without_matplotlib_plots_are_skipped(tmp_path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps(synthetic_results()))
    drawn, skipped = plot.draw_plots(str(results), str(tmp_path / "plots"),
                                     [str(tmp_path / "no-python")])
    assert drawn == set()
    assert "no python with matplotlib" in skipped
    assert not (tmp_path / "plots").exists()


def test_markdown_shows_only_drawn_plots():
    lines = ["# title\n", "| a |", "",
             plot.Figure("drawn.png", "a drawn plot"), "text",
             plot.Figure("missing.png", "a plot not drawn")]
    text = plot.markdown(lines, {"drawn.png"}, "plots")
    assert "![a drawn plot](plots/drawn.png)" in text
    assert "missing.png" not in text
    assert text.startswith("# title\n\n| a |\n")


def test_suite_writes_results_without_plots(tmp_path):
    """RESULTS.md and results.json are written when no python has
    matplotlib (no section runs, so this takes a second)."""
    env = dict(os.environ, MOH_BENCH_VENV=str(tmp_path / "no-venv"))
    out = tmp_path / "RESULTS.md"
    # /usr/bin/python3 (Debian's, as bench/run_suite.sh runs the suite):
    # plot.draw_plots also tries the suite's own python.
    p = subprocess.run(["/usr/bin/python3", os.path.join(SOURCE, "bench",
                                                         "suite.py"),
                        "--sections=none", "--out=%s" % out],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    assert text.startswith("# moh-serve benchmark results")
    if subprocess.run(["/usr/bin/python3", "-c", "import matplotlib"],
                      capture_output=True).returncode != 0:
        assert "Plots skipped: no python with matplotlib" in text
    assert json.loads((tmp_path / "results.json").read_text())[
        "schema_version"] == 1
