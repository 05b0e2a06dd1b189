"""Sections 1 and 2 of the benchmark suite: one attention layer and the whole
4-layer model at each ratio, from moh_attention_bench (a Google Benchmark)."""
import json
import os
import statistics
import sys

from plot import Figure
from suite_common import RATIOS, bench_threads, run


def attention_tables(build, min_time, rounds):
    """Medians over `rounds` whole runs of moh_attention_bench (so every
    configuration is measured in each round, interleaved in time), keyed by
    (benchmark, ratio, sparse): (real time ms, tokens/s)."""
    runs = {}
    for _ in range(rounds):
        out = run([os.path.join(build, "bench", "moh_attention_bench"),
                   "--benchmark_format=json",
                   # The layer and model benchmarks (not BM_Linear*).
                   "--benchmark_filter=BM_(Attention|Model)",
                   "--benchmark_min_time=%g" % min_time]).stdout
        for b in json.loads(out)["benchmarks"]:
            # e.g. BM_AttentionPrefill/ratio:500/sparse:1
            name, ratio, sparse = b["run_name"].split("/")
            key = (name, int(ratio.split(":")[1]), int(sparse.split(":")[1]))
            runs.setdefault(key, []).append((b["real_time"], b.get("tokens/s")))
    return {key: (statistics.median(t for t, _ in values),
                  statistics.median(r for _, r in values))
            for key, values in runs.items()}


def model_sections(say, results, build, quick):
    print("1-2. attention layer and model (moh_attention_bench) ...",
          file=sys.stderr)
    rounds = 1 if quick else 5
    m = attention_tables(build, 0.05 if quick else 0.3, rounds)

    def series(name, sparse, field):
        return [m[(name, r, sparse)][field] for r in RATIOS]
    results["attention"] = {
        "threads": bench_threads(),
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
