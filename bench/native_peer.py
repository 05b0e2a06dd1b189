#!/usr/bin/env python3
"""llama.cpp's own benchmark tool beside moh-generate, at each weight precision.

The fair peer of issue 33: llama.cpp built from source for this CPU
(GGML_NATIVE=ON, scripts/install_llama_cpp.sh), timed by its own
llama-batched-bench, against moh-serve in process (moh-generate), the same
shapes, threads and token counts, each engine at its defaults otherwise (KV
cache: llama.cpp f16, moh-serve the model's dtype; llama.cpp's flash
attention "auto"). Rows interleave: every round runs every configuration on
both engines, and each figure is the median over rounds.

  decode:  B sequences after a 16-token prompt, --steps steps of one token per
           sequence (llama.cpp: S_TG of batched-bench, prompts not shared;
           moh-generate: decode_tokens_per_s).
  prefill: B prompts of 512 tokens (llama.cpp: S_PP; moh-generate:
           prefill_tokens_per_s).

Sizes: "24m", bench/make_bench_lm.py (the suite's shape: hidden 512, 8 layers,
8 heads / 4 KV heads, 2 shared and 4 routed, a learned router; where
overheads decide), and "1b",
make_bench_lm.py --layout llama3-1b (LLaMA-3.2-1B's shape: hidden 2048, 16
layers, 32 heads / 8 KV heads, MLP 8192, 128256-token tied vocabulary, where
weights decide; MoH-LLaMA3's query-norm router, 16 shared and 8 of 16 routed
heads). llama.cpp reads them without the router (bench/make_gguf.py): every
head, the cost of moh-serve at ratio 1.0. Precisions: f32 (llama.cpp ALL_F32
GGUF, moh-generate --dtype=float32), bf16 (llama-quantize BF16; moh-generate --weights=bfloat16,
float32 activations; --dtype=bfloat16 where it has no --weights)
and q8_0 (llama-quantize Q8_0; moh-generate --weights=int8 when this
moh-generate has the flag, else the row says so). Batch-1 decode rows also
print the weight bytes a token reads over the read bandwidth measured in the
same run (bench/read_bandwidth.cc), the bound both engines share.

The instruction sets: the CPU's (/proc/cpuinfo flags), llama.cpp's (the
flags of the CPU its native build was made for) and moh-serve's (--moh_isa sets MOH_CPU_ISA for moh-generate, e.g. avx2
to run its AVX2 kernels on an AVX-512 machine; llama.cpp's native build
cannot be capped the same way).

  nice -n -20 /usr/bin/python3 bench/native_peer.py --build build [--sizes 24m,1b]
      [--precisions f32,bf16,q8_0] [--threads 2] [--rounds 3] [--quick]
      [--moh_isa avx2] [--workdir DIR] [--json OUT.json]

On a shared machine, `nice -n -20` (as root) keeps other jobs' threads off the
cores while it runs. Needs `bash scripts/install_llama_cpp.sh` (about 10 minutes of CPU, once) and Debian's
python3-numpy (bench/make_gguf.py runs on the tree's gguf-py). The 1b size
writes about 10 GB of models into --workdir (kept between runs when given).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODE_PROMPT = 16
PREFILL_PROMPT = 512
ROWS = {
    "24m": [("decode", 1, 1), ("decode", 1, 2), ("decode", 16, 2),
            ("decode", 32, 2), ("prefill", 1, 2), ("prefill", 16, 2)],
    "1b": [("decode", 1, 1), ("decode", 1, 2), ("decode", 16, 2),
           ("prefill", 1, 2)],
}
# Decode steps per run at the 1b size, as a share of --steps: a token there
# reads 5 GB of float32 weights (about half a second on this machine).
STEPS_SHARE = {"24m": 1, "1b": 4}
MOH_DTYPE = {"f32": "float32", "bf16": "bfloat16", "q8_0": "float32"}
GGUF_TYPE = {"bf16": "BF16", "q8_0": "Q8_0"}
BYTES_PER_WEIGHT = {"f32": 4.0, "bf16": 2.0, "q8_0": 34.0 / 32.0}


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


def run(cmd, env=None, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    if p.returncode != 0:
        raise RuntimeError("%s failed (%d):\n%s%s" % (
            " ".join(cmd), p.returncode, p.stdout[-2000:], p.stderr[-4000:]))
    return p


def llama_prefix():
    """$MOH_LLAMA_CPP_PREFIX as scripts/llama_cpp.env resolves it."""
    env = os.path.join(ROOT, "scripts", "llama_cpp.env")
    out = run(["bash", "-c", '. "$0"; echo "$MOH_LLAMA_CPP_PREFIX"', env])
    return out.stdout.strip()


def cpu_isa():
    """The x86 vector extensions lscpu lists, in one line."""
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n")[0]
    keep = [f for f in flags.split() if re.match(
        r"(avx2|fma|f16c|avx512(f|bw|vl|_bf16|_vnni|_fp16)|amx_\w+|avx_vnni)$",
        f)]
    model = re.search(r"model name\s*:\s*(.*)", open("/proc/cpuinfo").read())
    return "%s: %s" % (model.group(1) if model else "?", " ".join(keep))


def make_models(size, workdir, precisions, prefix):
    """{precision: gguf path}, and the model directory moh-generate reads."""
    model_dir = os.path.join(workdir, "bench-" + size)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        log("writing the %s model ..." % size)
        extra = (["--max_position_embeddings=1024"] if size == "24m"
                 else ["--layout=llama3-1b", "--device=cpu"])
        run(["/usr/bin/python3", os.path.join(ROOT, "bench",
                                              "make_bench_lm.py"),
             "--out=" + model_dir] + extra)
    ggufs = {"f32": model_dir + "-f32.gguf"}
    if not os.path.exists(ggufs["f32"]):
        log("writing its F32 GGUF ...")
        env = dict(os.environ, PYTHONPATH=os.path.join(prefix, "gguf-py"))
        run(["/usr/bin/python3", os.path.join(ROOT, "bench", "make_gguf.py"),
             "--model_dir=" + model_dir, "--out=" + ggufs["f32"]], env=env)
    for p in precisions:
        if p == "f32":
            continue
        ggufs[p] = "%s-%s.gguf" % (model_dir, p)
        if not os.path.exists(ggufs[p]):
            log("quantizing to %s ..." % GGUF_TYPE[p])
            run([os.path.join(prefix, "bin", "llama-quantize"), ggufs["f32"],
                 ggufs[p], GGUF_TYPE[p]])
    return model_dir, ggufs


def weight_count(model_dir):
    """Weights a decode token reads: every matrix but the embedding table,
    which a tied model reads whole as its output layer."""
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    names = [f for f in os.listdir(model_dir) if f.endswith(".safetensors")]
    total = 0
    for name in names:
        with open(os.path.join(model_dir, name), "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            n = 1
            for d in info["shape"]:
                n *= d
            if "embed_tokens" in key and not cfg.get("tie_word_embeddings"):
                continue
            total += n
    return total


def llama_rate(prefix, gguf, phase, batch, threads, steps):
    prompt = DECODE_PROMPT if phase == "decode" else PREFILL_PROMPT
    tokens = steps if phase == "decode" else 1
    ctx = batch * (prompt + tokens) + 256
    # Its results go through llama.cpp's asynchronous logger, which drops
    # what it has not written yet when the program exits (the last row, 1 run
    # in 4 here; nearly always under a real-time policy, `chrt`, whose compute
    # threads starve the logger's): a cheaper configuration follows the one
    # timed (8 more tokens, or a 64-token prompt), so that the timed row is
    # written while it runs; a run that still lost it is repeated.
    decode = phase == "decode"
    cmd = [os.path.join(prefix, "bin", "llama-batched-bench"), "-m", gguf,
           "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(prompt) if decode else "%d,64" % prompt,
           "-ntg", "%d,8" % tokens if decode else "1", "-npl", str(batch),
           "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    for _ in range(8):
        p = run(cmd)
        for line in (p.stdout + p.stderr).splitlines():
            if not line.startswith('{"n_kv_max"'):
                continue
            row = json.loads(line)
            if (row["pp"], row["tg"], row["pl"]) == (prompt, tokens, batch):
                return row["speed_tg" if decode else "speed_pp"]
    raise RuntimeError("llama-batched-bench printed no result:\n" +
                       p.stdout[-2000:] + p.stderr[-2000:])


def llama_build(prefix):
    """What install_llama_cpp.sh recorded: the version and the CPU flags its
    native (-march=native) build was made for."""
    with open(os.path.join(prefix, "VERSION")) as f:
        version, _, flags = f.read().strip().partition(" ")
    if flags.endswith(" avx2-only"):
        # MOH_LLAMA_CPP_ISA=avx2: what an AVX2-only CPU's native build has.
        return ("llama-cpp-python %s's llama.cpp, AVX2 + FMA + F16C only (no "
                "AVX-512, no AVX-VNNI: an AVX2-only CPU's native build) on: %s"
                % (version, flags[:-len(" avx2-only")]))
    if flags.endswith(" no-amx"):
        # install_llama_cpp.sh named every extension but AMX instead.
        return ("llama-cpp-python %s's llama.cpp, every extension of -march=native "
                "but AMX (its AMX path dies of SIGILL here) for: %s"
                % (version, flags[:-len(" no-amx")]))
    return ("llama-cpp-python %s's llama.cpp, GGML_NATIVE=ON (-march=native) "
            "for: %s" % (version, flags))


def moh_rate(build, model_dir, precision, phase, batch, threads, steps,
             ratio, isa, has_int8, has_weights):
    decode = phase == "decode"
    flags = ["--model_dir=" + model_dir, "--ratio=%g" % ratio,
             "--threads=%d" % threads, "--batch=%d" % batch, "--repeat=1",
             "--warmup=1", "--dtype=" + MOH_DTYPE[precision],
             "--prompt_tokens=%d" % (DECODE_PROMPT if decode
                                     else PREFILL_PROMPT),
             "--max_new_tokens=%d" % (steps + 1 if decode else 1)]
    if precision == "q8_0":
        if not has_int8:
            return None
        flags.append("--weights=int8")
    elif precision == "bf16" and has_weights:
        # bfloat16 weights under float32 activations, as llama.cpp's BF16.
        flags[flags.index("--dtype=bfloat16")] = "--dtype=float32"
        flags.append("--weights=bfloat16")
    env = dict(os.environ)
    if isa:
        env["MOH_CPU_ISA"] = isa
    err = run([os.path.join(build, "tools", "moh-generate")] + flags,
              env=env).stderr
    for line in err.splitlines():
        start = line.find("batch=")
        if start >= 0 and "decode_tokens_per_s=" in line:
            f = dict(kv.split("=", 1) for kv in line[start:].split())
            return float(f["decode_tokens_per_s" if decode
                           else "prefill_tokens_per_s"])
    raise RuntimeError("moh-generate printed no throughput:\n" + err)


def bandwidth(build, threads):
    """GB/s reading 1 GiB (far past the caches) on `threads` threads."""
    out = run([os.path.join(build, "bench", "moh_read_bandwidth"),
               "--mib=1024", "--threads=%d" % threads, "--passes=3"]).stdout
    return float(json.loads(out)["gb_per_s"][str(threads)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--sizes", default="24m,1b")
    ap.add_argument("--precisions", default="f32,bf16,q8_0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--quick", action="store_true",
                    help="one round, 16 steps, the 1b size's batch-1 rows")
    ap.add_argument("--moh_isa", help="MOH_CPU_ISA for moh-generate")
    ap.add_argument("--workdir", help="models kept here (default: a temp dir)")
    ap.add_argument("--json", help="write the medians here")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 16
    prefix = llama_prefix()
    if not os.access(os.path.join(prefix, "bin", "llama-batched-bench"),
                     os.X_OK):
        sys.exit("no llama.cpp tools in %s: run scripts/install_llama_cpp.sh"
                 % prefix)
    helpfull = subprocess.run(
        [os.path.join(args.build, "tools", "moh-generate"), "--helpfull"],
        capture_output=True, text=True)
    text = helpfull.stdout + helpfull.stderr
    # --weights (bfloat16; int8 where its help names it).
    has_weights = "-weights" in text
    has_int8 = has_weights and "int8" in text.split("-weights", 1)[1][:300]
    sizes = args.sizes.split(",")
    precisions = args.precisions.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        models = {s: make_models(s, workdir, precisions, prefix)
                  for s in sizes}
        result = measure(args, prefix, models, sizes, precisions, has_int8,
                         has_weights)
    result["cpu"] = cpu_isa()
    result["moh_isa"] = args.moh_isa or "best (MOH_CPU_ISA unset)"
    report(result, sizes, precisions, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def rows_of(size, quick):
    rows = ROWS[size]
    if quick and size == "1b":
        rows = [r for r in rows if r[1] == 1]
    return rows


def measure(args, prefix, models, sizes, precisions, has_int8, has_weights):
    rates, bw = {}, {}
    for r in range(args.rounds):
        log("round %d/%d" % (r + 1, args.rounds))
        for t in (1, 2):
            bw.setdefault(t, []).append(bandwidth(args.build, t))
        for size in sizes:
            model_dir, ggufs = models[size]
            for precision in precisions:
                for row in rows_of(size, args.quick):
                    phase, batch, threads = row
                    log("  %s %s %s batch %d, %d threads" % (
                        size, precision, phase, batch, threads))
                    key = "%s|%s|%s|%d|%d" % (size, precision, phase, batch,
                                              threads)
                    steps = max(8, args.steps // STEPS_SHARE[size])
                    rate = llama_rate(prefix, ggufs[precision], phase, batch,
                                      threads, steps)
                    rates.setdefault(key + "|llama.cpp", []).append(rate)
                    for ratio in (1.0, 0.5):
                        got = moh_rate(args.build, model_dir, precision,
                                       phase, batch, threads, steps, ratio,
                                       args.moh_isa, has_int8, has_weights)
                        if got is not None:
                            rates.setdefault("%s|moh %g" % (key, ratio),
                                             []).append(got)
    weights = {s: weight_count(models[s][0]) for s in sizes}
    return {"tokens_per_s": {k: statistics.median(v)
                             for k, v in rates.items()},
            "read_gb_per_s": {t: statistics.median(v) for t, v in bw.items()},
            "weights_per_token": weights,
            "llama_cpp": llama_build(prefix),
            "rounds": args.rounds, "steps": args.steps}


def report(result, sizes, precisions, args):
    med = result["tokens_per_s"]
    print("# llama.cpp (native) beside moh-serve\n")
    print("CPU: %s  \nllama.cpp: %s  \nmoh-serve kernels: %s  " % (
        result["cpu"], result["llama_cpp"], result["moh_isa"]))
    print("Medians of %d interleaved rounds, %d decode steps (a quarter of "
          "that at 1b); read bandwidth "
          "(1 GiB): %s GB/s.\n" % (
              result["rounds"], result["steps"], ", ".join(
                  "%d thread%s %.1f" % (t, "" if t == 1 else "s", v)
                  for t, v in sorted(result["read_gb_per_s"].items()))))
    print("| size | weights | phase | batch | threads | llama.cpp tok/s | "
          "moh 1.0 / llama.cpp | moh 0.5 / llama.cpp | bound (tok/s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for precision in precisions:
            for phase, batch, threads in rows_of(size, args.quick):
                key = "%s|%s|%s|%d|%d" % (size, precision, phase, batch,
                                          threads)
                peer = med[key + "|llama.cpp"]
                cells = []
                for ratio in (1.0, 0.5):
                    mine = med.get("%s|moh %g" % (key, ratio))
                    cells.append("n/a (no int8 weights)" if mine is None
                                 else "%.2f (%.1f)" % (mine / peer, mine))
                bound = ""
                if phase == "decode" and batch == 1:
                    bytes_per_token = (result["weights_per_token"][size] *
                                       BYTES_PER_WEIGHT[precision])
                    bound = "%.1f" % (result["read_gb_per_s"][threads] * 1e9 /
                                      bytes_per_token)
                print("| %s | %s | %s | %d | %d | %.1f | %s | %s | %s |" % (
                    size, precision, phase if phase == "decode" else
                    "prefill %d" % PREFILL_PROMPT, batch, threads, peer,
                    cells[0], cells[1], bound))


if __name__ == "__main__":
    main()
