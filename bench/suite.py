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
     throughput of Generate through moh-server, at ratio 0.5 to 1.0;
  8. MoH-ViT TransNeXt images/s in process (moh-classify) on full-size
     random-weight checkpoints of the S and B shapes, at batch 1 and 32:
     the variant's default ratio, 0.5 and 0.25 / every head computed (the
     pair kernel at ratio 1.0, and dense as the official code does), with
     the effective ratio each computes;
  9. MoH-DiT image generation: seconds per sampler step in process
     (moh-generate-image) on full-size random-weight checkpoints of the XL
     and S shapes (256 px, one guided request) at the default ratio, 0.75
     and 0.5 / every head computed (ratio 1.0 and dense); and the batching
     gain of GenerateImage through moh-server: 8 requests at once / the same
     8 one at a time, beside the same in process (models/demo-dit, else a
     small random-weight S-shape model), with whether each request's image
     is the same both ways.

The driver is this file; each section's code is in its own module:
suite_model.py (1-2), suite_server.py (3, 4, 6, 7), suite_peer.py (5),
suite_vit.py (8), suite_dit.py (9), and what they share in suite_common.py.

Beside the Markdown (--out) it writes the numbers as results.json and, with
bench/plot.py, PNG plots in plots/ that the Markdown shows; without
matplotlib (the bench virtual environment's) it says the plots were skipped.

Usage (after building: scripts/build.sh moh-server moh-bench moh-generate
moh-classify moh-generate-image moh_attention_bench moh_read_bandwidth):
  /usr/bin/python3 bench/suite.py [--build build] [--out bench/RESULTS.md]
      [--lm_dir DIR] [--vit_dir DIR] [--work_dir DIR] [--quick]
      [--sections=1,2,...]
"""
import argparse
import datetime
import json
import os
import sys

import plot
from suite_common import ROOT, bench_venv_python
from suite_dit import dit_section
from suite_model import model_sections
from suite_peer import peer_section
from suite_server import (prefix_cache_section, server_sections,
                          serving_ratio_section)
from suite_vit import vit_section


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
    parser.add_argument("--work_dir",
                        help="where sections keep what they generate "
                        "between runs (the checkpoints of section 8, "
                        "~560 MB, and section 9, ~1.4 GB); "
                        "default: BUILD/bench-work")
    parser.add_argument("--sections", default="1,2,3,4,5,6,7,8,9",
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
    work_dir = os.path.abspath(args.work_dir or
                               os.path.join(build, "bench-work"))
    if "8" in sections:
        vit_section(say, results, build, quick, work_dir)
    if "9" in sections:
        dit_section(say, results, build, quick, work_dir)

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


if __name__ == "__main__":
    main()
