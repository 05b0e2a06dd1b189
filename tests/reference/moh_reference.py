"""Independent Python reference for moh-serve (plain torch, no transformers/timm).

This module TRANSCRIBES the official MoH code (github.com/SkyworkAI/MoH, mirrored at
commit 2cefd57b78196dd0fabc34a858a7739235f55356) so that a reader can compare it line by
line; the C++ engine is tested against the fixtures that `make_fixtures.py` computes
with it.  Official file / lines -> what here:

  MoH-LLaMA3/Inference_code/modeling_llama.py
    144-158  LlamaRMSNorm                       -> LlamaRMSNorm
    164-197  LlamaRotaryEmbedding               -> LlamaRotaryEmbedding
    245-249  rotate_half                        -> rotate_half
    252-277  apply_rotary_pos_emb               -> apply_rotary_pos_emb
    280-311  LlamaMLP (pretraining_tp == 1)     -> LlamaMLP
    314-323  repeat_kv                          -> repeat_kv
    326-517  LlamaAttention (eager; the SDPA subclass 741-842 has the same gate lines
             781-791 and differs only in calling F.scaled_dot_product_attention)
                                                -> LlamaAttention.forward
             361-364  routed_head = int(H*(0.75-0.5)), shared_head = int(H*0.5)
             439-450  query-norm router: ||q_h||_2 of the q_proj output (before RoPE)
                      for routed heads, / unbiased std, softmax, topk, one-hot mask,
                      shared heads 1
             503-505  attn_output = einsum("bne,bned->bned", mask, attn_output)
    845-905  LlamaDecoderLayer                  -> LlamaDecoderLayer
    1112-1186 LlamaModel.forward (position_ids, embed, 4d causal mask, layers, norm)
    1213, 1301 lm_head                          -> LlamaForCausalLM

  MoH-DiT/models.py
    30-150   MoHAttention (learned two-stage router; timm Attention with the
             non-fused path 115-119)            -> MoHAttention
  MoH-ViT/attention.py
    84-112   the same router, but it also handles shared_head == 1 (gate
             ones * shared_head, lines 90-91) and shared_head == 0 (lines 93-94),
             where DiT lines 124-125 would call the missing wg_1.  MoHAttention uses
             these lines in place of DiT 124-136 (identical for shared_head > 1).

  timm VisionTransformer (PatchEmbed, cls_token, pos_embed, Block = pre-norm
  attention + Mlp(fc1, exact GELU, fc2), final norm, head(x[:, 0]))  -> MoHViT

THE ONE EXTENSION: per-row K (moh-serve SPEC section 1).  A request's activation ratio
r gives, per layer with routed heads, K = clamp(floor(r*H + 0.5) - S, 0, R), R = H - S
(`k_for_ratio`); r = 0 / None means the trained K.  Every router takes `top_k`, None or
a LongTensor with one K per batch row (sequence/image), expanded to one K per token.
It is implemented as: topk with k = max K over rows, then keep only the first K_row of
the sorted indices of each row (`per_row_topk_mask`, a mask by rank).  Learned router:
routed_gate = gates*mask / clamp(sum(gates*mask), eps) * K_row, so with the trained K
this is exactly the official code (the --self-test proves it against verbatim copies);
rows with K_row == 0 get zero routed gates.  Query-norm router: the binary mask.

Every attention module leaves, after each forward, for tests and fixtures:
  last_gates   [B, N, H] float: the final per-head multiplier (0 = head not used)
  last_used    [B, N, H] bool : (token, head) pairs computed (shared + selected heads)
  last_scores  [B*N, E] or None: the routing scores topk selected from (softmax
               outputs), E = R routed heads
  last_top_k   [B*N] long or None: K per row

Run `/usr/bin/python3 moh_reference.py --self-test` to check the extension against the
official code, or `... run MODEL_DIR --ids 1 2 3 [--ratio 0.5]` to print a forward.
"""
import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F
from torch import nn

OFFICIAL_COMMIT = "2cefd57b78196dd0fabc34a858a7739235f55356"


# ----------------------------------------------------------------------------------
# The per-row K extension (SPEC section 1)
# ----------------------------------------------------------------------------------
def k_for_ratio(ratio, num_heads, shared_head, trained_k):
    """K for one layer: trained K for r == 0/None or a layer without routed heads."""
    num_routed = num_heads - shared_head
    if ratio is None or ratio == 0 or num_routed == 0:
        return trained_k
    return min(max(int(math.floor(ratio * num_heads + 0.5)) - shared_head, 0), num_routed)


def _rows_top_k(top_k, trained_k, B, N):
    """top_k: None (trained K), int, or LongTensor [B] (per sequence) -> LongTensor [B*N]."""
    if top_k is None:
        top_k = trained_k
    if isinstance(top_k, int):
        return torch.full((B * N,), top_k, dtype=torch.long)
    top_k = torch.as_tensor(top_k, dtype=torch.long).reshape(-1)
    if top_k.numel() == B:
        return top_k.repeat_interleave(N)
    assert top_k.numel() == B * N, "top_k must have one K per batch row or per token"
    return top_k


def per_row_topk_mask(gates, top_k_rows):
    """The official `topk(gates, k) -> one_hot(indices).sum(1)`, with K per row.

    topk with k = max K over rows, then only the first K_row sorted indices of each row
    are kept (mask by rank).  With the same K for every row this is the official mask.
    """
    num_tokens, num_experts = gates.shape
    k_max = int(top_k_rows.max()) if num_tokens > 0 else 0
    if k_max == 0:
        return torch.zeros((num_tokens, num_experts), dtype=torch.long)
    _, indices = torch.topk(gates, k=k_max, dim=1)
    rank_keep = (torch.arange(k_max)[None, :] < top_k_rows[:, None]).long()  # [T, k_max]
    mask = (F.one_hot(indices, num_classes=num_experts) * rank_keep[:, :, None]).sum(dim=1)
    return mask


def topk_margin(scores, top_k_rows):
    """Min over rows with 0 < K < E of (s_K - s_{K+1}) / s_K, the scores sorted descending.

    This is the relative gap at the selection boundary (= 1 - exp(-(logit gap)) for a
    softmax); math.inf when no row has a boundary.
    """
    if scores is None:
        return math.inf
    num_experts = scores.shape[1]
    s, _ = torch.sort(scores.double(), dim=1, descending=True)
    best = math.inf
    for row in range(s.shape[0]):
        k = int(top_k_rows[row])
        if 0 < k < num_experts:
            best = min(best, float((s[row, k - 1] - s[row, k]) / s[row, k - 1]))
    return best


# ----------------------------------------------------------------------------------
# LLaMA: transcription of MoH-LLaMA3/Inference_code/modeling_llama.py
# ----------------------------------------------------------------------------------
class LlamaConfig:
    """The config.json fields the reference reads, plus the MoH settings per layer.

    Router: config `moh_router` if present; else `query_norm` with the official defaults
    S = int(H*0.5), K = int(H*(0.75-0.5)) when the config has `auto_map` (as released
    MoH-LLaMA3-8B); else a dense model (all heads).  `moh_shared_heads` and
    `moh_routed_top_k` (int or per-layer list) override S and K.
    """

    def __init__(self, d):
        self.raw = dict(d)
        self.hidden_size = d["hidden_size"]
        self.num_attention_heads = d["num_attention_heads"]
        self.num_key_value_heads = d.get("num_key_value_heads", self.num_attention_heads)
        self.num_hidden_layers = d["num_hidden_layers"]
        self.intermediate_size = d["intermediate_size"]
        self.vocab_size = d["vocab_size"]
        self.rms_norm_eps = d.get("rms_norm_eps", 1e-6)
        self.rope_theta = d.get("rope_theta", 10000.0)
        self.max_position_embeddings = d.get("max_position_embeddings", 2048)
        self.tie_word_embeddings = d.get("tie_word_embeddings", False)
        self.attention_bias = d.get("attention_bias", False)
        self.hidden_act = d.get("hidden_act", "silu")
        assert self.hidden_act == "silu"
        assert d.get("rope_scaling") is None, "rope_scaling is not transcribed"
        H, L = self.num_attention_heads, self.num_hidden_layers
        if "moh_router" in d:
            router = d["moh_router"]
        elif "auto_map" in d:
            router = "query_norm"
        else:
            router = "dense"
        assert router in ("learned", "query_norm", "dense"), router
        self.moh_router = router
        if router == "query_norm":
            default_s, default_k = int(H * (0.5)), int(H * (0.75 - 0.5))  # official 362-363
        else:
            default_s, default_k = H, 0
        self.shared_heads = _per_layer(d.get("moh_shared_heads", default_s), L)
        self.routed_top_k = _per_layer(d.get("moh_routed_top_k", default_k), L)
        if router == "dense":
            self.shared_heads, self.routed_top_k = [H] * L, [0] * L
        _check_moh(H, self.shared_heads, self.routed_top_k, router)


def _check_moh(H, shared, top_k, router):
    for S, K in zip(shared, top_k):
        assert 0 <= S <= H and 0 <= K <= H - S, "bad MoH layer S=%d K=%d H=%d" % (S, K, H)
        # official learned router: no routing (K == 0) only with every head shared
        assert router != "learned" or K > 0 or S == H, "learned layer with K == 0 needs S == H"


def _per_layer(v, n):
    if isinstance(v, (list, tuple)):
        assert len(v) == n, "per-layer list has %d entries for %d layers" % (len(v), n)
        return [int(x) for x in v]
    return [int(v)] * n


class LlamaRMSNorm(nn.Module):  # modeling_llama.py 144-158
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):  # modeling_llama.py 164-197
    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None):
        super().__init__()

        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float().to(device) / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

        self._set_cos_sin_cache(
            seq_len=max_position_embeddings, device=self.inv_freq.device, dtype=torch.get_default_dtype()
        )

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        t = torch.arange(self.max_seq_len_cached, device=device, dtype=self.inv_freq.dtype)

        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cached", emb.sin().to(dtype), persistent=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len=seq_len, device=x.device, dtype=x.dtype)

        return (
            self.cos_cached[:seq_len].to(dtype=x.dtype),
            self.sin_cached[:seq_len].to(dtype=x.dtype),
        )


def rotate_half(x):  # modeling_llama.py 245-249
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):  # 252-277
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class LlamaMLP(nn.Module):  # modeling_llama.py 280-311 (pretraining_tp == 1)
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()  # ACT2FN["silu"]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


def repeat_kv(hidden_states, n_rep):  # modeling_llama.py 314-323
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def _learned_router_gates(module, _x, B, N, top_k_rows):
    """Gates of the learned two-stage router, for LLaMA layers.

    The gate lines of MoHAttention.forward (DiT models.py 84-103 and 121-136, with
    ViT attention.py 87-102 for shared_head <= 1, 106-108 for routed_head == 0), without
    the attention in between; returns masked_gates [B, N, H], used [B, N, H].
    The self-test checks it against MoHAttention.
    """
    if module.routed_head > 0:
        logits = module.wg(_x)
        gates = F.softmax(logits, dim=1)

        num_tokens, num_experts = gates.shape
        mask = per_row_topk_mask(gates, top_k_rows)  # official: topk(k=routed_head), one_hot

        routed_head_gates = gates * mask
        denom_s = torch.sum(routed_head_gates, dim=1, keepdim=True)
        denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
        routed_head_gates /= denom_s
        routed_head_gates = routed_head_gates.reshape(B, N, -1) * top_k_rows.reshape(B, N, 1).to(gates.dtype)

        if module.shared_head > 1:
            shared_head_weight = module.wg_1(_x)
            shared_head_gates = F.softmax(shared_head_weight, dim=1).reshape(B, N, -1) * module.shared_head
        else:
            shared_head_gates = torch.ones((B, N, module.shared_head)).to(_x.device).to(_x.dtype) * module.shared_head

        if module.shared_head == 0:
            masked_gates = routed_head_gates
        else:
            weight_0 = module.wg_0(_x)
            weight_0 = F.softmax(weight_0, dim=1).reshape(B, N, 2) * 2

            shared_head_gates = torch.einsum("bn,bne->bne", weight_0[:, :, 0], shared_head_gates)
            routed_head_gates = torch.einsum("bn,bne->bne", weight_0[:, :, 1], routed_head_gates)

            masked_gates = torch.cat([shared_head_gates, routed_head_gates], dim=2)
        used = torch.cat([torch.ones((B, N, module.shared_head), dtype=torch.bool),
                          mask.reshape(B, N, -1) > 0], dim=2)
        module.last_scores, module.last_top_k = gates.detach(), top_k_rows
    else:
        shared_head_weight = module.wg_1(_x)
        masked_gates = F.softmax(shared_head_weight, dim=1).reshape(B, N, -1) * module.shared_head
        used = torch.ones_like(masked_gates, dtype=torch.bool)
        module.last_scores, module.last_top_k = None, None
    return masked_gates, used


class LlamaAttention(nn.Module):  # modeling_llama.py 326-517 (eager path)
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx

        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.rope_theta = config.rope_theta
        self.is_causal = True
        assert self.head_dim * self.num_heads == self.hidden_size

        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=config.attention_bias)

        #################MoH#################
        # official 362-363: routed_head = int(H * 0.25) (the top-K), shared_head = int(H * 0.5)
        self.router = config.moh_router
        self.routed_head = config.routed_top_k[layer_idx]
        self.shared_head = config.shared_heads[layer_idx]
        if self.router == "learned":  # tensors as in MoHAttention (DiT models.py 71-77)
            if self.routed_head > 0:
                self.wg = torch.nn.Linear(self.hidden_size, self.num_heads - self.shared_head, bias=False)
                if self.shared_head > 0:
                    self.wg_0 = torch.nn.Linear(self.hidden_size, 2, bias=False)
            if self.shared_head > 1:
                self.wg_1 = torch.nn.Linear(self.hidden_size, self.shared_head, bias=False)
        #################MoH#################

        self.rotary_emb = LlamaRotaryEmbedding(
            self.head_dim, max_position_embeddings=self.max_position_embeddings, base=self.rope_theta)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, top_k=None):
        """top_k: None (trained K) or LongTensor [bsz], one K per sequence (the extension)."""
        bsz, q_len, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        if self.router == "query_norm" and self.shared_head < self.num_heads:
            top_k_rows = _rows_top_k(top_k, self.routed_head, bsz, q_len)
            gate = query_states.view(-1, self.num_heads, self.head_dim)
            logits = torch.stack([torch.norm(gate[:, i, :], p=2, dim=1) for i in range(self.shared_head, self.num_heads)],
                                 dim=1)
            logits_std = logits.std(dim=1, keepdim=True)
            logits_norm = logits / (logits_std / 1)
            gates = F.softmax(logits_norm, dim=1)

            num_tokens, num_experts = gates.shape
            mask = per_row_topk_mask(gates, top_k_rows)  # official 447-448 with k = routed_head
            mask = mask.reshape(bsz, q_len, -1)
            mask = torch.cat([torch.ones_like(mask).to(query_states.dtype), mask], dim=-1).to(query_states.dtype)
            self.last_scores, self.last_top_k = gates.detach(), top_k_rows
            used = mask > 0
        elif self.router == "learned":
            top_k_rows = _rows_top_k(top_k, self.routed_head, bsz, q_len)
            # router input: the attention block input = output of input_layernorm
            _x = hidden_states.reshape(bsz * q_len, self.hidden_size)
            mask, used = _learned_router_gates(self, _x, bsz, q_len, top_k_rows)
        else:  # dense (or a query-norm layer with no routed heads): every head, gate 1
            mask = torch.ones((bsz, q_len, self.num_heads), dtype=query_states.dtype)
            used = mask > 0
            self.last_scores, self.last_top_k = None, None
        self.last_gates, self.last_used = mask.detach(), used

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)

        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask

        # upcast attention to fp32
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).contiguous()

        attn_output = attn_output.reshape(bsz, q_len, self.num_heads, self.head_dim)
        attn_output = torch.einsum("bne,bned->bned", mask, attn_output)
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)

        attn_output = self.o_proj(attn_output)
        return attn_output


class LlamaDecoderLayer(nn.Module):  # modeling_llama.py 845-905
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, top_k=None):
        residual = hidden_states

        hidden_states = self.input_layernorm(hidden_states)

        # Self Attention
        hidden_states = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids, top_k=top_k)
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class LlamaModel(nn.Module):  # modeling_llama.py 1036-1186
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, top_k_per_layer=None):
        batch_size, seq_length = input_ids.shape
        position_ids = torch.arange(0, seq_length, dtype=torch.long).unsqueeze(0)
        inputs_embeds = self.embed_tokens(input_ids)
        # _prepare_4d_causal_attention_mask: 0 on/below the diagonal, finfo.min above
        dtype = inputs_embeds.dtype
        causal = torch.full((seq_length, seq_length), torch.finfo(dtype).min, dtype=dtype).triu(1)
        attention_mask = causal[None, None, :, :].expand(batch_size, 1, seq_length, seq_length)

        hidden_states = inputs_embeds
        for i, decoder_layer in enumerate(self.layers):
            top_k = None if top_k_per_layer is None else top_k_per_layer[i]
            hidden_states = decoder_layer(
                hidden_states, attention_mask=attention_mask, position_ids=position_ids, top_k=top_k)
        hidden_states = self.norm(hidden_states)
        return hidden_states


class LlamaForCausalLM(nn.Module):  # modeling_llama.py 1206-1301
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def layer_top_k(self, ratio):
        """K per layer for one activation ratio (None/0 = trained)."""
        c = self.config
        return [k_for_ratio(ratio, c.num_attention_heads, s, k) for s, k in zip(c.shared_heads, c.routed_top_k)]

    def forward(self, input_ids, ratios=None):
        """input_ids [B, T] (same length rows); ratios: None, a float, or one per row.

        Returns (logits [B, T, V] fp32, gates per layer [B, T, H], used per layer [B, T, H]).
        """
        B = input_ids.shape[0]
        top_k_per_layer = None
        if ratios is not None:
            if not isinstance(ratios, (list, tuple)):
                ratios = [ratios] * B
            per_row = [self.layer_top_k(r) for r in ratios]
            top_k_per_layer = [torch.tensor([ks[l] for ks in per_row], dtype=torch.long)
                               for l in range(self.config.num_hidden_layers)]
        hidden_states = self.model(input_ids, top_k_per_layer)
        logits = self.lm_head(hidden_states).float()
        attns = [layer.self_attn for layer in self.model.layers]
        return logits, [a.last_gates for a in attns], [a.last_used for a in attns]

    def routing_records(self):
        """(scores, top_k_rows) of each layer's last forward (None for no routing)."""
        return [(l.self_attn.last_scores, l.self_attn.last_top_k) for l in self.model.layers]

    def load_tensors(self, tensors):
        sd = {k: v.float() for k, v in tensors.items()}
        if self.config.tie_word_embeddings and "lm_head.weight" not in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise ValueError("checkpoint mismatch: missing %s unexpected %s" % (missing, unexpected))
        return self


# ----------------------------------------------------------------------------------
# ViT: timm VisionTransformer with MoHAttention (MoH-DiT/models.py 30-150)
# ----------------------------------------------------------------------------------
class MoHAttention(nn.Module):  # MoH-DiT/models.py 30-150
    def __init__(self, dim, num_heads=8, qkv_bias=False, shared_head=0, routed_head=0, head_dim=None):
        super().__init__()
        self.num_heads = num_heads

        if head_dim is None:
            self.head_dim = dim // num_heads
        else:
            self.head_dim = head_dim

        self.scale = self.head_dim ** -0.5

        self.qkv = nn.Linear(dim, (self.head_dim * self.num_heads) * 3, bias=qkv_bias)
        self.proj = nn.Linear(self.head_dim * self.num_heads, dim)

        self.shared_head = shared_head
        self.routed_head = routed_head

        if self.routed_head > 0:
            self.wg = torch.nn.Linear(dim, num_heads - shared_head, bias=False)
            if self.shared_head > 0:
                self.wg_0 = torch.nn.Linear(dim, 2, bias=False)

        if self.shared_head > 1:
            self.wg_1 = torch.nn.Linear(dim, shared_head, bias=False)

    def forward(self, x, top_k=None):
        """top_k: None (trained K = self.routed_head) or LongTensor [B] (the extension)."""
        B, N, C = x.shape

        _x = x.reshape(B * N, C)

        if self.routed_head > 0:
            top_k_rows = _rows_top_k(top_k, self.routed_head, B, N)
            logits = self.wg(_x)
            gates = F.softmax(logits, dim=1)

            num_tokens, num_experts = gates.shape
            mask = per_row_topk_mask(gates, top_k_rows)  # official 89-90 with k = routed_head

            routed_head_gates = gates * mask
            denom_s = torch.sum(routed_head_gates, dim=1, keepdim=True)
            denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
            routed_head_gates /= denom_s
            routed_head_gates = routed_head_gates.reshape(B, N, -1) * top_k_rows.reshape(B, N, 1).to(gates.dtype)
            self.last_scores, self.last_top_k = gates.detach(), top_k_rows
        else:
            self.last_scores, self.last_top_k = None, None

        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)

        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        x = attn @ v

        if self.routed_head > 0:
            x = x.transpose(1, 2)

            # MoH-ViT/attention.py 87-102 (= DiT 124-136 when shared_head > 1)
            if self.shared_head > 1:
                shared_head_weight = self.wg_1(_x)
                shared_head_gates = F.softmax(shared_head_weight, dim=1).reshape(B, N, -1) * self.shared_head
            else:
                shared_head_gates = torch.ones((B, N, self.shared_head)).to(_x.device).to(_x.dtype) * self.shared_head

            if self.shared_head == 0:
                masked_gates = routed_head_gates
            else:
                weight_0 = self.wg_0(_x)
                weight_0 = F.softmax(weight_0, dim=1).reshape(B, N, 2) * 2

                shared_head_gates = torch.einsum("bn,bne->bne", weight_0[:, :, 0], shared_head_gates)
                routed_head_gates = torch.einsum("bn,bne->bne", weight_0[:, :, 1], routed_head_gates)

                masked_gates = torch.cat([shared_head_gates, routed_head_gates], dim=2)

            x = torch.einsum("bne,bned->bned", masked_gates, x)
            x = x.reshape(B, N, self.head_dim * self.num_heads)
            used = torch.cat([torch.ones((B, N, self.shared_head), dtype=torch.bool),
                              mask.reshape(B, N, -1) > 0], dim=2)
        else:
            shared_head_weight = self.wg_1(_x)
            masked_gates = F.softmax(shared_head_weight, dim=1).reshape(B, N, -1) * self.shared_head
            x = x.transpose(1, 2)

            x = torch.einsum("bne,bned->bned", masked_gates, x)
            x = x.reshape(B, N, self.head_dim * self.num_heads)
            used = torch.ones_like(masked_gates, dtype=torch.bool)
        self.last_gates, self.last_used = masked_gates.detach(), used

        x = self.proj(x)
        return x


class Mlp(nn.Module):  # timm.layers.Mlp
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()  # exact (erf)
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):  # timm.models.vision_transformer.Block (no layer scale / drop path)
    def __init__(self, dim, num_heads, mlp_hidden, eps, shared_head, routed_head):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = MoHAttention(dim, num_heads=num_heads, qkv_bias=True,
                                 shared_head=shared_head, routed_head=routed_head)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, mlp_hidden)

    def forward(self, x, top_k=None):
        x = x + self.attn(self.norm1(x), top_k)
        x = x + self.mlp(self.norm2(x))
        return x


class PatchEmbed(nn.Module):  # timm.layers.PatchEmbed (flatten, no norm)
    def __init__(self, patch_size, in_chans, embed_dim):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        x = self.proj(x)
        return x.flatten(2).transpose(1, 2)  # B, N, C


class MoHViT(nn.Module):
    """timm VisionTransformer(class_token=True, global_pool='token') with MoH attention."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = dict(cfg)
        C = cfg["hidden_size"]
        L = cfg["num_hidden_layers"]
        self.num_heads = cfg["num_attention_heads"]
        n = (cfg["image_size"] // cfg["patch_size"]) ** 2
        self.shared_heads = _per_layer(cfg.get("moh_shared_heads", self.num_heads), L)
        self.routed_top_k = _per_layer(cfg.get("moh_routed_top_k", 0), L)
        _check_moh(self.num_heads, self.shared_heads, self.routed_top_k, "learned")
        self.patch_embed = PatchEmbed(cfg["patch_size"], cfg["num_channels"], C)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, C))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + n, C))
        eps = cfg.get("layer_norm_eps", 1e-6)
        self.blocks = nn.ModuleList([
            Block(C, self.num_heads, cfg["intermediate_size"], eps, self.shared_heads[i], self.routed_top_k[i])
            for i in range(L)])
        self.norm = nn.LayerNorm(C, eps=eps)
        self.head = nn.Linear(C, len(cfg["labels"]))

    def layer_top_k(self, ratio):
        return [k_for_ratio(ratio, self.num_heads, s, k) for s, k in zip(self.shared_heads, self.routed_top_k)]

    def forward(self, pixel_values, ratios=None):
        """pixel_values [B, C, H, W], already normalized.  Returns (logits [B, classes],
        gates per layer [B, 1+N, H], used per layer [B, 1+N, H])."""
        B = pixel_values.shape[0]
        x = self.patch_embed(pixel_values)
        x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1)
        x = x + self.pos_embed
        if ratios is not None and not isinstance(ratios, (list, tuple)):
            ratios = [ratios] * B
        for i, blk in enumerate(self.blocks):
            top_k = None if ratios is None else torch.tensor([self.layer_top_k(r)[i] for r in ratios])
            x = blk(x, top_k)
        x = self.norm(x)
        logits = self.head(x[:, 0])
        attns = [b.attn for b in self.blocks]
        return logits, [a.last_gates for a in attns], [a.last_used for a in attns]

    def routing_records(self):
        return [(b.attn.last_scores, b.attn.last_top_k) for b in self.blocks]

    def load_tensors(self, tensors):
        missing, unexpected = self.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
        if missing or unexpected:
            raise ValueError("checkpoint mismatch: missing %s unexpected %s" % (missing, unexpected))
        return self


# ----------------------------------------------------------------------------------
# Loading a model directory (safetensors, sharded safetensors, .bin, sharded .bin)
# ----------------------------------------------------------------------------------
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _ST_DTYPES[info["dtype"]]
        raw = bytearray(data[begin:end])
        if dtype == torch.bfloat16:
            t = torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16) if raw else torch.empty(0, dtype=dtype)
        else:
            t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def load_checkpoint_dir(directory):
    """All tensors of a Hugging Face style model directory (trusted test files only)."""
    def p(name):
        return os.path.join(directory, name)

    for index, reader in (("model.safetensors.index.json", read_safetensors),
                          ("pytorch_model.bin.index.json", lambda f: torch.load(f, map_location="cpu", weights_only=False))):
        if os.path.exists(p(index)):
            with open(p(index)) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            out = {}
            for fn in files:
                out.update(reader(p(fn)))
            return out
    if os.path.exists(p("model.safetensors")):
        return read_safetensors(p("model.safetensors"))
    if os.path.exists(p("pytorch_model.bin")):
        return dict(torch.load(p("pytorch_model.bin"), map_location="cpu", weights_only=False))
    raise FileNotFoundError("no checkpoint in " + directory)


def load_model(directory):
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    tensors = load_checkpoint_dir(directory)
    if cfg.get("model_type") == "moh_vit":
        return MoHViT(cfg).load_tensors(tensors).eval()
    return LlamaForCausalLM(LlamaConfig(cfg)).load_tensors(tensors).eval()


# ----------------------------------------------------------------------------------
# Self-test: with the trained K the extension IS the official code
# ----------------------------------------------------------------------------------
class _OfficialDiTMoHAttention(nn.Module):
    """Verbatim MoH-DiT/models.py 30-150 (eval; fused_attn False; no q/k norm, dropout)."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, shared_head=0, routed_head=0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = False
        self.training = False
        self.qkv = nn.Linear(dim, (self.head_dim * self.num_heads) * 3, bias=qkv_bias)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(0.)
        self.proj = nn.Linear(self.head_dim * self.num_heads, dim)
        self.proj_drop = nn.Dropout(0.)
        self.shared_head = shared_head
        self.routed_head = routed_head
        if self.routed_head > 0:
            self.wg = torch.nn.Linear(dim, num_heads - shared_head, bias=False)
            if self.shared_head > 0:
                self.wg_0 = torch.nn.Linear(dim, 2, bias=False)
        if self.shared_head > 1:
            self.wg_1 = torch.nn.Linear(dim, shared_head, bias=False)

    def forward(self, x):
        B, N, C = x.shape

        _x = x.reshape(B * N, C)

        if self.routed_head > 0:
            logits = self.wg(_x)
            gates = F.softmax(logits, dim=1)

            num_tokens, num_experts = gates.shape
            _, indices = torch.topk(gates, k=self.routed_head, dim=1)
            mask = F.one_hot(indices, num_classes=num_experts).sum(dim=1)

            routed_head_gates = gates * mask
            denom_s = torch.sum(routed_head_gates, dim=1, keepdim=True)
            denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
            routed_head_gates /= denom_s
            routed_head_gates = routed_head_gates.reshape(B, N, -1) * self.routed_head

        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)

        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = attn @ v

        if self.routed_head > 0:
            x = x.transpose(1, 2)

            if self.shared_head > 0:
                shared_head_weight = self.wg_1(_x)
                shared_head_gates = F.softmax(shared_head_weight, dim=1).reshape(B, N, -1) * self.shared_head

                weight_0 = self.wg_0(_x)
                weight_0 = F.softmax(weight_0, dim=1).reshape(B, N, 2) * 2

                shared_head_gates = torch.einsum("bn,bne->bne", weight_0[:,:,0], shared_head_gates)
                routed_head_gates = torch.einsum("bn,bne->bne", weight_0[:,:,1], routed_head_gates)

                masked_gates = torch.cat([shared_head_gates, routed_head_gates], dim=2)
            else:
                masked_gates = routed_head_gates

            x = torch.einsum("bne,bned->bned", masked_gates, x)
            x = x.reshape(B, N, self.head_dim * self.num_heads)
        else:
            shared_head_weight = self.wg_1(_x)
            masked_gates = F.softmax(shared_head_weight, dim=1).reshape(B, N, -1) * self.shared_head
            x = x.transpose(1, 2)

            x = torch.einsum("bne,bned->bned", masked_gates, x)
            x = x.reshape(B, N, self.head_dim * self.num_heads)

        self.masked_gates = masked_gates
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


def _official_vit_gates(m, x):
    """Verbatim MoH-ViT/attention.py 47-69 and 84-108, gates only (covers shared_head == 1)."""
    B, N, C = x.shape
    _x = x.reshape(B * N, C)
    self = m
    if self.routed_head > 0:
        logits = self.wg(_x)
        gates = F.softmax(logits, dim=1)

        num_tokens, num_experts = gates.shape
        _, indices = torch.topk(gates, k=self.routed_head, dim=1)
        mask = F.one_hot(indices, num_classes=num_experts).sum(dim=1)

        routed_head_gates = gates * mask
        denom_s = torch.sum(routed_head_gates, dim=1, keepdim=True)
        denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
        routed_head_gates /= denom_s
        routed_head_gates = routed_head_gates.reshape(B, N, -1) * self.routed_head

    if self.routed_head > 0:
        if self.shared_head > 1:
            shared_head_weight = self.wg_1(_x)
            shared_head_gates = F.softmax(shared_head_weight, dim=1).reshape(B, N, -1) * self.shared_head
        else:
            shared_head_gates = torch.ones((B, N, self.shared_head)).to(_x.device).to(_x.dtype) * self.shared_head

        if self.shared_head == 0:
            masked_gates = routed_head_gates
        else:
            weight_0 = self.wg_0(_x)
            weight_0 = F.softmax(weight_0, dim=1).reshape(B, N, 2) * 2

            shared_head_gates = torch.einsum("bn,bne->bne", weight_0[:,:,0], shared_head_gates)
            routed_head_gates = torch.einsum("bn,bne->bne", weight_0[:,:,1], routed_head_gates)

            masked_gates = torch.cat([shared_head_gates, routed_head_gates], dim=2)
    else:
        shared_head_weight = self.wg_1(_x)
        masked_gates = F.softmax(shared_head_weight, dim=1).reshape(B, N, -1) * self.shared_head
    return masked_gates


class _OfficialLlamaAttention(LlamaAttention):
    """Verbatim modeling_llama.py 413-517 (pretraining_tp 1, no cache, eval), query-norm."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bsz, q_len, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        gate = query_states.view(-1, self.num_heads, self.head_dim)
        logits = torch.stack([torch.norm(gate[:, i, :], p=2, dim=1) for i in range(self.shared_head, self.num_heads)],
                             dim=1)
        logits_std = logits.std(dim=1, keepdim=True)
        logits_norm = logits / (logits_std / 1)
        gates = F.softmax(logits_norm, dim=1)

        num_tokens, num_experts = gates.shape
        _, indices = torch.topk(gates, k=self.routed_head, dim=1)
        mask = F.one_hot(indices, num_classes=num_experts).sum(dim=1)
        mask = mask.reshape(bsz, q_len, -1)
        mask = torch.cat([torch.ones_like(mask).to(query_states.dtype), mask], dim=-1).to(query_states.dtype)
        self.official_mask = mask

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)

        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask

        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).contiguous()

        attn_output = attn_output.reshape(bsz, q_len, self.num_heads, self.head_dim)
        attn_output = torch.einsum("bne,bned->bned", mask, attn_output)
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)

        attn_output = self.o_proj(attn_output)
        return attn_output


def _randomize(module, gen, std=0.3):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def _close(a, b, tol=1e-5):
    """Equal up to float32 noise of a differently batched matmul."""
    return float((a - b).abs().max()) <= tol * (1.0 + float(b.abs().max()))


def self_test(verbose=True):
    """Proves the per-row-K extension reduces to the official code with the trained K,
    and that rows are independent (a mixed-K batch equals separate runs)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    checks = 0

    def log(msg):
        if verbose:
            print("self-test:", msg)

    # 1. learned router: MoHAttention vs verbatim DiT (S > 1, S == 0, K == 0 / S == H)
    #    and vs verbatim ViT gates (S == 1, which DiT cannot run).
    dim, H, B, N = 48, 6, 3, 7
    for S, K in [(2, 2), (3, 1), (0, 3), (6, 0), (1, 3), (2, 4)]:
        ours = MoHAttention(dim, H, qkv_bias=True, shared_head=S, routed_head=K).eval()
        _randomize(ours, gen)
        x = torch.randn(B, N, dim, generator=gen)
        with torch.no_grad():
            y = ours(x)  # top_k None -> trained K
            y_rows = ours(x, torch.full((B,), K, dtype=torch.long)) if K > 0 else y
            g_official = _official_vit_gates(ours, x)
            assert torch.equal(ours.last_gates, g_official), (S, K)
            if S != 1:
                off = _OfficialDiTMoHAttention(dim, H, qkv_bias=True, shared_head=S, routed_head=K).eval()
                off.load_state_dict(ours.state_dict())
                y_off = off(x)
                assert torch.equal(y, y_off), ("DiT output", S, K, (y - y_off).abs().max())
                assert torch.equal(ours.last_gates, off.masked_gates), ("DiT gates", S, K)
            assert torch.equal(y, y_rows)
        checks += 1
        log("learned S=%d K=%d: equal to official %s" % (S, K, "ViT gates" if S == 1 else "DiT forward"))

    # 2. per-row K: a batch mixing K = 0..R equals each row alone; K == 0 rows -> 0 routed gates
    S, K = 2, 2
    ours = MoHAttention(dim, H, qkv_bias=True, shared_head=S, routed_head=K).eval()
    _randomize(ours, gen)
    R = H - S
    x = torch.randn(R + 1, N, dim, generator=gen)
    ks = torch.arange(R + 1)
    with torch.no_grad():
        y = ours(x, ks)
        g = ours.last_gates.clone()
        for b in range(R + 1):
            yb = ours(x[b:b + 1], ks[b:b + 1])
            assert _close(y[b:b + 1], yb)
            assert _close(g[b:b + 1], ours.last_gates)
            assert int((ours.last_gates[0, :, S:] != 0).sum(-1).max()) == int(ks[b])
        assert torch.count_nonzero(g[0, :, S:]) == 0
        # on the same input, the K_row selected heads are the K_row best (nested selections)
        ours(x[:1].expand(R + 1, N, dim), ks)
        sel = [(ours.last_gates[b, :, S:] != 0) for b in range(R + 1)]
        for b in range(R):
            assert bool((sel[b] <= sel[b + 1]).all())
    checks += 1
    log("learned per-row K: mixed batch == separate rows, nested selections, K=0 rows zero")

    # 3. query-norm router: LlamaAttention vs verbatim official LlamaAttention.forward
    cfg = LlamaConfig({"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
                       "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 10,
                       "auto_map": {}, "rope_theta": 500000.0, "max_position_embeddings": 64})
    ours = LlamaAttention(cfg, 0).eval()
    _randomize(ours, gen)
    off = _OfficialLlamaAttention(cfg, 0).eval()
    off.load_state_dict(ours.state_dict())
    T = 9
    pos = torch.arange(T).unsqueeze(0)
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    B = 4
    x = torch.randn(B, T, 64, generator=gen)
    with torch.no_grad():
        y = ours(x, causal.expand(B, 1, T, T), pos)
        y_off = off(x, causal.expand(B, 1, T, T), pos)
        assert torch.equal(y, y_off), (y - y_off).abs().max()
        assert torch.equal(ours.last_gates, off.official_mask)
        # per-row K (K = 0, 1, 2, 4 of R = 4) equals separate rows
        ks = torch.tensor([0, 1, 2, 4])
        y = ours(x, causal.expand(B, 1, T, T), pos, top_k=ks)
        g = ours.last_gates.clone()
        for b in range(B):
            yb = ours(x[b:b + 1], causal, pos, top_k=ks[b:b + 1])
            assert _close(y[b:b + 1], yb)
            assert torch.equal(g[b:b + 1], ours.last_gates)
            assert bool((g[b, :, 4:].sum(-1) == ks[b]).all())
    checks += 1
    log("query-norm: equal to official LlamaAttention.forward; per-row K == separate rows")

    # 4. learned router inside LLaMA == MoHAttention's gates on the same input
    for S, K in [(2, 3), (1, 2), (0, 2), (8, 0)]:
        cfg = LlamaConfig({"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4,
                           "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 10,
                           "moh_router": "learned", "moh_shared_heads": S, "moh_routed_top_k": K})
        la = LlamaAttention(cfg, 0).eval()
        _randomize(la, gen)
        ma = MoHAttention(64, 8, shared_head=S, routed_head=K).eval()
        sd = {k: v for k, v in la.state_dict().items() if k.startswith("wg")}
        ma.load_state_dict(sd, strict=False)
        x = torch.randn(2, 5, 64, generator=gen)
        with torch.no_grad():
            for top_k in ([None] if K == 0 else [None, torch.tensor([0, K + 1])]):
                la(x, causal[..., :5, :5], torch.arange(5)[None], top_k=top_k)
                ma(x, top_k)
                assert torch.equal(la.last_gates, ma.last_gates), (S, K)
                assert torch.equal(la.last_used, ma.last_used)
    checks += 1
    log("learned router in LLaMA == MoHAttention gates")

    assert k_for_ratio(0.75, 8, 4, 2) == 2 and k_for_ratio(0.5, 8, 4, 2) == 0
    assert k_for_ratio(1.0, 8, 4, 2) == 4 and k_for_ratio(0, 8, 4, 2) == 2
    assert k_for_ratio(0.5, 6, 6, 0) == 0 and k_for_ratio(0.75, 6, 1, 3) == 4
    checks += 1
    print("self-test: OK (%d groups of checks)" % checks)


def _main(argv):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--self-test", action="store_true")
    sub = ap.add_subparsers(dest="cmd")
    run = sub.add_parser("run", help="forward one prompt (LLaMA) and print top tokens, K, gates")
    run.add_argument("model_dir")
    run.add_argument("--ids", type=int, nargs="+", required=True)
    run.add_argument("--ratio", type=float, default=0.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.self_test:
        self_test()
        return 0
    if args.cmd == "run":
        model = load_model(args.model_dir)
        with torch.no_grad():
            logits, gates, _ = model(torch.tensor([args.ids]), args.ratio)
        print("top_k per layer:", model.layer_top_k(args.ratio))
        for t in range(len(args.ids)):
            print(t, "argmax", int(logits[0, t].argmax()), "gates", [[round(v, 4) for v in g[0, t].tolist()] for g in gates])
        return 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
