#!/usr/bin/python3
"""Batch-1 decode of the bench model on each instruction set the CPU kernels
can be capped at (MOH_CPU_ISA, model/kernels/cpu_isa.h), side by side:
every round runs every configuration once (1 and 2 threads, ratio 1.0 and
0.5), so that a shared machine's load falls on all of them alike.

  /usr/bin/python3 bench/make_bench_lm.py --out=/tmp/bench-lm \\
      --max_position_embeddings=1024
  /usr/bin/python3 bench/isa_decode.py build/tools/moh-generate \\
      /tmp/bench-lm avx512,avx2,portable [rounds]

Prints two tables: moh-generate's decode_tokens_per_s (medians), and for one
thread the user + system CPU seconds per decode token (a 144-token run
minus a 16-token one, over the 2 x 128 extra tokens: warm-up and timed run),
which other processes on the cores disturb far less than wall time.
OPENBLAS_CORETYPE=Haswell for every run (as this project's machines pin
it); ATEN_CPU_CAPABILITY=avx2 beside any cap below avx512, so that
LibTorch's own kernels run as on an AVX2-only CPU too. `portable` is what
the build before the AVX2 paths ran on such a CPU for a batch-1 decode (its
one-row products in OpenBLAS's sgemv, the attention products in the BLAS,
the softmax in libm's expf)."""
import itertools
import os
import re
import resource
import statistics
import subprocess
import sys


def run(binary, model, isa, threads, ratio, tokens):
    env = dict(os.environ, OPENBLAS_CORETYPE="Haswell", MOH_CPU_ISA=isa)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if isa != "avx512":
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([binary, "--model_dir=" + model, "--ratio=" + ratio,
                          "--threads=%d" % threads, "--batch=1", "--repeat=1",
                          "--warmup=1", "--prompt_tokens=8",
                          "--max_new_tokens=%d" % tokens],
                         env=env, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime -
                                                before.ru_stime)
    m = re.search(r"decode_tokens_per_s=([0-9.]+)", out.stdout + out.stderr)
    return float(m.group(1)), cpu


def main():
    binary, model = sys.argv[1], sys.argv[2]
    isas = sys.argv[3].split(",")
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    configs = list(itertools.product([1, 2], ["1.0", "0.5"], isas))
    wall = {c: [] for c in configs}
    cpu = {c: [] for c in configs}
    for r in range(rounds):
        for c in configs:
            threads, ratio, isa = c
            tps, cpu_long = run(binary, model, isa, threads, ratio, 144)
            wall[c].append(tps)
            if threads == 1:
                _, cpu_short = run(binary, model, isa, threads, ratio, 16)
                cpu[c].append((cpu_long - cpu_short) / 256)
        print("round %d of %d" % (r + 1, rounds), file=sys.stderr, flush=True)
    others = isas[1:]
    print("| threads | ratio | " +
          " | ".join("%s tok/s" % i for i in isas) + " | " +
          " | ".join("%s / %s" % (i, isas[0]) for i in others) + " |")
    print("|---" * (2 + len(isas) + len(others)) + "|")
    for threads in [1, 2]:
        for ratio in ["1.0", "0.5"]:
            med = [statistics.median(wall[(threads, ratio, i)]) for i in isas]
            print("| %d | %s | " % (threads, ratio) +
                  " | ".join("%.1f" % v for v in med) + " | " +
                  " | ".join("%.2f" % (v / med[0]) for v in med[1:]) + " |")
    print("\nOne thread, CPU ms per decode token (speed: %s's time / each):\n"
          % isas[0])
    print("| ratio | " + " | ".join("%s ms" % i for i in isas) + " | " +
          " | ".join("%s speed / %s" % (i, isas[0]) for i in others) + " |")
    print("|---" * (1 + len(isas) + len(others)) + "|")
    for ratio in ["1.0", "0.5"]:
        med = [statistics.median(cpu[(1, ratio, i)]) * 1000 for i in isas]
        print("| %s | " % ratio + " | ".join("%.2f" % v for v in med) + " | " +
              " | ".join("%.2f" % (med[0] / v) for v in med[1:]) + " |")


if __name__ == "__main__":
    main()
