#!/usr/bin/env python3
"""The GPU benchmark (run by scripts/gpu_check.sh on a CUDA machine).

Everything is measured side by side in one run, on one device:

  1. the device-to-device copy bandwidth (bytes read plus bytes written, the
     median of 20 copies of 2 GiB), the ceiling a decode step's bound uses;
  2. for each layout (bench/make_bench_lm.py --layout, random bfloat16
     weights in the released MoH-LLaMA3-8B layout, and its 1B sibling):
     - batch 1: a 4096-token prompt, then 128 greedy tokens (prefill tokens/s
       of the 4k prompt; decode tokens/s against the bound: the weights and
       KV-cache bytes a token reads over the copy bandwidth);
     - 64 sequences x a 2048-token prompt, then 32 tokens each (decode
       tokens/s of the batch at 2k context);
     each at ratios 1.0, 0.75 and 0.5, then in the reverse order, with one
     load of the model (moh-generate --ratios; a leading untimed ratio-1.0
     run warms the device up; the table shows the mean of both orders and
     each);
  3. on the last layout, 64 sequences x a 4096-token prompt, then 32
     tokens each, at ratios 1.0 and 0.5 in both orders (the goal's shape:
     KV reads weigh more than at 2k);
  4. serving overhead (the first layout): moh-server over gRPC, driven by
     moh-bench with 16 concurrent streams, against moh-generate --batch 16 in
     process: the same requests, greedy, 64 new tokens; medians of 3
     interleaved rounds; and the server at ratio 0.5 in the same rounds (the
     released layout's rows then narrow: the ratio ceiling);
  5. side by side, each layout's batch-1 decode and 4k prefill at ratio 1.0
     another way (the last layout's first): the prompt through padded rows
     and a mask, the narrow products on cuBLAS, overlapped launches;
  6. the transformers peer on the last layout: dense, and with the official
     MoH-LLaMA3 router (bench/moh_peer.py).
In that order, so that an overrun cuts what matters least.

  gpu_bench.py --build build-cuda --work DIR --out DIR [--layouts a,b]

Writes DIR/gpu_bench.json and prints a Markdown table (last, so that a device
tool's output tail carries it). Every step is bounded in time; a step that
fails or overruns is recorded as such and the rest still run. Should the
default path fail (a kernel new since the last lease), the run is tried with
each of this project's CUDA paths switched off in turn (CUDA_PATHS), and the
benchmark goes on with the first set that runs, saying so above its table:
a lease still measures the rest. $MOH_CUDA_PATHS_OFF=a,b switches some off
from the start.
"""
import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_paths import (CUDA_PATHS, path_config, paths_off,  # noqa: E402
                        path_flags)
from moh_peer import add_official_router, official_routing  # noqa: E402
from suite_server import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIOS = [1.0, 0.75, 0.5]
LAYOUT_DIRS = {"8b": "llama3-8b", "1b": "llama3-1b", "tiny": "llama3-tiny"}
# (batch, prompt tokens, new tokens) of the two measurements; --quick: a
# rehearsal on a CPU.
SIZES = {"batch1": (1, 4096, 128), "batched": (64, 2048, 32),
         "batched_4k": (64, 4096, 32)}
QUICK_SIZES = {"batch1": (1, 256, 16), "batched": (8, 128, 8),
               "batched_4k": (8, 256, 8)}
# The goal's shape (issue 30: ratio 0.5 >= 1.4x ratio 1.0 at 64 x 4k), after
# the layouts, on the last one: ratios 1.0 and 0.5, each order.
GOAL_RATIOS = [1.0, 0.5, 0.5, 1.0]
# Should the default path fail, the triage (working_paths) finds which of
# this project's CUDA paths (cuda_paths.CUDA_PATHS) to leave off so that a
# lease still measures the rest; $MOH_CUDA_PATHS_OFF leaves some off from
# the start. A probe of the triage, and a side-by-side measurement, may take
# PROBE_TIMEOUT seconds (a hang must not take the lease's command).
PROBE_TIMEOUT = 120


def log(*args):
    print("[gpu_bench %s]" % time.strftime("%H:%M:%S"), *args, file=sys.stderr,
          flush=True)


def copy_bandwidth():
    """Bytes read + written per second by a device-to-device copy."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    if not torch.equal(dst[:1 << 20], src[:1 << 20]):
        raise RuntimeError("the device copy is wrong")
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times)


def checkpoint_bytes(model_dir):
    """(all weight bytes, bytes a decode token reads: all but an untied
    embedding table, of which it reads one row)."""
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        total = json.load(f)["metadata"]["total_size"]
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    embed = cfg["vocab_size"] * cfg["hidden_size"] * 2
    if cfg.get("tie_word_embeddings"):  # read whole as the output layer
        return total, total, cfg
    return total, total - embed, cfg


def kv_bytes_per_position(cfg):
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return (cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim *
            2 * 2)  # keys and values, bfloat16


def precision(device):
    """moh-generate's precision flags and moh-server's model fields: bfloat16
    on a GPU; on the CPU (the rehearsal) float32 activations over bfloat16
    weights, which this project's kernels widen in registers on any x86
    (bfloat16 activations go through ATen's bfloat16 matmul, scalar without
    AVX-512 BF16: on an AVX2 EPYC 16x slower in prefill than float32, and the
    rehearsal's serving overhead ran past its timeout)."""
    if device == "cpu":
        return (["--dtype=float32", "--weights=bfloat16"],
                'dtype: "float32" weights: "bfloat16"')
    return ["--dtype=bfloat16"], 'dtype: "bfloat16"'


def run(cmd, timeout, **kwargs):
    log("$", " ".join(cmd))
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          **kwargs)
    log("  %.1fs, exit %d" % (time.time() - start, proc.returncode))
    if proc.returncode != 0:
        raise RuntimeError("%s exited %d:\n%s" % (cmd[0], proc.returncode,
                                                   proc.stderr[-3000:]))
    return proc


def generate(args, model_dir, sizes, timeout, warmup=True, ratios=None,
             extra=()):
    """moh-generate at RATIOS, then at RATIOS reversed (or at `ratios`), one
    process (with warmup, after an untimed ratio-1.0 run): {ratio: fields},
    each field the mean of the runs, and "runs": each of them (the order's
    effect); "graph_replays": the decode steps that ran as CUDA graphs."""
    batch, prompt_tokens, new_tokens = sizes
    ratios = ([1.0] if warmup else []) + (ratios or RATIOS + RATIOS[::-1])
    err = run([os.path.join(args.build, "tools", "moh-generate"),
               "--model_dir=" + model_dir, "--device=" + args.device,
               "--temperature=0"] + precision(args.device)[0] + [
               "--batch=%d" % batch, "--prompt_tokens=%d" % prompt_tokens,
               "--max_new_tokens=%d" % new_tokens,
               "--ratios=" + ",".join("%g" % r for r in ratios)] +
              path_flags(args.paths_off) + list(extra),
              timeout).stderr
    replays = [int(line.split("=")[1]) for line in err.splitlines()
               if line.startswith("cuda_graph_replays=")]
    lines = [line[line.find("batch="):] for line in err.splitlines()
             if "batch=" in line and "decode_tokens_per_s=" in line]
    if len(lines) != len(ratios):
        raise RuntimeError("moh-generate printed %d throughput lines, not %d:\n%s"
                           % (len(lines), len(ratios), err[-3000:]))
    runs = {}
    skip = 1 if warmup else 0
    for ratio, line in zip(ratios[skip:], lines[skip:]):
        fields = dict(kv.split("=") for kv in line.split())
        runs.setdefault(ratio, []).append(
            {k: float(v.rstrip("s")) for k, v in fields.items()})
    out = {}
    for ratio, both in runs.items():
        out[ratio] = {k: statistics.mean(r[k] for r in both) for k in both[0]}
        out[ratio]["runs"] = both
    out["graph_replays"] = replays[0] if replays else None
    return out


def gist(e):
    """An exception's type and its last line (a failed run's: the end of its
    stderr, where the error is)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return "%s: %s" % (type(e).__name__, lines[-1] if lines else "")


def working_paths(args, model_dir, sizes, results, where, error):
    """After the default path failed at `where`: the run again with each
    path off alone, newest first, then all of them; the first that runs
    becomes args.paths_off (and results["paths_off"]) for the rest of the
    benchmark and the server's config. The tries are recorded in
    results["paths"]; raises if none runs."""
    tried = {}
    results["paths"] = {"failed_at": where, "error": error, "tried": tried}
    default_off = args.paths_off
    for off in [[p] for p in CUDA_PATHS] + [CUDA_PATHS]:
        args.paths_off = default_off + [p for p in off if p not in default_off]
        try:
            generate(args, model_dir, sizes, PROBE_TIMEOUT, warmup=False,
                     ratios=[1.0, 0.5])
        except Exception as e:  # noqa: BLE001 - the next set is tried
            tried[",".join(off)] = gist(e)
            log("with %s off: failed" % ",".join(off))
            continue
        tried[",".join(off)] = "ok"
        results["paths_off"] = list(args.paths_off)
        log("the rest of the benchmark runs with %s off" % ",".join(off))
        return
    args.paths_off = default_off
    raise RuntimeError("the run failed with every path off too: %s" % error)


def measured(args, model_dir, sizes, results, where, **kwargs):
    """generate(...); where it fails and no triage ran yet, the triage
    (working_paths), then the same run with the paths it left off."""
    try:
        return generate(args, model_dir, sizes, args.step_timeout, **kwargs)
    except Exception as e:  # noqa: BLE001 - triaged once, else raised
        if "paths" in results:
            raise
        error = gist(e)
        log("%s failed; finding the paths that run: %s" % (where, e))
    working_paths(args, model_dir, sizes, results, where, error)
    return generate(args, model_dir, sizes, args.step_timeout, **kwargs)


def layout_section(args, layout, bandwidth, results):
    model_dir = os.path.join(args.work, LAYOUT_DIRS[layout])
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        run([sys.executable, os.path.join(ROOT, "bench", "make_bench_lm.py"),
             "--layout=" + LAYOUT_DIRS[layout], "--out=" + model_dir], 600)
    total, per_token, cfg = checkpoint_bytes(model_dir)
    kv_pos = kv_bytes_per_position(cfg)
    entry = results.setdefault(layout, {})
    entry["weight_bytes"] = total
    entry["kv_bytes_per_position"] = kv_pos
    sizes = QUICK_SIZES if args.quick else SIZES
    single = measured(args, model_dir, sizes["batch1"], results,
                      layout + " batch 1")
    # Mean context over the decoded tokens.
    _, prompt, new = sizes["batch1"]
    bound = bandwidth / (per_token + kv_pos * (prompt + new / 2))
    entry["batch1"] = {"bound_tokens_per_s": bound,
                       "graph_replays": single.pop("graph_replays")}
    for ratio, f in single.items():
        entry["batch1"][str(ratio)] = {
            "prefill_4k_tokens_per_s": f["prefill_tokens_per_s"],
            # Each run's, in order: a ratio's first run may pay for kernels
            # its shapes load (prefill at 0.5 ran at 0.91 of 1.0 in run 7,
            # faster in the profile).
            "prefill_4k_tokens_per_s_runs": [r["prefill_tokens_per_s"]
                                             for r in f["runs"]],
            "decode_tokens_per_s": f["decode_tokens_per_s"],
            "decode_tokens_per_s_runs": [r["decode_tokens_per_s"]
                                         for r in f["runs"]],
            "of_bound": f["decode_tokens_per_s"] / bound,
        }
    # With its own warm-up too: on the H100 the first batched decode at ratio
    # 1.0 without one ran at 0.19-0.48 of the same decode measured later in
    # the process (the caching allocator growing, kernels loading).
    batched = measured(args, model_dir, sizes["batched"], results,
                       layout + " 64 x 2k")
    entry["batch64_2k_graph_replays"] = batched.pop("graph_replays")
    entry["sizes"] = sizes
    entry["batch64_2k"] = {
        str(ratio): {"decode_tokens_per_s": f["decode_tokens_per_s"],
                     "prefill_tokens_per_s": f["prefill_tokens_per_s"],
                     "prefill_tokens_per_s_runs": [
                         r["prefill_tokens_per_s"] for r in f["runs"]],
                     "decode_tokens_per_s_runs": [
                         r["decode_tokens_per_s"] for r in f["runs"]]}
        for ratio, f in batched.items()}
    return model_dir


def side_by_side_section(args, layout, model_dir, results):
    """The batch-1 decode measured other ways in the same run (after every
    main measurement, which they must not cut short): each that fails or
    overruns is recorded, and the others still run."""
    entry = results[layout]
    sizes = QUICK_SIZES if args.quick else SIZES
    bound = entry["batch1"]["bound_tokens_per_s"]

    def batch1_with(name, extra):
        """entry[name]: the batch-1 run at ratio 1.0 (twice) with `extra`
        flags, in the same run: its decode against the same bound, and its
        4k prefill."""
        try:
            other = generate(args, model_dir, sizes["batch1"],
                             min(args.step_timeout, PROBE_TIMEOUT),
                             ratios=[1.0, 1.0], extra=extra)
        except Exception as e:  # noqa: BLE001 - recorded, the rest still run
            results["errors"]["%s %s" % (layout, name)] = "%s: %s" % (
                type(e).__name__, e)
            return
        other.pop("graph_replays")
        entry[name] = {str(r): {
            "decode_tokens_per_s": f["decode_tokens_per_s"],
            "decode_tokens_per_s_runs": [x["decode_tokens_per_s"]
                                         for x in f["runs"]],
            "of_bound": f["decode_tokens_per_s"] / bound,
            "prefill_4k_tokens_per_s": f["prefill_tokens_per_s"],
            "prefill_4k_tokens_per_s_runs": [x["prefill_tokens_per_s"]
                                             for x in f["runs"]]}
            for r, f in other.items()}

    # The prompt's attention through padded rows and a mask (DenseAttention,
    # the path before FlashAttention over packed keys): what the varlen
    # prefill buys. (Graphs against none, runs 4-7: 2.6-5.2x; no longer
    # measured.)
    batch1_with("batch1_padded_prefill", ["--cuda_varlen_prefill=false"])
    # The decode step's narrow products through cuBLAS (split-K and its
    # reductions) and SwiGLU as its own kernel, in place of the skinny
    # kernel: what that kernel buys. (The paged kernel against the gathered
    # copy, runs 6 and 7: 1.37-1.60x at batch 1; no longer measured.)
    batch1_with("batch1_cublas", ["--cuda_skinny_linear=false"])
    # This project's kernels launched to overlap the kernel before them
    # (programmatic dependent launch, off by default): what it would buy.
    # (The fused layer kernels against ATen chains, run 7: 1.18x at 8b and
    # 1.34x at 1b; no longer measured.)
    batch1_with("batch1_overlapped", ["--cuda_programmatic_launch=true"])


def goal_section(args, model_dir, results, layout):
    """64 sequences x 4k context at ratios 1.0 and 0.5, each order, with a
    warm-up: results[layout]["batch64_4k"]."""
    entry = results[layout]
    sizes = (QUICK_SIZES if args.quick else SIZES)["batched_4k"]
    batched = measured(args, model_dir, sizes, results, layout + " 64 x 4k",
                       ratios=GOAL_RATIOS)
    entry["batch64_4k_graph_replays"] = batched.pop("graph_replays")
    entry["batch64_4k"] = {
        str(ratio): {"decode_tokens_per_s": f["decode_tokens_per_s"],
                     "decode_tokens_per_s_runs": [
                         r["decode_tokens_per_s"] for r in f["runs"]],
                     "prefill_tokens_per_s": f["prefill_tokens_per_s"]}
        for ratio, f in batched.items()}


def serving_overhead(args, model_dir, results, rounds=3):
    """moh-server over gRPC against moh-generate in process, `rounds`
    interleaved rounds (the server up throughout), medians. The server's
    prefix cache is off: its 16 identical prompts would otherwise share one
    prefill where moh-generate computes each (runs 3-7 measured above 1)."""
    concurrency, new_tokens, waves = 16, 64, 4
    port = free_port()
    config = os.path.join(args.work, "gpu-bench-server.textproto")
    with open(config, "w") as f:
        f.write('port: %d\nmetrics_port: -1\nhttp_port: -1\nhost: "127.0.0.1"\n'
                'models { name: "lm" model_dir: "%s" device: "%s" %s '
                'generation { max_running: %d max_seq_len: 512 '
                'prefix_caching: false%s } }\n'
                % (port, model_dir, args.device, precision(args.device)[1],
                   concurrency, path_config(args.paths_off)))
    server_log = os.path.join(args.out, "gpu-bench-server.log")
    with open(server_log, "w") as logf:
        server = subprocess.Popen(
            [os.path.join(args.build, "service", "moh-server"),
             "--config=" + config], stdout=logf, stderr=subprocess.STDOUT)
    local, served, served_half = [], [], []

    def served_rate(extra):
        """moh-bench's tokens/s through the server (flags `extra` added)."""
        out = run([os.path.join(args.build, "client", "moh-bench"),
                   "--server=127.0.0.1:%d" % port, "--quiet", "--json",
                   "--rpc=generate", "--model=lm", "--temperature=0",
                   "--prompt=Once upon a time",
                   "--max_new_tokens=%d" % new_tokens,
                   "--concurrency=%d" % concurrency,
                   "--requests=%d" % (concurrency * waves),
                   "--warmup_requests=%d" % concurrency] + extra,
                  args.step_timeout).stdout
        return json.loads(out)["throughput"]["tokens_per_s"]

    try:
        client = os.path.join(args.build, "client", "moh-client")
        deadline = time.time() + 180
        while True:
            if server.poll() is not None:
                raise RuntimeError("moh-server exited; see " + server_log)
            if subprocess.run([client, "--server=127.0.0.1:%d" % port, "health"],
                              capture_output=True).returncode == 0:
                break
            if time.time() > deadline:
                raise RuntimeError("moh-server did not become SERVING")
            time.sleep(0.5)
        for _ in range(rounds):
            err = run([os.path.join(args.build, "tools", "moh-generate"),
                       "--model_dir=" + model_dir, "--device=" + args.device,
                       "--temperature=0"] + precision(args.device)[0] + [
                       "--prompt=Once upon a time",
                       "--max_new_tokens=%d" % new_tokens,
                       "--batch=%d" % concurrency, "--repeat=%d" % waves,
                       "--warmup=1"] + path_flags(args.paths_off),
                      args.step_timeout).stderr
            line = next(l[l.find("batch="):] for l in err.splitlines()
                        if "tokens_per_s=" in l and "batch=" in l)
            local.append(float(dict(kv.split("=") for kv in line.split())
                               ["tokens_per_s"]))
            served.append(served_rate([]))
            # The same through the server at ratio 0.5: on the released layout
            # its rows are narrow (the ratio ceiling: half-width KV blocks,
            # decode over their narrow view, graphs of their own).
            served_half.append(served_rate(["--ratios=0.5"]))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    in_process, server_rate = statistics.median(local), statistics.median(served)
    results["serving_overhead"] = {
        "concurrency": concurrency, "new_tokens": new_tokens,
        "in_process_tokens_per_s": in_process, "server_tokens_per_s": server_rate,
        "in_process_runs": local, "server_runs": served,
        "server_over_in_process": server_rate / in_process,
        "server_ratio_0_5_tokens_per_s": statistics.median(served_half),
        "server_ratio_0_5_runs": served_half,
        "server_ratio_0_5_over_1_0": statistics.median(served_half) / server_rate}


def hf_peer(model_dir, device, sizes):
    """Hugging Face transformers' LlamaForCausalLM of the checkpoint's shape,
    random bfloat16 weights on the GPU, batch-1 greedy decode of 64 tokens
    after the 4096-token prompt, eager and SDPA attention, each measured twice
    on one model: dense (every head, as MoH at ratio 1.0 computes them,
    without a router; runs 1-7's stand-in) and with the official MoH-LLaMA3
    query-norm router added (bench/moh_peer.py: the released code's math at
    its default, 16 shared heads and 8 of 16 routed on the 8B layout; the
    device machines lack that code itself)."""
    import transformers

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(model, ids, new):
        with torch.no_grad():
            model.generate(ids[:, :64], max_new_tokens=8, min_new_tokens=8,
                           do_sample=False)  # warm-up
            sync()
            start = time.time()
            model(ids)
            sync()
            prefill_s = time.time() - start
            start = time.time()
            model.generate(ids, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)
            sync()
            total_s = time.time() - start
        return {"prefill_4k_tokens_per_s": ids.shape[1] / prefill_s,
                "decode_tokens_per_s": (new - 1) / max(total_s - prefill_s, 1e-9)}

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    out = {"transformers": transformers.__version__}
    # Half the batch-1 measurement's tokens: each of the four runs 64 at 8b
    # (runs 1-7 ran two of 128; its SDPA decoded 10-18 tokens/s).
    prompt, new = sizes["batch1"][1], max(8, sizes["batch1"][2] // 2)
    shared, routed = official_routing(cfg["num_attention_heads"])
    out["router"] = {"shared_heads": shared, "routed_top_k": routed}
    for attn in ("sdpa", "eager"):
        config = transformers.LlamaConfig(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            max_position_embeddings=cfg["max_position_embeddings"],
            rope_theta=cfg["rope_theta"],
            tie_word_embeddings=cfg["tie_word_embeddings"],
            attn_implementation=attn)
        with torch.device(device):
            model = transformers.LlamaForCausalLM._from_config(
                config, dtype=torch.bfloat16).eval()
        ids = torch.randint(0, min(768, cfg["vocab_size"]), (1, prompt),
                            device=device)
        out[attn] = timed(model, ids, new)
        add_official_router(model, shared, routed)
        out[attn + "_moh"] = timed(model, ids, new)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def table(results):
    lines = ["", "## GPU benchmark: %s, %s (torch %s)" % (
        results.get("device", "?"), results.get("host", ""),
        results.get("torch", "?")), ""]
    bw = results.get("copy_bandwidth_bytes_per_s")
    if bw:
        lines.append("device-to-device copy: %.0f GB/s (read + write)" % (bw / 1e9))
        lines.append("")
    paths = results.get("paths")
    if paths:
        lines.append("THE DEFAULT PATH FAILED (%s): %s" % (
            paths["failed_at"], paths["error"]))
        for off, outcome in paths["tried"].items():
            lines.append("- with %s off: %s" % (off, outcome))
        lines.append("")
    if results.get("paths_off"):
        lines.append("measured with CUDA paths off: %s" % ", ".join(
            results["paths_off"]))
        lines.append("")
    lines.append("| layout | measure | ratio 1.0 | ratio 0.75 | ratio 0.5 | 0.5 / 1.0 |")
    lines.append("|---|---|---|---|---|---|")
    for layout in LAYOUT_DIRS:
        entry = results.get(layout)
        if not entry:
            continue

        def row(label, section, key, fmt="%.1f"):
            values = [entry.get(section, {}).get(str(r), {}).get(key) for r in RATIOS]
            cells = [fmt % v if v is not None else "-" for v in values]
            gain = ("%.2f" % (values[2] / values[0])
                    if values[0] and values[2] else "-")
            lines.append("| %s | %s | %s | %s |" % (layout, label, " | ".join(cells), gain))

        row("prefill 4k, tokens/s", "batch1", "prefill_4k_tokens_per_s", "%.0f")
        row("decode b1 @4k, tokens/s", "batch1", "decode_tokens_per_s")
        row("decode b1, of bound", "batch1", "of_bound", "%.2f")
        ours = entry.get("batch1", {}).get("1.0")

        def side_by_side(section, label, gain):
            """A batch-1 decode at ratio 1.0 measured another way in the same
            run, and what the default way gains over it."""
            other = entry.get(section, {}).get("1.0")
            if not other:
                return
            lines.append("| %s | decode b1 @4k, %s (of bound) | %.1f (%.2f) | | | "
                         "%s at 1.0: %s |" % (
                             layout, label, other["decode_tokens_per_s"],
                             other["of_bound"], gain,
                             "%.2f" % (ours["decode_tokens_per_s"] /
                                       other["decode_tokens_per_s"])
                             if ours else "-"))

        padded = entry.get("batch1_padded_prefill", {}).get("1.0")
        if padded:
            lines.append("| %s | prefill 4k, padded rows + mask, tokens/s | %.0f "
                         "| | | varlen / padded at 1.0: %s |" % (
                             layout, padded["prefill_4k_tokens_per_s"],
                             "%.2f" % (ours["prefill_4k_tokens_per_s"] /
                                       padded["prefill_4k_tokens_per_s"])
                             if ours else "-"))
        side_by_side("batch1_cublas", "narrow products on cuBLAS",
                     "skinny / cuBLAS")
        side_by_side("batch1_overlapped", "overlapped launches (PDL)",
                     "default / overlapped")
        row("decode 64 x 2k, tokens/s", "batch64_2k", "decode_tokens_per_s", "%.0f")
        if "batch64_4k" in entry:
            row("decode 64 x 4k, tokens/s", "batch64_4k", "decode_tokens_per_s",
                "%.0f")
        lines.append("| %s | decode steps replayed as CUDA graphs (b1 / 64 x 2k) "
                     "| %s / %s | | | |" % (
                         layout, entry.get("batch1", {}).get("graph_replays", "-"),
                         entry.get("batch64_2k_graph_replays", "-")))
        for section, label in (("batch1", "decode b1, runs"),
                               ("batch64_2k", "decode 64 x 2k, runs"),
                               ("batch64_4k", "decode 64 x 4k, runs")):
            if section not in entry:
                continue
            cells = ["/".join("%.0f" % v for v in entry.get(section, {})
                              .get(str(r), {}).get("decode_tokens_per_s_runs", []))
                     or "-" for r in RATIOS]
            lines.append("| %s | %s (forward / reverse order) | %s | |" % (
                layout, label, " | ".join(cells)))
        bound = entry.get("batch1", {}).get("bound_tokens_per_s")
        if bound:
            lines.append("| %s | bound b1 @4k, tokens/s | %.1f | | | |" % (layout, bound))
    peer = results.get("transformers_peer")
    if peer:
        layout = peer.get("layout", "?")
        ours = results.get(layout, {}).get("batch1", {}).get("1.0", {})
        default = results.get(layout, {}).get("batch1", {}).get("0.75", {})
        for attn, kind, mine, ratio in (
                ("sdpa", "dense", ours, "1.0"), ("eager", "dense", ours, "1.0"),
                ("sdpa_moh", "official MoH router", default, "0.75"),
                ("eager_moh", "official MoH router", default, "0.75")):
            if attn in peer:
                d = peer[attn]["decode_tokens_per_s"]
                lines.append("| %s | transformers %s %s (%s) decode b1 @4k | %.1f "
                             "| | | moh %s / it: %s |" % (
                                 layout, peer["transformers"], attn.split("_")[0],
                                 kind, d, ratio,
                                 "%.2f" % (mine["decode_tokens_per_s"] / d)
                                 if mine else "-"))
    so = results.get("serving_overhead")
    if so:
        lines += ["", "serving overhead (%s, %d streams, %d tokens, medians): in "
                  "process %.0f tokens/s, moh-server %.0f tokens/s, ratio %.2f "
                  "(target 0.95)"
                  % (so.get("layout", "?"), so["concurrency"], so["new_tokens"],
                     so["in_process_tokens_per_s"], so["server_tokens_per_s"],
                     so["server_over_in_process"]),
                  "moh-server at ratio 0.5 (narrow rows): %.0f tokens/s, %.2f of ratio 1.0"
                  % (so["server_ratio_0_5_tokens_per_s"],
                     so["server_ratio_0_5_over_1_0"])]
    for name, error in results.get("errors", {}).items():
        lines.append("ERROR in %s: %s" % (name, error.splitlines()[0] if error else ""))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build")
    parser.add_argument("--work")
    parser.add_argument("--out")
    parser.add_argument("--layouts", default="1b,8b")
    parser.add_argument("--step_timeout", type=int, default=240)
    parser.add_argument("--device", default="cuda",
                        help="cpu rehearses the script without a GPU")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (a rehearsal; see QUICK_SIZES)")
    parser.add_argument("--hf_peer", metavar="MODEL_DIR",
                        help="(internal) time transformers on MODEL_DIR's shape")
    parser.add_argument("--no_hf_peer", dest="hf_peer_too",
                        action="store_false",
                        help="skip the transformers peer")
    parser.add_argument("--table", metavar="JSON",
                        help="print the table of an earlier run's JSON")
    args = parser.parse_args()
    if args.hf_peer:
        print(json.dumps(hf_peer(args.hf_peer, args.device,
                                 QUICK_SIZES if args.quick else SIZES)))
        return 0
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return 0
    if not (args.build and args.work and args.out):
        parser.error("--build, --work and --out are required")
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    try:
        args.paths_off = paths_off()
    except ValueError as e:
        parser.error("MOH_CUDA_PATHS_OFF: %s" % e)
    results = {"host": platform.node(), "torch": torch.__version__,
               "errors": {}, "paths_off": list(args.paths_off)}
    path = os.path.join(args.out, "gpu_bench.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=2)

    if args.device == "cpu":
        results["device"] = "cpu (a rehearsal: the bound uses 20 GB/s)"
        bandwidth = 20e9
    elif not torch.cuda.is_available():
        results["errors"]["device"] = "no CUDA device visible to torch"
        save()
        print(table(results))
        return 1
    else:
        props = torch.cuda.get_device_properties(0)
        results["device"] = "%s (%d SMs, %.0f GiB)" % (
            props.name, props.multi_processor_count, props.total_memory / 2**30)
        bandwidth = copy_bandwidth()
    results["copy_bandwidth_bytes_per_s"] = bandwidth
    log("copy bandwidth %.0f GB/s" % (bandwidth / 1e9))
    save()
    # Each step is recorded as it ends (a later overrun keeps what came
    # before): every layout's main measurements, the serving overhead after
    # the first one, 64 x 4k on the last one, then the side-by-side runs
    # (the last layout's first) and the transformers peer (measured in every
    # run since the first): what matters most comes first.
    layouts = args.layouts.split(",")
    model_dirs = {}
    for i, layout in enumerate(layouts):
        try:
            model_dirs[layout] = layout_section(args, layout, bandwidth,
                                                results)
        except Exception as e:  # noqa: BLE001 - recorded, the rest still run
            results["errors"][layout] = "%s: %s" % (type(e).__name__, e)
            log("layout %s failed: %s" % (layout, e))
        save()
        model_dir = model_dirs.get(layout)
        if i == 0 and model_dir:
            try:
                serving_overhead(args, model_dir, results)
                results["serving_overhead"]["layout"] = layout
            except Exception as e:  # noqa: BLE001
                results["errors"]["serving_overhead"] = "%s: %s" % (
                    type(e).__name__, e)
            save()
    if model_dir:
        try:
            goal_section(args, model_dir, results, layout)
        except Exception as e:  # noqa: BLE001
            results["errors"]["batch64_4k"] = "%s: %s" % (type(e).__name__, e)
        save()
    for other in reversed(layouts):
        if other in model_dirs:
            side_by_side_section(args, other, model_dirs[other], results)
            save()
    if model_dir and args.hf_peer_too:
        try:
            out = run([sys.executable, os.path.abspath(__file__), "--hf_peer",
                       model_dir, "--device=" + args.device] +
                      (["--quick"] if args.quick else []),
                      args.step_timeout).stdout
            results["transformers_peer"] = json.loads(out.splitlines()[-1])
            results["transformers_peer"]["layout"] = layout
        except Exception as e:  # noqa: BLE001
            results["errors"]["transformers_peer"] = "%s: %s" % (
                type(e).__name__, e)
        save()
    text = table(results)
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
