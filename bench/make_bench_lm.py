#!/usr/bin/python3
"""Writes a random-weight MoH-LLaMA checkpoint for throughput benchmarks.

The shipped demo model is tiny (0.9 M parameters): a decode step costs about
as much as the bookkeeping around it, so serving overhead measured on it is
mostly per-token RPC work. This model has the demo's tokenizer and a size
where the model's compute matters (hidden 512, 8 layers, 8 heads / 4 KV heads,
2 shared + 4 routed, learned router: 24 M parameters). Its weights are
random, so its text is noise; its end-of-sequence token can never win greedy
decoding (a zero row of lm_head), so every run generates exactly the tokens
asked for.

  /usr/bin/python3 bench/make_bench_lm.py --out DIR [--demo_dir models/demo-lm]
      [--max_position_embeddings N]  (default: the demo's, 256)
      [--dense]  (no router: a plain LLaMA of the same shape, which llama.cpp
                  computes exactly; bench/suite.py checks its GGUF with it)
"""
import argparse
import json
import os
import shutil
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import checkpoint_io  # noqa: E402
import make_fixtures  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--demo_dir", default=os.path.join(ROOT, "models",
                                                           "demo-lm"))
    parser.add_argument("--max_position_embeddings", type=int,
                        help="longest sequence (default: the demo's)")
    parser.add_argument("--dense", action="store_true",
                        help="no MoH router (every head, weight 1)")
    args = parser.parse_args()
    with open(os.path.join(args.demo_dir, "config.json")) as f:
        demo = json.load(f)
    cfg = dict(demo)
    cfg.update({
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_hidden_layers": 8,
        "intermediate_size": 1376,
        "tie_word_embeddings": False,
        "moh_shared_heads": 2,
        "moh_routed_top_k": 4,
    })
    if args.max_position_embeddings:
        cfg["max_position_embeddings"] = args.max_position_embeddings
    if args.dense:
        cfg["moh_router"] = "dense"
        del cfg["moh_shared_heads"], cfg["moh_routed_top_k"]
    tensors = make_fixtures.llama_tensors(cfg, seed=7, dtype=torch.float32)
    # Scaled down so activations stay in a sane range over 8 layers.
    for name, t in tensors.items():
        if name.endswith("proj.weight"):
            t.mul_(0.25)
    for eos in ([cfg["eos_token_id"]] if isinstance(cfg["eos_token_id"], int)
                else cfg["eos_token_id"]):
        tensors["lm_head.weight"][eos].zero_()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(os.path.join(args.demo_dir, name), args.out)
    checkpoint_io.save_safetensors(
        tensors, os.path.join(args.out, "model.safetensors"), {"format": "pt"})
    params = sum(t.numel() for t in tensors.values())
    print("%s: %.1f M parameters" % (args.out, params / 1e6))


if __name__ == "__main__":
    main()
