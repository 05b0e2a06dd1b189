"""What the benchmark suite's sections share: the repository root, the
ratios sections 1, 2 and 7 measure, a checked subprocess, the bench virtual
environment's python, the threads of in-process benchmarks, how a ratio
over rounds is written and the random-weight checkpoints made once."""
import hashlib
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIOS = [500, 625, 750, 875, 1000]


def run(cmd, **kwargs):
    return subprocess.run(cmd, check=True, capture_output=True, text=True,
                          **kwargs)


def bench_venv_python():
    """The bench virtual environment's python (scripts/bench_venv.env,
    $MOH_BENCH_VENV overrides) and the pinned llama-cpp-python version."""
    out = run(["bash", "-c", '. "$1"; echo "$MOH_BENCH_VENV"; '
               'echo "$MOH_LLAMA_CPP_PYTHON_VERSION"', "_",
               os.path.join(ROOT, "scripts", "bench_venv.env")]).stdout.split()
    return os.path.join(out[0], "bin", "python"), out[1]


def bench_threads():
    """LibTorch threads of the in-process benchmarks: MOH_BENCH_THREADS or
    every core (moh_attention_bench reads the same variable)."""
    return int(os.environ.get("MOH_BENCH_THREADS") or os.cpu_count())


def ratio_text(per_round):
    """The median of one ratio per round, with its range when there are
    several rounds."""
    text = "%.2f" % statistics.median(per_round)
    if len(per_round) > 1:
        text += " (%.2f–%.2f)" % (min(per_round), max(per_round))
    return text


def made_once(out, script, args, sources):
    """The directory `out`, written by `script` (a generator in bench/, run
    with this python as `script ARGS --out OUT`) once and kept while `args`
    and the files `sources` (the generator and what it imports, from the
    repository root) are unchanged."""
    digest = hashlib.sha256("\0".join(args).encode())
    for path in sources:
        with open(os.path.join(ROOT, path), "rb") as f:
            digest.update(f.read())
    stamp = os.path.join(out, "generator.sha256")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read().strip() == digest.hexdigest():
                return out
    print("  making %s (%s) ..." % (out, script), file=sys.stderr)
    run([sys.executable, os.path.join(ROOT, script)] + list(args) +
        ["--out", out])
    with open(stamp, "w") as f:
        f.write(digest.hexdigest() + "\n")
    return out
