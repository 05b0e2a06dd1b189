#!/usr/bin/python3
"""The moh-serve benchmark suite: one command, a Markdown table of ratios.

Every figure is a ratio of two measurements taken side by side in the same
run (interleaved where they are separate processes), because the machines
this runs on are shared and noisy:

  1. attention layer time, head-sparse at ratio r / every head computed
     (dense as the official code does, and the pair kernel at ratio 1.0);
  2. whole-model prefill and decode tokens/s at each ratio (head-sparse), and
     relative to computing every head;
  3. serving overhead: moh-server throughput (moh-bench, closed loop at
     concurrency N) / the same model driven in process (moh-generate --batch N);
  4. batching gain: throughput at concurrency 32 / concurrency 1, for Generate
     and Classify, and their throughput and latency at concurrency 1 to 32;
  5. peer: llama.cpp (llama-cpp-python, built from source into the bench
     virtual environment by `scripts/install_deps.sh --bench`) on the same
     24 M parameter shape (bench/make_bench_lm.py, written as an F32 GGUF by
     bench/make_gguf.py), each engine in its own process with the same
     threads: decode at batch 1, 16, 32 and 512-token prefill at batch 1 and
     16, moh-serve at ratio 1.0 and 0.5 / llama.cpp, at both engines' default
     KV cache, at f32, and at 16 bits (llama.cpp f16, moh-serve bfloat16);
     batch-1 decode as weight bytes read per second /
     the machine's read bandwidth (moh_read_bandwidth). Skipped, with the
     command that installs it, when the bench environment is missing;
  6. prefix cache: throughput and time to first token of requests whose
     prompts repeat, with generation.prefix_caching on / off;
  7. serving at each ratio: time to first token, time per output token and
     throughput of Generate through moh-server, at ratio 0.5 to 1.0.

Beside the Markdown (--out) it writes the numbers as results.json and, with
bench/plot.py, PNG plots in plots/ that the Markdown shows; without
matplotlib (the bench virtual environment's) it says the plots were skipped.

Usage (after building: scripts/build.sh moh-server moh-bench moh-generate
moh_attention_bench moh_read_bandwidth):
  /usr/bin/python3 bench/suite.py [--build build] [--out bench/RESULTS.md]
      [--lm_dir DIR] [--vit_dir DIR] [--quick] [--sections=1,2,...]
"""
import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import plot
from plot import Figure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIOS = [500, 625, 750, 875, 1000]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, **kwargs):
    return subprocess.run(cmd, check=True, capture_output=True, text=True,
                          **kwargs)


def attention_tables(build, min_time, rounds):
    """Medians over `rounds` whole runs of moh_attention_bench (so every
    configuration is measured in each round, interleaved in time), keyed by
    (benchmark, ratio, sparse): (real time ms, tokens/s)."""
    runs = {}
    for _ in range(rounds):
        out = run([os.path.join(build, "bench", "moh_attention_bench"),
                   "--benchmark_format=json",
                   "--benchmark_min_time=%g" % min_time]).stdout
        for b in json.loads(out)["benchmarks"]:
            # e.g. BM_AttentionPrefill/ratio:500/sparse:1
            name, ratio, sparse = b["run_name"].split("/")
            key = (name, int(ratio.split(":")[1]), int(sparse.split(":")[1]))
            runs.setdefault(key, []).append((b["real_time"], b.get("tokens/s")))
    return {key: (statistics.median(t for t, _ in values),
                  statistics.median(r for _, r in values))
            for key, values in runs.items()}


class Server:
    """A moh-server on free loopback ports, stopped on exit."""

    def __init__(self, build, models, workdir, max_running):
        self.port = free_port()
        config = os.path.join(workdir, "bench-%d.textproto" % self.port)
        with open(config, "w") as f:
            f.write("port: %d\nmetrics_port: -1\nhost: \"127.0.0.1\"\n" %
                    self.port)
            for name, path, *extra in models:
                f.write('models { name: "%s" model_dir: "%s" generation { '
                        "max_running: %d %s } batching { max_batch_size: 32 "
                        "max_queue_delay_ms: 2 } }\n" %
                        (name, path, max_running, " ".join(extra)))
        self.log = open(os.path.join(workdir, "server-%d.log" % self.port), "w")
        self.proc = subprocess.Popen(
            [os.path.join(build, "service", "moh-server"), "--config=" + config],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.client = os.path.join(build, "client", "moh-client")
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("moh-server exited; see " + self.log.name)
            if subprocess.run([self.client, "--server=127.0.0.1:%d" % self.port,
                               "health"], capture_output=True).returncode == 0:
                self.threads = self._intra_op_threads()
                return
            time.sleep(0.3)
        raise RuntimeError("moh-server did not become SERVING")

    def _intra_op_threads(self):
        """From the start-up line "CPU: N intra-op threads, ..." (None if
        absent)."""
        self.log.flush()
        with open(self.log.name) as f:
            for line in f:
                start = line.find("CPU: ")
                if start >= 0 and "intra-op thread" in line:
                    return int(line[start + 5:].split()[0])
        return None

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def bench(build, server, *flags):
    out = run([os.path.join(build, "client", "moh-bench"),
               "--server=127.0.0.1:%d" % server.port, "--quiet", "--json"] +
              list(flags)).stdout
    return json.loads(out)


def in_process_tokens_per_s(build, lm_dir, batch, repeat, prompt, tokens):
    err = run([os.path.join(build, "tools", "moh-generate"),
               "--model_dir=" + lm_dir, "--prompt=" + prompt,
               "--max_new_tokens=%d" % tokens, "--batch=%d" % batch,
               "--repeat=%d" % repeat]).stderr
    for line in err.splitlines():
        start = line.find("batch=")
        if start >= 0 and "tokens_per_s=" in line:
            fields = dict(kv.split("=") for kv in line[start:].split())
            return float(fields["tokens_per_s"])
    raise RuntimeError("moh-generate printed no throughput:\n" + err)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench",
                                                      "RESULTS.md"))
    parser.add_argument("--lm_dir")
    parser.add_argument("--vit_dir")
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions (a smoke run, noisier)")
    parser.add_argument("--wheel_build", default=os.path.join(ROOT,
                                                             "build-cuda"),
                        help="a build against the PyPI torch wheel's LibTorch "
                        "(scripts/build.sh --torch=wheel); when it has "
                        "moh-generate, section 5 also measures it")
    parser.add_argument("--sections", default="1,2,3,4,5,6,7",
                        help="comma-separated sections to run (1-2 share one "
                        "benchmark run)")
    args = parser.parse_args()
    build = os.path.abspath(args.build)

    def pick(given, shipped, fixture):
        for path in (given, os.path.join(ROOT, "models", shipped),
                     os.path.join(build, "fixtures", fixture)):
            if path and os.path.exists(os.path.join(path, "config.json")):
                return os.path.abspath(path)
        sys.exit("no model for %s: pass --lm_dir/--vit_dir" % shipped)

    lm_dir = pick(args.lm_dir, "demo-lm", "llama_learned")
    vit_dir = pick(args.vit_dir, "demo-vit", "vit_learned")
    quick = args.quick
    lines = []
    say = lines.append
    command = "bash bench/run_suite.sh%s" % (" --quick" if quick else "")
    machine = "%s, %d CPU cores, %s UTC" % (
        os.uname().machine, os.cpu_count(),
        datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"))
    say("# moh-serve benchmark results\n")
    say("Command: `%s` — %s. Each figure is a ratio of two measurements "
        "taken side by side in this run.\n" % (command, machine))
    # The numbers the plots draw, filled in by the sections as they run.
    results = {"schema_version": 1, "title": "%s: %s" % (command, machine)}

    sections = set(args.sections.split(","))
    if sections & {"1", "2"}:
        model_sections(say, results, build, quick)
    if sections & {"3", "4"}:
        server_sections(say, results, build, quick, lm_dir, vit_dir, sections)
    if "5" in sections:
        peer_section(say, results, build, quick, lm_dir,
                     os.path.abspath(args.wheel_build))
    if "6" in sections:
        prefix_cache_section(say, results, build, quick, lm_dir)
    if "7" in sections:
        serving_ratio_section(say, results, build, quick, lm_dir)

    out_dir = os.path.dirname(os.path.abspath(args.out))
    results_path = os.path.join(out_dir, "results.json")
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print("plots (bench/plot.py) ...", file=sys.stderr)
    drawn, skipped = plot.draw_plots(
        results_path, os.path.join(out_dir, "plots"),
        [bench_venv_python()[0], sys.executable])
    if skipped:
        lines.insert(2, "Plots skipped: %s. `bash scripts/install_deps.sh "
                     "--bench` installs matplotlib; "
                     "`$MOH_BENCH_VENV/bin/python bench/plot.py` then draws "
                     "them from results.json.\n" % skipped)
    elif drawn:
        lines.insert(2, "Plots: `plots/`, drawn by `bench/plot.py` from the "
                     "same numbers (`results.json`).\n")
    text = plot.markdown(lines, drawn, "plots")
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


def model_sections(say, results, build, quick):
    print("1-2. attention layer and model (moh_attention_bench) ...",
          file=sys.stderr)
    rounds = 1 if quick else 5
    m = attention_tables(build, 0.05 if quick else 0.3, rounds)

    def series(name, sparse, field):
        return [m[(name, r, sparse)][field] for r in RATIOS]
    results["attention"] = {
        # moh_attention_bench's LibTorch threads: MOH_BENCH_THREADS or every
        # core.
        "threads": int(os.environ.get("MOH_BENCH_THREADS") or
                       os.cpu_count()),
        "layer": "One MoH attention layer (hidden 1024, 16 heads)",
        "model": "4-layer MoH-LLaMA (hidden 512, 8 heads)",
        "ratios": [r / 1000 for r in RATIOS],
        "layer_ms": {phase: {"dense": series(name, 0, 0),
                             "head-sparse": series(name, 1, 0)}
                     for phase, name in (("prefill", "BM_AttentionPrefill"),
                                         ("decode", "BM_AttentionDecode"))},
        "model_tokens_per_s": {
            phase: {"every head": series(name, 0, 1),
                    "head-sparse": series(name, 1, 1)}
            for phase, name in (("prefill", "BM_ModelPrefill"),
                                ("decode", "BM_ModelDecode"))},
    }
    say("## 1. Attention layer: head-sparse time / every head computed\n")
    say("One attention-heavy layer (hidden 1024, 16 heads, 4 KV heads, 4 "
        "shared), 2048-token prompt; decode: 16 sequences over 512 cached "
        "tokens. Two baselines compute every head: *dense* as the official "
        "MoH code does (every head, the whole masked score square), and the "
        "*pair kernel at ratio 1.0* (moh-serve's CPU kernel with every head "
        "selected; it skips causal key blocks, as the head-sparse runs do). "
        "Medians of %d rounds, each running every configuration. Target: "
        "ratio r costs at most (r + 0.1) of the faster of the two.\n" %
        rounds)
    say("| ratio | prefill dense ms | prefill head-sparse ms | / dense | "
        "/ pair kernel at 1.0 | target | decode dense ms | decode "
        "head-sparse ms | / dense | / pair kernel at 1.0 |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    pk, _ = m[("BM_AttentionPrefill", 1000, 1)]
    dk, _ = m[("BM_AttentionDecode", 1000, 1)]
    for r in RATIOS:
        pd, _ = m[("BM_AttentionPrefill", r, 0)]
        ps, _ = m[("BM_AttentionPrefill", r, 1)]
        dd, _ = m[("BM_AttentionDecode", r, 0)]
        ds, _ = m[("BM_AttentionDecode", r, 1)]
        target = ""
        if r in (500, 750):
            limit = r / 1000 + 0.1
            target = "≤ %.2f %s" % (limit, "met" if ps / min(pd, pk) <= limit
                                    else "MISSED")
        say("| %.3f | %.1f | %.1f | %.2f | %.2f | %s | %.2f | %.2f | %.2f | "
            "%.2f |" % (r / 1000, pd, ps, ps / pd, ps / pk, target, dd, ds,
                        ds / dd, ds / dk))
    say("")
    say(Figure("ratio_attention_layer.png",
               "Attention layer time against ratio, prefill and decode"))
    say("\n## 2. Whole model: tokens/s at each ratio\n")
    say("A 4-layer MoH-LLaMA (hidden 512, 8 heads, 2 shared, SwiGLU 1376, "
        "vocabulary 4096), 512-token prompt; head-sparse execution, and its "
        "speed-up over computing every head the official (dense) way.\n")
    say("| ratio | prefill tokens/s | vs every head | decode tokens/s | "
        "vs every head |")
    say("|---|---|---|---|---|")
    for r in RATIOS:
        pd, _ = m[("BM_ModelPrefill", r, 0)]
        ps, pt = m[("BM_ModelPrefill", r, 1)]
        dd, _ = m[("BM_ModelDecode", r, 0)]
        ds, dt = m[("BM_ModelDecode", r, 1)]
        say("| %.3f | %.0f | %.2f× | %.0f | %.2f× |" %
            (r / 1000, pt, pd / ps, dt, dd / ds))
    say("")
    say(Figure("ratio_model.png",
               "Whole-model prefill and decode tokens/s against ratio"))


PROMPT = "Once upon a time"


def server_sections(say, results, build, quick, lm_dir, vit_dir, sections):
    with tempfile.TemporaryDirectory() as workdir:
        models = [("lm", lm_dir), ("vit", vit_dir)]
        if "3" in sections:
            bench_lm = os.path.join(workdir, "bench-lm")
            run([sys.executable, os.path.join(ROOT, "bench",
                                              "make_bench_lm.py"),
                 "--out=" + bench_lm, "--demo_dir=" + lm_dir])
            models.append(("bench-lm", bench_lm))
        server = Server(build, models, workdir, max_running=32)
        try:
            if "3" in sections:
                serving_overhead(say, build, server, quick,
                                 [(os.path.relpath(lm_dir, ROOT), "lm",
                                   lm_dir),
                                  ("bench-lm (bench/make_bench_lm.py)",
                                   "bench-lm", bench_lm)])
            if "4" in sections:
                batching_section(say, results, build, server, quick,
                                 lm_dir, vit_dir)
        finally:
            server.stop()


def serving_overhead(say, build, server, quick, models):
    print("3. serving overhead ...", file=sys.stderr)
    concurrency, tokens = 8, 32
    rounds = 1 if quick else 3
    say("\n## 3. Serving overhead\n")
    say("Greedy, prompt \"%s\", %d new tokens, %d sequences at a time: "
        "moh-server driven by moh-bench (closed loop, on the same machine) "
        "against moh-generate --batch %d in process, same intra-op threads; "
        "medians of %d interleaved rounds. `demo-lm` (0.9 M parameters) "
        "spends about as long on a decode step's bookkeeping as on its "
        "compute, so per-token RPC work shows fully; `bench-lm` is a 24 M "
        "parameter random-weight MoH-LLaMA with the demo tokenizer. Target: "
        "server ≥ 0.95 × in process.\n" %
        (PROMPT, tokens, concurrency, concurrency, rounds))
    say("| model | in process tokens/s | server tokens/s | server / in "
        "process | target |")
    say("|---|---|---|---|---|")
    for label, name, model_dir in models:
        served, local = [], []
        for _ in range(rounds):
            local.append(in_process_tokens_per_s(
                build, model_dir, concurrency, 2 if quick else 4, PROMPT,
                tokens))
            result = bench(build, server, "--rpc=generate", "--model=" + name,
                           "--prompt=" + PROMPT, "--max_new_tokens=%d" % tokens,
                           "--concurrency=%d" % concurrency,
                           "--requests=%d" % (concurrency *
                                              (2 if quick else 4)),
                           "--warmup_requests=%d" % concurrency)
            served.append(result["throughput"]["tokens_per_s"])
        s, l = statistics.median(served), statistics.median(local)
        say("| %s | %.1f | %.1f | %.2f | ≥ 0.95 %s |" %
            (label, l, s, s / l, "met" if s / l >= 0.95 else "MISSED"))


CONCURRENCY = [1, 2, 4, 8, 16, 32]


def median_field(reports, *path):
    """The median over moh-bench JSON reports of one field, e.g.
    median_field(reports, "latency_ms", "e2e", "p50")."""
    values = []
    for report in reports:
        for key in path:
            report = report[key]
        values.append(report)
    return statistics.median(values)


def batching_section(say, results, build, server, quick, lm_dir, vit_dir):
    print("4. batching ...", file=sys.stderr)
    with open(os.path.join(vit_dir, "config.json")) as f:
        vit = json.load(f)
    shape = "%d,%d,%d" % (vit.get("num_channels", 3), vit["image_size"],
                          vit["image_size"])
    cases = [
        ("Generate", lm_dir, ["--rpc=generate", "--model=lm",
                              "--prompt=" + PROMPT, "--max_new_tokens=16"]),
        ("Classify", vit_dir, ["--rpc=classify", "--model=vit",
                               "--pixels_shape=" + shape]),
    ]
    rounds = 1 if quick else 3
    reports = {}  # (RPC, concurrency) -> [moh-bench report per round]
    for _ in range(rounds):
        for name, _, flags in cases:
            for c in CONCURRENCY:
                n = max(c * (2 if quick else 8), 16 if quick else 64)
                reports.setdefault((name, c), []).append(bench(
                    build, server, *flags, "--concurrency=%d" % c,
                    "--requests=%d" % n, "--warmup_requests=%d" % min(c, 8)))
    curves = {"threads": server.threads, "concurrency": CONCURRENCY}
    for name, model_dir, _ in cases:
        fields = {"requests_per_s": ("throughput", "requests_per_s"),
                  "e2e_p50_ms": ("latency_ms", "e2e", "p50"),
                  "e2e_p99_ms": ("latency_ms", "e2e", "p99")}
        if name == "Generate":
            fields.update(tokens_per_s=("throughput", "tokens_per_s"),
                          ttft_p50_ms=("latency_ms", "ttft", "p50"))
        curves[name] = {key: [median_field(reports[(name, c)], *path)
                              for c in CONCURRENCY]
                        for key, path in fields.items()}
        curves[name]["model"] = os.path.basename(model_dir)
    results["concurrency"] = curves

    say("\n## 4. Batching gain: throughput at concurrency 32 / 1\n")
    say("| RPC | requests/s at 1 | requests/s at 32 | gain | target |")
    say("|---|---|---|---|---|")
    for name, _, _ in cases:
        rate = curves[name]["requests_per_s"]
        gain = rate[-1] / rate[0]
        say("| %s | %.1f | %.1f | %.1f× | ≥ 5× %s |" %
            (name, rate[0], rate[-1], gain, "met" if gain >= 5 else "MISSED"))
    say("\n**Against concurrency.** Closed loop (moh-bench --concurrency N, "
        "min(N, 8) warm-up requests, then max(%d N, %d) measured): Generate "
        "on %s (prompt \"%s\", 16 new tokens, greedy), Classify on %s "
        "(random pixels); medians of %d interleaved round(s), which also "
        "give the gains above. Latency: each request's, send to last "
        "response; server intra-op threads: %s.\n" %
        (2 if quick else 8, 16 if quick else 64, curves["Generate"]["model"],
         PROMPT, curves["Classify"]["model"], rounds, server.threads))
    say("| concurrency | Generate requests/s | tokens/s | TTFT p50 ms | "
        "latency p50 ms | p99 ms | Classify requests/s | latency p50 ms | "
        "p99 ms |")
    say("|---|---|---|---|---|---|---|---|---|")
    g, k = curves["Generate"], curves["Classify"]
    for i, c in enumerate(CONCURRENCY):
        say("| %d | %.1f | %.0f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |" %
            (c, g["requests_per_s"][i], g["tokens_per_s"][i],
             g["ttft_p50_ms"][i], g["e2e_p50_ms"][i], g["e2e_p99_ms"][i],
             k["requests_per_s"][i], k["e2e_p50_ms"][i], k["e2e_p99_ms"][i]))
    say("")
    say(Figure("concurrency.png", "Generate and Classify requests/s and "
               "latency against concurrency"))


# Section 5: llama.cpp on the same shape, side by side (bench/llama_peer.py).
PEER_ROWS = [("decode", 1, 1), ("decode", 1, 2), ("decode", 16, 2),
             ("decode", 32, 2), ("prefill", 1, 2), ("prefill", 16, 2)]
PEER_DECODE_PROMPT = 16
PEER_PREFILL_PROMPT = 512


def bench_venv_python():
    """The bench virtual environment's python (scripts/bench_venv.env,
    $MOH_BENCH_VENV overrides) and the pinned llama-cpp-python version."""
    out = run(["bash", "-c", '. "$1"; echo "$MOH_BENCH_VENV"; '
               'echo "$MOH_LLAMA_CPP_PYTHON_VERSION"', "_",
               os.path.join(ROOT, "scripts", "bench_venv.env")]).stdout.split()
    return os.path.join(out[0], "bin", "python"), out[1]


def moh_kv_flag(build):
    """moh-generate's --kv_cache_dtype default, or None in a build without
    the flag (its KV cache is then the model's dtype, float32 here)."""
    p = subprocess.run([os.path.join(build, "tools", "moh-generate"),
                        "--helpfull"], capture_output=True, text=True)
    text = p.stdout + p.stderr
    start = text.find("-kv_cache_dtype")
    if start < 0:
        return None
    end = text.find("default:", start)
    value = text[end:].split('"')
    return value[1] if end >= 0 and len(value) > 1 else "?"


def moh_generate_fields(build, model_dir, *flags):
    cmd = [os.path.join(build, "tools", "moh-generate"),
           "--model_dir=" + model_dir] + list(flags)
    err = run(cmd).stderr
    for line in err.splitlines():
        start = line.find("batch=")
        if start >= 0 and "decode_tokens_per_s=" in line:
            return dict(kv.split("=") for kv in line[start:].split())
    raise RuntimeError("moh-generate printed no throughput:\n" + err)


def peer_section(say, results, build, quick, lm_dir, wheel_build):
    print("5. peer: llama.cpp ...", file=sys.stderr)
    say("\n## 5. Peer: llama.cpp on the same shape\n")
    py, version = bench_venv_python()
    if not os.access(py, os.X_OK) or subprocess.run(
            [py, "-c", "import llama_cpp, gguf"],
            capture_output=True).returncode != 0:
        say("Skipped: no llama.cpp in the bench environment (%s). Install it "
            "with `bash scripts/install_deps.sh --bench` (llama-cpp-python "
            "%s, which builds llama.cpp from its sources: several minutes), "
            "then `bash bench/run_suite.sh --sections=5`.\n" %
            (os.path.dirname(os.path.dirname(py)), version))
        return
    rounds = 1 if quick else 3
    repeat = 1 if quick else 3
    steps = 16 if quick else 64
    with tempfile.TemporaryDirectory() as workdir:
        models = {}
        for name, extra in (("bench-lm", []), ("bench-dense", ["--dense"])):
            d = os.path.join(workdir, name)
            run([sys.executable, os.path.join(ROOT, "bench", "make_bench_lm.py"),
                 "--out=" + d, "--demo_dir=" + lm_dir,
                 "--max_position_embeddings=1024"] + extra)
            run([py, os.path.join(ROOT, "bench", "make_gguf.py"),
                 "--model_dir=" + d, "--out=" + d + ".gguf"])
            models[name] = d
        check = peer_check(build, py, models["bench-dense"])
        if not os.access(os.path.join(wheel_build, "tools", "moh-generate"),
                         os.X_OK):
            wheel_build = None
        peer_tables(say, results, build, py, models["bench-lm"], quick,
                    rounds, repeat, steps, check, version, wheel_build)


def peer_check(build, py, dense_dir):
    """Greedy ids of the dense variant: moh-serve's against llama.cpp's."""
    n = 16
    err = run([os.path.join(build, "tools", "moh-generate"),
               "--model_dir=" + dense_dir, "--prompt_tokens=12",
               "--max_new_tokens=%d" % n, "--print_token_ids"]).stderr
    ids = dict(line.split("=", 1) for line in err.splitlines()
               if line.startswith(("prompt_ids=", "token_ids=")))
    out = json.loads(run([py, os.path.join(ROOT, "bench", "llama_peer.py"),
                          "--model=" + dense_dir + ".gguf", "--mode=greedy",
                          "--ids=" + ids["prompt_ids"], "--tokens=%d" % n,
                          "--kv=f32", "--threads=1"]).stdout)
    moh = [int(x) for x in ids["token_ids"].split(",")]
    same = 0
    while same < n and moh[same] == out["token_ids"][same]:
        same += 1
    return same, n


def peer_tables(say, results, build, py, model_dir, quick, rounds, repeat,
                steps, check, version, wheel_build):
    gguf_path = model_dir + ".gguf"
    moh_default_kv = moh_kv_flag(build)
    # (label, llama.cpp --kv, moh-generate --kv_cache_dtype or None)
    kv_settings = [("default", "f16", None), ("f32", "f32", "float32"),
                   ("16-bit", "f16", "bfloat16")]
    if moh_default_kv is None:
        kv_settings = [("default", "f16", None), ("f32", "f32", None)]
    peer = os.path.join(ROOT, "bench", "llama_peer.py")
    bw_exe = os.path.join(build, "bench", "moh_read_bandwidth")
    # The read bandwidth from memory (1 GiB, far past the caches) and over
    # an array of the weights' size (which a large last-level cache may hold).
    weight_bytes = peer_weight_bytes(os.path.join(model_dir,
                                                  "model.safetensors"))
    bw_sizes = {"memory": 1024,
                "weights": max(1, round(weight_bytes / (1 << 20)))}
    bw_flags = ["--threads=1,2"] + (["--passes=3"] if quick else [])

    def llama(phase, batch, threads, kv):
        prompt = PEER_DECODE_PROMPT if phase == "decode" else \
            PEER_PREFILL_PROMPT
        out = run([py, peer, "--model=" + gguf_path, "--mode=" + phase,
                   "--batch=%d" % batch, "--prompt_tokens=%d" % prompt,
                   "--tokens=%d" % steps, "--threads=%d" % threads,
                   "--kv=" + kv, "--repeat=%d" % repeat]).stdout
        return json.loads(out.strip().splitlines()[-1])

    def moh(phase, batch, threads, ratio, kv, build=build):
        decode = phase == "decode"
        flags = ["--ratio=%g" % ratio, "--threads=%d" % threads,
                 "--batch=%d" % batch, "--repeat=%d" % repeat, "--warmup=1",
                 "--prompt_tokens=%d" % (PEER_DECODE_PROMPT if decode
                                         else PEER_PREFILL_PROMPT),
                 "--max_new_tokens=%d" % (steps + 1 if decode else 1)]
        if kv:
            flags.append("--kv_cache_dtype=" + kv)
        f = moh_generate_fields(build, model_dir, *flags)
        return float(f["decode_tokens_per_s" if decode
                       else "prefill_tokens_per_s"])

    # Interleaved: every round runs every configuration on every engine.
    rates, bandwidth, flash = {}, {}, set()
    for r in range(rounds):
        print("  round %d/%d" % (r + 1, rounds), file=sys.stderr)
        for size, mib in bw_sizes.items():
            bw = json.loads(run([bw_exe, "--mib=%d" % mib] +
                                bw_flags).stdout)["gb_per_s"]
            for t, v in bw.items():
                bandwidth.setdefault((size, int(t)), []).append(v)
        for label, llama_kv, moh_kv in kv_settings:
            for phase, batch, threads in PEER_ROWS:
                key = (label, phase, batch, threads)
                out = llama(phase, batch, threads, llama_kv)
                flash.add(out["flash_attn"])
                rates.setdefault(key + ("llama",), []).append(
                    out["tokens_per_s"])
                for ratio in (1.0, 0.5):
                    mkey = (moh_kv or "model dtype", phase, batch, threads,
                            ratio)
                    if label == "f32" and moh_kv is None and r < len(
                            rates.get(mkey, [])):
                        continue  # the same moh configuration as "default"
                    rates.setdefault(mkey, []).append(
                        moh(phase, batch, threads, ratio, moh_kv))
                if label == "default" and wheel_build:
                    rates.setdefault(("wheel", phase, batch, threads),
                                     []).append(
                        moh(phase, batch, threads, 1.0, None, wheel_build))
    med = {k: statistics.median(v) for k, v in rates.items()}
    bw_med = {t: statistics.median(v) for t, v in bandwidth.items()}
    results["peer"] = {
        "model": "bench-lm (24 M parameters)",
        "rows": ["%s\nbatch %d, %d thread%s" % (
            phase if phase == "decode" else "prefill %d" % PEER_PREFILL_PROMPT,
            batch, threads, "" if threads == 1 else "s")
            for phase, batch, threads in PEER_ROWS],
        "kv": [{"label": "%s (llama.cpp %s, moh-serve %s)" % (
                    label, llama_kv, moh_kv or moh_default_kv or "float32"),
                "tokens_per_s": {
                    "llama.cpp": [med[(label,) + row + ("llama",)]
                                  for row in PEER_ROWS],
                    "moh 1.0": [med[(moh_kv or "model dtype",) + row + (1.0,)]
                                for row in PEER_ROWS],
                    "moh 0.5": [med[(moh_kv or "model dtype",) + row + (0.5,)]
                                for row in PEER_ROWS]}}
               for label, llama_kv, moh_kv in kv_settings],
    }

    moh_kv_text = ("float32, its model's dtype (this moh-generate has no "
                   "--kv_cache_dtype)" if moh_default_kv is None else
                   "--kv_cache_dtype unset (default \"%s\")" % moh_default_kv)
    say("llama.cpp (the sources llama-cpp-python %s vendors, built for this CPU "
        "with llama.cpp's default native flags; CPU backend, no BLAS) reads "
        "the bench model as an F32 GGUF (bench/make_gguf.py; the MoH router "
        "left out, so llama.cpp computes every head) and runs through its C "
        "API (bench/llama_peer.py: llama_decode with one KV sequence per "
        "row); moh-serve runs in process (moh-generate). Same thread count "
        "for both (llama.cpp n_threads = n_threads_batch). Decode: batch B "
        "sequences after a %d-token prompt, %d steps of one token per "
        "sequence, greedy; prefill: B prompts of %d tokens in one call "
        "(llama.cpp splits it into its default 512-token micro-batches). Each "
        "process runs one untimed warm-up and %d timed run(s) (their median); "
        "%d interleaved round(s): tokens/s are medians over the rounds, "
        "ratios the median of each round's ratio, with their range when "
        "there are several rounds. llama.cpp flash attention: %s (its default, "
        "\"auto\"). Default KV cache: llama.cpp f16; moh-serve %s.\n" %
        (version, PEER_DECODE_PROMPT, steps, PEER_PREFILL_PROMPT,
         repeat, rounds, ", ".join(sorted(flash)), moh_kv_text))
    same, n = check
    say("GGUF check: on the same shape without a router "
        "(`make_bench_lm.py --dense`), llama.cpp's greedy continuation of a "
        "12-token prompt equals moh-serve's in %d of the first %d tokens. "
        "(The bench model's learned router weights heads even at ratio 1.0, "
        "so there its outputs differ from llama.cpp's; its costs do not.)\n"
        % (same, n))
    for label, llama_kv, moh_kv in kv_settings:
        say("\n**KV cache: %s** (llama.cpp %s, moh-serve %s)\n" %
            (label, llama_kv, moh_kv or moh_default_kv or "float32"))
        say("| phase | batch | threads | llama.cpp tok/s | moh 1.0 tok/s | "
            "moh 1.0 / llama.cpp | moh 0.5 / llama.cpp |")
        say("|---|---|---|---|---|---|---|")
        for phase, batch, threads in PEER_ROWS:
            lkey = (label, phase, batch, threads, "llama")
            mkey = (moh_kv or "model dtype", phase, batch, threads)

            def ratio(r):
                per_round = [m / l for m, l in zip(rates[mkey + (r,)],
                                                   rates[lkey])]
                text = "%.2f" % statistics.median(per_round)
                if len(per_round) > 1:
                    text += " (%.2f–%.2f)" % (min(per_round), max(per_round))
                return text
            say("| %s%s | %d | %d | %.0f | %.0f | %s | %s |" %
                (phase, " %d" % PEER_PREFILL_PROMPT if phase == "prefill"
                 else "", batch, threads, med[lkey], med[mkey + (1.0,)],
                 ratio(1.0), ratio(0.5)))

    # Every matrix is read once a token at batch 1 (the embedding table but
    # one row is not); the router's few KiB are left out.
    say("")
    say(Figure("peer_llama_cpp.png", "Tokens/s of llama.cpp, moh-serve at "
               "ratio 1.0 and at 0.5, per row and KV cache"))
    say("\n**Batch-1 decode against the read bandwidth** "
        "(`moh_read_bandwidth`: a float sum, best of %s passes, over 1 GiB "
        "(*memory*) and over an array of the weights' size (*weights*, "
        "%d MiB: a last-level cache that large holds it)). Weights read per "
        "token: %.1f MB (every matrix in float32; the embedding table, of "
        "which one row is read, left out). Share = tokens/s × weight bytes / "
        "read bandwidth at the same threads; at ratio 0.5 moh-serve skips "
        "unselected heads' projection rows, so its share counts bytes it did "
        "not need to read. Default KV cache. Target: ≥ 0.70 of memory.\n" %
        ("3" if quick else "5", bw_sizes["weights"], weight_bytes / 1e6))
    say("| threads | memory GB/s | weights-size GB/s | llama.cpp | moh 1.0 | "
        "moh 0.5 |")
    say("|---|---|---|---|---|---|")
    default_moh = kv_settings[0][2] or "model dtype"
    for threads in (1, 2):
        mem, cache = bw_med[("memory", threads)], bw_med[("weights", threads)]

        def share(tok_s):
            gb_s = tok_s * weight_bytes / 1e9
            return "%.1f GB/s: %.2f of memory %s, %.2f of weights-size" % (
                gb_s, gb_s / mem, "met" if gb_s / mem >= 0.7 else "MISSED",
                gb_s / cache)
        say("| %d | %.1f | %.1f | %s | %s | %s |" % (
            threads, mem, cache,
            share(med[("default", "decode", 1, threads, "llama")]),
            share(med[(default_moh, "decode", 1, threads, 1.0)]),
            share(med[(default_moh, "decode", 1, threads, 0.5)])))
    if wheel_build:
        say("\n**LibTorch builds** (default KV caches, ratio 1.0): moh-serve "
            "built against the PyPI torch wheel's LibTorch %s (its own BLAS "
            "and oneDNN; `scripts/build.sh --torch=wheel`, %s) beside the "
            "Debian LibTorch 1.13 build with OpenBLAS above, in the same "
            "rounds.\n" % (wheel_torch_version(), os.path.relpath(
                wheel_build, ROOT)))
        say("| phase | batch | threads | Debian tok/s | wheel tok/s | "
            "wheel / Debian | wheel / llama.cpp |")
        say("|---|---|---|---|---|---|---|")
        for phase, batch, threads in PEER_ROWS:
            deb = med[(default_moh, phase, batch, threads, 1.0)]
            whl = med[("wheel", phase, batch, threads)]
            lla = med[("default", phase, batch, threads, "llama")]
            name = phase if phase == "decode" else "prefill %d" % \
                PEER_PREFILL_PROMPT
            say("| %s | %d | %d | %.0f | %.0f | %.2f | %.2f |" %
                (name, batch, threads, deb, whl, whl / deb, whl / lla))
    say("\nCommands (one configuration; the suite passes each row's "
        "values): `$MOH_BENCH_VENV/bin/python bench/llama_peer.py "
        "--model=bench-lm.gguf --mode=decode --batch=16 --prompt_tokens=%d "
        "--tokens=%d --threads=2 --kv=f16 --repeat=%d` and "
        "`build/tools/moh-generate --model_dir=bench-lm --ratio=1 "
        "--threads=2 --batch=16 --repeat=%d --warmup=1 --prompt_tokens=%d "
        "--max_new_tokens=%d` (its `decode_tokens_per_s`); prefill rows: "
        "`--mode=prefill --prompt_tokens=512` and `--prompt_tokens=512 "
        "--max_new_tokens=1` (`prefill_tokens_per_s`); the models from "
        "`bench/make_bench_lm.py --max_position_embeddings=1024` and "
        "`bench/make_gguf.py`.\n" %
        (PEER_DECODE_PROMPT, steps, repeat, repeat, PEER_DECODE_PROMPT,
         steps + 1))


def wheel_torch_version():
    with open(os.path.join(ROOT, "scripts", "torch_wheel.env")) as f:
        for line in f:
            if line.startswith("MOH_TORCH_WHEEL_VERSION="):
                return line.split("=", 1)[1].strip()
    return "2.x"


def peer_weight_bytes(path):
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    total = 0
    for name, info in header.items():
        if name in ("__metadata__", "model.embed_tokens.weight") or \
                ".wg" in name:
            continue
        begin, end = info["data_offsets"]
        total += end - begin
    return total


def prefix_cache_section(say, results, build, quick, lm_dir):
    print("6. prefix cache ...", file=sys.stderr)
    prompt, new, concurrency = 384, 4, 4
    rounds = 1 if quick else 3
    requests = 16 if quick else 48
    say("\n## 6. Prefix cache: requests sharing their prompts\n")
    say("The 24 M model (bench/make_bench_lm.py, 1024 positions) served twice "
        "by one moh-server, with `generation.prefix_caching` on (the default) "
        "and off; moh-bench sends %d-token prompts drawn from its 16 "
        "synthetic variants (`--prompt_tokens`), %d new tokens, %d requests "
        "at a time; an untimed warm-up of 16 requests first (with the cache "
        "on, it computes each variant once). KV blocks of 16 positions: a "
        "request reads the %d whole blocks before its prompt's last token "
        "and computes the rest. %d interleaved rounds; medians.\n" %
        (prompt, new, concurrency, (prompt - 1) // 16, rounds))
    with tempfile.TemporaryDirectory() as workdir:
        model = os.path.join(workdir, "bench-lm")
        run([sys.executable, os.path.join(ROOT, "bench", "make_bench_lm.py"),
             "--out=" + model, "--demo_dir=" + lm_dir,
             "--max_position_embeddings=1024"])
        server = Server(build, [("cached", model),
                                ("uncached", model, "prefix_caching: false")],
                        workdir, max_running=8)
        runs = {"cached": [], "uncached": []}
        try:
            for _ in range(rounds):
                for name in runs:
                    r = bench(build, server, "--rpc=generate",
                              "--model=" + name,
                              "--prompt_tokens=%d" % prompt,
                              "--max_new_tokens=%d" % new,
                              "--concurrency=%d" % concurrency,
                              "--requests=%d" % requests,
                              "--warmup_requests=16")
                    runs[name].append(
                        (r["throughput"]["requests_per_s"],
                         r["latency_ms"]["ttft"]["p50"]))
        finally:
            server.stop()
    medians = {"threads": server.threads,
               "model": "bench-lm, %d-token prompts" % prompt}
    say("| prefix cache | requests/s | TTFT p50 ms |")
    say("|---|---|---|")
    for name, label in (("cached", "on"), ("uncached", "off")):
        medians[label] = {
            "requests_per_s": statistics.median(r for r, _ in runs[name]),
            "ttft_p50_ms": statistics.median(t for _, t in runs[name])}
        say("| %s | %.1f | %.1f |" % (label, medians[label]["requests_per_s"],
                                      medians[label]["ttft_p50_ms"]))
    results["prefix_cache"] = medians
    say("\nThroughput with the cache / without: %.1f×.\n" %
        (medians["on"]["requests_per_s"] / medians["off"]["requests_per_s"]))
    say(Figure("prefix_cache.png", "Requests/s and time to first token with "
               "the prefix cache on and off"))


def serving_ratio_section(say, results, build, quick, lm_dir):
    print("7. serving at each ratio ...", file=sys.stderr)
    prompt, new = 128, 32
    rounds = 1 if quick else 3
    # concurrency -> measured requests
    loads = {1: 6, 8: 8} if quick else {1: 12, 8: 16}
    with tempfile.TemporaryDirectory() as workdir:
        model = os.path.join(workdir, "bench-lm")
        run([sys.executable, os.path.join(ROOT, "bench", "make_bench_lm.py"),
             "--out=" + model, "--demo_dir=" + lm_dir])
        server = Server(build, [("bench-lm", model, "prefix_caching: false")],
                        workdir, max_running=8)
        runs = {}  # (ratio, concurrency) -> [moh-bench report per round]
        try:
            for _ in range(rounds):
                for r in RATIOS:
                    for c, n in loads.items():
                        runs.setdefault((r, c), []).append(bench(
                            build, server, "--rpc=generate",
                            "--model=bench-lm", "--prompt_tokens=%d" % prompt,
                            "--max_new_tokens=%d" % new,
                            "--ratios=%g" % (r / 1000),
                            "--concurrency=%d" % c, "--requests=%d" % n,
                            "--warmup_requests=%d" % c))
        finally:
            server.stop()
    say("\n## 7. Serving at each ratio\n")
    say("The 24 M model (bench/make_bench_lm.py) through moh-server with "
        "`generation.prefix_caching` off (so each prompt is computed): "
        "moh-bench Generate, %d-token synthetic prompts (`--prompt_tokens`), "
        "%d new tokens, greedy, every request at the row's ratio "
        "(`--ratios`); measured requests: %s, after as many warm-up ones as "
        "the concurrency. Latency at concurrency 1: time to first token (the "
        "prompt's prefill) and time per output token (between streamed "
        "tokens). %d interleaved round(s); medians. Server intra-op threads: "
        "%s.\n" % (prompt, new, ", ".join(
            "%d at concurrency %d" % (n, c) for c, n in loads.items()),
            rounds, server.threads))
    curves = {"model": "bench-lm (24 M), %d-token prompts, %d new tokens" %
              (prompt, new), "threads": server.threads,
              "ratios": [r / 1000 for r in RATIOS]}
    for key, path in (("ttft_p50_ms", ("ttft", "p50")),
                      ("ttft_p99_ms", ("ttft", "p99")),
                      ("itl_p50_ms", ("itl", "p50")),
                      ("itl_p99_ms", ("itl", "p99")),
                      ("e2e_p50_ms", ("e2e", "p50"))):
        curves[key] = [median_field(runs[(r, 1)], "latency_ms", *path)
                       for r in RATIOS]
    curves["tokens_per_s"] = {
        str(c): [median_field(runs[(r, c)], "throughput", "tokens_per_s")
                 for r in RATIOS] for c in loads}
    results["serving_ratio"] = curves
    say("| ratio | TTFT p50 ms | TTFT p99 ms | per token p50 ms | per token "
        "p99 ms | request p50 ms | %s |" % " | ".join(
            "tokens/s at %d" % c for c in loads))
    say("|---|---|---|---|---|---|%s" % ("---|" * len(loads)))
    for i, r in enumerate(RATIOS):
        say("| %.3f | %.1f | %.1f | %.2f | %.2f | %.1f | %s |" % (
            r / 1000, curves["ttft_p50_ms"][i], curves["ttft_p99_ms"][i],
            curves["itl_p50_ms"][i], curves["itl_p99_ms"][i],
            curves["e2e_p50_ms"][i], " | ".join(
                "%.0f" % curves["tokens_per_s"][str(c)][i] for c in loads)))
    say("")
    say(Figure("ratio_serving.png", "Time to first token, time per output "
               "token and tokens/s against ratio, through moh-server"))


if __name__ == "__main__":
    main()
