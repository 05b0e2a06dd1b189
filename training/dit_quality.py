#!/usr/bin/python3
"""Quality of the demo MoH-DiT's digits versus activation ratio, and its sample grid.

For each ratio, generates PER_CLASS images of every digit (class c, request i: seed
c * PER_CLASS + i, the same seeds at every ratio, default steps and guidance of the model's
config.json), classifies each generated image with the shipped digits classifier
(models/demo-vit, tests/reference/moh_reference.py, at its trained ratio) and prints the
accuracy: the fraction of images classified as the digit they were asked for.

Pixels: a generated image is the server's uint8 image (save_image's mapping of the final
sample: clamp to [-1, 1], (x + 1) / 2 * 255 + 0.5, truncated); the classifier gets u8 / 255,
in [0, 1] like its training pixels value / 16, then its image_mean / image_std.

Generation source (pluggable: an object with `name`, `config` (the model's md.DiTConfig) and
`generate(requests)`, md.Request list -> one uint8 [1, 8, 8] tensor per request, in order):
  reference   tests/reference/moh_dit.py's sampler in this process (sample_batch: requests
              batched as a server batches them, each with its own generator)
  server      GenerateImage over gRPC (the PNG of each request's last message): `--serve`
              starts build/service/moh-server on models/ (demo-dit is served by default),
              `--server HOST:PORT` uses a running one. The README's grid and quality table
              are made this way. With `--serve --weights float32,bfloat16,int8` it serves
              demo-dit once per precision of its linear weights (ModelConfig.weights:
              demo-dit, demo-dit-bf16, demo-dit-int8) and measures each.

Ratios 0.5 .. 1.0 and 0 (the trained K); ratios that give the same K in every block (0.625 is
the trained K of demo-dit) are generated once.  `--grid PNG` also writes the README's grid:
one row per ratio (0.5, trained, 1.0), one column per digit, the same seed everywhere,
upscaled with nearest neighbour.

Usage: /usr/bin/python3 training/dit_quality.py [--model models/demo-dit]
           [--classifier models/demo-vit] [--per-class 100] [--steps N] [--guidance G]
           [--ratios 0.5,1.0] [--grid PNG] [--json OUT]
           [--serve [--moh_server BINARY] [--threads N] [--weights float32,bfloat16,int8]
            | --server HOST:PORT [--served_as NAME]]
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see demo_common.setup

import argparse
import io
import json
import sys
import time
from collections import OrderedDict

import torch

import demo_common as dc

import moh_dit as md  # tests/reference (demo_common put it on the path)

import demo_eval

RATIOS = [0.5, 0.625, 0.75, 0.875, 1.0, 0.0]  # 0 = the trained K
GRID_RATIOS = [0.5, 0.0, 1.0]
GRID_SEED = 7
GRID_SCALE = 8  # each pixel becomes 8 x 8
GRID_GAP = 4  # pixels between images, and around
GRID_GAP_GREY = 96  # the digits' background is black
PER_CLASS = 100
BATCH = 250  # requests sampled together


class ReferenceSource:
    """Images from tests/reference/moh_dit.py's float32 sampler (what the server reproduces)."""

    name = "reference"

    def __init__(self, model_dir, batch=BATCH):
        self.model, self.vae = md.load_model(model_dir)
        self.config = self.model.config
        self.batch = batch

    def generate(self, requests):
        """requests: md.Request list -> uint8 [1, 8, 8] tensors, in order."""
        images = []
        with torch.no_grad():
            for i in range(0, len(requests), self.batch):
                for latent in md.sample_batch(self.model, requests[i:i + self.batch]):
                    images.append(md.decode_image(latent, self.vae, self.config.latent_scale))
        return images


class ServerSource:
    """Images from a moh-server's GenerateImage (training/demo_eval.py's client)."""

    name = "server"

    def __init__(self, model_dir, channel, pb, served_as="demo-dit"):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.config = md.DiTConfig(json.load(f))
        self.channel, self.pb, self.served_as = channel, pb, served_as

    def generate(self, requests):
        from PIL import Image  # python3-pil; only this source decodes PNGs

        responses = demo_eval.generate_images(self.channel, self.pb, [
            demo_eval.image_request(self.pb, q.label, q.seed, q.ratio, q.steps, q.guidance,
                                    model=self.served_as) for q in requests])
        images = []
        for r in responses:
            grey = Image.open(io.BytesIO(r.png)).convert("L")
            images.append(torch.tensor(list(grey.getdata()), dtype=torch.uint8).view(
                1, grey.height, grey.width))
        return images


class DigitsClassifier:
    """models/demo-vit through the reference ViT, at its trained ratio."""

    def __init__(self, directory):
        self.model = dc.ref.load_model(directory)
        self.mean, self.std = self.model.cfg["image_mean"][0], self.model.cfg["image_std"][0]

    def predict(self, images_u8):
        """uint8 [N, 1, 8, 8] -> predicted classes [N]."""
        x = images_u8.float() / 255.0
        with torch.no_grad():
            logits, _, _ = self.model((x - self.mean) / self.std)
        return logits.argmax(-1)


def top_k(config, ratio):
    """K per block for a request at `ratio` (0: the trained K)."""
    return [md.ref.k_for_ratio(ratio, H, S, K) for H, _, S, K in config.layers()]


def effective_ratio(config, ratio):
    """The fraction of (token, head) pairs a request at `ratio` uses (every block has T tokens)."""
    return sum(S + k for S, k in zip(config.shared_heads, top_k(config, ratio))) / sum(config.num_heads)


def measure(source, classifier, ratios=RATIOS, per_class=PER_CLASS, steps=None, guidance=None, log=dc.log):
    """{ratio: {"accuracy", "per_class", "effective_ratio", "top_k"}} for `source`'s model."""
    config = source.config
    steps = steps or config.default_steps
    guidance = guidance or config.default_guidance
    by_topk, results = {}, OrderedDict()
    for r in ratios:
        ks = tuple(top_k(config, r))
        if ks not in by_topk:
            t0 = time.time()
            reqs = [md.Request(c, c * per_class + i, steps, guidance, r)
                    for c in range(config.num_classes) for i in range(per_class)]
            labels = torch.tensor([q.label for q in reqs])
            pred = classifier.predict(torch.stack(source.generate(reqs)))
            correct = (pred == labels)
            by_topk[ks] = OrderedDict([
                ("accuracy", round(correct.float().mean().item(), 4)),
                ("per_class", [round(correct[labels == c].float().mean().item(), 3)
                               for c in range(config.num_classes)]),
                ("effective_ratio", round(effective_ratio(config, r), 4)),
                ("top_k", list(ks)),
            ])
            log("dit quality: ratio %g (K %s): accuracy %.4f over %d images, %.0fs" % (
                r, list(ks), by_topk[ks]["accuracy"], len(reqs), time.time() - t0))
        results[str(r)] = by_topk[ks]
    return OrderedDict([("source", source.name), ("classifier", "demo-vit"), ("per_class", per_class),
                        ("steps", steps), ("guidance", guidance),
                        ("seeds", "class c, image i: seed c * per_class + i"), ("by_ratio", results)])


def grid_png(source, path, ratios=GRID_RATIOS, seed=GRID_SEED):
    """One row per ratio, one column per class, the default steps and guidance, one seed."""
    config = source.config
    reqs = [md.Request(c, seed, config.default_steps, config.default_guidance, r)
            for r in ratios for c in range(config.num_classes)]
    images = source.generate(reqs)
    L, s, g = config.input_size, GRID_SCALE, GRID_GAP
    cols, rows = config.num_classes, len(ratios)
    canvas = torch.full((g + rows * (L * s + g), g + cols * (L * s + g)), GRID_GAP_GREY, dtype=torch.uint8)
    for n, img in enumerate(images):
        r, c = divmod(n, cols)
        big = img[0].repeat_interleave(s, 0).repeat_interleave(s, 1)
        y, x = g + r * (L * s + g), g + c * (L * s + g)
        canvas[y:y + L * s, x:x + L * s] = big
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(dc.png_grey(canvas.tolist()))
    return OrderedDict([("rows_ratios", ratios), ("columns_classes", list(range(cols))), ("seed", seed),
                        ("steps", config.default_steps), ("guidance", config.default_guidance),
                        ("scale", s), ("source", source.name)])


def print_table(by_weights, trained):
    """by_weights: {weights: measure()'s result}; a weights column when more than one."""
    several = len(by_weights) > 1
    per_class = next(iter(by_weights.values()))["per_class"]
    print("| ratio |%s effective ratio | digits classified as asked (demo-vit, %d per class) |"
          % (" weights |" if several else "", per_class))
    print("|---|---|---|" + ("---|" if several else ""))
    ratios = next(iter(by_weights.values()))["by_ratio"].keys()
    for r in ratios:
        for w, q in by_weights.items():
            v = q["by_ratio"][r]
            name = "trained (%s)" % trained if float(r) == 0 else r
            print("| %s |%s %.3f | %.1f%% |" % (name, " %s |" % w if several else "",
                                              v["effective_ratio"], 100 * v["accuracy"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(dc.REPO, "models", "demo-dit"))
    parser.add_argument("--classifier", default=os.path.join(dc.REPO, "models", "demo-vit"))
    parser.add_argument("--per-class", type=int, default=PER_CLASS)
    parser.add_argument("--steps", type=int, default=0, help="0: the model's default_steps")
    parser.add_argument("--guidance", type=float, default=0.0, help="0: the model's default_guidance")
    parser.add_argument("--ratios", default=",".join(str(r) for r in RATIOS))
    parser.add_argument("--grid", help="also write the sample grid PNG here")
    parser.add_argument("--json", help="also write the results here")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--serve", action="store_true",
                       help="generate through a moh-server started on --models")
    where.add_argument("--server", help="generate through this running moh-server (HOST:PORT)")
    parser.add_argument("--served_as", default="demo-dit", help="the model's name on the server")
    parser.add_argument("--moh_server", default=os.path.join(dc.REPO, "build", "service",
                                                            "moh-server"))
    parser.add_argument("--models", default=os.path.join(dc.REPO, "models"))
    parser.add_argument("--threads", type=int, default=2, help="the started server's threads")
    parser.add_argument("--weights", default="float32",
                        help="with --serve: precisions of demo-dit's linear weights, of "
                        "float32, bfloat16, int8 (one served model each)")
    args = parser.parse_args()
    weights = args.weights.split(",")
    if weights != ["float32"] and not args.serve:
        parser.error("--weights needs --serve")
    dc.setup(0, threads=1)
    proc = None
    sources = OrderedDict()
    if args.serve or args.server:
        sys.path.insert(0, os.path.join(dc.REPO, "client", "python"))
        import moh_client
        import quality_vs_ratio as qr

        for w in weights:
            if w not in qr.WEIGHTS:
                parser.error("--weights: %r is none of %s" % (w, ", ".join(qr.WEIGHTS)))
        target, log_path = args.server, None
        if args.serve:
            proc, target, log_path = qr.start_server(
                args.moh_server, args.models, args.threads,
                None if weights == ["float32"] else weights, names=("demo-dit",))
        client = moh_client.MohClient(target, timeout=120)
        qr.wait_ready(client, proc, log_path)
        for w in weights:
            served_as = args.served_as if args.server else "demo-dit" + qr.WEIGHTS[w]
            sources[w] = ServerSource(args.model, client.channel, client.pb, served_as)
    else:
        sources["float32"] = ReferenceSource(args.model)
    classifier = DigitsClassifier(args.classifier)
    by_weights = OrderedDict()
    try:
        for w, source in sources.items():
            t0 = time.time()
            q = measure(source, classifier, [float(r) for r in args.ratios.split(",")],
                        args.per_class, args.steps, args.guidance)
            q["weights"] = w
            q["seconds"] = round(time.time() - t0)
            if args.grid and w == weights[0]:
                q["grid"] = grid_png(source, args.grid)
            by_weights[w] = q
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    if args.json:
        dc.write_json(args.json, by_weights if len(by_weights) > 1 else q)
    trained = "%.4g" % effective_ratio(next(iter(sources.values())).config, 0.0)
    print_table(by_weights, trained)
    print("\n%s sampler, %d steps, guidance %g; %.0f s." % (
        q["source"], q["steps"], q["guidance"], sum(v["seconds"] for v in by_weights.values())))


if __name__ == "__main__":
    main()
