"""Independent Python reference for MoH-ViT (MoH on TransNeXt), plain torch, no timm.

A TRANSCRIPTION of the official code (github.com/SkyworkAI/MoH at commit 2cefd57b, the
same commit as moh_reference.py), written to be compared with it line by line; the C++
engine is tested against the fixtures that make_transnext_fixtures.py computes with it.
Official file / lines -> what here:

  MoH-ViT/transnext.py
    42-53    DWConv                              -> DWConv
    56-74    ConvolutionalGLU: hidden = int(2 * int(dim * mlp_ratio) / 3), fc1 -> 2 hidden,
             chunk(2): first half -> dwconv -> exact GELU, times the second half, fc2
                                                 -> ConvolutionalGLU
    77-102   get_relative_position_cpb           -> relative_position_cpb
    105-147  Block: pre-norm attention + ConvGLU; attention is Attention when sr_ratio
             is 1, else AggregatedAttention      -> Block
    150-170  OverlapPatchEmbed: conv k = 2*patch-1, stride patch (stage 1) or k 3,
             stride 2 (later stages), padding k // 2, then LayerNorm (eps 1e-5)
                                                 -> OverlapPatchEmbed
    173-289  TransNeXt: per stage i (0-based) resolution img_size // 2**(i+2), CPB table
             with pretrain size pretrain_size // 2**(i+2), patch embed, blocks, norm{i}
             (eps layer_norm_eps); the next stage gets [B, C, H, W]; mean over the last
             stage's tokens; head               -> TransNeXt
    292-341  the four variants                  -> VARIANTS
  MoH-ViT/attention.py
    7-116    Attention (sr_ratio 1: full cosine attention, seq-length scale log(N),
             temperature, query embedding, CPB bias)        -> Attention
  MoH-ViT/attention_native.py
    8-14     get_seqlen_and_mask                -> seqlen_and_mask
    17-188   AggregatedAttention (local window + pooled keys through one softmax,
             the pool branch's sr conv / GELU / AdaptiveAvgPool2d / LayerNorm (eps 1e-5),
             learnable tokens and bias)         -> AggregatedAttention
  The router lines (attention.py 50-69 and 84-108 == attention_native.py 94-113 and
  156-180) are moh_reference._learned_router_gates (shared with moh_reference's ViT).
  MoH-ViT/datasets.py 85-125 build_transform (eval, input < 384): torchvision
  Resize(int(input/(224/256)), BICUBIC) on the PIL image, CenterCrop, ToTensor,
  Normalize(ImageNet mean/std); images loaded by ImageFolder's pil_loader, which is
  convert('RGB')                               -> preprocess_image

Eval only: no dropout / drop path.  The non-persistent buffers (relative_pos_index{i},
relative_coords_table{i}, seq_length_scale, padding_mask) are recomputed from the config.

Not in the official code: S == 1 without routing (H == 1) would call the missing wg_1;
here its gate is 1 (= softmax over one head * 1).

THE ONE EXTENSION: per-row K, exactly as moh_reference.py (k_for_ratio: for a ratio r,
K = clamp(floor(r*H + 0.5) - S, 0, H - S) in layers with routed heads; r = 0 / None is the
trained K; routed gates = renormalized top-K gates * K).  Each row (image) of a batch may
have its own ratio.  After a forward, every attention module holds last_gates
[B, N, H] (0 = head unused), last_used, last_scores and last_top_k as in moh_reference.

`--self-test` checks, on random weights, that with the trained K this equals verbatim
copies of the official forwards (section "_Official*" at the end, used only there), and
that rows with different K in one batch equal each row alone.
`run MODEL_DIR [--image FILE] [--ratio r]` prints a forward (config.json + checkpoint.pth or
model.safetensors).
"""
import argparse
import json
import math
import os
import sys
import warnings
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import moh_reference as ref  # noqa: E402
import pil_resample  # noqa: E402

OFFICIAL_COMMIT = ref.OFFICIAL_COMMIT
CPB_HIDDEN = 512  # cpb_fc1 = Linear(2, 512)
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]

# transnext.py 292-341; shared_head / routed_head (the trained top-K) per stage
VARIANTS = {
    "moh_transnext_base_75": dict(embed_dims=[96, 192, 384, 768], num_heads=[4, 8, 16, 32],
                                  depths=[5, 5, 23, 5], shared=[4, 8, 4, 5], routed=[0, 0, 8, 16]),
    "moh_transnext_base_50": dict(embed_dims=[96, 192, 384, 768], num_heads=[4, 8, 16, 32],
                                  depths=[5, 5, 23, 5], shared=[2, 2, 2, 4], routed=[2, 4, 6, 8]),
    "moh_transnext_small_80": dict(embed_dims=[72, 144, 288, 576], num_heads=[3, 6, 12, 24],
                                   depths=[5, 5, 22, 5], shared=[3, 6, 3, 8], routed=[0, 0, 6, 12]),
    "moh_transnext_small_75": dict(embed_dims=[72, 144, 288, 576], num_heads=[3, 6, 12, 24],
                                   depths=[5, 5, 22, 5], shared=[3, 6, 3, 4], routed=[0, 0, 6, 12]),
}


def variant_config(name, image_size=224, labels=None):
    """config.json for a released variant (common settings of transnext.py 294-297)."""
    v = VARIANTS[name]
    cfg = {
        "model_type": "moh_transnext", "variant": name,
        "image_size": image_size, "pretrain_size": 224, "resize_size": int(image_size / (224 / 256)),
        "num_channels": 3, "patch_size": 4,
        "embed_dims": v["embed_dims"], "num_heads": v["num_heads"], "mlp_ratios": [8, 8, 4, 4],
        "depths": v["depths"], "sr_ratios": [8, 4, 2, 1], "window_size": 3, "qkv_bias": True,
        "layer_norm_eps": 1e-6, "moh_shared_heads": v["shared"], "moh_routed_top_k": v["routed"],
        "labels": labels if labels is not None else ["class_%d" % i for i in range(1000)],
        "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD,
    }
    return cfg


# Tiny random-weight configs of the fixtures (make_transnext_fixtures.py) and the self-test.
# transnext_tiny: every router path: stage 1 re-weight only (S == H == 2), stage 2 S == 1
# with top-2 of 3 routed, stage 3 S == 2 with top-1 of 2 (two blocks), stage 4 full attention
# with S == 0 and top-2 of 4.
TINY_CONFIG = {
    "model_type": "moh_transnext",
    "image_size": 64, "pretrain_size": 64, "resize_size": 73, "num_channels": 3, "patch_size": 4,
    "embed_dims": [8, 16, 32, 32], "num_heads": [2, 4, 4, 4], "mlp_ratios": [2, 2, 2, 2],
    "depths": [1, 1, 2, 1], "sr_ratios": [8, 4, 2, 1], "window_size": 3, "qkv_bias": True,
    "layer_norm_eps": 1e-6, "moh_shared_heads": [2, 1, 2, 0], "moh_routed_top_k": [0, 2, 1, 2],
    "labels": ["tench", "goldfish", "shark", "tiger shark", "hammerhead", "electric ray",
               "stingray", "cock", "hen", "ostrich"],
    "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD,
}
# transnext_tiny_b: image 96 with pretrain 64 (CPB coordinates scaled by the pretrain size),
# pools whose windows are not sr_ratio wide (24 -> 4, 12 -> 2) and a 1 x 1 pool (6 -> 1),
# window 5, no qkv bias, non-integer mlp ratio, routing in stage 1, S == 1 with R == 1,
# S == H == 3 re-weight only, and stage 4 with S == 3 and top-2 of 5.
TINY_B_CONFIG = {
    "model_type": "moh_transnext",
    "image_size": 96, "pretrain_size": 64, "resize_size": 109, "num_channels": 3, "patch_size": 4,
    "embed_dims": [16, 16, 24, 32], "num_heads": [4, 2, 3, 8], "mlp_ratios": [4, 3, 2.5, 2],
    "depths": [1, 2, 1, 1], "sr_ratios": [5, 5, 4, 1], "window_size": 5, "qkv_bias": False,
    "layer_norm_eps": 1e-6, "moh_shared_heads": [2, 1, 3, 3], "moh_routed_top_k": [1, 1, 0, 2],
    "labels": ["red", "orange", "yellow", "green", "blue", "indigo", "violet"],
    "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD,
}


class TransNeXtConfig:
    """The config.json fields (tests/reference/README.md), checked, plus derived sizes."""

    def __init__(self, d):
        assert d["model_type"] == "moh_transnext", d["model_type"]
        self.raw = dict(d)
        self.image_size = int(d["image_size"])
        self.pretrain_size = int(d.get("pretrain_size") or self.image_size)
        self.resize_size = int(d.get("resize_size", int(self.image_size / (224 / 256))))
        self.num_channels = int(d.get("num_channels", 3))
        self.patch_size = int(d.get("patch_size", 4))
        self.embed_dims = [int(v) for v in d["embed_dims"]]
        self.num_heads = [int(v) for v in d["num_heads"]]
        self.mlp_ratios = [float(v) for v in d["mlp_ratios"]]
        self.depths = [int(v) for v in d["depths"]]
        self.sr_ratios = [int(v) for v in d["sr_ratios"]]
        self.window_size = int(d.get("window_size", 3))
        self.qkv_bias = bool(d.get("qkv_bias", True))
        self.layer_norm_eps = float(d.get("layer_norm_eps", 1e-6))
        self.shared_heads = [int(v) for v in d["moh_shared_heads"]]
        self.routed_top_k = [int(v) for v in d["moh_routed_top_k"]]
        self.num_classes = len(d["labels"]) if "labels" in d else int(d["num_classes"])
        self.image_mean = [float(v) for v in d.get("image_mean", IMAGENET_MEAN)]
        self.image_std = [float(v) for v in d.get("image_std", IMAGENET_STD)]
        # transnext.py 204/218 use img_size // 2**(i+2) as the stage resolution, which is
        # the patch embeds' output size only for patch 4 and a multiple of 32
        assert self.patch_size == 4 and self.image_size % 32 == 0, "needs patch 4, image % 32 == 0"
        assert self.window_size % 2 == 1
        self.resolutions = [self.image_size // 2 ** (i + 2) for i in range(4)]
        self.pretrain_resolutions = [self.pretrain_size // 2 ** (i + 2) for i in range(4)]
        self.pool_sizes = [r // s for r, s in zip(self.resolutions, self.sr_ratios)]
        self.mlp_hidden = [int(2 * int(c * m) / 3) for c, m in zip(self.embed_dims, self.mlp_ratios)]
        for i in range(4):
            assert self.embed_dims[i] % self.num_heads[i] == 0
            assert self.pretrain_resolutions[i] >= 2, "the CPB divides by pretrain resolution - 1"
            assert self.pool_sizes[i] >= 1
            ref._check_moh(self.num_heads[i], [self.shared_heads[i]], [self.routed_top_k[i]], "learned")

    def layers(self):
        """(stage, block, H, S, trained K) in block order."""
        return [(i, j, self.num_heads[i], self.shared_heads[i], self.routed_top_k[i])
                for i in range(4) for j in range(self.depths[i])]


def state_dict_shapes(d):
    """name -> shape of every tensor of the official state dict, in its order, analytically."""
    c = d if isinstance(d, TransNeXtConfig) else TransNeXtConfig(d)
    out = OrderedDict()

    def linear(name, n_out, n_in, bias=True):
        out[name + ".weight"] = (n_out, n_in)
        if bias:
            out[name + ".bias"] = (n_out,)

    def layer_norm(name, n):
        out[name + ".weight"] = (n,)
        out[name + ".bias"] = (n,)

    for i in range(4):
        C, H = c.embed_dims[i], c.num_heads[i]
        S, K, hd, L = c.shared_heads[i], c.routed_top_k[i], C // H, c.window_size ** 2
        k = 2 * c.patch_size - 1 if i == 0 else 3
        out["patch_embed%d.proj.weight" % (i + 1)] = (C, c.num_channels if i == 0 else c.embed_dims[i - 1], k, k)
        out["patch_embed%d.proj.bias" % (i + 1)] = (C,)
        layer_norm("patch_embed%d.norm" % (i + 1), C)
        for j in range(c.depths[i]):
            p = "block%d.%d." % (i + 1, j)
            layer_norm(p + "norm1", C)
            a = p + "attn."
            out[a + "temperature"] = (H, 1, 1)
            out[a + "query_embedding"] = (H, 1, hd)
            if c.sr_ratios[i] == 1:
                linear(a + "qkv", 3 * C, C, c.qkv_bias)
                linear(a + "proj", C, C)
            else:
                out[a + "relative_pos_bias_local"] = (H, L)
                out[a + "learnable_tokens"] = (H, hd, L)
                out[a + "learnable_bias"] = (H, 1, L)
                linear(a + "q", C, C, c.qkv_bias)
                linear(a + "kv", 2 * C, C, c.qkv_bias)
                linear(a + "proj", C, C)
                out[a + "sr.weight"] = (C, C, 1, 1)
                out[a + "sr.bias"] = (C,)
                layer_norm(a + "norm", C)
            linear(a + "cpb_fc1", CPB_HIDDEN, 2)
            linear(a + "cpb_fc2", H, CPB_HIDDEN)
            if K > 0:
                linear(a + "wg", H - S, C, bias=False)
                if S > 0:
                    linear(a + "wg_0", 2, C, bias=False)
            if S > 1:
                linear(a + "wg_1", S, C, bias=False)
            layer_norm(p + "norm2", C)
            h = c.mlp_hidden[i]
            linear(p + "mlp.fc1", 2 * h, C)
            out[p + "mlp.dwconv.dwconv.weight"] = (h, 1, 3, 3)
            out[p + "mlp.dwconv.dwconv.bias"] = (h,)
            linear(p + "mlp.fc2", C, h)
        layer_norm("norm%d" % (i + 1), C)
    linear("head", c.num_classes, c.embed_dims[3])
    return out


def variant_manifest():
    """{variant: {"config": config.json without labels, "num_classes": 1000, "tensors": {name: shape}}}."""
    out = {}
    for name in VARIANTS:
        cfg = variant_config(name)
        del cfg["labels"]
        shapes = state_dict_shapes(dict(cfg, num_classes=1000))
        out[name] = {"config": cfg, "num_classes": 1000,
                     "tensors": OrderedDict((k, list(v)) for k, v in shapes.items())}
    return out


# ----------------------------------------------------------------------------------
# Position tables (transnext.py 77-102, attention_native.py 8-14, attention.py 20, 69-72)
# ----------------------------------------------------------------------------------
@torch.no_grad()
def relative_position_cpb(query_size, key_size, pretrain_size):
    """(index [Nq*Nk] into the table, table [U, 2]) for the continuous position bias.

    Query tokens sit at integer (h, w); key tokens at the adaptive-average-pooled
    coordinates.  Offsets are scaled by 8 / (pretrain resolution - 1), mapped by
    sign(x) * log2(|x| + 1) / log2(8), and deduplicated (torch.unique, rows sorted).
    """
    qh = torch.arange(query_size[0], dtype=torch.float32)
    qw = torch.arange(query_size[1], dtype=torch.float32)
    kh = F.adaptive_avg_pool1d(qh.unsqueeze(0), key_size[0]).squeeze(0)
    kw = F.adaptive_avg_pool1d(qw.unsqueeze(0), key_size[1]).squeeze(0)
    # token t = h * W + w, row-major, for queries and keys
    q_h = qh[:, None].expand(query_size[0], query_size[1]).reshape(-1)
    q_w = qw[None, :].expand(query_size[0], query_size[1]).reshape(-1)
    k_h = kh[:, None].expand(key_size[0], key_size[1]).reshape(-1)
    k_w = kw[None, :].expand(key_size[0], key_size[1]).reshape(-1)
    rel_h = (q_h[:, None] - k_h[None, :]) / (pretrain_size[0] - 1) * 8
    rel_w = (q_w[:, None] - k_w[None, :]) / (pretrain_size[1] - 1) * 8
    table, index = torch.unique(torch.stack([rel_h, rel_w], dim=-1).view(-1, 2), return_inverse=True, dim=0)
    table = torch.sign(table) * torch.log2(torch.abs(table) + 1.0) / torch.log2(torch.tensor(8, dtype=torch.float32))
    return index, table


@torch.no_grad()
def seqlen_and_mask(resolution, window_size):
    """Valid positions per query of the zero-padded window: ([N, 1] float count, [N, w*w] bool pad)."""
    ones = torch.ones([1, 1, resolution[0], resolution[1]])
    valid = F.unfold(ones, window_size, dilation=1, padding=(window_size // 2, window_size // 2), stride=1)
    return valid.sum(-2).squeeze().unsqueeze(-1), valid.squeeze(0).permute(1, 0) == 0


# ----------------------------------------------------------------------------------
# Modules (attribute names = the official state-dict names)
# ----------------------------------------------------------------------------------
def _router_gates(module, _x, B, N, top_k):
    """masked_gates [B, N, H], used [B, N, H]; per-row K through top_k (None = trained)."""
    if module.routed_head == 0 and module.shared_head == 1:  # H == 1: the official has no wg_1
        module.last_scores, module.last_top_k = None, None
        gates = torch.ones((B, N, 1), dtype=_x.dtype)
        return gates, gates > 0
    return ref._learned_router_gates(module, _x, B, N, ref._rows_top_k(top_k, module.routed_head, B, N))


def _add_router(module, dim, num_heads, shared_head, routed_head):
    module.shared_head, module.routed_head = shared_head, routed_head
    if routed_head > 0:
        module.wg = nn.Linear(dim, num_heads - shared_head, bias=False)
        if shared_head > 0:
            module.wg_0 = nn.Linear(dim, 2, bias=False)
    if shared_head > 1:
        module.wg_1 = nn.Linear(dim, shared_head, bias=False)


def _apply_gates(module, masked_gates, used, heads_out, B, N, C):
    """heads_out [B, H, N, hd] -> gated [B, N, C] (einsum bne,bned->bned), recording the gates."""
    module.last_gates, module.last_used = masked_gates.detach(), used
    x = torch.einsum("bne,bned->bned", masked_gates, heads_out.transpose(1, 2))
    return x.reshape(B, N, C)


class Attention(nn.Module):  # attention.py 7-116 (sr_ratio == 1)
    def __init__(self, dim, input_resolution, num_heads, qkv_bias, shared_head, routed_head):
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.temperature = nn.Parameter(torch.zeros(num_heads, 1, 1))
        # a float64 0-dim tensor, as np.log(int) is
        self.register_buffer("seq_length_scale", torch.as_tensor(np.log(input_resolution[0] * input_resolution[1])),
                             persistent=False)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.query_embedding = nn.Parameter(torch.zeros(num_heads, 1, self.head_dim))
        self.proj = nn.Linear(dim, dim)
        self.cpb_fc1 = nn.Linear(2, CPB_HIDDEN)
        self.cpb_act = nn.ReLU(inplace=True)
        self.cpb_fc2 = nn.Linear(CPB_HIDDEN, num_heads)
        _add_router(self, dim, num_heads, shared_head, routed_head)

    def forward(self, x, H, W, relative_pos_index, relative_coords_table, top_k=None):
        B, N, C = x.shape
        masked_gates, used = _router_gates(self, x.reshape(B * N, C), B, N, top_k)
        # heads: q = channels [0, C), k = [C, 2C), v = [2C, 3C) of qkv, each split into H heads
        q, k, v = self.qkv(x).reshape(B, N, 3 * self.num_heads, self.head_dim).permute(0, 2, 1, 3).chunk(3, dim=1)
        bias = self.cpb_fc2(self.cpb_act(self.cpb_fc1(relative_coords_table)))  # [U, H]
        bias = bias.transpose(0, 1)[:, relative_pos_index.view(-1)].view(-1, N, N)
        # cosine attention: (unit q + query embedding) * softplus(temperature) * log(N)
        q_scaled = (F.normalize(q, dim=-1) + self.query_embedding) * F.softplus(self.temperature) * self.seq_length_scale
        attn = (q_scaled @ F.normalize(k, dim=-1).transpose(-2, -1) + bias).softmax(dim=-1)
        return self.proj(_apply_gates(self, masked_gates, used, attn @ v, B, N, C))


class AggregatedAttention(nn.Module):  # attention_native.py 17-188
    def __init__(self, dim, input_resolution, num_heads, window_size, qkv_bias, sr_ratio, shared_head, routed_head):
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.sr_ratio, self.window_size, self.local_len = sr_ratio, window_size, window_size ** 2
        self.pool_H, self.pool_W = input_resolution[0] // sr_ratio, input_resolution[1] // sr_ratio
        self.pool_len = self.pool_H * self.pool_W
        self.unfold = nn.Unfold(kernel_size=window_size, padding=window_size // 2, stride=1)
        self.temperature = nn.Parameter(torch.zeros(num_heads, 1, 1))
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.query_embedding = nn.Parameter(torch.zeros(num_heads, 1, self.head_dim))
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.pool = nn.AdaptiveAvgPool2d((self.pool_H, self.pool_W))
        self.sr = nn.Conv2d(dim, dim, kernel_size=1, stride=1, padding=0)
        self.norm = nn.LayerNorm(dim)  # eps 1e-5 (nn.LayerNorm's default), not layer_norm_eps
        self.act = nn.GELU()
        self.cpb_fc1 = nn.Linear(2, CPB_HIDDEN)
        self.cpb_act = nn.ReLU(inplace=True)
        self.cpb_fc2 = nn.Linear(CPB_HIDDEN, num_heads)
        self.relative_pos_bias_local = nn.Parameter(torch.zeros(num_heads, self.local_len))
        local_seq_length, padding_mask = seqlen_and_mask(input_resolution, window_size)
        # log(valid window positions + pool_len) per query, float32 through numpy as official
        self.register_buffer("seq_length_scale", torch.as_tensor(np.log(local_seq_length.numpy() + self.pool_len)),
                             persistent=False)
        self.register_buffer("padding_mask", padding_mask, persistent=False)
        self.learnable_tokens = nn.Parameter(torch.zeros(num_heads, self.head_dim, self.local_len))
        self.learnable_bias = nn.Parameter(torch.zeros(num_heads, 1, self.local_len))
        _add_router(self, dim, num_heads, shared_head, routed_head)

    def forward(self, x, H, W, relative_pos_index, relative_coords_table, top_k=None):
        B, N, C = x.shape
        nh, hd = self.num_heads, self.head_dim
        masked_gates, used = _router_gates(self, x.reshape(B * N, C), B, N, top_k)

        q_unit = F.normalize(self.q(x).reshape(B, N, nh, hd).permute(0, 2, 1, 3), dim=-1)  # [B, nh, N, hd]
        q_scaled = (q_unit + self.query_embedding) * F.softplus(self.temperature) * self.seq_length_scale

        # local branch: keys (unit length per head) and values of the window around each token,
        # zero padded; unfold orders channels (c, window position)
        k_local, v_local = self.kv(x).chunk(2, dim=-1)
        k_local = F.normalize(k_local.reshape(B, N, nh, hd), dim=-1).reshape(B, N, -1)
        kv_local = torch.cat([k_local, v_local], dim=-1).permute(0, 2, 1).reshape(B, -1, H, W)
        k_local, v_local = self.unfold(kv_local).reshape(B, 2 * nh, hd, self.local_len, N) \
            .permute(0, 1, 4, 2, 3).chunk(2, dim=1)  # each [B, nh, N, hd, local]
        attn_local = (q_scaled.unsqueeze(-2) @ k_local).squeeze(-2) + self.relative_pos_bias_local.unsqueeze(1)
        attn_local = attn_local.masked_fill(self.padding_mask, float("-inf"))

        # pooled branch: 1x1 conv, exact GELU, adaptive average pool, LayerNorm, the same kv
        pooled = self.pool(self.act(self.sr(x.permute(0, 2, 1).reshape(B, -1, H, W).contiguous())))
        pooled = self.norm(pooled.reshape(B, -1, self.pool_len).permute(0, 2, 1))
        k_pool, v_pool = self.kv(pooled).reshape(B, self.pool_len, 2 * nh, hd).permute(0, 2, 1, 3).chunk(2, dim=1)
        bias = self.cpb_fc2(self.cpb_act(self.cpb_fc1(relative_coords_table)))
        bias = bias.transpose(0, 1)[:, relative_pos_index.view(-1)].view(-1, N, self.pool_len)
        attn_pool = q_scaled @ F.normalize(k_pool, dim=-1).transpose(-2, -1) + bias

        # one softmax over [local, pooled]; the local weights also get q_unit @ learnable tokens + bias
        attn_local, attn_pool = torch.split(torch.cat([attn_local, attn_pool], dim=-1).softmax(dim=-1),
                                            [self.local_len, self.pool_len], dim=-1)
        w_local = (q_unit @ self.learnable_tokens) + self.learnable_bias + attn_local
        x_local = (w_local.unsqueeze(-2) @ v_local.transpose(-2, -1)).squeeze(-2)
        x_pool = attn_pool @ v_pool
        return self.proj(_apply_gates(self, masked_gates, used, x_local + x_pool, B, N, C))


class DWConv(nn.Module):  # transnext.py 42-53
    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=3, stride=1, padding=1, bias=True, groups=dim)

    def forward(self, x, H, W):
        B, N, C = x.shape
        return self.dwconv(x.transpose(1, 2).view(B, C, H, W).contiguous()).flatten(2).transpose(1, 2)


class ConvolutionalGLU(nn.Module):  # transnext.py 56-74
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden * 2)
        self.dwconv = DWConv(hidden)
        self.act = nn.GELU()  # exact (erf)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x, H, W):
        x, v = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(self.act(self.dwconv(x, H, W)) * v)


class Block(nn.Module):  # transnext.py 105-147
    def __init__(self, c, stage):
        super().__init__()
        dim, res, H = c.embed_dims[stage], (c.resolutions[stage],) * 2, c.num_heads[stage]
        S, K = c.shared_heads[stage], c.routed_top_k[stage]
        self.norm1 = nn.LayerNorm(dim, eps=c.layer_norm_eps)
        if c.sr_ratios[stage] == 1:
            self.attn = Attention(dim, res, H, c.qkv_bias, S, K)
        else:
            self.attn = AggregatedAttention(dim, res, H, c.window_size, c.qkv_bias, c.sr_ratios[stage], S, K)
        self.norm2 = nn.LayerNorm(dim, eps=c.layer_norm_eps)
        self.mlp = ConvolutionalGLU(dim, c.mlp_hidden[stage])

    def forward(self, x, H, W, relative_pos_index, relative_coords_table, top_k=None):
        x = x + self.attn(self.norm1(x), H, W, relative_pos_index, relative_coords_table, top_k)
        return x + self.mlp(self.norm2(x), H, W)


class OverlapPatchEmbed(nn.Module):  # transnext.py 150-170
    def __init__(self, patch_size, stride, in_chans, embed_dim):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=stride,
                              padding=(patch_size // 2, patch_size // 2))
        self.norm = nn.LayerNorm(embed_dim)  # eps 1e-5

    def forward(self, x):
        x = self.proj(x)
        _, _, H, W = x.shape
        return self.norm(x.flatten(2).transpose(1, 2)), H, W


class TransNeXt(nn.Module):  # transnext.py 173-289
    def __init__(self, cfg):
        super().__init__()
        c = cfg if isinstance(cfg, TransNeXtConfig) else TransNeXtConfig(cfg)
        self.config, self.num_stages = c, 4
        for i in range(4):
            index, table = relative_position_cpb((c.resolutions[i],) * 2, (c.pool_sizes[i],) * 2,
                                                 (c.pretrain_resolutions[i],) * 2)
            self.register_buffer("relative_pos_index%d" % (i + 1), index, persistent=False)
            self.register_buffer("relative_coords_table%d" % (i + 1), table, persistent=False)
            setattr(self, "patch_embed%d" % (i + 1), OverlapPatchEmbed(
                c.patch_size * 2 - 1 if i == 0 else 3, c.patch_size if i == 0 else 2,
                c.num_channels if i == 0 else c.embed_dims[i - 1], c.embed_dims[i]))
            setattr(self, "block%d" % (i + 1), nn.ModuleList([Block(c, i) for _ in range(c.depths[i])]))
            setattr(self, "norm%d" % (i + 1), nn.LayerNorm(c.embed_dims[i], eps=c.layer_norm_eps))
        self.head = nn.Linear(c.embed_dims[3], c.num_classes)

    def attentions(self):
        """The attention modules in block order (stage 1 block 0, ...)."""
        return [blk.attn for i in range(4) for blk in getattr(self, "block%d" % (i + 1))]

    def layer_top_k(self, ratio):
        return [ref.k_for_ratio(ratio, H, S, K) for _, _, H, S, K in self.config.layers()]

    def forward(self, pixel_values, ratios=None):
        """pixel_values [B, C, S, S] normalized; ratios None, a float, or one per row.

        Returns logits [B, classes]; gates per layer are in attentions()[l].last_gates.
        """
        B = pixel_values.shape[0]
        if ratios is not None and not isinstance(ratios, (list, tuple)):
            ratios = [ratios] * B
        ks = None if ratios is None else [self.layer_top_k(r) for r in ratios]
        x, layer = pixel_values, 0
        for i in range(4):
            x, H, W = getattr(self, "patch_embed%d" % (i + 1))(x)
            index = getattr(self, "relative_pos_index%d" % (i + 1))
            table = getattr(self, "relative_coords_table%d" % (i + 1))
            for blk in getattr(self, "block%d" % (i + 1)):
                top_k = None if ks is None else torch.tensor([k[layer] for k in ks], dtype=torch.long)
                x = blk(x, H, W, index, table, top_k)
                layer += 1
            x = getattr(self, "norm%d" % (i + 1))(x)
            if i != 3:
                x = x.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous()
        return self.head(x.mean(dim=1))

    def gates(self):
        return [a.last_gates for a in self.attentions()]

    def routing_records(self):
        return [(a.last_scores, a.last_top_k) for a in self.attentions()]

    def load_tensors(self, tensors):
        """Strict: exactly the tensors of state_dict_shapes, any float dtype (computed in the model's)."""
        want = state_dict_shapes(self.config)
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != dict(want):
            missing = sorted(set(want) - set(got))
            unexpected = sorted(set(got) - set(want))
            wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
            raise ValueError("checkpoint mismatch: missing %s unexpected %s wrong shape %s" % (missing, unexpected, wrong))
        dtype = self.head.weight.dtype
        self.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
        return self


def head_token_counts(gates):
    """Per layer: [B][H] counts of tokens whose gate is nonzero."""
    return [(g != 0).sum(dim=1).tolist() for g in gates]


# ----------------------------------------------------------------------------------
# Preprocessing (datasets.py 106-125 with torchvision's PIL semantics)
# ----------------------------------------------------------------------------------
def resized_size(width, height, size):
    """torchvision Resize(int) on a PIL image: the shorter side becomes `size`, the longer
    int(size * long / short) (Python float division, truncated).  Returns (width, height)."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def center_crop_origin(width, height, size):
    """torchvision CenterCrop: (left, top) = int(round((side - size) / 2.0)), Python round
    (half to even: 16.5 -> 16, 17.5 -> 18)."""
    assert width >= size and height >= size, "image smaller than the crop"
    return int(round((width - size) / 2.0)), int(round((height - size) / 2.0))


def to_rgb(img):
    """ImageFolder's pil_loader: Image.convert('RGB') (alpha dropped, gray replicated, palette looked up)."""
    return img.convert("RGB")


def resize_and_crop(img, resize_size, image_size):
    """RGB PIL image -> cropped RGB PIL image (BICUBIC: PIL's antialiased bicubic, a = -0.5,
    in 8-bit fixed point; pil_resample.py states its arithmetic and checks it against PIL)."""
    from PIL import Image

    w, h = resized_size(img.width, img.height, resize_size)
    if (w, h) != img.size:
        img = img.resize((w, h), Image.BICUBIC)
    left, top = center_crop_origin(w, h, image_size)
    return img.crop((left, top, left + image_size, top + image_size))


def normalize_pixels(u8_chw, mean, std):
    """ToTensor (uint8 / 255 in float32) then Normalize ((x - mean) / std in float32)."""
    x = u8_chw.to(torch.float32).div(255)
    mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)
    return x.sub(mean).div(std)


def preprocess_image(img, resize_size, image_size, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """PIL image (any mode) -> float32 [3, image_size, image_size], as the authors evaluated."""
    crop = resize_and_crop(to_rgb(img), resize_size, image_size)
    u8 = torch.from_numpy(np.array(crop, dtype=np.uint8, copy=True)).permute(2, 0, 1)
    return normalize_pixels(u8, mean, std)


# ----------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------
def load_tensors(directory):
    """The model's tensors: model.safetensors, or checkpoint.pth as MoH-ViT/main.py saves it ('model')."""
    st = os.path.join(directory, "model.safetensors")
    if os.path.exists(st):
        return ref.read_safetensors(st)
    ckpt = torch.load(os.path.join(directory, "checkpoint.pth"), map_location="cpu", weights_only=False)
    return dict(ckpt["model"])


def load_model(directory, dtype=torch.float32):
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    model = TransNeXt(cfg)
    if dtype != torch.float32:  # (keeps the float64 0-dim seq_length_scale of Attention as official)
        model = model.to(dtype)
    return model.load_tensors(load_tensors(directory)).eval()


# ----------------------------------------------------------------------------------
# Self-test
# ----------------------------------------------------------------------------------
def randomize(model, gen, scale=1.0):
    """Random weights with non-trivial biases, temperatures and routers (also for fixtures)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            parts = name.split(".")
            leaf, owner = parts[-1], (parts[-2] if len(parts) > 1 else "")
            if leaf == "temperature":  # softplus(t) around 1/0.24, the official init
                v = math.log(math.exp(1 / 0.24) - 1) + 0.5 * torch.randn(p.shape, generator=gen)
            elif owner.startswith("norm"):  # patch_embed*.norm, norm1/2, attn.norm, stage norms
                v = (1.0 + 0.1 * torch.randn(p.shape, generator=gen)) if leaf == "weight" else \
                    0.1 * torch.randn(p.shape, generator=gen)
            elif owner in ("wg", "wg_0", "wg_1"):
                v = torch.randn(p.shape, generator=gen) * (1.0 * scale)
            elif leaf in ("query_embedding", "learnable_tokens", "learnable_bias"):
                v = 0.3 * torch.randn(p.shape, generator=gen)
            elif leaf == "relative_pos_bias_local":
                v = 0.5 * torch.randn(p.shape, generator=gen)
            elif leaf == "bias":
                v = 0.1 * torch.randn(p.shape, generator=gen)
            else:  # weights: unit-variance outputs for unit-variance inputs
                fan_in = p[0].numel() if p.dim() > 1 else 1
                v = torch.randn(p.shape, generator=gen) / math.sqrt(fan_in)
            p.copy_(v.to(p.dtype))
    return model


def _close(a, b, tol=1e-5):
    return float((a - b).abs().max()) <= tol * (1.0 + float(b.abs().max()))


def self_test(verbose=True):
    gen = torch.Generator().manual_seed(4321)
    checks = 0

    def log(msg):
        if verbose:
            print("self-test:", msg)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.meshgrid without indexing= in the official copy
        # 1. position tables and buffers == official
        for q, k, p in [(16, 2, 16), (24, 4, 16), (12, 2, 8), (6, 1, 4), (3, 3, 2), (56, 7, 56), (32, 10, 24),
                        (7, 7, 7), (20, 6, 14)]:
            i_ours, t_ours = relative_position_cpb((q, q), (k, k), (p, p))
            i_off, t_off = _official_get_relative_position_cpb((q, q), (k, k), (p, p))
            assert torch.equal(i_ours, i_off.view(-1)) and torch.equal(t_ours, t_off), (q, k, p)
        for res, w in [(16, 3), (5, 3), (6, 5), (3, 5), (56, 3)]:
            n_ours, m_ours = seqlen_and_mask((res, res), w)
            n_off, m_off = _official_get_seqlen_and_mask((res, res), w)
            assert torch.equal(n_ours, n_off) and torch.equal(m_ours, m_off), (res, w)
        checks += 1
        log("relative_position_cpb, seqlen_and_mask == official")

        # 2. each attention (S, K) == official forward at the trained K
        dim, H, B, res = 16, 4, 2, 6
        N = res * res
        for S, K in [(4, 0), (1, 2), (2, 1), (0, 2), (2, 2), (3, 1), (0, 4)]:
            for kind in ("full", "aggregated"):
                if kind == "full":
                    ours = Attention(dim, (res, res), H, True, S, K)
                    off = Attention(dim, (res, res), H, True, S, K)
                    off.__class__ = _OfficialAttention
                    index, table = relative_position_cpb((res, res), (res, res), (res, res))
                else:
                    ours = AggregatedAttention(dim, (res, res), H, 3, True, 2, S, K)
                    off = AggregatedAttention(dim, (res, res), H, 3, True, 2, S, K)
                    off.__class__ = _OfficialAggregatedAttention
                    index, table = relative_position_cpb((res, res), (3, 3), (res, res))
                randomize(ours.eval(), gen)
                off.load_state_dict(ours.state_dict())
                off.eval()
                x = torch.randn(B, N, dim, generator=gen)
                with torch.no_grad():
                    y = ours(x, res, res, index, table)
                    y_off = off(x, res, res, index, table)
                    assert torch.equal(y, y_off), (kind, S, K, float((y - y_off).abs().max()))
                    if S + K > 0 and not (K == 0 and S == 1):
                        assert torch.equal(ours.last_gates, ref._official_vit_gates(ours, x)), (kind, S, K)
                    if K > 0:
                        y_rows = ours(x, res, res, index, table, torch.full((B,), K, dtype=torch.long))
                        assert torch.equal(y, y_rows)
        checks += 1
        log("Attention and AggregatedAttention == official forwards for S/K in 4/0 1/2 2/1 0/2 2/2 3/1 0/4")

        # 3. whole models == the official forwards (blocks, ConvGLU, patch embeds, stages)
        for cfg in (TINY_CONFIG, TINY_B_CONFIG):
            ours = randomize(TransNeXt(cfg).eval(), gen)
            shapes = state_dict_shapes(cfg)
            sd = ours.state_dict()
            assert list(sd) == list(shapes) and all(tuple(sd[k].shape) == shapes[k] for k in sd)
            off = _officialize(TransNeXt(cfg).eval())
            off.load_state_dict(sd)
            S = cfg["image_size"]
            x = torch.randn(3, 3, S, S, generator=gen)
            with torch.no_grad():
                y = ours(x)
                y_off = off(x)
                assert torch.equal(y, y_off), float((y - y_off).abs().max())
                assert torch.equal(ours(x, 0.0), y)
                assert torch.equal(ours(x, [0.0, None, 0.0]), y)
            checks += 1
            log("TransNeXt %dpx == official forward_features + head; state dict names/shapes == manifest" % S)

            # 4. per-row ratios: a mixed batch == each row alone; selected heads == K
            ratios = [0.1, 0.5, 0.75, 1.0, 0.0]
            xs = torch.randn(len(ratios), 3, S, S, generator=gen)
            with torch.no_grad():
                y = ours(xs, ratios)
                gates = [g.clone() for g in ours.gates()]
                for b, r in enumerate(ratios):
                    yb = ours(xs[b:b + 1], r)
                    assert _close(y[b:b + 1], yb), (r, float((y[b:b + 1] - yb).abs().max()))
                    ks = ours.layer_top_k(r)
                    for layer, (g_all, g_row) in enumerate(zip(gates, ours.gates())):
                        assert torch.equal(g_all[b:b + 1] != 0, g_row != 0)
                        assert _close(g_all[b:b + 1], g_row)
                        _, _, Hl, Sl, Kl = ours.config.layers()[layer]
                        if Kl > 0:
                            assert bool(((g_row[0, :, Sl:] != 0).sum(-1) == ks[layer]).all()), (r, layer)
            checks += 1
            log("TransNeXt %dpx: mixed ratios %s == each row alone, routed heads == K" % (S, ratios))

    # 5. ratios -> K, the released variants' sizes, the preprocessing arithmetic
    assert ref.k_for_ratio(0.75, 32, 5, 16) == 19 and ref.k_for_ratio(0.5, 32, 5, 16) == 11
    assert ref.k_for_ratio(0.5, 4, 0, 2) == 2 and ref.k_for_ratio(0.1, 4, 1, 2) == 0
    assert ref.k_for_ratio(0.9, 3, 3, 0) == 0 and ref.k_for_ratio(1.0, 16, 2, 6) == 14
    params = {n: sum(math.prod(s) for s in v["tensors"].values()) for n, v in variant_manifest().items()}
    # TransNeXt-Base 89.7M / -Small 49.7M parameters, plus the routers
    assert 89.6e6 < params["moh_transnext_base_75"] < 90.2e6, params
    assert 49.6e6 < params["moh_transnext_small_80"] < 50.2e6, params
    assert resized_size(300, 200, 256) == (384, 256) and resized_size(150, 401, 256) == (256, 684)
    assert resized_size(257, 257, 256) == (256, 256) and resized_size(320, 240, 73) == (97, 73)
    assert center_crop_origin(257, 257, 224) == (16, 16) and center_crop_origin(259, 256, 224) == (18, 16)
    assert center_crop_origin(384, 256, 224) == (80, 16) and center_crop_origin(97, 73, 64) == (16, 4)
    pil_resample.self_test(verbose)
    checks += 1
    log("k_for_ratio, variant parameter counts %s, resize/crop rounding" %
        {k: "%.2fM" % (v / 1e6) for k, v in params.items()})
    print("self-test: OK (%d groups of checks)" % checks)


def _main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--self-test", action="store_true")
    sub = ap.add_subparsers(dest="cmd")
    run = sub.add_parser("run", help="classify an image (or a gray one) and print top classes and K")
    run.add_argument("model_dir")
    run.add_argument("--image")
    run.add_argument("--ratio", type=float, default=0.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.self_test:
        self_test()
        return 0
    if args.cmd == "run":
        model = load_model(args.model_dir)
        c = model.config
        if args.image:
            from PIL import Image

            with Image.open(args.image) as img:
                x = preprocess_image(img, c.resize_size, c.image_size, c.image_mean, c.image_std)
        else:
            x = torch.zeros(3, c.image_size, c.image_size)
        with torch.no_grad():
            logits = model(x[None], args.ratio)[0]
        labels = c.raw.get("labels") or [str(i) for i in range(c.num_classes)]
        print("top_k per layer:", model.layer_top_k(args.ratio))
        print("head token counts:", head_token_counts(model.gates()))
        for v, i in zip(*torch.topk(logits, min(5, logits.numel()))):
            print("%8.4f %s" % (float(v), labels[int(i)]))
        return 0
    ap.print_help()
    return 2


# ==================================================================================
# _Official*: VERBATIM copies of the official forwards (SkyworkAI/MoH @ 2cefd57b), used
# only by the self-test.  They run on the modules above (same attributes) by class swap.
# ==================================================================================
def _identity(x):
    return x


@torch.no_grad()
def _official_get_relative_position_cpb(query_size, key_size, pretrain_size=None):  # transnext.py 77-102
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    pretrain_size = pretrain_size or query_size
    axis_qh = torch.arange(query_size[0], dtype=torch.float32, device=device)
    axis_kh = F.adaptive_avg_pool1d(axis_qh.unsqueeze(0), key_size[0]).squeeze(0)
    axis_qw = torch.arange(query_size[1], dtype=torch.float32, device=device)
    axis_kw = F.adaptive_avg_pool1d(axis_qw.unsqueeze(0), key_size[1]).squeeze(0)
    axis_kh, axis_kw = torch.meshgrid(axis_kh, axis_kw)
    axis_qh, axis_qw = torch.meshgrid(axis_qh, axis_qw)

    axis_kh = torch.reshape(axis_kh, [-1])
    axis_kw = torch.reshape(axis_kw, [-1])
    axis_qh = torch.reshape(axis_qh, [-1])
    axis_qw = torch.reshape(axis_qw, [-1])

    relative_h = (axis_qh[:, None] - axis_kh[None, :]) / (pretrain_size[0] - 1) * 8
    relative_w = (axis_qw[:, None] - axis_kw[None, :]) / (pretrain_size[1] - 1) * 8
    relative_hw = torch.stack([relative_h, relative_w], dim=-1).view(-1, 2)

    relative_coords_table, idx_map = torch.unique(relative_hw, return_inverse=True, dim=0)

    relative_coords_table = torch.sign(relative_coords_table) * torch.log2(
        torch.abs(relative_coords_table) + 1.0) / torch.log2(torch.tensor(8, dtype=torch.float32))

    return idx_map, relative_coords_table


@torch.no_grad()
def _official_get_seqlen_and_mask(input_resolution, window_size):  # attention_native.py 8-14
    attn_map = F.unfold(torch.ones([1, 1, input_resolution[0], input_resolution[1]]), window_size,
                        dilation=1, padding=(window_size // 2, window_size // 2), stride=1)
    attn_local_length = attn_map.sum(-2).squeeze().unsqueeze(-1)
    attn_mask = (attn_map.squeeze(0).permute(1, 0)) == 0
    return attn_local_length, attn_mask


class _OfficialAggregatedAttention(AggregatedAttention):
    attn_drop = proj_drop = staticmethod(_identity)

    def forward(self, x, H, W, relative_pos_index, relative_coords_table):  # attention_native.py 90-188
        B, N, C = x.shape
        _x = x.reshape(B * N, C)
        
        if self.routed_head > 0:
            logits = self.wg(_x)
            gates = F.softmax(logits, dim=1)

            num_tokens, num_experts = gates.shape
            _, indices = torch.topk(gates, k=self.routed_head, dim=1)
            mask = F.one_hot(indices, num_classes=num_experts).sum(dim=1)

            if self.training:
                me = gates.mean(dim=0)
                ce = mask.float().mean(dim=0)
                l_aux = torch.mean(me * ce) * num_experts * num_experts

                Attention.LOAD_BALANCING_LOSSES.append(l_aux)

            routed_head_gates = gates * mask
            denom_s = torch.sum(routed_head_gates, dim=1, keepdim=True)
            denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
            routed_head_gates /= denom_s
            routed_head_gates = routed_head_gates.reshape(B, N, -1) * self.routed_head

        # Generate queries, normalize them with L2, add query embedding, and then magnify with sequence length scale and temperature.
        # Use softplus function ensuring that the temperature is not lower than 0.
        q_norm = F.normalize(self.q(x).reshape(B, N, self.num_heads, self.head_dim).permute(0, 2, 1, 3), dim=-1)
        q_norm_scaled = (q_norm + self.query_embedding) * F.softplus(self.temperature) * self.seq_length_scale

        # Generate unfolded keys and values and l2-normalize them
        k_local, v_local = self.kv(x).chunk(2, dim=-1)
        k_local = F.normalize(k_local.reshape(B, N, self.num_heads, self.head_dim), dim=-1).reshape(B, N, -1)
        kv_local = torch.cat([k_local, v_local], dim=-1).permute(0, 2, 1).reshape(B, -1, H, W)
        k_local, v_local = self.unfold(kv_local).reshape(
            B, 2 * self.num_heads, self.head_dim, self.local_len, N).permute(0, 1, 4, 2, 3).chunk(2, dim=1)

        # Compute local similarity
        attn_local = ((q_norm_scaled.unsqueeze(-2) @ k_local).squeeze(-2) \
                      + self.relative_pos_bias_local.unsqueeze(1)).masked_fill(self.padding_mask, float('-inf'))

        # Generate pooled features
        x_ = x.permute(0, 2, 1).reshape(B, -1, H, W).contiguous()
        x_ = self.pool(self.act(self.sr(x_))).reshape(B, -1, self.pool_len).permute(0, 2, 1)
        x_ = self.norm(x_)

        # Generate pooled keys and values
        kv_pool = self.kv(x_).reshape(B, self.pool_len, 2 * self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        k_pool, v_pool = kv_pool.chunk(2, dim=1)

        # Use MLP to generate continuous relative positional bias for pooled features.
        pool_bias = self.cpb_fc2(self.cpb_act(self.cpb_fc1(relative_coords_table))).transpose(0, 1)[:,
                    relative_pos_index.view(-1)].view(-1, N, self.pool_len)
        # Compute pooled similarity
        attn_pool = q_norm_scaled @ F.normalize(k_pool, dim=-1).transpose(-2, -1) + pool_bias

        # Concatenate local & pooled similarity matrices and calculate attention weights through the same Softmax
        attn = torch.cat([attn_local, attn_pool], dim=-1).softmax(dim=-1)
        attn = self.attn_drop(attn)

        # Split the attention weights and separately aggregate the values of local & pooled features
        attn_local, attn_pool = torch.split(attn, [self.local_len, self.pool_len], dim=-1)
        x_local = (((q_norm @ self.learnable_tokens) + self.learnable_bias + attn_local).unsqueeze(
            -2) @ v_local.transpose(-2, -1)).squeeze(-2)
        x_pool = attn_pool @ v_pool

        if self.routed_head > 0:
            x = (x_local + x_pool).transpose(1, 2)  # B, N, head, dim
            
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

            x = torch.einsum("bne,bned->bned", masked_gates, x)
            x = x.reshape(B, N, C)
        else:
            shared_head_weight = self.wg_1(_x)
            masked_gates = F.softmax(shared_head_weight, dim=1).reshape(B, N, -1) * self.shared_head
                
            x = (x_local + x_pool).transpose(1, 2)  # B, N, head, dim
            x = torch.einsum("bne,bned->bned", masked_gates, x)
            x = x.reshape(B, N, C)

        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class _OfficialAttention(Attention):
    attn_drop = proj_drop = staticmethod(_identity)

    def forward(self, x, H, W, relative_pos_index, relative_coords_table):  # attention.py 46-116
        B, N, C = x.shape
        _x = x.reshape(B * N, C)
        
        if self.routed_head > 0:
            logits = self.wg(_x)
            gates = F.softmax(logits, dim=1)

            num_tokens, num_experts = gates.shape
            _, indices = torch.topk(gates, k=self.routed_head, dim=1)
            mask = F.one_hot(indices, num_classes=num_experts).sum(dim=1)

            if self.training:
                me = gates.mean(dim=0)
                ce = mask.float().mean(dim=0)
                l_aux = torch.mean(me * ce) * num_experts * num_experts

                Attention.LOAD_BALANCING_LOSSES.append(l_aux)

            routed_head_gates = gates * mask
            denom_s = torch.sum(routed_head_gates, dim=1, keepdim=True)
            denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
            routed_head_gates /= denom_s
            routed_head_gates = routed_head_gates.reshape(B, N, -1) * self.routed_head

        qkv = self.qkv(x).reshape(B, -1, 3 * self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        q, k, v = qkv.chunk(3, dim=1)

        # Use MLP to generate continuous relative positional bias
        rel_bias = self.cpb_fc2(self.cpb_act(self.cpb_fc1(relative_coords_table))).transpose(0, 1)[:,
                   relative_pos_index.view(-1)].view(-1, N, N)

        # Calculate attention map using sequence length scaled cosine attention and query embedding
        attn = ((F.normalize(q, dim=-1) + self.query_embedding) * F.softplus(
            self.temperature) * self.seq_length_scale) @ F.normalize(k, dim=-1).transpose(-2, -1) + rel_bias
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)

        if self.routed_head > 0:
            x = (attn @ v).transpose(1, 2)  # B, N, head, dim

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

            x = torch.einsum("bne,bned->bned", masked_gates, x)
            x = x.reshape(B, N, C)
        else:
            shared_head_weight = self.wg_1(_x)
            masked_gates = F.softmax(shared_head_weight, dim=1).reshape(B, N, -1) * self.shared_head
                
            x = (attn @ v).transpose(1, 2)  # B, N, head, dim
            x = torch.einsum("bne,bned->bned", masked_gates, x)
            x = x.reshape(B, N, C)

        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class _OfficialDWConv(DWConv):
    def forward(self, x, H, W):  # transnext.py 47-53
        B, N, C = x.shape
        x = x.transpose(1, 2).view(B, C, H, W).contiguous()
        x = self.dwconv(x)
        x = x.flatten(2).transpose(1, 2)

        return x


class _OfficialConvolutionalGLU(ConvolutionalGLU):
    drop = staticmethod(_identity)

    def forward(self, x, H, W):  # transnext.py 68-74
        x, v = self.fc1(x).chunk(2, dim=-1)
        x = self.act(self.dwconv(x, H, W)) * v
        x = self.drop(x)
        x = self.fc2(x)
        x = self.drop(x)
        return x


class _OfficialBlock(Block):
    drop_path = staticmethod(_identity)

    def forward(self, x, H, W, relative_pos_index, relative_coords_table):  # transnext.py 143-147
        x = x + self.drop_path(self.attn(self.norm1(x), H, W, relative_pos_index, relative_coords_table))
        x = x + self.drop_path(self.mlp(self.norm2(x), H, W))

        return x


class _OfficialOverlapPatchEmbed(OverlapPatchEmbed):
    def forward(self, x):  # transnext.py 164-170
        x = self.proj(x)
        _, _, H, W = x.shape
        x = x.flatten(2).transpose(1, 2)
        x = self.norm(x)

        return x, H, W


class _OfficialTransNeXt(TransNeXt):
    def forward_features(self, x):  # transnext.py 267-283
        B = x.shape[0]

        for i in range(self.num_stages):
            patch_embed = getattr(self, f"patch_embed{i + 1}")
            block = getattr(self, f"block{i + 1}")
            norm = getattr(self, f"norm{i + 1}")
            x, H, W = patch_embed(x)
            relative_pos_index = getattr(self, f"relative_pos_index{i + 1}")
            relative_coords_table = getattr(self, f"relative_coords_table{i + 1}")
            for blk in block:
                x = blk(x, H, W, relative_pos_index, relative_coords_table)
            x = norm(x)
            if i != self.num_stages - 1:
                x = x.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous()

        return x.mean(dim=1)

    def forward(self, x):  # transnext.py 285-289
        x = self.forward_features(x)
        x = self.head(x)

        return x


_OFFICIAL_CLASSES = {AggregatedAttention: _OfficialAggregatedAttention, Attention: _OfficialAttention,
                     DWConv: _OfficialDWConv, ConvolutionalGLU: _OfficialConvolutionalGLU, Block: _OfficialBlock,
                     OverlapPatchEmbed: _OfficialOverlapPatchEmbed, TransNeXt: _OfficialTransNeXt}


def _officialize(model):
    """The same modules, running the verbatim official forwards (trained K only)."""
    for m in model.modules():
        if type(m) in _OFFICIAL_CLASSES:
            m.__class__ = _OFFICIAL_CLASSES[type(m)]
    return model


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
