#!/usr/bin/python3
"""Writes a random-weight MoH-ViT TransNeXt checkpoint of a released variant's
full size, for throughput benchmarks (the released weights are not needed to
time the model: the compute does not depend on the values).

Initialization follows TransNeXt._init_weights (linear weights N(0, 0.02),
conv weights N(0, sqrt(2 / fan_out)), LayerNorm 1 and 0) and the attention
modules' own (temperature so that softplus gives 1 / 0.24, query embedding and
learnable tokens N(0, 0.02), local bias N(0, 0.0004)), so routing spreads
tokens over heads as a trained model's does roughly.

  /usr/bin/python3 bench/make_bench_transnext.py --variant moh_transnext_small_75 --out DIR
"""
import argparse
import json
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import checkpoint_io  # noqa: E402
import moh_transnext  # noqa: E402


def random_tensor(name, shape, gen):
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("temperature"):
        return torch.full(shape, math.log(math.exp(1 / 0.24) - 1))
    if leaf in ("query_embedding", "learnable_tokens"):
        return torch.randn(shape, generator=gen) * 0.02
    if leaf == "relative_pos_bias_local":
        return torch.randn(shape, generator=gen) * 0.0004
    if leaf == "learnable_bias" or leaf == "bias":
        return torch.zeros(shape)
    if ".norm" in name or name.startswith("norm") or "norm1" in name or "norm2" in name:
        return torch.ones(shape)
    if len(shape) == 4:  # convolutions
        fan_out = shape[0] * shape[2] * shape[3]
        groups = shape[0] if shape[1] == 1 else 1
        return torch.randn(shape, generator=gen) * math.sqrt(2.0 / (fan_out // groups))
    return torch.randn(shape, generator=gen) * 0.02


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", required=True, choices=sorted(moh_transnext.VARIANTS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = moh_transnext.variant_config(args.variant)
    gen = torch.Generator().manual_seed(args.seed)
    tensors = {name: random_tensor(name, tuple(shape), gen)
               for name, shape in moh_transnext.state_dict_shapes(config).items()}
    os.makedirs(args.out, exist_ok=True)
    checkpoint_io.save_safetensors(tensors, os.path.join(args.out, "model.safetensors"))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    params = sum(t.numel() for t in tensors.values())
    print("%s: %.1f M parameters -> %s" % (args.variant, params / 1e6, args.out))


if __name__ == "__main__":
    main()
