"""Writes the tiny MoH checkpoints and golden outputs the C++ tests compare against.

Usage: /usr/bin/python3 tests/reference/make_fixtures.py OUTDIR

Deterministic and idempotent: OUTDIR/stamp holds a hash of the reference scripts (and
the torch version); when it matches, nothing is regenerated.  Everything is built in a
temporary sibling directory and renamed into place, so a half-written OUTDIR never
carries a valid stamp.

Layout (see tests/reference/README.md for the full schema):
  llama_qnorm/            imitates released MoH-LLaMA3-8B: config without MoH fields but
                          with auto_map (-> query-norm router, S = H/2, K = H/4), bf16
                          weights in sharded pytorch_model-*.bin + index, tokenizer.json,
                          generation_config.json, golden.json
  llama_learned/          learned router, per-layer K, tied embeddings, F32
                          model.safetensors (+ tokenizer, generation_config, golden)
  llama_learned_sharded/  the same tensors and config, sharded safetensors + index
  llama_learned_bin/      the same tensors and config, one pytorch_model.bin
  llama_learned_int8_compressed_tensors/, llama_learned_int8_bitsandbytes/
                          the same with the decoder's linear weights pre-quantized to
                          int8 (a scale per row) in those tools' layouts, with their
                          quantization_config (no golden: what `weights: "int8"` makes
                          of llama_learned is what they hold)
  vit_learned/            MoH-ViT (timm names), F16 model.safetensors, golden.json
  transnext_tiny/, transnext_tiny_st/, transnext_tiny_b/, preprocess/,
  transnext_manifest.json MoH-ViT on TransNeXt (make_transnext_fixtures.py)
  dit_tiny/, dit_tiny_vae/, dit_tiny_vae_old/, dit_tiny_pixels/,
  dit_manifest.json       MoH-DiT image generation (make_dit_fixtures.py)
  stamp
"""
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import checkpoint_io  # noqa: E402
import make_dit_fixtures  # noqa: E402
from gpt2_bytes import (bytes_to_unicode,  # noqa: E402
                        byte_level_bpe_tokenizer_json)
import make_transnext_fixtures  # noqa: E402
import moh_reference as ref  # noqa: E402

RATIOS = [0.0, 0.5, 0.75, 1.0]
NEW_TOKENS = 8
MIN_TOPK_MARGIN = 1e-3   # relative gap (s_K - s_{K+1}) / s_K of the routing scores
MIN_GREEDY_MARGIN = 1e-2  # top-1 minus top-2 logit
MAX_SEEDS = 200
BOS, EOS = 318, 319

LLAMA_QNORM_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_llama.LlamaConfig",
                 "AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"},
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 160,
    "vocab_size": 320,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 256,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "attention_bias": False,
}

LLAMA_LEARNED_CONFIG = dict(LLAMA_QNORM_CONFIG)
del LLAMA_LEARNED_CONFIG["auto_map"]
LLAMA_LEARNED_CONFIG.update({
    "num_key_value_heads": 4,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "moh_router": "learned",
    "moh_shared_heads": 2,
    "moh_routed_top_k": [3, 2],
})

VIT_CONFIG = {
    "model_type": "moh_vit",
    "image_size": 16,
    "patch_size": 4,
    "num_channels": 3,
    "hidden_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "intermediate_size": 96,
    "layer_norm_eps": 1e-6,
    "labels": ["zero", "one", "two", "three", "four"],
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.25, 0.25, 0.25],
    "moh_router": "learned",
    "moh_shared_heads": [2, 1, 6],
    "moh_routed_top_k": [2, 3, 0],
}

PROMPT_LENGTHS = [5, 11, 8]

BPE_TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. Then the fox sat in the shade of the "
    "tree and thought about the other animals that lived in the forest. There were "
    "rabbits and deer, and there was the old owl that watched them all at night. The "
    "owl said that the weather would change, and the fox said that it was the best "
    "time of the year. In the morning the sun came up over the hills, and the animals "
    "went out to find something to eat. It is not easy to live in the forest, but they "
    "were happy there, and they stayed together through the winter and the spring."
)
NUM_MERGES = 62


# ----------------------------------------------------------------------------------
# tokenizer.json: byte-level BPE, 256 byte tokens + 62 merges + 2 special = 320
# ----------------------------------------------------------------------------------
# GPT-2 pre-tokenizer regex, restricted to what `re` can express (the training text is ASCII)
_PRETOKENIZE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


def train_bpe(text, num_merges):
    b2u = bytes_to_unicode()
    words = {}
    for w in _PRETOKENIZE.findall(text):
        key = tuple(b2u[b] for b in w.encode("utf-8"))
        words[key] = words.get(key, 0) + 1
    vocab = {b2u[b]: b for b in range(256)}
    merges = []
    while len(merges) < num_merges:
        counts = {}
        for w, c in words.items():
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + c
        candidates = sorted((-c, p) for p, c in counts.items() if p[0] + p[1] not in vocab)
        if not candidates:
            raise RuntimeError("BPE training text too short")
        best = candidates[0][1]
        merged = best[0] + best[1]
        merges.append(best)
        vocab[merged] = len(vocab)
        new_words = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words
    return vocab, merges


def make_tokenizer_json():
    vocab, merges = train_bpe(BPE_TRAINING_TEXT, NUM_MERGES)
    assert len(vocab) == BOS
    return byte_level_bpe_tokenizer_json(vocab, merges, BOS, EOS)


# ----------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------
def _normal(gen, shape, std):
    return torch.randn(shape, generator=gen) * std


def _norm_weight(gen, n):
    return 1.0 + 0.1 * torch.randn(n, generator=gen)


def _router_gates(gen, prefix, H, C, S, K):
    """The learned router's gate weights of one attention layer (prefix: its module's
    name and "."; H heads, S shared, K routed per token, width C), drawn in this order."""
    t = {}
    if K > 0:
        t[prefix + "wg.weight"] = _normal(gen, (H - S, C), 0.3)
        if S > 0:
            t[prefix + "wg_0.weight"] = _normal(gen, (2, C), 0.3)
    if S > 1:
        t[prefix + "wg_1.weight"] = _normal(gen, (S, C), 0.3)
    return t


def llama_tensors(cfg, seed, dtype):
    """name -> tensor in the storage dtype (the reference computes from these, in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    C, H, KV = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, I, V = C // H, cfg["intermediate_size"], cfg["vocab_size"]
    conf = ref.LlamaConfig(cfg)
    t = {"model.embed_tokens.weight": _normal(gen, (V, C), 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % i
        t[p + "input_layernorm.weight"] = _norm_weight(gen, C)
        t[p + "self_attn.q_proj.weight"] = _normal(gen, (H * hd, C), 0.25)
        t[p + "self_attn.k_proj.weight"] = _normal(gen, (KV * hd, C), 0.25)
        t[p + "self_attn.v_proj.weight"] = _normal(gen, (KV * hd, C), 0.25)
        t[p + "self_attn.o_proj.weight"] = _normal(gen, (C, H * hd), 0.2)
        if conf.moh_router == "learned":
            t.update(_router_gates(gen, p + "self_attn.", H, C,
                                   conf.shared_heads[i], conf.routed_top_k[i]))
        t[p + "post_attention_layernorm.weight"] = _norm_weight(gen, C)
        t[p + "mlp.gate_proj.weight"] = _normal(gen, (I, C), 0.2)
        t[p + "mlp.up_proj.weight"] = _normal(gen, (I, C), 0.2)
        t[p + "mlp.down_proj.weight"] = _normal(gen, (C, I), 0.15)
    t["model.norm.weight"] = _norm_weight(gen, C)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = _normal(gen, (V, C), 0.5)
    return {k: v.to(dtype) for k, v in t.items()}


def vit_tensors(cfg, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    C, H, I, p = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"], cfg["patch_size"]
    n = (cfg["image_size"] // p) ** 2
    t = {
        "cls_token": _normal(gen, (1, 1, C), 1.0),
        "pos_embed": _normal(gen, (1, 1 + n, C), 0.5),
        "patch_embed.proj.weight": _normal(gen, (C, cfg["num_channels"], p, p), 0.2),
        "patch_embed.proj.bias": _normal(gen, (C,), 0.1),
    }
    for i in range(cfg["num_hidden_layers"]):
        b = "blocks.%d." % i
        t[b + "norm1.weight"] = _norm_weight(gen, C)
        t[b + "norm1.bias"] = _normal(gen, (C,), 0.1)
        t[b + "attn.qkv.weight"] = _normal(gen, (3 * C, C), 0.25)
        t[b + "attn.qkv.bias"] = _normal(gen, (3 * C,), 0.1)
        t[b + "attn.proj.weight"] = _normal(gen, (C, C), 0.2)
        t[b + "attn.proj.bias"] = _normal(gen, (C,), 0.1)
        t.update(_router_gates(gen, b + "attn.", H, C, cfg["moh_shared_heads"][i],
                               cfg["moh_routed_top_k"][i]))
        t[b + "norm2.weight"] = _norm_weight(gen, C)
        t[b + "norm2.bias"] = _normal(gen, (C,), 0.1)
        t[b + "mlp.fc1.weight"] = _normal(gen, (I, C), 0.2)
        t[b + "mlp.fc1.bias"] = _normal(gen, (I,), 0.1)
        t[b + "mlp.fc2.weight"] = _normal(gen, (C, I), 0.15)
        t[b + "mlp.fc2.bias"] = _normal(gen, (C,), 0.1)
    t["norm.weight"] = _norm_weight(gen, C)
    t["norm.bias"] = _normal(gen, (C,), 0.1)
    t["head.weight"] = _normal(gen, (len(cfg["labels"]), C), 0.5)
    t["head.bias"] = _normal(gen, (len(cfg["labels"]),), 0.1)
    return {k: v.to(dtype) for k, v in t.items()}


# ----------------------------------------------------------------------------------
# Golden outputs
# ----------------------------------------------------------------------------------
def _floats(t):
    return [float(v) for v in t.reshape(-1).tolist()] if t.dim() <= 1 else [_floats(r) for r in t]


def _routing_margin(model):
    return min([ref.topk_margin(s, k) for s, k in model.routing_records()] + [math.inf])


def _effective_ratio(used):
    n = sum(int(u.sum()) for u in used)
    return n / float(sum(u.numel() for u in used))


def llama_golden(model, prompts):
    """Returns (golden dict, min topk margin, min greedy margin, greedy tokens ok)."""
    cases = []
    min_topk, min_greedy, tokens_ok = math.inf, math.inf, True
    for r in RATIOS:
        for i, prompt in enumerate(prompts):
            seq = list(prompt)
            greedy = []
            for step in range(NEW_TOKENS):
                logits, gates, used = model(torch.tensor([seq]), r)
                min_topk = min(min_topk, _routing_margin(model))
                if step == 0:
                    prompt_logits, prompt_gates, prompt_used = logits[0], [g[0] for g in gates], used
                    assert all(bool(((g != 0) == u).all()) for g, u in zip(gates, used))
                top2 = torch.topk(logits[0, -1], 2).values
                min_greedy = min(min_greedy, float(top2[0] - top2[1]))
                tok = int(torch.argmax(logits[0, -1]))
                tokens_ok = tokens_ok and tok not in (BOS, EOS)
                greedy.append(tok)
                seq.append(tok)
            cases.append({
                "ratio": r,
                "prompt": i,
                "top_k": model.layer_top_k(r),
                "logits": _floats(prompt_logits),
                "gates": [_floats(g) for g in prompt_gates],
                "greedy": greedy,
                "effective_ratio": _effective_ratio(prompt_used),
            })
    golden = {"ratios": RATIOS, "prompts": prompts, "new_tokens": NEW_TOKENS, "cases": cases,
              "min_topk_margin": min_topk, "min_greedy_margin": min_greedy}
    return golden, min_topk, min_greedy, tokens_ok


def vit_golden(model, images, raw):
    cases = []
    min_topk, min_class = math.inf, math.inf
    for r in RATIOS:
        for i, img in enumerate(images):
            logits, gates, used = model(img[None], r)
            min_topk = min(min_topk, _routing_margin(model))
            assert all(bool(((g != 0) == u).all()) for g, u in zip(gates, used))
            top2 = torch.topk(logits[0], 2).values
            min_class = min(min_class, float(top2[0] - top2[1]))
            cases.append({
                "ratio": r,
                "image": i,
                "top_k": model.layer_top_k(r),
                "logits": _floats(logits[0]),
                "gates": [_floats(g[0]) for g in gates],
                "effective_ratio": _effective_ratio(used),
            })
    golden = {"ratios": RATIOS, "images": [_floats(x) for x in images], "pixels": [_floats(x) for x in raw],
              "cases": cases, "min_topk_margin": min_topk, "min_greedy_margin": min_class}
    return golden, min_topk, min_class


def fixed_prompts():
    gen = torch.Generator().manual_seed(20241015)
    return [torch.randint(0, BOS, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def fixed_images(cfg):
    """3 images: raw pixels k/255 in [0, 1] and (raw - mean) / std as float32."""
    gen = torch.Generator().manual_seed(20241016)
    c, s = cfg["num_channels"], cfg["image_size"]
    mean = torch.tensor(cfg["image_mean"]).view(c, 1, 1)
    std = torch.tensor(cfg["image_std"]).view(c, 1, 1)
    raw = [torch.randint(0, 256, (c, s, s), generator=gen).float() / 255.0 for _ in range(3)]
    return [(x - mean) / std for x in raw], raw


def search_llama(cfg, dtype, prompts, log):
    for seed in range(MAX_SEEDS):
        tensors = llama_tensors(cfg, seed, dtype)
        model = ref.LlamaForCausalLM(ref.LlamaConfig(cfg)).load_tensors(tensors).eval()
        golden, m_topk, m_greedy, ok = llama_golden(model, prompts)
        if m_topk >= MIN_TOPK_MARGIN and m_greedy >= MIN_GREEDY_MARGIN and ok:
            log("seed %d: min topk margin %.3g, min greedy margin %.3g" % (seed, m_topk, m_greedy))
            golden["seed"] = seed
            return tensors, golden
    raise RuntimeError("no seed < %d gives well separated routing/logits" % MAX_SEEDS)


def search_vit(cfg, dtype, images, raw, log):
    for seed in range(MAX_SEEDS):
        tensors = vit_tensors(cfg, seed, dtype)
        model = ref.MoHViT(cfg).load_tensors(tensors).eval()
        golden, m_topk, m_class = vit_golden(model, images, raw)
        if m_topk >= MIN_TOPK_MARGIN and m_class >= MIN_GREEDY_MARGIN:
            log("seed %d: min topk margin %.3g, min class margin %.3g" % (seed, m_topk, m_class))
            golden["seed"] = seed
            return tensors, golden
    raise RuntimeError("no seed < %d gives well separated routing/logits" % MAX_SEEDS)


# ----------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------
def _write_json(path, obj, indent=2):
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")


def _write_golden(path, golden):
    with open(path, "w") as f:
        json.dump(golden, f, separators=(",", ":"), allow_nan=False)
        f.write("\n")


def _verify_roundtrip(directory, golden, kind):
    """Reloads the written checkpoint and checks one case (guards the writers)."""
    model = ref.load_model(directory)
    case = golden["cases"][-1]
    if kind == "llama":
        x = torch.tensor([golden["prompts"][case["prompt"]]])
    else:
        x = torch.tensor(golden["images"][case["image"]])[None]
    logits, _, _ = model(x, case["ratio"])
    want = torch.tensor(case["logits"])
    got = logits[0]
    assert torch.equal(got, want), "%s: reloaded checkpoint differs by %g" % (
        directory, float((got - want).abs().max()))


# quantization_config for llama_learned's linear weights pre-quantized as
# llm-compressor (compressed-tensors "int-quantized", W8A16 per channel) and
# bitsandbytes (8-bit) write them.
PREQUANTIZED_CONFIGS = {
    "compressed_tensors": {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                        "strategy": "channel", "group_size": None,
                        "dynamic": False, "observer": "minmax"},
            "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head"],
    },
    "bitsandbytes": {
        "quant_method": "bitsandbytes", "load_in_8bit": True,
        "load_in_4bit": False, "llm_int8_threshold": 6.0,
        "llm_int8_skip_modules": None, "llm_int8_has_fp16_weight": False,
    },
}
_PREQUANTIZED_LINEAR = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def prequantize(tensors, layout):
    """The decoder layers' linear weights as int8 with a float32 scale per row
    (symmetric, largest |W| / 127; round(W * (1 / scale)), half to even, the
    arithmetic of moh-serve's load-time quantization, so the checkpoint holds
    what `weights: "int8"` makes of llama_learned), in `layout`'s names."""
    out = {}
    for name, w in tensors.items():
        if not _PREQUANTIZED_LINEAR.search(name):
            out[name] = w
            continue
        w = w.float()
        largest = w.abs().amax(dim=1)
        scale = torch.where(largest > 0, largest / 127.0, torch.ones_like(largest))
        q = torch.round(w * (1.0 / scale)[:, None]).clamp(-127, 127).to(torch.int8)
        out[name] = q
        if layout == "compressed_tensors":
            out[name + "_scale"] = scale[:, None].contiguous()
            out[name + "_zero_point"] = torch.zeros((w.shape[0], 1), dtype=torch.int8)
        else:
            out[name[:-len(".weight")] + ".SCB"] = largest.contiguous()
            out[name + "_format"] = torch.tensor(0, dtype=torch.uint8)
    return out


def _shard_size(tensors, n):
    """The smallest max_shard_bytes (in 1% steps) that gives exactly n shards."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for size in range(total // n, total + 1, max(1, total // 100)):
        if len(checkpoint_io._shard(tensors, size)) == n:
            return size
    raise RuntimeError("cannot split into %d shards" % n)


def generate(outdir, log):
    torch.set_num_threads(1)
    prompts = fixed_prompts()
    tokenizer = make_tokenizer_json()
    generation_config = {"bos_token_id": BOS, "eos_token_id": EOS}
    os.makedirs(outdir)

    def llama_common(d, cfg, golden):
        os.makedirs(d)
        _write_json(os.path.join(d, "config.json"), cfg)
        _write_json(os.path.join(d, "tokenizer.json"), tokenizer, indent=None)
        _write_json(os.path.join(d, "generation_config.json"), generation_config)
        _write_golden(os.path.join(d, "golden.json"), golden)

    # 1. query-norm LLaMA, bf16 sharded .bin (as released)
    t0 = time.time()
    tensors, golden = search_llama(LLAMA_QNORM_CONFIG, torch.bfloat16, prompts, lambda m: log("llama_qnorm " + m))
    d = os.path.join(outdir, "llama_qnorm")
    llama_common(d, LLAMA_QNORM_CONFIG, golden)
    n = checkpoint_io.save_sharded_torch_bin(tensors, d, _shard_size(tensors, 3))
    _verify_roundtrip(d, golden, "llama")
    log("llama_qnorm: %d shards, %.1fs" % (n, time.time() - t0))

    # 2. learned-router LLaMA, F32, three layouts of the same tensors
    t0 = time.time()
    tensors, golden = search_llama(LLAMA_LEARNED_CONFIG, torch.float32, prompts,
                                   lambda m: log("llama_learned " + m))
    d = os.path.join(outdir, "llama_learned")
    llama_common(d, LLAMA_LEARNED_CONFIG, golden)
    checkpoint_io.save_safetensors(tensors, os.path.join(d, "model.safetensors"), {"format": "pt"})
    _verify_roundtrip(d, golden, "llama")
    d = os.path.join(outdir, "llama_learned_sharded")
    llama_common(d, LLAMA_LEARNED_CONFIG, golden)
    n = checkpoint_io.save_sharded_safetensors(tensors, d, _shard_size(tensors, 3))
    _verify_roundtrip(d, golden, "llama")
    d = os.path.join(outdir, "llama_learned_bin")
    llama_common(d, LLAMA_LEARNED_CONFIG, golden)
    checkpoint_io.save_torch_bin(tensors, os.path.join(d, "pytorch_model.bin"))
    _verify_roundtrip(d, golden, "llama")
    for layout, quantization in PREQUANTIZED_CONFIGS.items():
        d = os.path.join(outdir, "llama_learned_int8_" + layout)
        os.makedirs(d)
        _write_json(os.path.join(d, "config.json"),
                    dict(LLAMA_LEARNED_CONFIG, quantization_config=quantization))
        _write_json(os.path.join(d, "tokenizer.json"), tokenizer, indent=None)
        _write_json(os.path.join(d, "generation_config.json"), generation_config)
        checkpoint_io.save_safetensors(prequantize(tensors, layout),
                                       os.path.join(d, "model.safetensors"), {"format": "pt"})
    log("llama_learned: %d safetensors shards, %.1fs" % (n, time.time() - t0))

    # 3. MoH-ViT, F16 safetensors
    t0 = time.time()
    images, raw = fixed_images(VIT_CONFIG)
    tensors, golden = search_vit(VIT_CONFIG, torch.float16, images, raw, lambda m: log("vit_learned " + m))
    d = os.path.join(outdir, "vit_learned")
    os.makedirs(d)
    _write_json(os.path.join(d, "config.json"), VIT_CONFIG)
    checkpoint_io.save_safetensors(tensors, os.path.join(d, "model.safetensors"), {"format": "pt"})
    _write_golden(os.path.join(d, "golden.json"), golden)
    _verify_roundtrip(d, golden, "vit")
    log("vit_learned: %.1fs" % (time.time() - t0))

    # 4. MoH-ViT on TransNeXt: release container, safetensors, preprocessing, manifest
    make_transnext_fixtures.generate(outdir, log)

    # 5. MoH-DiT: release container, tiny VAEs in both attention namings, pixel space, manifest
    make_dit_fixtures.generate(outdir, log)


def source_hash():
    h = hashlib.sha256()
    for name in ("make_fixtures.py", "moh_reference.py", "checkpoint_io.py", "moh_transnext.py",
                 "make_transnext_fixtures.py", "pil_resample.py", "moh_dit.py", "moh_dit_official.py",
                 "make_dit_fixtures.py"):
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    # PIL's encoders and bicubic resampling shape the preprocessing fixtures
    h.update(torch.__version__.encode() + b"\0" + make_transnext_fixtures.PIL.__version__.encode())
    return h.hexdigest()


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def main(argv):
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: make_fixtures.py OUTDIR", file=sys.stderr)
        return 2
    outdir = os.path.abspath(argv[0])
    stamp = source_hash()
    if _read(os.path.join(outdir, "stamp")) == stamp:
        print("make_fixtures: %s is up to date" % outdir)
        return 0
    t0 = time.time()
    parent = os.path.dirname(outdir)
    os.makedirs(parent, exist_ok=True)
    tmp = "%s.tmp.%d" % (outdir, os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        generate(tmp, lambda m: print("make_fixtures: " + m, flush=True))
        with open(os.path.join(tmp, "stamp"), "w") as f:
            f.write(stamp + "\n")
        old = "%s.old.%d" % (outdir, os.getpid())
        if os.path.lexists(outdir):
            os.rename(outdir, old)
        try:
            os.rename(tmp, outdir)
        except OSError:
            # another run put a directory there meanwhile; fine if it is up to date
            if _read(os.path.join(outdir, "stamp")) != stamp:
                raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("make_fixtures: wrote %s in %.1fs" % (outdir, time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
