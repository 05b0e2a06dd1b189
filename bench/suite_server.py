"""Sections 3, 4, 6 and 7 of the benchmark suite: moh-server on loopback,
driven by moh-bench (serving overhead, batching, prefix cache, serving at
each ratio)."""
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from plot import Figure
from suite_common import RATIOS, ROOT, run


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A moh-server on free loopback ports, stopped on exit."""

    def __init__(self, build, models, workdir, max_running):
        self.port = free_port()
        config = os.path.join(workdir, "bench-%d.textproto" % self.port)
        with open(config, "w") as f:
            f.write("port: %d\nmetrics_port: -1\nhttp_port: -1\nhost: \"127.0.0.1\"\n" %
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
    flags = list(flags)
    if "--rpc=generate" in flags:
        # Greedy, whatever sampling defaults a model's generation_config.json
        # has (demo-lm's sample).
        flags.append("--temperature=0")
    out = run([os.path.join(build, "client", "moh-bench"),
               "--server=127.0.0.1:%d" % server.port, "--quiet", "--json"] +
              flags).stdout
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
        "against moh-generate --batch %d in process, same intra-op threads, "
        "the same number of requests each way (16 waves of %d for demo-lm, "
        "4 for bench-lm); medians of %d interleaved rounds. `demo-lm` (0.9 M "
        "parameters) "
        "spends about as long on a decode step's bookkeeping as on its "
        "compute, so per-token RPC work shows fully; `bench-lm` is a 24 M "
        "parameter random-weight MoH-LLaMA with the demo tokenizer. Target: "
        "server ≥ 0.95 × in process.\n" %
        (PROMPT, tokens, concurrency, concurrency, concurrency, rounds))
    say("| model | in process tokens/s | server tokens/s | server / in "
        "process | target |")
    say("|---|---|---|---|---|")
    for label, name, model_dir in models:
        # Waves of `concurrency` requests per measurement: demo-lm's are
        # about 17 ms each, so 4 waves (the suite's first choice) measured
        # 70 ms and moved by a third between runs.
        waves = 2 if quick else (16 if name == "lm" else 4)
        served, local = [], []
        for _ in range(rounds):
            local.append(in_process_tokens_per_s(
                build, model_dir, concurrency, waves, PROMPT, tokens))
            result = bench(build, server, "--rpc=generate", "--model=" + name,
                           "--prompt=" + PROMPT, "--max_new_tokens=%d" % tokens,
                           "--concurrency=%d" % concurrency,
                           "--requests=%d" % (concurrency * waves),
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
