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
      [--attention_heavy]  (hidden 256 in 16 heads of 16, 4 KV heads, 4 shared
                  + 6 of 12 routed, 4 layers, SwiGLU 512, 2048 positions: at a
                  1536-token prompt attention is about half of a prefill, the
                  shape on which head-sparse prefill is judged; RESULTS.md 17)
      [--layout llama3-8b|llama3-1b [--device cuda]]

--layout writes the released MoH-LLaMA3-8B layout instead (bench/gpu_bench.py,
the GPU benchmark): its config.json as released (no MoH fields, an auto_map to
its own modeling code, so the query-norm router with 16 shared and 8 of 16
routed heads: ratio 0.75 by default), bfloat16 weights in 5 GB safetensors
shards with an index, 128256-token vocabulary (the demo tokenizer's 768 ids are
the ones used). llama3-1b is the same with LLaMA-3.2-1B's sizes (hidden 2048,
16 layers, 32 heads / 8 KV heads, MLP 8192, tied embeddings) for quick runs. Weights are drawn
on --device (default: cuda when present) one shard at a time, so an 8B
checkpoint needs about 6 GB of host memory beyond the page cache.
"""
import argparse
import json
import math
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
    parser.add_argument("--attention_heavy", action="store_true",
                        help="16 heads of 16 dimensions, 4 layers (above)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS),
                        help="a released layout in bfloat16 (see above)")
    parser.add_argument("--device", help="where --layout's weights are drawn")
    args = parser.parse_args()
    if args.layout:
        return released_layout(args)
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
    if args.attention_heavy:
        cfg.update({
            "hidden_size": 256,
            "num_attention_heads": 16,
            "num_hidden_layers": 4,
            "intermediate_size": 512,
            "moh_shared_heads": 4,
            "moh_routed_top_k": 6,
            "max_position_embeddings": 2048,
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


# MoH-LLaMA3-8B (LLaMA-3-8B's shape) and a 1B layout of LLaMA-3.2-1B's shape.
LAYOUTS = {
    "llama3-8b": {"hidden_size": 4096, "num_hidden_layers": 32,
                  "intermediate_size": 14336},
    "llama3-1b": {"hidden_size": 2048, "num_hidden_layers": 16,
                  "intermediate_size": 8192, "tie_word_embeddings": True},
    # For rehearsing bench/gpu_bench.py on a CPU (--device=cpu --quick).
    "llama3-tiny": {"hidden_size": 256, "num_hidden_layers": 2,
                    "intermediate_size": 512},
}
SHARD_BYTES = 5 << 30


def released_config(layout, demo):
    """config.json as MoH-LLaMA3-8B ships it, with the demo's special ids."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_llama.LlamaConfig",
                     "AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"},
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "bos_token_id": demo["bos_token_id"],
        "eos_token_id": demo["eos_token_id"],
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "attention_bias": False,
    }
    cfg.update(LAYOUTS[layout])
    return cfg


def released_tensors(cfg, layer):
    """(name, shape, std) of one layer's tensors; layer -1: the others."""
    C, H, KV = (cfg["hidden_size"], cfg["num_attention_heads"],
                cfg["num_key_value_heads"])
    hd, inter, vocab = C // H, cfg["intermediate_size"], cfg["vocab_size"]
    if layer < 0:
        if cfg["tie_word_embeddings"]:  # the table is the output layer too
            return [("model.embed_tokens.weight", (vocab, C), C ** -0.5),
                    ("model.norm.weight", (C,), None)]
        return [("model.embed_tokens.weight", (vocab, C), 1.0),
                ("model.norm.weight", (C,), None),
                ("lm_head.weight", (vocab, C), C ** -0.5)]
    p = "model.layers.%d." % layer
    # std 1/sqrt(fan in), halved: activations stay near unit scale.
    return [(p + "input_layernorm.weight", (C,), None),
            (p + "self_attn.q_proj.weight", (H * hd, C), 0.5 * C ** -0.5),
            (p + "self_attn.k_proj.weight", (KV * hd, C), 0.5 * C ** -0.5),
            (p + "self_attn.v_proj.weight", (KV * hd, C), 0.5 * C ** -0.5),
            (p + "self_attn.o_proj.weight", (C, H * hd), 0.5 * (H * hd) ** -0.5),
            (p + "post_attention_layernorm.weight", (C,), None),
            (p + "mlp.gate_proj.weight", (inter, C), 0.5 * C ** -0.5),
            (p + "mlp.up_proj.weight", (inter, C), 0.5 * C ** -0.5),
            (p + "mlp.down_proj.weight", (C, inter), 0.5 * inter ** -0.5)]


def released_layout(args):
    with open(os.path.join(args.demo_dir, "config.json")) as f:
        demo = json.load(f)
    cfg = released_config(args.layout, demo)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(7)
    eos = cfg["eos_token_id"]
    eos = [eos] if isinstance(eos, int) else eos
    os.makedirs(args.out, exist_ok=True)
    specs = released_tensors(cfg, -1)
    for layer in range(cfg["num_hidden_layers"]):
        specs += released_tensors(cfg, layer)
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = 2 * math.prod(spec[1])
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        tensors = {}
        for name, shape, std in shard:
            if std is None:  # a norm's weight
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
            else:
                t = torch.randn(shape, generator=gen, device=device) * std
            if name == "lm_head.weight" or (
                    cfg["tie_word_embeddings"] and "embed_tokens" in name):
                t[eos] = 0  # end of sequence never wins: every run is full
            tensors[name] = t.to(torch.bfloat16).cpu()
            total += tensors[name].numel() * 2
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        checkpoint_io.save_safetensors(
            tensors, os.path.join(args.out, fname), {"format": "pt"})
        weight_map.update({name: fname for name in tensors})
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total},
                   "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(os.path.join(args.demo_dir, name), args.out)
    print("%s: %s layout, %.2f B parameters, %d shards, drawn on %s" %
          (args.out, args.layout, total / 2e9, len(shards), device))


if __name__ == "__main__":
    main()
