#!/usr/bin/env python3
"""Writes an F32 GGUF of a moh-serve LLaMA-layout model directory for llama.cpp.

The benchmark suite's peer engine (llama.cpp, bench/llama_peer.py) reads this
file. Input: config.json and model.safetensors (or the shards its index
names) with the Hugging Face LLaMA tensor names (bench/make_bench_lm.py writes
such a directory). Output: the
"llama" architecture's keys and tensors under llama.cpp's names, every tensor
float32 (file type ALL_F32). As llama.cpp's own Hugging Face converter does,
the rows of the q and k projections are permuted per head from the Hugging
Face rotate-half RoPE layout to the interleaved pairs llama.cpp rotates.

MoH router weights (`...self_attn.router...`, `wg...`) are not written:
llama.cpp computes every head with weight 1, the dense shape of moh-serve at
ratio 1.0 (for a model whose router scales heads, a learned router, the
outputs then differ; the shapes and the costs are the same). The vocabulary
is llama.cpp's "none" type of the model's size: the benchmark feeds token
ids, so no tokenizer is needed.

Runs in the bench virtual environment (gguf and numpy; scripts/bench_venv.env):
  $MOH_BENCH_VENV/bin/python bench/make_gguf.py --model_dir DIR --out FILE.gguf
"""
import argparse
import json
import os
import re
import sys

import numpy as np

import gguf

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_safetensors(path):
    """{name: float32 ndarray} of one .safetensors file (numpy only)."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            sys.exit("%s: tensor %s has dtype %s (want F32, F16 or BF16)" %
                     (path, name, info["dtype"]))
        begin, end = info["data_offsets"]
        a = np.frombuffer(data[begin:end], dtype=_DTYPES[info["dtype"]])
        if info["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = a.astype(np.float32).reshape(info["shape"])
    return tensors


def read_model(model_dir):
    """{name: float32 ndarray} of model.safetensors, or of every shard that
    model.safetensors.index.json names (the released layouts')."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(model_dir, "model.safetensors"))
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for shard in shards:
        tensors.update(read_safetensors(os.path.join(model_dir, shard)))
    return tensors


def permute_rope(w, n_head):
    """Per head, rows [first halves | second halves] -> interleaved pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(os.path.join(args.model_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("rope_scaling"):
        sys.exit("make_gguf: rope_scaling is not supported")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        sys.exit("make_gguf: biases are not supported")
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_head)
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // n_head
    tensors = read_model(args.model_dir)

    writer = gguf.GGUFWriter(args.out, "llama")
    writer.add_name(os.path.basename(os.path.abspath(args.model_dir)))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(cfg.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_tokenizer_model("none")

    layer_re = re.compile(r"model\.layers\.(\d+)\.(.+)")
    written, skipped = 0, []
    for name, t in tensors.items():
        m = layer_re.fullmatch(name)
        if m and m.group(2) in _LAYER_NAMES:
            suffix = m.group(2)
            if suffix == "self_attn.q_proj.weight":
                t = permute_rope(t, n_head)
            elif suffix == "self_attn.k_proj.weight":
                t = permute_rope(t, n_kv)
            out = "blk.%s.%s" % (m.group(1), _LAYER_NAMES[suffix])
        elif name in _GLOBAL_NAMES:
            out = _GLOBAL_NAMES[name]
        else:
            skipped.append(name)  # the MoH router
            continue
        writer.add_tensor(out, np.ascontiguousarray(t))
        written += 1
    if "lm_head.weight" not in tensors and not cfg.get("tie_word_embeddings",
                                                        True):
        sys.exit("make_gguf: no lm_head.weight and tie_word_embeddings false")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print("%s: %d tensors (float32), %d router tensors left out" %
          (args.out, written, len(skipped)))


if __name__ == "__main__":
    main()
