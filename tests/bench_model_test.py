"""bench/make_bench_lm.py writes a model moh-generate loads and that always
generates exactly the tokens asked for (its end-of-sequence token never wins);
moh-generate --ratios and --profile_dir with bench/trace_summary.py;
bench/gpu_bench.py rehearsed on the CPU.

Environment (CTest sets them): MOH_GENERATE (path of moh-generate),
MOH_SOURCE_DIR (the repository), MOH_TORCH_CUDA (ON when moh-generate links
the torch wheel's LibTorch, which has the kineto profiler), MOH_SANITIZE (the
build's sanitizer, if any). Run with
/usr/bin/python3 -m pytest.
"""
import json
import os
import re
import subprocess
import sys

import pytest

GENERATE = os.environ.get("MOH_GENERATE", "")
SOURCE = os.environ.get("MOH_SOURCE_DIR", "")
SANITIZE = os.environ.get("MOH_SANITIZE", "")


def test_bench_model_generates_every_token(tmp_path):
    assert os.access(GENERATE, os.X_OK), "MOH_GENERATE=%r" % GENERATE
    out = tmp_path / "bench-lm"
    subprocess.run([sys.executable, os.path.join(SOURCE, "bench",
                                                 "make_bench_lm.py"),
                    "--out=%s" % out], check=True, timeout=120)
    with open(out / "config.json") as f:
        config = json.load(f)
    assert config["hidden_size"] == 512 and config["num_hidden_layers"] == 8
    result = subprocess.run(
        [GENERATE, "--model_dir=%s" % out, "--prompt=In the beginning",
         "--max_new_tokens=48", "--batch=2"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    finished = re.findall(r"finish_reason=(\w+) prompt_tokens=\d+ "
                          r"completion_tokens=(\d+)", result.stderr)
    assert finished, result.stderr
    assert all(reason == "LENGTH" and int(n) == 48
               for reason, n in finished), finished


def test_generate_measures_several_ratios_with_one_load(tmp_path):
    """moh-generate --ratios: a throughput line per ratio, tagged, in order;
    the routing really changes with the ratio (effective ratio of the
    first), and a ratio outside [0, 1] is refused naming the flag."""
    lm = os.path.join(SOURCE, "models", "demo-lm")
    result = subprocess.run(
        [GENERATE, "--model_dir=%s" % lm, "--prompt=In the beginning",
         "--max_new_tokens=8", "--temperature=0", "--ratios=0.5,1,0.75"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    ratios = re.findall(r"ratio=([0-9.]+) generated_tokens=(\d+)", result.stderr)
    assert [(float(r), int(n)) for r, n in ratios] == [(0.5, 8), (1.0, 8), (0.75, 8)]
    effective = re.search(r"effective_ratio=([0-9.]+)", result.stderr)
    assert effective and float(effective.group(1)) == 0.5, result.stderr
    bad = subprocess.run([GENERATE, "--model_dir=%s" % lm, "--ratios=0.5,1.5"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--ratios" in bad.stderr and "[0, 1]" in bad.stderr


def test_generate_profile_dir_traces_each_ratio(tmp_path):
    """moh-generate --profile_dir: with the wheel's LibTorch, Chrome traces
    of each ratio's prefill and decode, which bench/trace_summary.py
    tabulates per step; with Debian's (no kineto), exit 1 naming the flag
    and the cause."""
    lm = os.path.join(SOURCE, "models", "demo-lm")
    traces = tmp_path / "traces"
    traces.mkdir()
    result = subprocess.run(
        [GENERATE, "--model_dir=%s" % lm, "--prompt=In the beginning",
         "--max_new_tokens=6", "--temperature=0", "--ratios=1,0.5",
         "--profile_dir=%s" % traces], capture_output=True, text=True,
        timeout=120)
    if os.environ.get("MOH_TORCH_CUDA") != "ON":
        assert result.returncode == 1, result.stderr
        assert "--profile_dir" in result.stderr and "Kineto" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in traces.iterdir())
    assert names == ["decode-ratio-0.50.json", "decode-ratio-1.00.json",
                     "prefill-ratio-0.50.json", "prefill-ratio-1.00.json"], names
    for name in names:
        assert "profile_trace=%s" % (traces / name) in result.stderr
    summary = tmp_path / "summary.json"
    table = subprocess.run(
        [sys.executable, os.path.join(SOURCE, "bench", "trace_summary.py"),
         str(traces / "decode-ratio-1.00.json"), "--steps=5", "--top=5",
         "--json=%s" % summary], capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith("5 decode steps: "), table.stdout
    assert "| host operator | per step |" in table.stdout
    with open(summary) as f:
        s = json.load(f)
    # Host operators of the decode steps (a CPU trace has no kernels), each
    # step's operators counted once.
    assert s["kind"] == "host operators" and 0 < len(s["rows"]) <= 5
    assert s["wall_us_per_step"] >= s["busy_us_per_step"] > 0
    assert all(r["per_step"] > 0 for r in s["rows"])
    # The host's phases of each step, named (no device: no idle time).
    phases = {p["name"]: p for p in s["host_phases"]}
    assert {"moh::step_indices", "moh::layers", "moh::download",
            "moh::sample", "moh::build_batch"} <= set(phases), phases
    assert phases["moh::layers"]["per_step"] == 1.0
    assert "idle_us_per_step" not in phases["moh::layers"]
    prefill = subprocess.run(
        [sys.executable, os.path.join(SOURCE, "bench", "trace_summary.py"),
         str(traces / "prefill-ratio-0.50.json"), "--label=prefill"],
        capture_output=True, text=True, timeout=120)
    assert prefill.returncode == 0, prefill.stderr
    assert prefill.stdout.startswith("1 prefill: "), prefill.stdout
    # The prompt's forward pass is in it: its embedding lookup among the
    # operators.
    assert "aten::embedding" in prefill.stdout
    bad = subprocess.run(
        [sys.executable, os.path.join(SOURCE, "bench", "trace_summary.py"),
         str(traces / "decode-ratio-1.00.json"), "--steps=0"],
        capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--steps" in bad.stderr


def rehearse_gpu_bench(build, tmp_path):
    """bench/gpu_bench.py on the CPU (--device cpu --quick, the tiny layout,
    no transformers peer) with `build`'s binaries, its output under
    tmp_path/out: (the finished process, its results JSON)."""
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, os.path.join(SOURCE, "bench", "gpu_bench.py"),
         "--build=%s" % build, "--work=%s" % (tmp_path / "work"),
         "--out=%s" % out, "--layouts=tiny", "--device=cpu", "--quick",
         "--no_hf_peer"], capture_output=True, text=True, timeout=600)
    with open(out / "gpu_bench.json") as f:
        return result, json.load(f)


@pytest.mark.skipif(
    SANITIZE != "",
    reason="a benchmark's orchestration: 145 s under AddressSanitizer, and "
    "every binary it drives is tested there on its own; both unsanitized "
    "builds run it")
def test_gpu_bench_rehearsal_on_cpu(tmp_path):
    """bench/gpu_bench.py end to end on the CPU (--device cpu --quick, the
    tiny layout of the released MoH-LLaMA3-8B config): every ratio measured
    in both orders, the bound, and the serving overhead through the real
    moh-server and moh-bench; a results JSON and the table."""
    build = os.path.dirname(os.path.dirname(GENERATE))
    out = tmp_path / "out"
    result, results = rehearse_gpu_bench(build, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert results["errors"] == {}
    with open(tmp_path / "work" / "llama3-tiny" / "config.json") as f:
        config = json.load(f)
    assert "auto_map" in config and "moh_shared_heads" not in config
    tiny = results["tiny"]
    for ratio in ("1.0", "0.75", "0.5"):
        single = tiny["batch1"][ratio]
        assert len(single["decode_tokens_per_s_runs"]) == 2
        assert single["decode_tokens_per_s"] > 0
        assert single["prefill_4k_tokens_per_s"] > 0
        assert len(single["prefill_4k_tokens_per_s_runs"]) == 2
        assert tiny["batch64_2k"][ratio]["decode_tokens_per_s"] > 0
        assert len(tiny["batch64_2k"][ratio]["prefill_tokens_per_s_runs"]) == 2
    assert tiny["batch1"]["bound_tokens_per_s"] > 0
    # The goal's shape, after the layouts: ratios 1.0 and 0.5, each in both orders.
    for ratio in ("1.0", "0.5"):
        assert len(tiny["batch64_4k"][ratio]["decode_tokens_per_s_runs"]) == 2
    assert "0.75" not in tiny["batch64_4k"]
    assert "| tiny | decode 64 x 4k, tokens/s |" in result.stdout
    # The prompt through padded rows and a mask (--cuda_varlen_prefill=false),
    # side by side; on the CPU no step is a graph.
    padded = tiny["batch1_padded_prefill"]["1.0"]
    assert len(padded["prefill_4k_tokens_per_s_runs"]) == 2
    assert padded["decode_tokens_per_s"] > 0
    assert tiny["batch1"]["graph_replays"] is None  # printed on CUDA only
    assert "| tiny | prefill 4k, padded rows + mask, tokens/s |" in result.stdout
    # The narrow products on cuBLAS (--cuda_skinny_linear=false), side by
    # side.
    assert tiny["batch1_cublas"]["1.0"]["decode_tokens_per_s"] > 0
    assert ("| tiny | decode b1 @4k, narrow products on cuBLAS (of bound) |"
            in result.stdout)
    # With overlapped launches (--cuda_programmatic_launch), side by side.
    assert tiny["batch1_overlapped"]["1.0"]["decode_tokens_per_s"] > 0
    assert ("| tiny | decode b1 @4k, overlapped launches (PDL) (of bound) |"
            in result.stdout)
    overhead = results["serving_overhead"]
    assert len(overhead["server_runs"]) == 3
    assert overhead["server_tokens_per_s"] > 0
    assert len(overhead["server_ratio_0_5_runs"]) == 3
    assert overhead["server_ratio_0_5_tokens_per_s"] > 0
    assert "moh-server at ratio 0.5 (narrow rows)" in result.stdout
    # The released layout's shared heads fill whole KV groups: ratio 0.5's rows
    # were narrow.
    with open(out / "gpu-bench-server.log") as f:
        assert "narrow KV width 4 of 8" in f.read()
    assert "| tiny | decode b1 @4k, tokens/s |" in result.stdout


@pytest.mark.skipif(
    SANITIZE != "" or os.environ.get("MOH_TORCH_CUDA") == "ON",
    reason="the benchmark's orchestration in Python, the same in every "
    "build: run in the Debian build's tests only")
def test_gpu_bench_goes_on_past_failing_paths(tmp_path):
    """Where the default path fails (a kernel new since the last lease),
    gpu_bench.py tries each CUDA path off in turn and measures everything with
    the first set that runs, moh-server's config included; a side-by-side
    measurement that fails is an error of its own, and the rest stand.
    Rehearsed with a moh-generate that fails unless --cuda_varlen_prefill=false
    (the second path tried) and always with overlapped launches, beside the
    real moh-server."""
    build = os.path.dirname(os.path.dirname(GENERATE))
    fake = tmp_path / "build"
    (fake / "tools").mkdir(parents=True)
    wrapper = fake / "tools" / "moh-generate"
    wrapper.write_text(
        '#!/bin/sh\n'
        'case " $* " in *" --cuda_programmatic_launch=true "*)\n'
        '  echo "CUDA error: an illegal instruction" >&2; exit 1 ;; esac\n'
        'case " $* " in *" --cuda_varlen_prefill=false "*) exec %s "$@" ;; esac\n'
        'echo "CUDA error: misaligned address" >&2\nexit 1\n' % GENERATE)
    wrapper.chmod(0o755)
    for part in ("service", "client"):
        os.symlink(os.path.join(build, part), fake / part)
    out = tmp_path / "out"
    result, results = rehearse_gpu_bench(fake, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert list(results["errors"]) == ["tiny batch1_overlapped"]
    assert "illegal instruction" in results["errors"]["tiny batch1_overlapped"]
    assert "ERROR in tiny batch1_overlapped: RuntimeError" in result.stdout
    paths = results["paths"]
    assert paths["failed_at"] == "tiny batch 1"
    assert paths["error"] == "RuntimeError: CUDA error: misaligned address"
    assert list(paths["tried"]) == ["skinny_linear", "varlen_prefill"]
    assert paths["tried"]["skinny_linear"] == paths["error"]
    assert paths["tried"]["varlen_prefill"] == "ok"
    assert results["paths_off"] == ["varlen_prefill"]
    tiny = results["tiny"]
    for ratio in ("1.0", "0.5"):
        assert tiny["batch1"][ratio]["decode_tokens_per_s"] > 0
        assert tiny["batch64_2k"][ratio]["decode_tokens_per_s"] > 0
        assert tiny["batch64_4k"][ratio]["decode_tokens_per_s"] > 0
    assert tiny["batch1_cublas"]["1.0"]["decode_tokens_per_s"] > 0
    assert "batch1_overlapped" not in tiny
    assert results["serving_overhead"]["server_tokens_per_s"] > 0
    with open(out / "gpu-bench-server.log") as f:
        assert ("CUDA paths off: varlen_prefill (generation.cuda_paths)"
                in f.read())
    assert "THE DEFAULT PATH FAILED (tiny batch 1)" in result.stdout
    assert "- with varlen_prefill off: ok" in result.stdout
    assert "measured with CUDA paths off: varlen_prefill" in result.stdout
