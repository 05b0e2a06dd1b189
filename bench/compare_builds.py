"""Serving throughput of two builds of moh-server side by side, for a change
that must not move it (a refactor): both servers run the demo models with the
suite's settings, and moh-bench (of the new build) loads each in turn, the
rounds interleaved (old, new, old, new, ...) so that a noisy machine moves
both alike. Prints, per workload, each build's median and the ratio
new / old with the spread of the per-round ratios.

  python3 bench/compare_builds.py --old=/path/to/old/build --new=build
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite_common import ROOT  # noqa: E402
from suite_server import PROMPT, Server, bench  # noqa: E402

MODELS = os.path.join(ROOT, "models")


def instruction_set():
    """The widest vector extension the kernels can choose on this CPU."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f
                      if line.startswith("flags")), [])
    for isa in ("avx512f", "avx2"):
        if isa in flags:
            return isa.upper()
    return "neither AVX-512F nor AVX2"


def workloads(requests):
    generate = ["--rpc=generate", "--model=lm", "--prompt=" + PROMPT,
                "--max_new_tokens=32", "--concurrency=8",
                "--requests=%d" % requests, "--warmup_requests=8"]
    with open(os.path.join(MODELS, "demo-vit", "config.json")) as f:
        vit = json.load(f)
    shape = "%d,%d,%d" % (vit.get("num_channels", 3), vit["image_size"],
                          vit["image_size"])
    return [
        ("Generate, ratio 1.0, 8 streams", "tokens_per_s",
         generate + ["--ratios=1.0"]),
        ("Generate, ratio 0.5, 8 streams", "tokens_per_s",
         generate + ["--ratios=0.5"]),
        ("Classify, 8 streams", "requests_per_s",
         ["--rpc=classify", "--model=vit", "--pixels_shape=" + shape,
          "--concurrency=8", "--requests=%d" % (requests * 4),
          "--warmup_requests=8"]),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the old build folder")
    parser.add_argument("--new", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=128,
                        help="Generate requests per measurement (Classify: 4x)")
    args = parser.parse_args()
    models = [("lm", os.path.join(MODELS, "demo-lm")),
              ("vit", os.path.join(MODELS, "demo-vit"))]
    print("CPU: %s, %d cores" % (instruction_set(), os.cpu_count()))
    work = tempfile.mkdtemp(prefix="moh-compare-")
    servers = {name: Server(build, models, work, max_running=32)
               for name, build in (("old", args.old), ("new", args.new))}
    try:
        print("| workload | old | new | new / old (median) | per-round range |")
        print("|---|---|---|---|---|")
        for label, field, flags in workloads(args.requests):
            measured = {"old": [], "new": []}
            for _ in range(args.rounds):
                for name in ("old", "new"):
                    report = bench(args.new, servers[name], *flags)
                    measured[name].append(report["throughput"][field])
            ratios = [n / o for n, o in zip(measured["new"], measured["old"])]
            print("| %s | %.1f | %.1f | %.3f | %.3f to %.3f |" % (
                label, statistics.median(measured["old"]),
                statistics.median(measured["new"]),
                statistics.median(ratios), min(ratios), max(ratios)))
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
