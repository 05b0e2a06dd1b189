"""Section 5 of the benchmark suite: llama.cpp (bench/llama_peer.py) beside
moh-generate on the same 24 M parameter shape, and batch-1 decode against the
machine's read bandwidth (moh_read_bandwidth)."""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from plot import Figure
from suite_common import ROOT, bench_venv_python, ratio_text, run


# Section 5: llama.cpp on the same shape, side by side (bench/llama_peer.py).
PEER_ROWS = [("decode", 1, 1), ("decode", 1, 2), ("decode", 16, 2),
             ("decode", 32, 2), ("prefill", 1, 2), ("prefill", 16, 2)]
PEER_DECODE_PROMPT = 16
PEER_PREFILL_PROMPT = 512


def moh_kv_flag(build):
    """moh-generate's --kv_cache_dtype default, or None in a build without
    the flag (its KV cache is then the model's dtype, float32 here)."""
    p = subprocess.run([os.path.join(build, "tools", "moh-generate"),
                        "--helpfull"], capture_output=True, text=True)
    text = p.stdout + p.stderr
    start = text.find("-kv_cache_dtype")
    if start < 0:
        return None
    end = text.find("default:", start)
    value = text[end:].split('"')
    return value[1] if end >= 0 and len(value) > 1 else "?"


def moh_generate_fields(build, model_dir, *flags):
    cmd = [os.path.join(build, "tools", "moh-generate"),
           "--model_dir=" + model_dir] + list(flags)
    err = run(cmd).stderr
    for line in err.splitlines():
        start = line.find("batch=")
        if start >= 0 and "decode_tokens_per_s=" in line:
            return dict(kv.split("=") for kv in line[start:].split())
    raise RuntimeError("moh-generate printed no throughput:\n" + err)


def peer_section(say, results, build, quick, lm_dir, wheel_build):
    print("5. peer: llama.cpp ...", file=sys.stderr)
    say("\n## 5. Peer: llama.cpp on the same shape\n")
    py, version = bench_venv_python()
    if not os.access(py, os.X_OK) or subprocess.run(
            [py, "-c", "import llama_cpp, gguf"],
            capture_output=True).returncode != 0:
        say("Skipped: no llama.cpp in the bench environment (%s). Install it "
            "with `bash scripts/install_deps.sh --bench` (llama-cpp-python "
            "%s, which builds llama.cpp from its sources: several minutes), "
            "then `bash bench/run_suite.sh --sections=5`.\n" %
            (os.path.dirname(os.path.dirname(py)), version))
        return
    rounds = 1 if quick else 3
    repeat = 1 if quick else 3
    steps = 16 if quick else 64
    with tempfile.TemporaryDirectory() as workdir:
        models = {}
        for name, extra in (("bench-lm", []), ("bench-dense", ["--dense"])):
            d = os.path.join(workdir, name)
            run([sys.executable, os.path.join(ROOT, "bench", "make_bench_lm.py"),
                 "--out=" + d, "--demo_dir=" + lm_dir,
                 "--max_position_embeddings=1024"] + extra)
            run([py, os.path.join(ROOT, "bench", "make_gguf.py"),
                 "--model_dir=" + d, "--out=" + d + ".gguf"])
            models[name] = d
        check = peer_check(build, py, models["bench-dense"])
        if not os.access(os.path.join(wheel_build, "tools", "moh-generate"),
                         os.X_OK):
            wheel_build = None
        peer_tables(say, results, build, py, models["bench-lm"], quick,
                    rounds, repeat, steps, check, version, wheel_build)


def peer_check(build, py, dense_dir):
    """Greedy ids of the dense variant: moh-serve's against llama.cpp's."""
    n = 16
    err = run([os.path.join(build, "tools", "moh-generate"),
               "--model_dir=" + dense_dir, "--prompt_tokens=12",
               "--max_new_tokens=%d" % n, "--print_token_ids"]).stderr
    ids = dict(line.split("=", 1) for line in err.splitlines()
               if line.startswith(("prompt_ids=", "token_ids=")))
    out = json.loads(run([py, os.path.join(ROOT, "bench", "llama_peer.py"),
                          "--model=" + dense_dir + ".gguf", "--mode=greedy",
                          "--ids=" + ids["prompt_ids"], "--tokens=%d" % n,
                          "--kv=f32", "--threads=1"]).stdout)
    moh = [int(x) for x in ids["token_ids"].split(",")]
    same = 0
    while same < n and moh[same] == out["token_ids"][same]:
        same += 1
    return same, n


def peer_tables(say, results, build, py, model_dir, quick, rounds, repeat,
                steps, check, version, wheel_build):
    gguf_path = model_dir + ".gguf"
    moh_default_kv = moh_kv_flag(build)
    # (label, llama.cpp --kv, moh-generate --kv_cache_dtype or None)
    kv_settings = [("default", "f16", None), ("f32", "f32", "float32"),
                   ("16-bit", "f16", "bfloat16")]
    if moh_default_kv is None:
        kv_settings = [("default", "f16", None), ("f32", "f32", None)]
    peer = os.path.join(ROOT, "bench", "llama_peer.py")
    bw_exe = os.path.join(build, "bench", "moh_read_bandwidth")
    # The read bandwidth from memory (1 GiB, far past the caches) and over
    # an array of the weights' size (which a large last-level cache may hold).
    weight_bytes = peer_weight_bytes(os.path.join(model_dir,
                                                  "model.safetensors"))
    bw_sizes = {"memory": 1024,
                "weights": max(1, round(weight_bytes / (1 << 20)))}
    bw_flags = ["--threads=1,2"] + (["--passes=3"] if quick else [])

    def llama(phase, batch, threads, kv):
        prompt = PEER_DECODE_PROMPT if phase == "decode" else \
            PEER_PREFILL_PROMPT
        out = run([py, peer, "--model=" + gguf_path, "--mode=" + phase,
                   "--batch=%d" % batch, "--prompt_tokens=%d" % prompt,
                   "--tokens=%d" % steps, "--threads=%d" % threads,
                   "--kv=" + kv, "--repeat=%d" % repeat]).stdout
        return json.loads(out.strip().splitlines()[-1])

    def moh(phase, batch, threads, ratio, kv, build=build):
        decode = phase == "decode"
        flags = ["--ratio=%g" % ratio, "--threads=%d" % threads,
                 "--batch=%d" % batch, "--repeat=%d" % repeat, "--warmup=1",
                 "--prompt_tokens=%d" % (PEER_DECODE_PROMPT if decode
                                         else PEER_PREFILL_PROMPT),
                 "--max_new_tokens=%d" % (steps + 1 if decode else 1)]
        if kv:
            flags.append("--kv_cache_dtype=" + kv)
        f = moh_generate_fields(build, model_dir, *flags)
        return float(f["decode_tokens_per_s" if decode
                       else "prefill_tokens_per_s"])

    # Interleaved: every round runs every configuration on every engine.
    rates, bandwidth, flash = {}, {}, set()
    for r in range(rounds):
        print("  round %d/%d" % (r + 1, rounds), file=sys.stderr)
        for size, mib in bw_sizes.items():
            bw = json.loads(run([bw_exe, "--mib=%d" % mib] +
                                bw_flags).stdout)["gb_per_s"]
            for t, v in bw.items():
                bandwidth.setdefault((size, int(t)), []).append(v)
        for label, llama_kv, moh_kv in kv_settings:
            for phase, batch, threads in PEER_ROWS:
                key = (label, phase, batch, threads)
                out = llama(phase, batch, threads, llama_kv)
                flash.add(out["flash_attn"])
                rates.setdefault(key + ("llama",), []).append(
                    out["tokens_per_s"])
                for ratio in (1.0, 0.5):
                    mkey = (moh_kv or "model dtype", phase, batch, threads,
                            ratio)
                    if label == "f32" and moh_kv is None and r < len(
                            rates.get(mkey, [])):
                        continue  # the same moh configuration as "default"
                    rates.setdefault(mkey, []).append(
                        moh(phase, batch, threads, ratio, moh_kv))
                if label == "default" and wheel_build:
                    rates.setdefault(("wheel", phase, batch, threads),
                                     []).append(
                        moh(phase, batch, threads, 1.0, None, wheel_build))
    med = {k: statistics.median(v) for k, v in rates.items()}
    bw_med = {t: statistics.median(v) for t, v in bandwidth.items()}
    results["peer"] = {
        "model": "bench-lm (24 M parameters)",
        "rows": ["%s\nbatch %d, %d thread%s" % (
            phase if phase == "decode" else "prefill %d" % PEER_PREFILL_PROMPT,
            batch, threads, "" if threads == 1 else "s")
            for phase, batch, threads in PEER_ROWS],
        "kv": [{"label": "%s (llama.cpp %s, moh-serve %s)" % (
                    label, llama_kv, moh_kv or moh_default_kv or "float32"),
                "tokens_per_s": {
                    "llama.cpp": [med[(label,) + row + ("llama",)]
                                  for row in PEER_ROWS],
                    "moh 1.0": [med[(moh_kv or "model dtype",) + row + (1.0,)]
                                for row in PEER_ROWS],
                    "moh 0.5": [med[(moh_kv or "model dtype",) + row + (0.5,)]
                                for row in PEER_ROWS]}}
               for label, llama_kv, moh_kv in kv_settings],
    }

    moh_kv_text = ("float32, its model's dtype (this moh-generate has no "
                   "--kv_cache_dtype)" if moh_default_kv is None else
                   "--kv_cache_dtype unset (default \"%s\")" % moh_default_kv)
    say("llama.cpp (the sources llama-cpp-python %s vendors, built for this CPU "
        "with llama.cpp's default native flags; CPU backend, no BLAS) reads "
        "the bench model as an F32 GGUF (bench/make_gguf.py; the MoH router "
        "left out, so llama.cpp computes every head) and runs through its C "
        "API (bench/llama_peer.py: llama_decode with one KV sequence per "
        "row); moh-serve runs in process (moh-generate). Same thread count "
        "for both (llama.cpp n_threads = n_threads_batch). Decode: batch B "
        "sequences after a %d-token prompt, %d steps of one token per "
        "sequence, greedy; prefill: B prompts of %d tokens in one call "
        "(llama.cpp splits it into its default 512-token micro-batches). Each "
        "process runs one untimed warm-up and %d timed run(s) (their median); "
        "%d interleaved round(s): tokens/s are medians over the rounds, "
        "ratios the median of each round's ratio, with their range when "
        "there are several rounds. llama.cpp flash attention: %s (its default, "
        "\"auto\"). Default KV cache: llama.cpp f16; moh-serve %s.\n" %
        (version, PEER_DECODE_PROMPT, steps, PEER_PREFILL_PROMPT,
         repeat, rounds, ", ".join(sorted(flash)), moh_kv_text))
    same, n = check
    say("GGUF check: on the same shape without a router "
        "(`make_bench_lm.py --dense`), llama.cpp's greedy continuation of a "
        "12-token prompt equals moh-serve's in %d of the first %d tokens. "
        "(The bench model's learned router weights heads even at ratio 1.0, "
        "so there its outputs differ from llama.cpp's; its costs do not.)\n"
        % (same, n))
    for label, llama_kv, moh_kv in kv_settings:
        say("\n**KV cache: %s** (llama.cpp %s, moh-serve %s)\n" %
            (label, llama_kv, moh_kv or moh_default_kv or "float32"))
        say("| phase | batch | threads | llama.cpp tok/s | moh 1.0 tok/s | "
            "moh 1.0 / llama.cpp | moh 0.5 / llama.cpp |")
        say("|---|---|---|---|---|---|---|")
        for phase, batch, threads in PEER_ROWS:
            lkey = (label, phase, batch, threads, "llama")
            mkey = (moh_kv or "model dtype", phase, batch, threads)

            def ratio(r):
                return ratio_text([m / l for m, l in zip(rates[mkey + (r,)],
                                                         rates[lkey])])
            say("| %s%s | %d | %d | %.0f | %.0f | %s | %s |" %
                (phase, " %d" % PEER_PREFILL_PROMPT if phase == "prefill"
                 else "", batch, threads, med[lkey], med[mkey + (1.0,)],
                 ratio(1.0), ratio(0.5)))

    # Every matrix is read once a token at batch 1 (the embedding table but
    # one row is not); the router's few KiB are left out.
    say("")
    say(Figure("peer_llama_cpp.png", "Tokens/s of llama.cpp, moh-serve at "
               "ratio 1.0 and at 0.5, per row and KV cache"))
    say("\n**Batch-1 decode against the read bandwidth** "
        "(`moh_read_bandwidth`: a float sum, best of %s passes, over 1 GiB "
        "(*memory*) and over an array of the weights' size (*weights*, "
        "%d MiB: a last-level cache that large holds it)). Weights read per "
        "token: %.1f MB (every matrix in float32; the embedding table, of "
        "which one row is read, left out). Share = tokens/s × weight bytes / "
        "read bandwidth at the same threads; at ratio 0.5 moh-serve skips "
        "unselected heads' projection rows, so its share counts bytes it did "
        "not need to read. Default KV cache. Target: ≥ 0.70 of memory.\n" %
        ("3" if quick else "5", bw_sizes["weights"], weight_bytes / 1e6))
    say("| threads | memory GB/s | weights-size GB/s | llama.cpp | moh 1.0 | "
        "moh 0.5 |")
    say("|---|---|---|---|---|---|")
    default_moh = kv_settings[0][2] or "model dtype"
    for threads in (1, 2):
        mem, cache = bw_med[("memory", threads)], bw_med[("weights", threads)]

        def share(tok_s):
            gb_s = tok_s * weight_bytes / 1e9
            return "%.1f GB/s: %.2f of memory %s, %.2f of weights-size" % (
                gb_s, gb_s / mem, "met" if gb_s / mem >= 0.7 else "MISSED",
                gb_s / cache)
        say("| %d | %.1f | %.1f | %s | %s | %s |" % (
            threads, mem, cache,
            share(med[("default", "decode", 1, threads, "llama")]),
            share(med[(default_moh, "decode", 1, threads, 1.0)]),
            share(med[(default_moh, "decode", 1, threads, 0.5)])))
    if wheel_build:
        say("\n**LibTorch builds** (default KV caches, ratio 1.0): moh-serve "
            "built against the PyPI torch wheel's LibTorch %s (its own BLAS "
            "and oneDNN; `scripts/build.sh --torch=wheel`, %s) beside the "
            "Debian LibTorch 1.13 build with OpenBLAS above, in the same "
            "rounds.\n" % (wheel_torch_version(), os.path.relpath(
                wheel_build, ROOT)))
        say("| phase | batch | threads | Debian tok/s | wheel tok/s | "
            "wheel / Debian | wheel / llama.cpp |")
        say("|---|---|---|---|---|---|---|")
        for phase, batch, threads in PEER_ROWS:
            deb = med[(default_moh, phase, batch, threads, 1.0)]
            whl = med[("wheel", phase, batch, threads)]
            lla = med[("default", phase, batch, threads, "llama")]
            name = phase if phase == "decode" else "prefill %d" % \
                PEER_PREFILL_PROMPT
            say("| %s | %d | %d | %.0f | %.0f | %.2f | %.2f |" %
                (name, batch, threads, deb, whl, whl / deb, whl / lla))
    say("\nCommands (one configuration; the suite passes each row's "
        "values): `$MOH_BENCH_VENV/bin/python bench/llama_peer.py "
        "--model=bench-lm.gguf --mode=decode --batch=16 --prompt_tokens=%d "
        "--tokens=%d --threads=2 --kv=f16 --repeat=%d` and "
        "`build/tools/moh-generate --model_dir=bench-lm --ratio=1 "
        "--threads=2 --batch=16 --repeat=%d --warmup=1 --prompt_tokens=%d "
        "--max_new_tokens=%d` (its `decode_tokens_per_s`); prefill rows: "
        "`--mode=prefill --prompt_tokens=512` and `--prompt_tokens=512 "
        "--max_new_tokens=1` (`prefill_tokens_per_s`); the models from "
        "`bench/make_bench_lm.py --max_position_embeddings=1024` and "
        "`bench/make_gguf.py`.\n" %
        (PEER_DECODE_PROMPT, steps, repeat, repeat, PEER_DECODE_PROMPT,
         steps + 1))


def wheel_torch_version():
    with open(os.path.join(ROOT, "scripts", "torch_wheel.env")) as f:
        for line in f:
            if line.startswith("MOH_TORCH_WHEEL_VERSION="):
                return line.split("=", 1)[1].strip()
    return "2.x"


def peer_weight_bytes(path):
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    total = 0
    for name, info in header.items():
        if name in ("__metadata__", "model.embed_tokens.weight") or \
                ".wg" in name:
            continue
        begin, end = info["data_offsets"]
        total += end - begin
    return total
