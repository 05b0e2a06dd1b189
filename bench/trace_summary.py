#!/usr/bin/env python3
"""Summarises a Chrome trace that `moh-generate --profile_dir` wrote (LibTorch's
profiler, kineto) as a Markdown table, per decode step.

    trace_summary.py TRACE.json [--steps N] [--label L] [--top 25] [--json OUT]

--steps is how many steps the trace holds: a decode trace of moh-generate
(the first timed generation from its first token on) holds
--max_new_tokens - 1; a prefill trace is read as one (--label prefill).
On CUDA the table lists kernels (graph-replayed ones too) by their total
device time: launches and microseconds per step, the mean, and the share of
all kernel time; above it, the window's wall time per step against the time
the device was busy (kernels, copies and fills, overlaps counted once). On a
CPU trace (no kernels) it lists the host operators at the top of their
stacks the same way.
Below, the host's phases of a step (the "moh::" profiler scopes: the step's
indices, its launches, the logits' reduction, the download and its wait,
sampling, the next batch) with their time per step and, on CUDA, how much of
the device's idle time falls inside each: what the host does while the
device waits for it.
"""

import argparse
import bisect
import collections
import gzip
import json
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def busy_us(intervals):
    """The length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def top_level(ops):
    """The host operators not inside another one on the same thread."""
    out = []
    by_thread = collections.defaultdict(list)
    for e in ops:
        by_thread[e["tid"]].append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_until = None
        for e in events:
            if open_until is None or e["ts"] >= open_until:
                out.append(e)
                open_until = e["ts"] + e["dur"]
    return out


def short(name, width=96):
    return name if len(name) <= width else name[: width - 3] + "..."


def summarise(events, steps, top):
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = [e for e in complete
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = [e for e in device if e["cat"] == "kernel"]
    cpu_ops = [e for e in complete if e.get("cat") == "cpu_op"]
    launches = collections.Counter(
        e["name"] for e in complete if e.get("cat") == "cuda_runtime")
    summary = {"steps": steps}
    rows = kernels if kernels else top_level(cpu_ops)
    if not rows:
        raise SystemExit("trace_summary: no kernels and no host operators")
    window = device if kernels else rows
    start = min(e["ts"] for e in window)
    end = max(e["ts"] + e["dur"] for e in window)
    summary["kind"] = "kernels" if kernels else "host operators"
    summary["wall_us_per_step"] = (end - start) / steps
    summary["busy_us_per_step"] = busy_us(
        (e["ts"], e["ts"] + e["dur"]) for e in window) / steps
    if kernels:
        summary["kernels_per_step"] = len(kernels) / steps
        for cat in ("gpu_memcpy", "gpu_memset"):
            these = [e for e in device if e["cat"] == cat]
            summary[cat + "_per_step"] = len(these) / steps
            summary[cat + "_us_per_step"] = sum(e["dur"] for e in these) / steps
        summary["graph_launches_per_step"] = launches["cudaGraphLaunch"] / steps
        summary["kernel_launches_per_step"] = (
            launches["cudaLaunchKernel"] + launches["cudaLaunchKernelExC"]) / steps
    total = collections.defaultdict(float)
    count = collections.Counter()
    for e in rows:
        total[e["name"]] += e["dur"]
        count[e["name"]] += 1
    all_us = sum(total.values())
    table = []
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        table.append({"name": name, "per_step": count[name] / steps,
                      "us_per_step": us / steps, "mean_us": us / count[name],
                      "share": us / all_us})
    summary["rows"] = table
    summary["row_us_per_step"] = all_us / steps
    summary["host_phases"] = host_phases(
        complete, steps, idle_intervals(device, start, end) if kernels else None)
    if kernels:
        summary["idle_us_per_step"] = (summary["wall_us_per_step"] -
                                       summary["busy_us_per_step"])
    return summary


def idle_intervals(device, start, end):
    """The gaps in [start, end) where no device event ran, sorted."""
    gaps, at = [], start
    for s, e in sorted((e["ts"], e["ts"] + e["dur"]) for e in device):
        if s > at:
            gaps.append((at, s))
        at = max(at, e)
    if end > at:
        gaps.append((at, end))
    return gaps


def overlap_us(start, end, gaps, gap_starts):
    """How much of [start, end) the sorted, disjoint `gaps` cover."""
    total = 0.0
    i = max(0, bisect.bisect_right(gap_starts, start) - 1)
    while i < len(gaps) and gaps[i][0] < end:
        total += max(0.0, min(end, gaps[i][1]) - max(start, gaps[i][0]))
        i += 1
    return total


def host_phases(complete, steps, gaps):
    """The host's named phases of a step (the "moh::" user scopes of
    LlamaModel::Forward and the loops that drive it), each with its time
    and, given the device's idle `gaps`, the idle time inside it."""
    phases = [e for e in complete if e.get("cat") == "user_annotation"
              and e["name"].startswith("moh::")]
    gap_starts = [g[0] for g in gaps or []]
    total = collections.defaultdict(float)
    idle = collections.defaultdict(float)
    count = collections.Counter()
    for e in phases:
        total[e["name"]] += e["dur"]
        count[e["name"]] += 1
        if gaps is not None:
            idle[e["name"]] += overlap_us(e["ts"], e["ts"] + e["dur"], gaps,
                                          gap_starts)
    out = []
    for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
        row = {"name": name, "per_step": count[name] / steps,
               "us_per_step": us / steps}
        if gaps is not None:
            row["idle_us_per_step"] = idle[name] / steps
        out.append(row)
    return out


def markdown(s):
    lines = [f"{s['steps']} {s['label']}: {s['wall_us_per_step']:.0f} µs a step "
             f"(first to last {s['kind']}), busy {s['busy_us_per_step']:.0f} µs "
             f"({s['busy_us_per_step'] / s['wall_us_per_step']:.0%})"]
    if s["kind"] == "kernels":
        lines.append(
            f"per step: {s['kernels_per_step']:.0f} kernels "
            f"({s['row_us_per_step']:.0f} µs), "
            f"{s['gpu_memcpy_per_step']:.1f} copies "
            f"({s['gpu_memcpy_us_per_step']:.0f} µs), "
            f"{s['gpu_memset_per_step']:.1f} fills, "
            f"{s['graph_launches_per_step']:.1f} graph launches, "
            f"{s['kernel_launches_per_step']:.1f} eager kernel launches")
    lines += ["", f"| {s['kind'][:-1]} | per step | µs per step | mean µs | share |",
              "|---|---|---|---|---|"]
    for r in s["rows"]:
        lines.append(f"| `{short(r['name'])}` | {r['per_step']:.1f} | "
                     f"{r['us_per_step']:.1f} | {r['mean_us']:.2f} | "
                     f"{r['share']:.1%} |")
    phases = s["host_phases"]
    if phases:
        idle = "idle_us_per_step" in s
        head = "host phases (the moh:: scopes; the profiler's cost is in them too)"
        if idle:
            inside = sum(p["idle_us_per_step"] for p in phases)
            head += (f": the device idle {s['idle_us_per_step']:.0f} µs a step, "
                     f"{inside:.0f} µs of it inside them")
        lines += ["", head, "",
                  "| host phase | per step | µs per step |" +
                  (" device idle inside, µs per step |" if idle else ""),
                  "|---|---|---|" + ("---|" if idle else "")]
        for p in phases:
            lines.append(f"| `{p['name']}` | {p['per_step']:.1f} | "
                         f"{p['us_per_step']:.1f} |" +
                         (f" {p['idle_us_per_step']:.1f} |" if idle else ""))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--label", default="decode steps",
                        help="what a step is, for the table's first line")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    s = summarise(load(args.trace), args.steps, args.top)
    s["trace"] = args.trace
    s["label"] = args.label
    print(markdown(s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
