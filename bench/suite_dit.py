"""Section 9 of the benchmark suite: MoH-DiT image generation.

(a) Seconds per sampler step in process (moh-generate-image --time_steps) on
full-size random-weight checkpoints of the XL and S shapes
(bench/make_bench_dit.py) at the variant's default ratio and lower ones,
against every head computed (ratio 1.0 through the same pair kernel, and
--attention=dense as the official code computes it). (b) The batching gain of
GenerateImage through moh-server: 8 requests at once against the same 8 one
at a time (the trained demo when there is one, else a small random-weight
model), beside the same in process, and whether each request's image is the
same both ways."""
import json
import os
import statistics
import sys
import tempfile
import threading
import time

from plot import Figure
from suite_common import ROOT, bench_threads, made_once, ratio_text, run
from suite_server import Server

# (label, variant of make_bench_dit.py, latent side, timed steps per
# process): the step-time shapes. An XL step takes seconds on 2 cores, so S
# (whose routed blocks are two thirds of its 12) is measured beside it, with
# more steps; --quick runs a small S only.
STEP_SHAPES = [("XL", "MoH-DiT-XL/2-90", 32, 1), ("S", "MoH-DiT-S/2-90", 32, 3)]
QUICK_STEP_SHAPES = [("S", "MoH-DiT-S/2-90", 16, 1)]
# (label, requested ratio: 0 is the variant's default, attention mode); the
# last two compute every head.
STEP_CONFIGS = [("default", 0.0, "auto"), ("0.75", 0.75, "auto"),
                ("0.5", 0.5, "auto"), ("1.0", 1.0, "auto"),
                ("dense", 0.0, "dense")]
# The served model of (b) when there is no trained demo (models/demo-dit):
# the S shape at a small pixel-space input (RGB samples are the images: no
# VAE). CONCURRENT requests at once, and max_running (model rows per step:
# room for every one of them guided, two rows each).
SERVED = ("MoH-DiT-S/2-90", 16)
CONCURRENT = 8
# What a cached checkpoint was made by: a change to these remakes it.
GENERATOR = ["bench/make_bench_dit.py", "tests/reference/moh_dit.py",
             "tests/reference/checkpoint_io.py"]


def bench_checkpoint(work_dir, variant, input_size, in_channels=4):
    name = "bench-%s-%d-%d" % (variant.replace("/", "_"), input_size,
                               in_channels)
    return made_once(os.path.join(work_dir, name), GENERATOR[0],
                     ["--variant", variant, "--input_size", str(input_size),
                      "--in_channels", str(in_channels)], GENERATOR)


def routing_text(variant):
    """Which blocks of `variant` route, and their K at each ratio measured
    (tests/reference/moh_dit.py's variant table and k_for_ratio)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
    import moh_dit  # noqa: E402  (imports torch: only when the section runs)
    layers = moh_dit.DiTConfig({"variant": variant}).layers()
    routed = [i for i, (_, _, _, k) in enumerate(layers) if k > 0]
    blocks = ("blocks %d-%d" % (routed[0], routed[-1])
              if routed == list(range(routed[0], routed[-1] + 1)) else
              "blocks " + ", ".join(map(str, routed)))
    parts = []
    for h, s, k in sorted({(h, s, k) for h, _, s, k in layers if k > 0}):
        ks = ", ".join("%d at %s" % (
            moh_dit.ref.k_for_ratio(ratio, h, s, k),
            "ratio " + label if ratio else "the default")
            for label, ratio, attention in STEP_CONFIGS
            if attention == "auto")
        parts.append("%d heads: %d shared, and of %d routed ones K = %s" %
                     (h, s, h - s, ks))
    return ("%s of %d route (%s); the other blocks compute every head at any "
            "ratio" % (blocks, len(layers), "; ".join(parts)))


def step_seconds(build, model_dir, time_steps, threads, ratio=0.0,
                 attention="auto", batch=1):
    """moh-generate-image's (seconds per step, effective ratio, rows)."""
    out = run([os.path.join(build, "tools", "moh-generate-image"),
               "--model_dir=" + model_dir, "--batch=%d" % batch,
               "--time_steps=%d" % time_steps, "--threads=%d" % threads,
               "--ratio=%g" % ratio, "--attention=" + attention]).stdout
    fields = {}
    for line in out.splitlines():
        key, _, value = line.partition(": ")
        if key in ("step seconds", "effective ratio"):
            fields[key] = float(value.split()[0])
        if key == "step seconds":
            fields["rows"] = int(value.split("rows ")[1].split(",")[0])
    if len(fields) != 3:
        raise RuntimeError("moh-generate-image printed no step time:\n" + out)
    return fields["step seconds"], fields["effective ratio"], fields["rows"]


def load_api(workdir):
    """The generated moh.v1 messages and stubs (client/python/gen_stubs.sh),
    as tests/integration/conftest.py makes them."""
    import importlib
    stub_dir = os.path.join(workdir, "stubs")
    run(["bash", os.path.join(ROOT, "client", "python", "gen_stubs.sh"),
         stub_dir])
    sys.path.insert(0, stub_dir)
    importlib.invalidate_caches()
    return (importlib.import_module("moh.v1.inference_pb2"),
            importlib.import_module("moh.v1.inference_pb2_grpc"))


def generate_images(api, port, seeds, steps, concurrent):
    """GenerateImage for each seed (class 1, the model's default guidance),
    one after another or all at once: (seconds for all, {seed: PNG bytes},
    per-request seconds)."""
    import grpc
    pb, pb_grpc = api
    pngs, latency, errors = {}, {}, []
    with grpc.insecure_channel("127.0.0.1:%d" % port) as channel:
        stub = pb_grpc.InferenceStub(channel)

        def one(seed):
            start = time.monotonic()
            try:
                for response in stub.GenerateImage(pb.GenerateImageRequest(
                        model="dit", class_index=1, seed=seed, steps=steps),
                        timeout=600):
                    if response.png:
                        pngs[seed] = response.png
            except grpc.RpcError as e:
                errors.append("seed %d: %s" % (seed, e))
            latency[seed] = time.monotonic() - start

        start = time.monotonic()
        if concurrent:
            threads = [threading.Thread(target=one, args=(s,)) for s in seeds]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for s in seeds:
                one(s)
        seconds = time.monotonic() - start
    if errors or len(pngs) != len(seeds):
        raise RuntimeError("GenerateImage failed: %s" % "; ".join(errors))
    return seconds, pngs, [latency[s] for s in seeds]


def step_time_part(say, build, quick, work_dir):
    """Writes 9a; returns its numbers (results.json's "dit"/"step")."""
    shapes = QUICK_STEP_SHAPES if quick else STEP_SHAPES
    rounds = 1 if quick else 3
    threads = bench_threads()
    dirs = {label: bench_checkpoint(work_dir, variant, size)
            for label, variant, size, _ in shapes}
    seconds, effective, rows = {}, {}, {}  # (shape, config) -> per round
    for r in range(rounds):
        print("  step time, round %d/%d" % (r + 1, rounds), file=sys.stderr)
        for shape, _, _, time_steps in shapes:
            for config, ratio, attention in STEP_CONFIGS:
                key = (shape, config)
                s, eff, rows[shape] = step_seconds(
                    build, dirs[shape], time_steps, threads, ratio,
                    attention)
                seconds.setdefault(key, []).append(s)
                effective.setdefault(key, []).append(eff)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    computed = {k: 1.0 if k[1] == "dense" else statistics.median(v)
                for k, v in effective.items()}
    numbers = {
        "threads": threads, "configs": [c for c, _, _ in STEP_CONFIGS],
        "shapes": [{
            "label": shape, "variant": variant, "input_size": size,
            "rows": rows[shape], "timed_steps": time_steps,
            "step_seconds": [med[(shape, c)] for c, _, _ in STEP_CONFIGS],
            "effective_ratio": [computed[(shape, c)]
                                for c, _, _ in STEP_CONFIGS],
            "selected_ratio": [statistics.median(effective[(shape, c)])
                               for c, _, _ in STEP_CONFIGS]}
            for shape, variant, size, time_steps in shapes],
    }
    say("### 9a. Seconds per sampler step at each ratio (in process)\n")
    say("Random-weight checkpoints of the released shapes "
        "(`bench/make_bench_dit.py`: %s), "
        "one guided request (guidance 4: the class and the null-class row, 2 "
        "rows per step) sampled in process by `moh-generate-image` at %d "
        "intra-op thread(s): one untimed step, then %s per process. "
        "Configurations: the variant's default ratio (its trained "
        "top-K), ratios 0.75 and 0.5, ratio 1.0 (every head, through the "
        "same head-sparse pair kernel) and `--attention=dense` at the default "
        "ratio (every head computed as the official code does, the gates "
        "multiplied). %s. The *effective ratio* is the share of (token, "
        "head) pairs computed over every block (dense computes them all). %d "
        "interleaved round(s), each running every configuration one after "
        "another: seconds are medians over the rounds, ratios the median of "
        "each round's ratio%s.\n" %
        (", ".join("%s `%s` at latent %d × %d (%d px)" %
                   (label, variant, size, size, size * 8)
                   for label, variant, size, _ in shapes), threads,
         " and ".join("%d timed (%s)" % (n, label)
                      for label, _, _, n in shapes),
         "; ".join("%s: %s" % (label, routing_text(variant))
                   for label, variant, _, _ in shapes),
         rounds, ", with their range" if rounds > 1 else ""))
    say("| shape | configuration | effective ratio | s / step | ratio 1.0 / "
        "this | dense / this |")
    say("|---|---|---|---|---|---|")
    for shape, _, _, _ in shapes:
        for config, _, _ in STEP_CONFIGS:
            key = (shape, config)

            def speedup(base):
                return ratio_text([b / a for a, b in zip(
                    seconds[key], seconds[(shape, base)])])
            eff = "%.3f" % computed[key]
            if config == "dense":
                eff += " (gates select %.3f)" % statistics.median(
                    effective[key])
            say("| %s | %s | %s | %.3f | %s | %s |" % (
                shape, config, eff, med[key], speedup("1.0"),
                speedup("dense")))
    say("")
    say("Command (one configuration; the suite passes each row's values): "
        "`/usr/bin/python3 bench/make_bench_dit.py --variant %s "
        "--input_size %d --out bench-dit` and `build/tools/moh-generate-image "
        "--model_dir=bench-dit --batch=1 --time_steps=%d --threads=%d "
        "--ratio=0.5` (`--ratio=0 --attention=dense` for dense).\n" %
        (shapes[0][1], shapes[0][2], shapes[0][3], threads))
    return numbers


def served_model(work_dir):
    """(directory, name, Markdown description, guidance) of (b)'s model: the
    trained demo when the repository has one, else SERVED's random
    weights."""
    demo = os.path.join(ROOT, "models", "demo-dit")
    if os.path.exists(os.path.join(demo, "config.json")):
        with open(os.path.join(demo, "config.json")) as f:
            c = json.load(f)
        size, channels = c.get("input_size", 32), c.get("in_channels", 4)
        return (demo, "demo-dit, %d × %d" % (size, size),
                "`models/demo-dit` (the trained demo: %d × %d, %d channel(s)%s)"
                % (size, size, channels,
                   ", with its VAE" if c.get("vae") else ", pixel space"),
                c.get("default_guidance", 4.0))
    variant, size = SERVED
    return (bench_checkpoint(work_dir, variant, size, in_channels=3),
            "%s, %d × %d pixels" % (variant, size, size),
            "a random-weight `%s` (`bench/make_bench_dit.py --input_size %d "
            "--in_channels 3`: pixel space, %d × %d RGB, no VAE)" %
            (variant, size, size, size), 4.0)


def batching_part(say, build, quick, work_dir):
    """Writes 9b; returns its numbers (results.json's "dit"/"batching")."""
    model_dir, name, description, guidance = served_model(work_dir)
    rounds = 1 if quick else 3
    steps = 4 if quick else 10
    seeds = list(range(CONCURRENT))
    one, many = "one at a time", "%d at once" % CONCURRENT
    # (way, mode) -> images/s per round; mode -> request latencies.
    rates, latency = {}, {one: [], many: []}
    identical = True
    with tempfile.TemporaryDirectory() as workdir:
        api = load_api(workdir)
        server = Server(build, [("dit", model_dir)], workdir,
                        max_running=2 * CONCURRENT)
        threads = server.threads or bench_threads()
        try:
            # One image first: the server's first requests are slower.
            generate_images(api, server.port, [99], 2, False)
            for r in range(rounds):
                print("  GenerateImage, round %d/%d" % (r + 1, rounds),
                      file=sys.stderr)
                # Alternate which goes first, against drift.
                modes = [one, many] if r % 2 == 0 else [many, one]
                pngs = {}
                for mode in modes:
                    batch = 1 if mode == one else CONCURRENT
                    s = step_seconds(build, model_dir, steps - 1, threads,
                                     batch=batch)[0]
                    rates.setdefault(("in process", mode), []).append(
                        batch / (steps * s))
                    seconds, pngs[mode], lat = generate_images(
                        api, server.port, seeds, steps, mode == many)
                    rates.setdefault(("moh-server", mode), []).append(
                        len(seeds) / seconds)
                    latency[mode].extend(lat)
                identical = identical and pngs[one] == pngs[many]
        finally:
            server.stop()
    ways = ["in process", "moh-server"]
    gains = {w: [m / o for o, m in zip(rates[(w, one)], rates[(w, many)])]
             for w in ways}
    numbers = {
        "model": name,
        "requests": CONCURRENT, "steps": steps, "threads": threads,
        "modes": [one, many],
        "images_per_s": {w: [statistics.median(rates[(w, m)])
                             for m in (one, many)] for w in ways},
        "gain": {w: statistics.median(gains[w]) for w in ways},
        "latency_p50_s": [statistics.median(latency[m]) for m in (one, many)],
        "identical_images": identical,
    }
    say("\n### 9b. Batching gain of GenerateImage\n")
    say("%s%s, %d requests (class 1, seeds 0-%d, %d steps, the model's "
        "guidance %g: %d row(s) each) one at a time and all %d at once, at %d intra-op thread(s): through "
        "moh-server (`generation { max_running: %d }`: model rows per step, "
        "room for all %d guided; its default threads), "
        "sent from Python (grpcio; at once: one thread each), images/s = %d "
        "/ the wall time from the first request to the last image; and in "
        "process, sampler steps only (`moh-generate-image --batch=1` and "
        "`--batch=%d --time_steps=%d` at the same threads: images/s = batch "
        "/ (%d × seconds per step)), the most batching can gain when every "
        "request steps together. Medians of %d interleaved round(s), the "
        "gain the median of each round's ratio. Each request's image is the "
        "same both ways through the server: **%s**.\n" %
        (description[0].upper(), description[1:], CONCURRENT,
         CONCURRENT - 1, steps, guidance, 2 if guidance != 1 else 1,
         CONCURRENT, threads, 2 * CONCURRENT, CONCURRENT, CONCURRENT,
         CONCURRENT, steps - 1,
         steps,
         rounds, "yes" if identical else "NO"))
    say("| | images/s, %s | images/s, %s | gain |" % (one, many))
    say("|---|---|---|---|")
    for w in ways:
        say("| %s | %.2f | %.2f | %s |" % (
            w, statistics.median(rates[(w, one)]),
            statistics.median(rates[(w, many)]), ratio_text(gains[w])))
    say("\nRequest latency through moh-server, p50: %.3f s one at a time, "
        "%.3f s at once.\n" % tuple(numbers["latency_p50_s"]))
    return numbers


def dit_section(say, results, build, quick, work_dir):
    print("9. MoH-DiT: step time and GenerateImage batching ...",
          file=sys.stderr)
    start = time.time()
    say("\n## 9. MoH-DiT image generation: step time at each ratio, "
        "batching gain\n")
    step = step_time_part(say, build, quick, work_dir)
    batching = batching_part(say, build, quick, work_dir)
    seconds = time.time() - start
    results["dit"] = {"seconds": seconds, "step": step, "batching": batching}
    say(Figure("dit.png", "MoH-DiT seconds per step against the effective "
               "ratio, and GenerateImage images/s one at a time and "
               "batched"))
    say("\nThe section took %.1f min.\n" % (seconds / 60))
    print("  section 9 took %.0f s" % seconds, file=sys.stderr)
