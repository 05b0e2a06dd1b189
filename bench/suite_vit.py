"""Section 8 of the benchmark suite: MoH-ViT TransNeXt images/s (moh-classify,
in process) on full-size random-weight checkpoints of the released S and B
shapes (bench/make_bench_transnext.py), at the variant's default ratio and
lower ones, against every head computed by the pair kernel (ratio 1.0) and
as the official code does (--attention=dense)."""
import os
import statistics
import sys
import time

from plot import Figure
from suite_common import bench_threads, made_once, ratio_text, run

# (label, variant of make_bench_transnext.py)
VIT_SHAPES = [("S", "moh_transnext_small_75"), ("B", "moh_transnext_base_75")]
# (label, requested ratio: 0 is the variant's default, attention mode); the
# last two compute every head.
VIT_CONFIGS = [("default", 0.0, "auto"), ("0.5", 0.5, "auto"),
               ("0.25", 0.25, "auto"), ("1.0", 1.0, "auto"),
               ("dense", 0.0, "dense")]
# What a cached checkpoint was made by: a change to these remakes it.
GENERATOR = ["bench/make_bench_transnext.py",
             "tests/reference/moh_transnext.py",
             "tests/reference/checkpoint_io.py"]


def bench_checkpoint(work_dir, variant):
    """The random-weight checkpoint of `variant` under work_dir, made once
    and kept while its generator is unchanged."""
    out = os.path.join(work_dir, "bench-" + variant)
    return made_once(out, GENERATOR[0], ["--variant", variant], GENERATOR)


def classify(build, model_dir, batch, repeat, threads, ratio, attention):
    """moh-classify's (images/s, effective ratio)."""
    out = run([os.path.join(build, "tools", "moh-classify"),
               "--model_dir=" + model_dir, "--batch=%d" % batch,
               "--repeat=%d" % repeat, "--warmup=1", "--threads=%d" % threads,
               "--ratio=%g" % ratio, "--attention=" + attention]).stdout
    fields = {}
    for line in out.splitlines():
        key, _, value = line.partition(": ")
        if key in ("images/s", "effective ratio"):
            fields[key] = float(value.split()[0])
    if len(fields) != 2:
        raise RuntimeError("moh-classify printed no throughput:\n" + out)
    return fields["images/s"], fields["effective ratio"]


def vit_section(say, results, build, quick, work_dir):
    print("8. MoH-ViT TransNeXt images/s (moh-classify) ...", file=sys.stderr)
    start = time.time()
    batches = [1, 4] if quick else [1, 32]
    rounds = 1 if quick else 3
    # Timed forwards per process: a batch-32 forward of B takes 10-30 s here.
    repeats = {b: (2 if quick else 5) if b == 1 else 1 for b in batches}
    threads = bench_threads()
    dirs = {label: bench_checkpoint(work_dir, variant)
            for label, variant in VIT_SHAPES}
    rates, effective = {}, {}  # (shape, batch, config) -> per round
    for r in range(rounds):
        print("  round %d/%d" % (r + 1, rounds), file=sys.stderr)
        for shape, _ in VIT_SHAPES:
            for batch in batches:
                for config, ratio, attention in VIT_CONFIGS:
                    key = (shape, batch, config)
                    rate, eff = classify(build, dirs[shape], batch,
                                         repeats[batch], threads, ratio,
                                         attention)
                    rates.setdefault(key, []).append(rate)
                    effective.setdefault(key, []).append(eff)
    seconds = time.time() - start
    med = {k: statistics.median(v) for k, v in rates.items()}
    # Pairs computed: dense computes every head whatever its gates select.
    computed = {k: 1.0 if k[2] == "dense" else statistics.median(v)
                for k, v in effective.items()}
    results["vit_throughput"] = {
        "threads": threads, "batches": batches, "seconds": seconds,
        "configs": [c for c, _, _ in VIT_CONFIGS],
        "shapes": [{
            "label": shape, "variant": variant,
            "images_per_s": {str(b): [med[(shape, b, c)]
                                      for c, _, _ in VIT_CONFIGS]
                             for b in batches},
            "effective_ratio": {str(b): [computed[(shape, b, c)]
                                         for c, _, _ in VIT_CONFIGS]
                                for b in batches},
            "selected_ratio": {str(b): [statistics.median(
                effective[(shape, b, c)]) for c, _, _ in VIT_CONFIGS]
                for b in batches},
            "images_per_s_rounds": {str(b): [rates[(shape, b, c)]
                                             for c, _, _ in VIT_CONFIGS]
                                    for b in batches}}
            for shape, variant in VIT_SHAPES],
    }

    say("\n## 8. MoH-ViT TransNeXt: images/s at each ratio\n")
    say("Full-size random-weight checkpoints of the released shapes "
        "(`bench/make_bench_transnext.py`: %s; 224 × 224 images, random "
        "pixels), classified in process by `moh-classify` at %d intra-op "
        "threads: batch %s, one untimed forward and then %s timed ones per "
        "process. Configurations: the variant's default ratio (its trained "
        "top-K), ratios 0.5 and 0.25, ratio 1.0 (every head, through the same "
        "head-sparse pair kernel) and `--attention=dense` at the default "
        "ratio (every head computed as the official code does, the gates "
        "multiplied). Stages 1 and 2 of both variants route no head (every "
        "head is shared), so a lower ratio selects fewer heads in stages 3 "
        "and 4 only: the *effective ratio* is the share of (token, head) "
        "pairs computed, summed over every layer (`moh-classify` prints it; "
        "dense computes them all, whatever its gates select). %d "
        "interleaved round(s), each running every configuration of a shape "
        "and batch one after another: images/s are medians over the rounds, "
        "ratios the median of each round's ratio%s.\n" %
        (", ".join("%s `%s`" % s for s in VIT_SHAPES), threads,
         " and ".join(str(b) for b in batches),
         " and ".join("%d (batch %d)" % (repeats[b], b) for b in batches),
         rounds, ", with their range" if rounds > 1 else ""))
    say("| shape | batch | configuration | effective ratio | images/s | "
        "/ ratio 1.0 | / dense |")
    say("|---|---|---|---|---|---|---|")
    for shape, _ in VIT_SHAPES:
        for batch in batches:
            for config, _, _ in VIT_CONFIGS:
                key = (shape, batch, config)

                def against(base):
                    return ratio_text([a / b for a, b in zip(
                        rates[key], rates[(shape, batch, base)])])
                eff = "%.3f" % computed[key]
                if config == "dense":
                    eff += " (gates select %.3f)" % statistics.median(
                        effective[key])
                say("| %s | %d | %s | %s | %.2f | %s | %s |" % (
                    shape, batch, config, eff, med[key], against("1.0"),
                    against("dense")))
    say("")
    say(Figure("vit_throughput.png", "MoH-ViT TransNeXt images/s against "
               "the effective ratio, per shape and batch"))
    say("\nCommand (one configuration; the suite passes each row's values): "
        "`/usr/bin/python3 bench/make_bench_transnext.py --variant "
        "moh_transnext_small_75 --out bench-s` and `build/tools/moh-classify "
        "--model_dir=bench-s --batch=32 --repeat=1 --warmup=1 --threads=%d "
        "--ratio=0.5` (`--ratio=0 --attention=dense` for dense). The section "
        "took %.1f min.\n" % (threads, seconds / 60))
    print("  section 8 took %.0f s" % seconds, file=sys.stderr)
