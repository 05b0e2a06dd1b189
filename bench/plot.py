#!/usr/bin/python3
"""Draws the benchmark suite's numbers as PNG plots.

  $MOH_BENCH_VENV/bin/python bench/plot.py [--results bench/results.json]
      [--out_dir bench/plots]

Reads the results.json bench/suite.py writes beside RESULTS.md (the numbers
of its tables) and writes one PNG per measured section into --out_dir with
matplotlib's Agg backend, printing each file's name on a line. matplotlib
comes with the bench virtual environment (`scripts/install_deps.sh --bench`,
pinned in scripts/bench_venv.env); suite.py imports this module without it
and runs this file with that environment's python (draw_plots), so a missing
matplotlib only skips the plots.

results.json (schema_version 1; each section present only when it ran;
lists run along the section's "ratios" or "concurrency"):
  "title": machine text,
  "attention" (sections 1-2): "threads", "layer", "model", "ratios",
      "layer_ms": {"prefill"|"decode": {"dense", "head-sparse": [ms]}},
      "model_tokens_per_s": {"prefill"|"decode":
                             {"every head", "head-sparse": [tokens/s]}}
  "concurrency" (section 4): "threads", "concurrency",
      "Generate"|"Classify": {"model", "requests_per_s", "e2e_p50_ms",
                              "e2e_p99_ms"[, "tokens_per_s", "ttft_p50_ms"]}
  "peer" (section 5): "model", "rows": [row label],
      "kv": [{"label", "tokens_per_s":
              {"llama.cpp"|"moh 1.0"|"moh 0.5": [tokens/s per row]}}]
  "prefix_cache" (section 6): "model", "threads",
      "on"|"off": {"requests_per_s", "ttft_p50_ms"}
  "serving_ratio" (section 7): "model", "threads", "ratios",
      "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms"
      (at concurrency 1),
      "tokens_per_s": {"1"|"8"...: [tokens/s]}
  "vit_throughput" (section 8): "threads", "batches", "seconds", "configs"
      (labels: "default", lower ratios, "1.0", "dense"),
      "shapes": [{"label", "variant",
                  "images_per_s"|"effective_ratio"|"selected_ratio":
                  {"1"|"32"...: [per config]}}]
      (effective_ratio: pairs computed, 1 for dense; selected_ratio: what
      the gates select, as moh-classify prints it), "images_per_s_rounds":
      {"1"|"32"...: [[images/s per round] per config]}
  "dit" (section 9): "seconds" (the whole section),
      "step": {"threads", "configs" (as vit_throughput's),
               "shapes": [{"label", "variant", "input_size", "rows",
                           "timed_steps",
                           "step_seconds"|"effective_ratio"|"selected_ratio":
                           [per config]}]},
      "batching": {"model", "requests", "steps", "threads",
                   "modes": [one at a time, at once],
                   "images_per_s": {"in process"|"moh-server": [per mode]},
                   "gain": {"in process"|"moh-server": at once / one},
                   "latency_p50_s": [per mode] (moh-server),
                   "identical_images"}
"""
import argparse
import json
import os
import subprocess
import sys


class Figure:
    """Where suite.py's Markdown shows a plot: a line of its own in the
    list of lines, a Markdown image when the plot was drawn (markdown())."""

    def __init__(self, name, alt):
        self.name, self.alt = name, alt


def markdown(lines, drawn, rel_dir):
    """`lines` (strings and Figures) as Markdown text; a Figure whose file is
    not among `drawn` is left out."""
    out = []
    for line in lines:
        if isinstance(line, Figure):
            if line.name in drawn:
                out.append("![%s](%s/%s)" % (line.alt, rel_dir, line.name))
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def draw_plots(results_path, out_dir, pythons):
    """Runs this file with the first of `pythons` that has matplotlib.
    Returns (names of the files drawn, None), or (empty set, why not)."""
    for py in pythons:
        if py and os.access(py, os.X_OK) and subprocess.run(
                [py, "-c", "import matplotlib"],
                capture_output=True).returncode == 0:
            break
    else:
        return set(), "no python with matplotlib (tried %s)" % ", ".join(
            p for p in pythons if p)
    try:
        p = subprocess.run([py, os.path.abspath(__file__),
                            "--results=" + results_path,
                            "--out_dir=" + out_dir],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return set(), "bench/plot.py did not run: %s" % e
    if p.returncode != 0:
        err = p.stderr.strip().splitlines()
        return set(), "bench/plot.py failed: %s" % (err[-1] if err else
                                                     "exit %d" % p.returncode)
    return set(p.stdout.split()), None


def _threads(n):
    if n is None:
        return "the server's default threads"
    return "%d thread%s" % (n, "" if n == 1 else "s")


def _lines(ax, x, series, xlabel, ylabel, title, log2_x=False):
    for label, ys, style in series:
        ax.plot(x, ys, style, label=label)
    if log2_x:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.set_xticklabels([str(v) for v in x])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def plot_attention_layer(plt, a):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    r = a["ratios"]
    for ax, phase in zip(axes, ("prefill", "decode")):
        ms = a["layer_ms"][phase]
        series = [("dense (every head, official)", ms["dense"], "o-"),
                  ("head-sparse (pair kernel)", ms["head-sparse"], "s-")]
        if phase == "prefill":
            # Section 1's target: ratio r costs at most (r + 0.1) of the
            # faster of dense (measured at r) and the pair kernel at 1.0
            # (head-sparse at ratio 1.0).
            kernel = ms["head-sparse"][r.index(1.0)]
            series.append(("target: (r + 0.1) × faster baseline",
                           [(x + 0.1) * min(dense, kernel)
                            for x, dense in zip(r, ms["dense"])], "k:"))
        _lines(ax, r, series, "activation ratio", "time per call (ms)",
               phase)
    fig.suptitle("%s: time against ratio, %s" % (a["layer"],
                                                  _threads(a["threads"])))
    return fig


def plot_model_ratio(plt, a):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, phase in zip(axes, ("prefill", "decode")):
        t = a["model_tokens_per_s"][phase]
        _lines(ax, a["ratios"],
               [("head-sparse", t["head-sparse"], "s-"),
                ("every head (dense)", t["every head"], "o-")],
               "activation ratio", "tokens/s", phase)
    fig.suptitle("%s: throughput against ratio, %s" %
                 (a["model"], _threads(a["threads"])))
    return fig


def plot_serving_ratio(plt, s):
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    r = s["ratios"]
    _lines(axes[0], r, [("p50", s["ttft_p50_ms"], "o-"),
                        ("p99", s["ttft_p99_ms"], "s--")],
           "activation ratio", "ms", "time to first token, concurrency 1")
    _lines(axes[1], r, [("p50", s["itl_p50_ms"], "o-"),
                        ("p99", s["itl_p99_ms"], "s--")],
           "activation ratio", "ms", "time per output token, concurrency 1")
    _lines(axes[2], r, [("concurrency %s" % c, v, "o-")
                        for c, v in sorted(s["tokens_per_s"].items(),
                                           key=lambda kv: int(kv[0]))],
           "activation ratio", "generated tokens/s", "throughput")
    fig.suptitle("moh-server, %s: Generate against ratio, %s" %
                 (s["model"], _threads(s["threads"])))
    return fig


def plot_concurrency(plt, c):
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    x = c["concurrency"]
    for row, rpc in zip(axes, ("Generate", "Classify")):
        d = c[rpc]
        _lines(row[0], x, [("requests/s", d["requests_per_s"], "o-")],
               "concurrency (requests in flight)", "requests/s",
               "%s (%s): throughput" % (rpc, d["model"]), log2_x=True)
        latency = [("p50", d["e2e_p50_ms"], "o-"),
                   ("p99", d["e2e_p99_ms"], "s--")]
        if "ttft_p50_ms" in d:
            latency.append(("time to first token p50", d["ttft_p50_ms"],
                            "^:"))
        _lines(row[1], x, latency, "concurrency (requests in flight)",
               "request latency (ms)", "%s (%s): latency" % (rpc, d["model"]),
               log2_x=True)
    fig.suptitle("moh-server, closed loop (moh-bench): throughput and latency "
                 "against concurrency, %s" % _threads(c["threads"]))
    return fig


def plot_peer(plt, p):
    kvs = p["kv"]
    fig, axes = plt.subplots(len(kvs), 1, figsize=(11, 3.6 * len(kvs)),
                             squeeze=False)
    engines = ("llama.cpp", "moh 1.0", "moh 0.5")
    width = 0.8 / len(engines)
    for ax, kv in zip(axes[:, 0], kvs):
        for i, engine in enumerate(engines):
            ys = kv["tokens_per_s"][engine]
            bars = ax.bar([j + (i - 1) * width for j in range(len(ys))], ys,
                          width, label=engine)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(p["rows"])))
        ax.set_xticklabels(p["rows"], fontsize=8)
        ax.set_ylabel("tokens/s")
        ax.set_title("KV cache: %s" % kv["label"], fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("%s: moh-serve (ratio 1.0 and 0.5) beside llama.cpp, in "
                 "process, same threads per row" % p["model"])
    return fig


def plot_prefix_cache(plt, p):
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.8))
    names = ("on", "off")
    for ax, key, label in zip(axes, ("requests_per_s", "ttft_p50_ms"),
                              ("requests/s", "time to first token p50 (ms)")):
        bars = ax.bar(names, [p[n][key] for n in names], color=["C2", "C7"])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xlabel("prefix cache")
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("moh-server, %s: repeated prompts, prefix cache on / off, "
                 "%s" % (p["model"], _threads(p["threads"])), fontsize=10)
    return fig


def _every_head_against_ratio(ax, configs, x, y):
    """Head-sparse configurations as a line along the effective ratio x
    (labelled), ratio 1.0 and dense as markers of their own."""
    routed = [i for i, c in enumerate(configs) if c not in ("1.0", "dense")]
    line = sorted(routed + [configs.index("1.0")], key=lambda i: x[i])
    ax.plot([x[i] for i in line], [y[i] for i in line], "o-", color="C0",
            label="head-sparse")
    for i in routed:
        ax.annotate(configs[i], (x[i], y[i]), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    for name, label, marker, color in (
            ("1.0", "pair kernel at ratio 1.0 (every head)", "D", "C3"),
            ("dense", "dense (every head, official)", "X", "k")):
        i = configs.index(name)
        ax.plot([x[i]], [y[i]], marker, color=color, markersize=9,
                label=label)
    ax.set_xlabel("effective ratio ((token, head) pairs computed)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def plot_vit_throughput(plt, v):
    shapes, batches = v["shapes"], v["batches"]
    fig, axes = plt.subplots(len(shapes), len(batches),
                             figsize=(5.5 * len(batches), 3.8 * len(shapes)),
                             squeeze=False)
    for row, shape in zip(axes, shapes):
        for ax, batch in zip(row, batches):
            _every_head_against_ratio(ax, v["configs"],
                                      shape["effective_ratio"][str(batch)],
                                      shape["images_per_s"][str(batch)])
            ax.set_ylabel("images/s")
            ax.set_title("%s (%s), batch %d" % (shape["label"],
                                                shape["variant"], batch),
                         fontsize=10)
    fig.suptitle("MoH-ViT TransNeXt, in process (moh-classify): images/s "
                 "against the effective ratio, %s" % _threads(v["threads"]))
    return fig


def plot_dit(plt, d):
    step, batching = d["step"], d["batching"]
    shapes = step["shapes"]
    fig, axes = plt.subplots(1, len(shapes) + 1,
                             figsize=(5.5 * (len(shapes) + 1), 4.2))
    for ax, shape in zip(axes, shapes):
        _every_head_against_ratio(ax, step["configs"],
                                  shape["effective_ratio"],
                                  shape["step_seconds"])
        ax.set_ylabel("seconds per sampler step")
        ax.set_title("%s (%s), latent %d, %d rows per step" % (
            shape["label"], shape["variant"], shape["input_size"],
            shape["rows"]), fontsize=10)
    ax = axes[-1]
    ways = list(batching["images_per_s"])
    for i, mode in enumerate(batching["modes"]):
        bars = ax.bar([j + (i - 0.5) * 0.4 for j in range(len(ways))],
                      [batching["images_per_s"][w][i] for w in ways], 0.4,
                      label=mode, color=("C7", "C2")[i])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(ways)))
    ax.set_xticklabels(["%s\n(gain %.2f×)" % (w, batching["gain"][w])
                        for w in ways])
    ax.set_ylim(0, 1.3 * max(max(v) for v in
                             batching["images_per_s"].values()))
    ax.set_ylabel("images/s")
    ax.set_title("GenerateImage, %d requests of %d steps\n(%s, %s)" % (
        batching["requests"], batching["steps"], batching["model"],
        _threads(batching["threads"])), fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle("MoH-DiT: seconds per step against the effective ratio (in "
                 "process, %s); GenerateImage batching" %
                 _threads(step["threads"]))
    return fig


# results.json section -> (file name, drawing function).
PLOTS = [
    ("attention", "ratio_attention_layer.png", plot_attention_layer),
    ("attention", "ratio_model.png", plot_model_ratio),
    ("serving_ratio", "ratio_serving.png", plot_serving_ratio),
    ("concurrency", "concurrency.png", plot_concurrency),
    ("peer", "peer_llama_cpp.png", plot_peer),
    ("prefix_cache", "prefix_cache.png", plot_prefix_cache),
    ("vit_throughput", "vit_throughput.png", plot_vit_throughput),
    ("dit", "dit.png", plot_dit),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--results", default=os.path.join(here,
                                                          "results.json"))
    parser.add_argument("--out_dir", default=os.path.join(here, "plots"))
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.results) as f:
        results = json.load(f)
    os.makedirs(args.out_dir, exist_ok=True)
    for section, name, draw in PLOTS:
        if section not in results:
            continue
        fig = draw(plt, results[section])
        fig.text(0.99, 0.005, results.get("title", ""), ha="right",
                 va="bottom", fontsize=7, color="0.4")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out_dir, name), dpi=100)
        plt.close(fig)
        print(name)


if __name__ == "__main__":
    sys.exit(main())
