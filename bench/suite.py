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
     and Classify.

Usage (after building: scripts/build.sh moh-server moh-bench moh-generate
moh_attention_bench):
  /usr/bin/python3 bench/suite.py [--build build] [--out bench/RESULTS.md]
      [--lm_dir DIR] [--vit_dir DIR] [--quick]
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
            for name, path in models:
                f.write('models { name: "%s" model_dir: "%s" generation { '
                        "max_running: %d } batching { max_batch_size: 32 "
                        "max_queue_delay_ms: 2 } }\n" % (name, path,
                                                          max_running))
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
                return
            time.sleep(0.3)
        raise RuntimeError("moh-server did not become SERVING")

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
    parser.add_argument("--sections", default="1,2,3,4",
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
    say("# moh-serve benchmark results\n")
    say("Command: `bash bench/run_suite.sh%s` — %s, %d CPU cores, %s UTC. "
        "Each figure is a ratio of two measurements taken side by side in "
        "this run.\n" % (" --quick" if quick else "", os.uname().machine,
                         os.cpu_count(),
                         datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M")))

    sections = set(args.sections.split(","))
    if sections & {"1", "2"}:
        model_sections(say, build, quick)
    if sections & {"3", "4"}:
        server_sections(say, build, quick, lm_dir, vit_dir, sections)

    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


def model_sections(say, build, quick):
    print("1-2. attention layer and model (moh_attention_bench) ...",
          file=sys.stderr)
    rounds = 1 if quick else 5
    m = attention_tables(build, 0.05 if quick else 0.3, rounds)
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


PROMPT = "Once upon a time"


def server_sections(say, build, quick, lm_dir, vit_dir, sections):
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
                batching_gain(say, build, server, quick, vit_dir)
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
        "server ≥ 0.9 × in process.\n" %
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
        say("| %s | %.1f | %.1f | %.2f | ≥ 0.90 %s |" %
            (label, l, s, s / l, "met" if s / l >= 0.9 else "MISSED"))


def batching_gain(say, build, server, quick, vit_dir):
    print("4. batching gain ...", file=sys.stderr)
    say("\n## 4. Batching gain: throughput at concurrency 32 / 1\n")
    say("| RPC | requests/s at 1 | requests/s at 32 | gain | target |")
    say("|---|---|---|---|---|")
    with open(os.path.join(vit_dir, "config.json")) as f:
        vit = json.load(f)
    shape = "%d,%d,%d" % (vit.get("num_channels", 3), vit["image_size"],
                          vit["image_size"])
    cases = [
        ("Generate", ["--rpc=generate", "--model=lm", "--prompt=" + PROMPT,
                      "--max_new_tokens=16"]),
        ("Classify", ["--rpc=classify", "--model=vit",
                      "--pixels_shape=" + shape]),
    ]
    for name, flags in cases:
        rates = {}
        for c in (1, 32):
            n = max(c * (2 if quick else 4), 8 if quick else 16)
            result = bench(build, server, *flags, "--concurrency=%d" % c,
                           "--requests=%d" % n,
                           "--warmup_requests=%d" % min(c, 8))
            rates[c] = result["throughput"]["requests_per_s"]
        gain = rates[32] / rates[1]
        say("| %s | %.1f | %.1f | %.1f× | ≥ 5× %s |" %
            (name, rates[1], rates[32], gain,
             "met" if gain >= 5 else "MISSED"))


if __name__ == "__main__":
    main()
