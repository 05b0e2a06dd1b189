#!/usr/bin/python3
"""Writes a random-weight MoH-DiT checkpoint of a released variant's full size,
for step-time benchmarks (the released weights are not needed to time the
model: the compute does not depend on the values).

Tensor names and shapes are tests/reference/moh_dit.py's state_dict_shapes of
the variant's config. Initialization follows DiT.initialize_weights (linear
and patch weights N(0, 0.02), biases 0, the fixed 2D sin-cos position
embedding) except that the adaLN modulation and the final layer are NOT
zeroed, so every block changes the tokens and its router sees varied inputs;
router weights N(0, 0.02) are non-degenerate (tokens pick different heads).
Stored in bfloat16 to halve the file (XL: ~1.35 GB instead of 2.7 GB); the
loader computes in float32. No VAE: config.json names none, which a step does
not need; with --in_channels 3 the model is a pixel-space one whose samples
are RGB images themselves, which moh-server can send as PNG.

  /usr/bin/python3 bench/make_bench_dit.py --variant MoH-DiT-XL/2-90 --out DIR
      [--input_size 32] [--in_channels 4]
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import checkpoint_io  # noqa: E402
import moh_dit  # noqa: E402


def random_tensor(name, shape, config, gen):
    if name == "pos_embed":
        grid = moh_dit.get_2d_sincos_pos_embed(config.hidden_size, config.grid)
        return torch.from_numpy(grid).float().reshape(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=gen) * 0.02


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", required=True, choices=sorted(moh_dit.VARIANTS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--input_size", type=int, default=32,
                        help="latent side (32: 256 px images, the released models')")
    parser.add_argument("--in_channels", type=int, default=4,
                        help="4: latents (the released models'); 3: RGB pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = {"model_type": "moh_dit", "variant": args.variant}
    if args.input_size != 32:
        config["input_size"] = args.input_size
    if args.in_channels != 4:
        config["in_channels"] = args.in_channels
    parsed = moh_dit.DiTConfig(config)
    gen = torch.Generator().manual_seed(args.seed)
    tensors = {name: random_tensor(name, shape, parsed, gen).to(torch.bfloat16)
               for name, shape in moh_dit.state_dict_shapes(parsed).items()}
    os.makedirs(args.out, exist_ok=True)
    checkpoint_io.save_safetensors(tensors, os.path.join(args.out, "model.safetensors"))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
        f.write("\n")
    params = sum(t.numel() for t in tensors.values())
    print("%s: %.1f M parameters -> %s" % (args.variant, params / 1e6, args.out))


if __name__ == "__main__":
    main()
