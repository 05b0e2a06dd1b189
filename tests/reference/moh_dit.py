"""Independent Python reference for MoH-DiT image generation (plain torch, no timm/diffusers).

A TRANSCRIPTION of the official MoH-DiT code (github.com/SkyworkAI/MoH at commit 2cefd57b, the
commit of moh_reference.py) and of the decoder half of diffusers' AutoencoderKL, written to be
compared with them line by line; the C++ engine is tested against the fixtures that
make_dit_fixtures.py computes with it.  Official file / lines -> what here:

  MoH-DiT/models.py
    23-24    modulate: x * (1 + scale) + shift                    -> modulate
    30-150   MoHAttention (learned router; head_dim may differ from hidden / heads, so the
             qkv width 3*H*hd and proj input H*hd need not be the hidden size)
                                                                  -> DiTAttention (the forward
             is moh_reference.MoHAttention.forward; it also takes S == 1 as MoH-ViT does,
             where DiT's line 125 would call the missing wg_1)
    153-190  TimestepEmbedder: 256 frequencies, exp(-ln(10000) * i / 128), args = t * f in
             float32, [cos, sin], Linear, SiLU, Linear                  -> TimestepEmbedder
    193-220  LabelEmbedder: table of num_classes + 1 rows (class_dropout_prob 0.1 > 0); row
             num_classes is the null class of classifier-free guidance; eval = lookup
                                                                  -> LabelEmbedder
    227-254  DiTBlock: adaLN-Zero.  c = t_emb + y_emb; SiLU, Linear(D, 6D) -> shift/scale/gate
             for attention and MLP; LayerNorm without affine, eps 1e-6; the ROUTER INPUT is
             the modulated normed token (what the attention gets); MLP GELU tanh
                                                                  -> DiTBlock
    257-274  FinalLayer: LayerNorm (no affine), adaLN shift/scale, Linear(D, p*p*out)
    277-393  DiT: PatchEmbed (conv p x p, stride p), + pos_embed, blocks, final layer,
             unpatchify ('nhwpqc->nchpwq')                         -> DiT
             310  pos_embed is an nn.Parameter (requires_grad False): it IS in the state dict,
                  and train.py's EMA (update_ema over named_parameters) updates it too, so a
                  released "ema" may hold a pos_embed a few ulps off the sin-cos formula.
                  Use the stored tensor.
             312-317  num_heads an int -> every block, and head_dim is then IGNORED (None);
                  a list -> per block, with head_dim an int (every block) or a list
    395-411  forward_with_cfg: the first half of x is run twice ([x, x] with labels
             [y, null]); only channels 0..2 of the output are guided (eps of channels 0-2;
             with in_channels 1 that is eps AND the variance channel), the rest is each row's
             own output; the guided half is duplicated                -> DiT.forward_with_cfg
    419-466  get_2d_sincos_pos_embed (float64, then float32)           -> get_2d_sincos_pos_embed
    472-561  the eight variants                                       -> VARIANTS
  MoH-DiT/diffusion/__init__.py 10-46 create_diffusion(str(steps)): linear schedule, 1000
             steps, epsilon prediction, LEARNED_RANGE variance        -> Schedule
  MoH-DiT/diffusion/gaussian_diffusion.py
    65-115   linear betas: np.linspace(1e-4, 0.02, 1000) in float64  -> linear_betas
    153-201  the float64 tables                                      -> Schedule
    254-339  p_mean_variance: the model output splits into eps (C channels) and var values
             v; log variance = f * log(beta_t) + (1 - f) * log(posterior variance clipped),
             f = (v + 1) / 2; x0 = sqrt(1/abar) x - sqrt(1/abar - 1) eps (sample.py passes
             clip_denoised=False: no clamp); mean = coef1 x0 + coef2 x  -> p_sample
    376-417  p_sample: noise = randn_like(x) drawn AFTER the model call, at every step,
             multiplied by 0 at index 0                                -> p_sample
    464-511  p_sample_loop_progressive: indices N-1 .. 0               -> sample
    861-873  _extract_into_tensor: every table value is cast to float32 (the sampler then
             computes in the model's float32)
  MoH-DiT/diffusion/respace.py
    12-62    space_timesteps (round() is Python's, half to even)      -> space_timesteps
    73-87    respaced betas 1 - abar_i / abar_prev over the kept steps -> Schedule
    117-129  _WrappedModel: the model gets the ORIGINAL timestep timestep_map[index]
  MoH-DiT/sample.py (and sample_ddp.py for guidance 1)
    23, 49-63  torch.manual_seed(seed); z = randn(n, 4, L, L); CFG: z = [z, z], y = [y, null]
    64-68    keep the first half; vae.decode(samples / 0.18215).sample; save_image(...,
             normalize=True, value_range=(-1, 1))                    -> sample, decode_image
  download.py 26-29: a train.py checkpoint serves "ema"; else the file is the state dict
  diffusers 0.21.4 AutoencoderKL, decoder only (autoencoder_kl.py 124-125 and 270-293,
  vae.py 154-282 Decoder, unet_2d_blocks.py 477-565 UNetMidBlock2D and 2325-2377
  UpDecoderBlock2D, resnet.py 104-179 Upsample2D and 470-666 ResnetBlock2D,
  attention_processor.py 53-167, 425-476 and 540-602 Attention + AttnProcessor,
  modeling_utils.py 915-957 the old attention names)                -> VaeDecoder
  torchvision 0.15 utils.py 79-98 and 147-151 save_image(normalize, value_range=(-1, 1))
                                                                  -> to_uint8

THE ONE EXTENSION: per-row K, exactly as moh_reference.py (k_for_ratio: for a ratio r, K =
clamp(floor(r*H + 0.5) - S, 0, H - S) in blocks with routed heads; r = 0 / None is the trained
K; routed gates = renormalized top-K gates * K).  Every row of a batch may have its own
ratio.  forward_with_cfg pairs rows: the conditional row i and the unconditional row i + n
of one request run at the request's ratio.

THE SAMPLER'S RANDOM NUMBERS (what the C++ server reproduces per request, with a CPU
torch.Generator seeded with the request's seed; sample.py's global torch.manual_seed(seed)
on CPU draws the same numbers, which the self-test checks):
  1. z = randn([1, C, L, L]) float32 (sample.py 51; sample_ddp.py 110 uses model.in_channels)
  2. for each of the N steps, index N-1 down to 0 (the last one included, although its noise
     is multiplied by 0): noise = randn([R, C, L, L]) float32, ONE call of that shape, with
     R = 2 rows under guidance (the state is [z, z]) and R = 1 without.  Row 0 is the
     request's; row 1 (the unconditional copy of the state) is never read by the model
     (forward_with_cfg runs the first half twice), so its values are drawn and discarded.
  Guidance: scale > 1 -> classifier-free guidance (sample_ddp.py 81 using_cfg; sample.py
  always guides); scale == 1 -> no CFG, one row (sample_ddp.py 121); scale < 1 is refused
  (sample_ddp.py 80 asserts).  The draws must have exactly these shapes: torch fills a
  float32 normal tensor of >= 16 values by Box-Muller over blocks of 16 uniforms, so
  randn([2, ...]) is not two randn([1, ...]) calls (its first row equals randn([1, ...])
  only when C*L*L is a multiple of 16, and the generator advances twice as far); and the
  vectorized (AVX2) and scalar kernels differ in the last bits, so a server draws on the CPU
  with the same kernel as the fixtures (Debian's LibTorch 1.13 on an AVX2 machine).  The
  official script on a GPU draws with the CUDA generator instead: other numbers.

Steps: 2 <= N <= 1000 (N = 1 makes posterior_log_variance_clipped empty and p_mean_variance
fails; N > 1000 cannot be spaced).

The float32 sampler is the official arithmetic (coefficients cast to float32 one by one, as
_extract_into_tensor does); in float64 (for golden outputs) the model and coefficients are
float64, the noise is still drawn in float32 and upcast, and the frequency embedding is
computed in float32 as the official does, then upcast.

`--self-test` checks, on random weights, that with the trained K this equals the verbatim
official code (moh_dit_official.py): blocks, forward, forward_with_cfg, the pos embed, the
variants' definitions, space_timesteps and the tables, and the whole sampler for a seed
against the official p_sample_loop under torch.manual_seed; that rows with different ratios
in one batch equal each row alone; that requests sampled together (each with its own
generator) equal each request alone; and the state-dict shapes of all eight variants.
`run MODEL_DIR --class 3 [--seed 0 --steps 50 --guidance 4 --ratio 0.5] --out x.png` samples
one image.
"""
import argparse
import glob
import json
import math
import os
import re
import sys
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import moh_reference as ref  # noqa: E402

OFFICIAL_COMMIT = ref.OFFICIAL_COMMIT
FREQUENCY_EMBEDDING_SIZE = 256
NUM_TRAIN_TIMESTEPS = 1000
LATENT_SCALE = 0.18215  # sample.py 65: samples / 0.18215 before vae.decode

# models.py 472-553: (depth, hidden, num_heads (int or per block), head_dim, S per block, K per block)
_XL_HEADS = [8] * 9 + [16] * 10 + [24] * 9
_L_HEADS = [8] * 8 + [16] * 8 + [24] * 8
VARIANTS = {
    "MoH-DiT-XL/2-90": dict(depth=28, hidden_size=1152, num_heads=_XL_HEADS, head_dim=72,
                            shared=[8] * 9 + [16] * 19, routed=[0] * 19 + [3] * 9),
    "MoH-DiT-XL/2-75": dict(depth=28, hidden_size=1152, num_heads=_XL_HEADS, head_dim=72,
                            shared=[8] * 9 + [10] * 10 + [14] * 9, routed=[0] * 9 + [2] * 19),
    "MoH-DiT-L/2-90": dict(depth=24, hidden_size=1024, num_heads=_L_HEADS, head_dim=64,
                           shared=[8] * 8 + [16] * 16, routed=[0] * 16 + [3] * 8),
    "MoH-DiT-L/2-75": dict(depth=24, hidden_size=1024, num_heads=_L_HEADS, head_dim=64,
                           shared=[8] * 16 + [12] * 8, routed=[0] * 8 + [4] * 16),
    "MoH-DiT-B/2-90": dict(depth=12, hidden_size=768, num_heads=12, head_dim=None,
                           shared=[6] * 5 + [7] * 5 + [12] * 2, routed=[4] * 10 + [0] * 2),
    "MoH-DiT-B/2-75": dict(depth=12, hidden_size=768, num_heads=12, head_dim=None,
                           shared=[4, 4] + [6] * 8 + [12] * 2, routed=[2, 2] + [3] * 8 + [0] * 2),
    "MoH-DiT-S/2-90": dict(depth=12, hidden_size=384, num_heads=6, head_dim=None,
                           shared=[3] * 8 + [6] * 4, routed=[2] * 8 + [0] * 4),
    "MoH-DiT-S/2-75": dict(depth=12, hidden_size=384, num_heads=6, head_dim=None,
                           shared=[2, 2] + [3] * 8 + [6] * 2, routed=[1] * 6 + [2] * 4 + [0] * 2),
}
ARCHITECTURE_FIELDS = ("input_size", "patch_size", "in_channels", "hidden_size", "depth", "num_heads", "head_dim",
                       "mlp_ratio", "num_classes", "learn_sigma", "moh_shared_heads", "moh_routed_top_k")


def variant_config(name, image_size=256):
    """The architecture fields of a released variant (sample.py: input_size = image_size // 8,
    DiT defaults: 4 latent channels, mlp_ratio 4, 1000 classes, learn_sigma)."""
    v = VARIANTS[name]
    return OrderedDict([
        ("model_type", "moh_dit"), ("variant", name), ("input_size", image_size // 8), ("patch_size", 2),
        ("in_channels", 4), ("hidden_size", v["hidden_size"]), ("depth", v["depth"]),
        ("num_heads", v["num_heads"]), ("head_dim", v["head_dim"]), ("mlp_ratio", 4.0), ("num_classes", 1000),
        ("learn_sigma", True), ("moh_shared_heads", v["shared"]), ("moh_routed_top_k", v["routed"]),
    ])


def _per_block(v, n, what):
    if isinstance(v, (list, tuple)):
        if len(v) != n:
            raise ValueError("%s has %d entries for %d blocks" % (what, len(v), n))
        return list(v)
    return [v] * n


class DiTConfig:
    """config.json (tests/reference/README.md), checked; a field present wins over the variant's."""

    def __init__(self, d):
        d = dict(d)
        if d.get("model_type", "moh_dit") != "moh_dit":
            raise ValueError("model_type %r is not moh_dit" % d.get("model_type"))
        if d.get("variant"):
            if d["variant"] not in VARIANTS:
                raise ValueError("unknown variant %r" % d["variant"])
            for k, v in variant_config(d["variant"]).items():
                d.setdefault(k, v)
        self.raw = d
        self.variant = d.get("variant")
        self.input_size = int(d["input_size"])
        self.patch_size = int(d.get("patch_size", 2))
        self.in_channels = int(d.get("in_channels", 4))
        self.hidden_size = int(d["hidden_size"])
        self.depth = int(d["depth"])
        self.num_heads = [int(h) for h in _per_block(d["num_heads"], self.depth, "num_heads")]
        head_dims = _per_block(d.get("head_dim"), self.depth, "head_dim")
        self.head_dims = [self.hidden_size // h if hd is None else int(hd) for h, hd in zip(self.num_heads, head_dims)]
        self.mlp_ratio = float(d.get("mlp_ratio", 4.0))
        self.mlp_hidden = int(self.hidden_size * self.mlp_ratio)  # DiTBlock: int(hidden_size * mlp_ratio)
        self.num_classes = int(d["num_classes"])
        self.learn_sigma = bool(d.get("learn_sigma", True))
        self.out_channels = self.in_channels * 2 if self.learn_sigma else self.in_channels
        self.shared_heads = [int(s) for s in _per_block(d["moh_shared_heads"], self.depth, "moh_shared_heads")]
        self.routed_top_k = [int(k) for k in _per_block(d["moh_routed_top_k"], self.depth, "moh_routed_top_k")]
        self.labels = d.get("labels")
        self.vae = d.get("vae")
        self.latent_scale = float(d.get("latent_scale", LATENT_SCALE))
        self.default_steps = int(d.get("default_steps", 250))
        self.default_guidance = float(d.get("default_guidance", 4.0))
        self.grid = self.input_size // self.patch_size
        self.tokens = self.grid * self.grid
        if self.input_size % self.patch_size:
            raise ValueError("input_size must be a multiple of patch_size")
        if self.hidden_size % 4:
            raise ValueError("hidden_size must be a multiple of 4 (the 2D sin-cos embedding)")
        if not self.learn_sigma:
            raise ValueError("learn_sigma must be true: the sampler's LEARNED_RANGE variance needs it")
        if self.labels is not None and len(self.labels) != self.num_classes:
            raise ValueError("labels has %d names for %d classes" % (len(self.labels), self.num_classes))
        for i, (H, S, K) in enumerate(zip(self.num_heads, self.shared_heads, self.routed_top_k)):
            if not (0 <= S <= H and 0 <= K <= H - S):
                raise ValueError("block %d: bad MoH S=%d K=%d H=%d" % (i, S, K, H))
            # the official router without routed heads re-weights with softmax(wg_1) * S: needs S == H >= 2
            if K == 0 and not (S == H and S >= 2):
                raise ValueError("block %d: without routing (K == 0) every head must be shared (S == H >= 2)" % i)

    def layers(self):
        """(H, head_dim, S, trained K) per block."""
        return list(zip(self.num_heads, self.head_dims, self.shared_heads, self.routed_top_k))


def state_dict_shapes(cfg):
    """name -> shape of every tensor of the official state dict, in its order (pos_embed first:
    it is DiT's own parameter), computed without building the model."""
    c = cfg if isinstance(cfg, DiTConfig) else DiTConfig(cfg)
    D, p = c.hidden_size, c.patch_size
    out = OrderedDict()

    def linear(name, n_out, n_in):
        out[name + ".weight"] = (n_out, n_in)
        out[name + ".bias"] = (n_out,)

    out["pos_embed"] = (1, c.tokens, D)
    out["x_embedder.proj.weight"] = (D, c.in_channels, p, p)
    out["x_embedder.proj.bias"] = (D,)
    linear("t_embedder.mlp.0", D, FREQUENCY_EMBEDDING_SIZE)
    linear("t_embedder.mlp.2", D, D)
    out["y_embedder.embedding_table.weight"] = (c.num_classes + 1, D)
    for i, (H, hd, S, K) in enumerate(c.layers()):
        b = "blocks.%d." % i
        linear(b + "attn.qkv", 3 * H * hd, D)
        linear(b + "attn.proj", D, H * hd)
        if K > 0:
            out[b + "attn.wg.weight"] = (H - S, D)
            if S > 0:
                out[b + "attn.wg_0.weight"] = (2, D)
        if S > 1:
            out[b + "attn.wg_1.weight"] = (S, D)
        linear(b + "mlp.fc1", c.mlp_hidden, D)
        linear(b + "mlp.fc2", D, c.mlp_hidden)
        linear(b + "adaLN_modulation.1", 6 * D, D)
    linear("final_layer.linear", p * p * c.out_channels, D)
    linear("final_layer.adaLN_modulation.1", 2 * D, D)
    return out


def variant_manifest():
    """{variant: {"config": its architecture fields, "tensors": {name: shape}}} (256 px: input 32)."""
    return OrderedDict((name, {"config": variant_config(name),
                               "tensors": OrderedDict((k, list(v)) for k, v in state_dict_shapes(
                                   variant_config(name)).items())}) for name in VARIANTS)


# ----------------------------------------------------------------------------------
# 2D sin-cos position embedding (models.py 419-466)
# ----------------------------------------------------------------------------------
def get_1d_sincos_pos_embed_from_grid(embed_dim, pos):
    """[M, D]: [sin(pos * w), cos(pos * w)], w_i = 1 / 10000**(i / (D/2)), float64."""
    assert embed_dim % 2 == 0
    omega = np.arange(embed_dim // 2, dtype=np.float64)
    omega /= embed_dim / 2.
    omega = 1. / 10000 ** omega
    out = np.einsum('m,d->md', pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def get_2d_sincos_pos_embed(embed_dim, grid_size):
    """[G*G, D] float64: the first D/2 channels encode the column (w goes first in the
    meshgrid), the last D/2 the row; token t = row * G + column.  The model stores it as
    float32 in pos_embed."""
    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape([2, 1, grid_size, grid_size])
    emb_h = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[0])
    emb_w = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[1])
    return np.concatenate([emb_h, emb_w], axis=1)


# ----------------------------------------------------------------------------------
# The model (models.py 23-411); attribute names = the official state-dict names
# ----------------------------------------------------------------------------------
def modulate(x, shift, scale):  # models.py 23-24
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTAttention(nn.Module):
    """MoHAttention (models.py 30-77 constructor; the forward is moh_reference.MoHAttention's:
    the official lines with per-row K).  qkv: D -> 3*H*hd (q, k, v each H heads of hd),
    proj: H*hd -> D, scale hd**-0.5, qkv bias."""

    forward = ref.MoHAttention.forward

    def __init__(self, dim, num_heads, shared_head, routed_head, head_dim, device=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, head_dim * num_heads * 3, bias=True, device=device)
        self.proj = nn.Linear(head_dim * num_heads, dim, device=device)
        self.shared_head, self.routed_head = shared_head, routed_head
        if routed_head > 0:
            self.wg = nn.Linear(dim, num_heads - shared_head, bias=False, device=device)
            if shared_head > 0:
                self.wg_0 = nn.Linear(dim, 2, bias=False, device=device)
        if shared_head > 1:
            self.wg_1 = nn.Linear(dim, shared_head, bias=False, device=device)


class TimestepEmbedder(nn.Module):  # models.py 153-190
    def __init__(self, hidden_size, device=None):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FREQUENCY_EMBEDDING_SIZE, hidden_size, device=device), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size, device=device))

    @staticmethod
    def timestep_embedding(t, dim=FREQUENCY_EMBEDDING_SIZE, max_period=10000):
        """[N, dim] float32: [cos(t * f_i), sin(t * f_i)], f_i = exp(-ln(max_period) * i / (dim/2)),
        all in float32 (t.float()); a zero column is appended for odd dim."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t).to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):  # models.py 193-220, eval (no label dropout)
    def __init__(self, num_classes, hidden_size, device=None):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size, device=device)
        self.num_classes = num_classes  # the null class (row num_classes)

    def forward(self, labels):
        return self.embedding_table(labels)


class Mlp(nn.Module):  # timm Mlp as DiTBlock builds it: fc1, GELU (tanh), fc2
    def __init__(self, dim, hidden, device=None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, device=device)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim, device=device)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):  # models.py 227-254
    def __init__(self, hidden_size, num_heads, head_dim, mlp_hidden, shared_head, routed_head, device=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = DiTAttention(hidden_size, num_heads, shared_head, routed_head, head_dim, device=device)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, mlp_hidden, device=device)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, device=device))

    def forward(self, x, c, top_k=None):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), top_k)
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):  # models.py 257-274
    def __init__(self, hidden_size, patch_size, out_channels, device=None):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, device=device)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, device=device))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class PatchEmbed(nn.Module):  # timm PatchEmbed: conv p x p stride p, flatten, [B, T, D]
    def __init__(self, patch_size, in_chans, embed_dim, device=None):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, device=device)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class DiT(nn.Module):  # models.py 277-411
    def __init__(self, cfg, device=None):
        super().__init__()
        c = cfg if isinstance(cfg, DiTConfig) else DiTConfig(cfg)
        self.config = c
        D = c.hidden_size
        self.x_embedder = PatchEmbed(c.patch_size, c.in_channels, D, device=device)
        self.t_embedder = TimestepEmbedder(D, device=device)
        self.y_embedder = LabelEmbedder(c.num_classes, D, device=device)
        self.pos_embed = nn.Parameter(torch.zeros(1, c.tokens, D, device=device), requires_grad=False)
        self.blocks = nn.ModuleList([DiTBlock(D, H, hd, c.mlp_hidden, S, K, device=device)
                                     for H, hd, S, K in c.layers()])
        self.final_layer = FinalLayer(D, c.patch_size, c.out_channels, device=device)

    def layer_top_k(self, ratio):
        return [ref.k_for_ratio(ratio, H, S, K) for H, _, S, K in self.config.layers()]

    def attentions(self):
        return [b.attn for b in self.blocks]

    def gates(self):
        """Per block, the last forward's [B, T, H] gates (0 = head unused)."""
        return [a.last_gates for a in self.attentions()]

    def routing_records(self):
        return [(a.last_scores, a.last_top_k) for a in self.attentions()]

    def unpatchify(self, x):  # models.py 363-376: [N, T, p*p*c] -> [N, c, H, W]
        c, p = self.config.out_channels, self.config.patch_size
        h = w = int(x.shape[1] ** 0.5)
        assert h * w == x.shape[1]
        x = x.reshape(shape=(x.shape[0], h, w, p, p, c))
        x = torch.einsum('nhwpqc->nchpwq', x)
        return x.reshape(shape=(x.shape[0], c, h * p, h * p))

    def forward(self, x, t, y, ratios=None):
        """x [N, C, L, L], t [N] original timesteps (long), y [N] labels (num_classes = null);
        ratios None (trained K), a float, or one per row.  Returns [N, out_channels, L, L]."""
        B = x.shape[0]
        if ratios is not None and not isinstance(ratios, (list, tuple)):
            ratios = [ratios] * B
        ks = None if ratios is None else [self.layer_top_k(r) for r in ratios]
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        for i, block in enumerate(self.blocks):
            x = block(x, c, None if ks is None else torch.tensor([k[i] for k in ks], dtype=torch.long))
        return self.unpatchify(self.final_layer(x, c))

    def forward_with_cfg(self, x, t, y, cfg_scale, ratios=None):
        """models.py 395-411; ratios None, a float, or one per request (the first half)."""
        half = x[: len(x) // 2]
        combined = torch.cat([half, half], dim=0)
        if isinstance(ratios, (list, tuple)):
            assert len(ratios) == len(half), "one ratio per request"
            ratios = list(ratios) * 2  # row i and row i + n: the same request
        model_out = self.forward(combined, t, y, ratios)
        eps, rest = model_out[:, :3], model_out[:, 3:]
        cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
        half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        eps = torch.cat([half_eps, half_eps], dim=0)
        return torch.cat([eps, rest], dim=1)

    def load_tensors(self, tensors):
        """Strict: exactly the tensors of state_dict_shapes; computed in the model's dtype."""
        want = state_dict_shapes(self.config)
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != dict(want):
            missing = sorted(set(want) - set(got))
            unexpected = sorted(set(got) - set(want))
            wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
            raise ValueError("checkpoint mismatch: missing %s unexpected %s wrong shape %s" % (missing, unexpected, wrong))
        dtype = self.final_layer.linear.weight.dtype
        self.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
        return self


def head_token_counts(gates):
    """Per block: [B][H] counts of tokens whose gate is nonzero."""
    return [(g != 0).sum(dim=1).tolist() for g in gates]


# ----------------------------------------------------------------------------------
# The diffusion (diffusion/__init__.py, gaussian_diffusion.py, respace.py)
# ----------------------------------------------------------------------------------
def linear_betas(num_diffusion_timesteps=NUM_TRAIN_TIMESTEPS):
    """get_named_beta_schedule("linear", T) = np.linspace(s * 1e-4, s * 0.02, T), s = 1000 / T, float64.
    numpy's arithmetic: beta_i = i * step + start with step = (stop - start) / (T - 1), the last = stop."""
    scale = 1000 / num_diffusion_timesteps
    start, stop = scale * 0.0001, scale * 0.02
    step = (stop - start) / (num_diffusion_timesteps - 1)
    betas = np.arange(0, num_diffusion_timesteps, dtype=np.float64) * step + start
    betas[-1] = stop
    return betas


def space_timesteps(num_timesteps, section_counts):
    """respace.py 12-62 (without "ddimN"): sections of equal size, each strided to its count;
    cur_idx accumulates the float64 stride and Python's round() (half to even) picks the step."""
    if isinstance(section_counts, str):
        section_counts = [int(x) for x in section_counts.split(",")]
    size_per, extra = num_timesteps // len(section_counts), num_timesteps % len(section_counts)
    start_idx, all_steps = 0, []
    for i, section_count in enumerate(section_counts):
        size = size_per + (1 if i < extra else 0)
        if size < section_count:
            raise ValueError("cannot divide section of %d steps into %d" % (size, section_count))
        frac_stride = 1 if section_count <= 1 else (size - 1) / (section_count - 1)
        cur_idx = 0.0
        for _ in range(section_count):
            all_steps.append(start_idx + round(cur_idx))
            cur_idx += frac_stride
        start_idx += size
    return set(all_steps)


class Schedule:
    """create_diffusion(str(steps)) as sample.py builds it: the respaced process's float64 tables.

    Index k (0 .. steps-1) is original timestep timestep_map[k] (ascending; 0 and 999 always
    among them).  Every table is computed in float64 in the official order of operations.
    """

    def __init__(self, steps):
        if not 2 <= steps <= NUM_TRAIN_TIMESTEPS:
            raise ValueError("steps must be in [2, %d], got %d" % (NUM_TRAIN_TIMESTEPS, steps))
        self.steps = steps
        base_alphas_cumprod = np.cumprod(1.0 - linear_betas())
        use = space_timesteps(NUM_TRAIN_TIMESTEPS, str(steps))
        self.timestep_map, new_betas, last_alpha_cumprod = [], [], 1.0
        for i, alpha_cumprod in enumerate(base_alphas_cumprod):  # respace.py 79-85
            if i in use:
                new_betas.append(1 - alpha_cumprod / last_alpha_cumprod)
                last_alpha_cumprod = alpha_cumprod
                self.timestep_map.append(i)
        betas = np.array(new_betas, dtype=np.float64)
        self.betas = betas
        alphas = 1.0 - betas  # gaussian_diffusion.py 174-201
        self.alphas_cumprod = np.cumprod(alphas, axis=0)
        alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1)
        self.posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_log_variance_clipped = np.log(np.append(self.posterior_variance[1], self.posterior_variance[1:]))
        self.posterior_mean_coef1 = betas * np.sqrt(alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - self.alphas_cumprod)
        self.log_betas = np.log(betas)  # p_mean_variance's max_log

    def tables(self):
        """The tables a sampler reads, by name (float64 lists), for golden files."""
        return OrderedDict((k, [float(v) for v in getattr(self, k)]) for k in (
            "betas", "alphas_cumprod", "sqrt_recip_alphas_cumprod", "sqrt_recipm1_alphas_cumprod",
            "posterior_variance", "posterior_log_variance_clipped", "log_betas",
            "posterior_mean_coef1", "posterior_mean_coef2"))


def p_sample(sched, model_output, x, index, noise):
    """x_{index-1} from x_index: p_mean_variance (LEARNED_RANGE, epsilon, no clipping) + p_sample.

    model_output [B, 2C, ...] (eps, var values), x and noise [B, C, ...] in the computing dtype;
    each table value is cast from float64 to that dtype first (_extract_into_tensor).
    """
    dtype = x.dtype

    def at(table):
        return torch.tensor(table[index], dtype=torch.float64).to(dtype)

    C = x.shape[1]
    eps, model_var_values = torch.split(model_output, C, dim=1)
    min_log, max_log = at(sched.posterior_log_variance_clipped), at(sched.log_betas)
    frac = (model_var_values + 1) / 2
    model_log_variance = frac * max_log + (1 - frac) * min_log
    pred_xstart = at(sched.sqrt_recip_alphas_cumprod) * x - at(sched.sqrt_recipm1_alphas_cumprod) * eps
    mean = at(sched.posterior_mean_coef1) * pred_xstart + at(sched.posterior_mean_coef2) * x
    nonzero_mask = torch.tensor(float(index != 0), dtype=dtype)  # no noise at index 0
    return mean + nonzero_mask * torch.exp(0.5 * model_log_variance) * noise


class Request:
    """One image request: class, seed, steps, guidance scale, activation ratio (0 = trained K)."""

    def __init__(self, label, seed, steps, guidance=1.0, ratio=0.0):
        if guidance < 1.0:
            raise ValueError("guidance scale must be >= 1 (1 = no classifier-free guidance)")
        self.label, self.seed, self.steps, self.guidance, self.ratio = int(label), int(seed), int(steps), \
            float(guidance), float(ratio)
        self.cfg = self.guidance > 1.0
        self.rows = 2 if self.cfg else 1


class _RequestState:
    """A request being sampled: its generator, schedule, [rows, C, L, L] state and step index."""

    def __init__(self, req, config, dtype):
        self.req, self.sched = req, Schedule(req.steps)
        self.gen = torch.Generator().manual_seed(req.seed)
        C, L = config.in_channels, config.input_size
        self.z = torch.randn((1, C, L, L), generator=self.gen, dtype=torch.float32)  # draw 1
        self.x = (torch.cat([self.z, self.z], 0) if req.cfg else self.z).to(dtype)
        self.labels = [req.label, config.num_classes] if req.cfg else [req.label]
        self.index = req.steps - 1
        self.first_noise = None

    def step(self, model_output):
        noise = torch.randn(tuple(self.x.shape), generator=self.gen, dtype=torch.float32)  # one draw per step
        if self.first_noise is None:
            self.first_noise = noise
        self.x = p_sample(self.sched, model_output, self.x, self.index, noise.to(self.x.dtype))
        self.index -= 1


def _combine_cfg(model_out, cfg_scale):
    """forward_with_cfg's lines 407-411 on one request's [cond, uncond] output rows."""
    eps, rest = model_out[:, :3], model_out[:, 3:]
    cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
    half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
    return torch.cat([torch.cat([half_eps, half_eps], dim=0), rest], dim=1)


def sample(model, req, dtype=torch.float32, on_forward=None):
    """sample.py (sample_ddp.py without guidance) for one request alone.

    Returns {"latent": [C, L, L] (the first row of the final state), "z": [C, L, L],
    "first_noise": [rows, C, L, L]}; on_forward(model) runs after each model call.
    """
    st = _RequestState(req, model.config, dtype)
    while st.index >= 0:
        t = torch.full((req.rows,), st.sched.timestep_map[st.index], dtype=torch.long)
        y = torch.tensor(st.labels, dtype=torch.long)
        if req.cfg:
            out = model.forward_with_cfg(st.x, t, y, req.guidance, [req.ratio])
        else:
            out = model(st.x, t, y, req.ratio)
        if on_forward is not None:
            on_forward(model)
        st.step(out)
    return {"latent": st.x[0], "z": st.z[0], "first_noise": st.first_noise}


def sample_batch(model, reqs, dtype=torch.float32):
    """Requests advanced together, as a server batches them: each step runs one forward over
    the rows of every unfinished request (its own timestep, labels and ratio; under guidance
    the request's first state row twice, as forward_with_cfg does), then each request combines
    its rows and draws its noise from its own generator.  Returns the latents [C, L, L]."""
    states = [_RequestState(r, model.config, dtype) for r in reqs]
    while any(s.index >= 0 for s in states):
        live = [s for s in states if s.index >= 0]
        x = torch.cat([s.x[:1].expand(s.req.rows, *s.x.shape[1:]) for s in live], 0)
        t = torch.tensor([s.sched.timestep_map[s.index] for s in live for _ in range(s.req.rows)], dtype=torch.long)
        y = torch.tensor([lab for s in live for lab in s.labels], dtype=torch.long)
        ratios = [s.req.ratio for s in live for _ in range(s.req.rows)]
        out = model(x, t, y, ratios)
        row = 0
        for s in live:
            o = out[row:row + s.req.rows]
            row += s.req.rows
            s.step(_combine_cfg(o, s.req.guidance) if s.req.cfg else o)
    return [s.x[0] for s in states]


# ----------------------------------------------------------------------------------
# VAE decoder: diffusers AutoencoderKL.decode (post_quant_conv + Decoder), SD's sd-vae-ft-*
# ----------------------------------------------------------------------------------
class VaeResnetBlock(nn.Module):  # resnet.py 470-666: temb None, pre-norm, output_scale_factor 1
    def __init__(self, cin, cout, groups, eps=1e-6):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=eps)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout, eps=eps)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return x + h


class VaeAttention(nn.Module):
    """attention_processor.py Attention(heads = 1, dim_head = C, group norm, residual) with
    AttnProcessor: GroupNorm over [B, C, H*W], q/k/v linear, softmax(q k^T / sqrt(C)) v,
    to_out.0, + input."""

    def __init__(self, channels, groups, eps=1e-6):
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=eps)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])
        self.scale = channels ** -0.5

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.group_norm(x.view(B, C, H * W)).transpose(1, 2)  # [B, HW, C]
        q, k, v = self.to_q(h), self.to_k(h), self.to_v(h)
        scores = torch.baddbmm(torch.empty(B, H * W, H * W, dtype=q.dtype), q, k.transpose(-1, -2),
                               beta=0, alpha=self.scale)
        h = self.to_out[0](torch.bmm(scores.softmax(dim=-1), v))
        return h.transpose(-1, -2).reshape(B, C, H, W) + x


class _VaeMidBlock(nn.Module):  # unet_2d_blocks.py 477-565: resnet, attention, resnet
    def __init__(self, channels, groups):
        super().__init__()
        self.attentions = nn.ModuleList([VaeAttention(channels, groups)])
        self.resnets = nn.ModuleList([VaeResnetBlock(channels, channels, groups),
                                      VaeResnetBlock(channels, channels, groups)])

    def forward(self, x):
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class _VaeUpsample(nn.Module):  # resnet.py 104-179: nearest x2, conv 3x3
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _VaeUpBlock(nn.Module):  # unet_2d_blocks.py 2325-2377 UpDecoderBlock2D
    def __init__(self, cin, cout, num_layers, groups, upsample):
        super().__init__()
        self.resnets = nn.ModuleList([VaeResnetBlock(cin if i == 0 else cout, cout, groups) for i in range(num_layers)])
        self.upsamplers = nn.ModuleList([_VaeUpsample(cout)]) if upsample else None

    def forward(self, x):
        for r in self.resnets:
            x = r(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class _VaeDecoderStack(nn.Module):  # vae.py 154-282 (norm_type "group")
    def __init__(self, latent_channels, out_channels, block_out_channels, layers_per_block, groups):
        super().__init__()
        rev = list(reversed(block_out_channels))
        self.conv_in = nn.Conv2d(latent_channels, rev[0], 3, padding=1)
        self.mid_block = _VaeMidBlock(rev[0], groups)
        self.up_blocks = nn.ModuleList([
            _VaeUpBlock(rev[max(i - 1, 0)], rev[i], layers_per_block + 1, groups, i < len(rev) - 1)
            for i in range(len(rev))])
        self.conv_norm_out = nn.GroupNorm(groups, block_out_channels[0], eps=1e-6)
        self.conv_out = nn.Conv2d(block_out_channels[0], out_channels, 3, padding=1)

    def forward(self, z):
        x = self.mid_block(self.conv_in(z))
        for up in self.up_blocks:
            x = up(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


VAE_DEFAULTS = {"in_channels": 3, "out_channels": 3, "block_out_channels": [64], "layers_per_block": 1,
                "act_fn": "silu", "latent_channels": 4, "norm_num_groups": 32, "scaling_factor": 0.18215}


class VaeDecoder(nn.Module):
    """AutoencoderKL.decode(z).sample from its config.json (diffusers' defaults for absent fields).

    Tensors: post_quant_conv.*, decoder.* (new attention names to_q / to_k / to_v / to_out.0);
    load_vae_tensors maps the old names and drops the encoder.  The image is 2**(n-1) times the
    latent, n = len(block_out_channels).
    """

    def __init__(self, cfg):
        super().__init__()
        c = dict(VAE_DEFAULTS, **cfg)
        if c["act_fn"] not in ("silu", "swish"):
            raise ValueError("act_fn %r is not transcribed" % c["act_fn"])
        ups = c.get("up_block_types", ["UpDecoderBlock2D"] * len(c["block_out_channels"]))
        if list(ups) != ["UpDecoderBlock2D"] * len(c["block_out_channels"]):
            raise ValueError("only UpDecoderBlock2D up blocks are transcribed")
        if not c.get("mid_block_add_attention", True) or not c.get("use_post_quant_conv", True):
            raise ValueError("mid_block_add_attention / use_post_quant_conv false are not transcribed")
        self.config = c
        L = c["latent_channels"]
        self.post_quant_conv = nn.Conv2d(L, L, 1)
        self.decoder = _VaeDecoderStack(L, c["out_channels"], list(c["block_out_channels"]), c["layers_per_block"],
                                        c["norm_num_groups"])

    def forward(self, z):
        return self.decoder(self.post_quant_conv(z))


_OLD_ATTENTION_NAMES = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def load_vae_tensors(tensors):
    """A diffusers AutoencoderKL state dict -> the decoder's tensors in the new names.

    Drops encoder.* and quant_conv.*; renames decoder.mid_block.attentions.N.{query, key, value,
    proj_attn} to {to_q, to_k, to_v, to_out.0} (modeling_utils.py 915-957); a 1x1-conv-shaped
    attention weight [C, C, 1, 1] (or [C, C, 1]) becomes [C, C] (convert_from_ckpt.py 223-232).
    """
    out = {}
    for name, t in tensors.items():
        if name.startswith(("encoder.", "quant_conv.")):
            continue
        m = re.match(r"^(decoder\.mid_block\.attentions\.\d+)\.(query|key|value|proj_attn)\.(weight|bias)$", name)
        if m:
            name = "%s.%s.%s" % (m.group(1), _OLD_ATTENTION_NAMES[m.group(2)], m.group(3))
        if re.match(r"^decoder\.mid_block\.attentions\.\d+\.(to_q|to_k|to_v|to_out\.0)\.weight$", name) and t.dim() > 2:
            if any(s != 1 for s in t.shape[2:]):
                raise ValueError("%s: attention weight of shape %s" % (name, tuple(t.shape)))
            t = t.reshape(t.shape[0], t.shape[1])
        if name in out:
            raise ValueError("%s appears in both the old and the new naming" % name)
        out[name] = t
    return out


def load_vae(directory, dtype=torch.float32):
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    st = os.path.join(directory, "diffusion_pytorch_model.safetensors")
    if os.path.exists(st):
        tensors = ref.read_safetensors(st)
    else:
        tensors = torch.load(os.path.join(directory, "diffusion_pytorch_model.bin"), map_location="cpu", weights_only=False)
    vae = VaeDecoder(cfg).to(dtype)
    vae.load_state_dict({k: v.to(dtype) for k, v in load_vae_tensors(tensors).items()}, strict=True)
    return vae.eval()


def to_uint8(image):
    """save_image(x, normalize=True, value_range=(-1, 1)) on one [C, H, W] image, in its dtype:
    clamp to [-1, 1], (x + 1) / 2, * 255 + 0.5, clamp to [0, 255], truncate to uint8.
    (save_image writes a 1-channel image as 3 equal channels; this keeps C.)"""
    x = image.clone()
    x.clamp_(min=-1, max=1)
    x.sub_(-1).div_(max(1 - (-1), 1e-5))
    return x.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8)


def decode_image(latent, vae, latent_scale=LATENT_SCALE):
    """[C, L, L] final latent -> uint8 [3, H, W]; vae None (pixel space): the sample itself."""
    if vae is None:
        return to_uint8(latent)
    with torch.no_grad():
        return to_uint8(vae(latent[None].to(vae.post_quant_conv.weight.dtype) / latent_scale)[0])


# ----------------------------------------------------------------------------------
# Loading a model directory
# ----------------------------------------------------------------------------------
def load_dit_tensors(directory):
    """model.safetensors, or the one *.pt / *.pth: a train.py container ({"model", "ema", "opt",
    "args"}: "ema" is served, download.py 27-28) or a plain state dict (trusted files only)."""
    st = os.path.join(directory, "model.safetensors")
    if os.path.exists(st):
        return ref.read_safetensors(st)
    files = sorted(glob.glob(os.path.join(directory, "*.pt")) + glob.glob(os.path.join(directory, "*.pth")))
    if len(files) != 1:
        raise FileNotFoundError("want one model.safetensors or one *.pt in %s, found %s" % (directory, files))
    ckpt = torch.load(files[0], map_location="cpu", weights_only=False)
    if "ema" in ckpt:
        ckpt = ckpt["ema"]
    return dict(ckpt)


def load_model(directory, dtype=torch.float32):
    """(DiT, VaeDecoder or None) from a model directory; config "vae" is relative to it."""
    with open(os.path.join(directory, "config.json")) as f:
        cfg = DiTConfig(json.load(f))
    model = DiT(cfg).to(dtype).load_tensors(load_dit_tensors(directory)).eval()
    vae = load_vae(os.path.normpath(os.path.join(directory, cfg.vae)), dtype) if cfg.vae else None
    return model, vae


# ----------------------------------------------------------------------------------
# Self-test
# ----------------------------------------------------------------------------------
# Tiny configs of the self-test (the fixtures' are in make_dit_fixtures.py): every router path.
_TEST_CONFIGS = [
    {"input_size": 8, "patch_size": 2, "in_channels": 4, "hidden_size": 32, "depth": 4,
     "num_heads": [4, 6, 4, 8], "head_dim": [None, 8, 12, 6], "mlp_ratio": 2.5, "num_classes": 10,
     "moh_shared_heads": [4, 2, 0, 3], "moh_routed_top_k": [0, 2, 2, 3]},
    {"input_size": 6, "patch_size": 3, "in_channels": 1, "hidden_size": 24, "depth": 3,
     "num_heads": 6, "head_dim": None, "mlp_ratio": 4.0, "num_classes": 3,
     "moh_shared_heads": [6, 2, 3], "moh_routed_top_k": [0, 1, 2]},
    {"input_size": 4, "patch_size": 2, "in_channels": 4, "hidden_size": 16, "depth": 2,
     "num_heads": [2, 4], "head_dim": 12, "num_classes": 5,
     "moh_shared_heads": [2, 2], "moh_routed_top_k": [0, 1]},
]


def randomize(model, gen):
    """Random weights with nonzero adaLN and output layers (the official init zeroes them),
    peaked routers, outputs of order 1.  Also used for the fixtures."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.split(".")[-2] if "." in name else name
            if name == "pos_embed":
                c = model.config
                v = torch.from_numpy(get_2d_sincos_pos_embed(c.hidden_size, c.grid)).float()[None]
            elif leaf in ("wg", "wg_0", "wg_1"):
                v = 0.6 * torch.randn(p.shape, generator=gen)
            elif name.endswith(".bias"):
                v = 0.1 * torch.randn(p.shape, generator=gen)
            elif leaf == "embedding_table":
                v = torch.randn(p.shape, generator=gen)
            else:
                fan_in = p[0].numel()
                gain = 0.5 if "adaLN" in name else 1.0
                v = gain * torch.randn(p.shape, generator=gen) / math.sqrt(fan_in)
            p.copy_(v.to(p.dtype))
    return model


def _close(a, b, tol=1e-5):
    return float((a - b).abs().max()) <= tol * (1.0 + float(b.abs().max()))


def _official_model(official, cfg):
    """The verbatim official DiT for a DiTConfig (the constructor call of models.py 472-553)."""
    heads = cfg.num_heads if isinstance(cfg.raw["num_heads"], list) else cfg.raw["num_heads"]
    hd = cfg.raw.get("head_dim")
    return official.models.DiT(
        input_size=cfg.input_size, patch_size=cfg.patch_size, in_channels=cfg.in_channels,
        hidden_size=cfg.hidden_size, depth=cfg.depth, num_heads=heads, mlp_ratio=cfg.mlp_ratio,
        num_classes=cfg.num_classes, learn_sigma=True, moh=True, shared_head=cfg.shared_heads,
        routed_head=cfg.routed_top_k, head_dim=hd if hd is not None else [None] * cfg.depth).eval()


def self_test(verbose=True):
    import moh_dit_official

    official = moh_dit_official.load()
    gen = torch.Generator().manual_seed(2024)
    checks = 0

    def log(msg):
        if verbose:
            print("self-test:", msg)

    # 1. the eight variants' definitions == models.py 472-561 (their DiT(...) calls, recorded)
    calls = {}
    real_dit = official.models.DiT
    try:
        official.models.MoH_DiT_XL_2_90.__globals__["DiT"] = lambda **kw: kw
        for name, fn in official.models.DiT_models.items():
            calls[name] = fn()
    finally:
        official.models.MoH_DiT_XL_2_90.__globals__["DiT"] = real_dit
    assert set(calls) == set(VARIANTS)
    for name, kw in calls.items():
        c = DiTConfig(variant_config(name))
        heads = kw["num_heads"] if isinstance(kw["num_heads"], list) else [kw["num_heads"]] * kw["depth"]
        hd = kw.get("head_dim") if isinstance(kw["num_heads"], list) else None  # models.py 312-314
        want = [kw["hidden_size"] // h if hd is None else hd for h in heads]
        assert (kw["depth"], kw["hidden_size"], kw["patch_size"]) == (c.depth, c.hidden_size, c.patch_size), name
        assert heads == c.num_heads and want == c.head_dims, name
        assert kw["shared_head"] == c.shared_heads and kw["routed_head"] == c.routed_top_k, name
        # state dict names and shapes: the module (on the meta device) == the analytic ones
        sd = DiT(c, device="meta").state_dict()
        shapes = state_dict_shapes(c)
        assert list(sd) == list(shapes) and all(tuple(sd[k].shape) == shapes[k] for k in sd), name
    params = {n: sum(math.prod(s) for s in v["tensors"].values()) for n, v in variant_manifest().items()}
    checks += 1
    log("the eight variants == models.py 472-561; state dicts == analytic shapes; parameters %s" %
        {k: "%.1fM" % (v / 1e6) for k, v in params.items()})

    # 2. pos embed, timestep embedding, schedules == official
    for dim, g in [(32, 4), (1152, 16), (384, 32), (24, 2)]:
        assert np.array_equal(get_2d_sincos_pos_embed(dim, g), official.models.get_2d_sincos_pos_embed(dim, g))
    t = torch.tensor([0, 1, 499, 999])
    assert torch.equal(TimestepEmbedder.timestep_embedding(t, 256),
                       official.models.TimestepEmbedder.timestep_embedding(t, 256))
    assert np.array_equal(linear_betas(), official.gd.get_named_beta_schedule("linear", 1000))
    for n in [2, 3, 4, 5, 6, 7, 10, 25, 27, 50, 100, 250, 333, 999, 1000]:
        assert space_timesteps(1000, str(n)) == official.respace.space_timesteps(1000, str(n)), n
        d, s = official.create_diffusion(str(n)), Schedule(n)
        assert d.timestep_map == s.timestep_map and d.num_timesteps == n
        for k in s.tables():
            want = np.log(d.betas) if k == "log_betas" else getattr(d, k)
            assert np.array_equal(getattr(s, k), want), (n, k)
    assert space_timesteps(1000, "7") == {0, 166, 333, 500, 666, 832, 999}  # 166.5 -> 166: half to even
    assert space_timesteps(1000, "10,20") == official.respace.space_timesteps(1000, "10,20")
    checks += 1
    log("pos embed, timestep embedding, betas, space_timesteps and the respaced tables == official")

    # 3. each config: forward, forward_with_cfg == the verbatim official at the trained K
    for raw in _TEST_CONFIGS:
        cfg = DiTConfig(raw)
        ours = randomize(DiT(cfg).eval(), gen)
        off = _official_model(official, cfg)
        sd = ours.state_dict()
        assert list(off.state_dict()) == list(state_dict_shapes(cfg)), "official names/order"
        off.load_state_dict(sd)
        B, C, L = 4, cfg.in_channels, cfg.input_size
        x = torch.randn(B, C, L, L, generator=gen)
        t = torch.tensor([999, 0, 500, 17])
        y = torch.tensor([0, cfg.num_classes, 1, cfg.num_classes - 1])
        with torch.no_grad():
            out = ours(x, t, y)
            assert torch.equal(out, off(x, t, y)), float((out - off(x, t, y)).abs().max())
            assert torch.equal(ours(x, t, y, 0.0), out) and torch.equal(ours(x, t, y, [0.0, None, 0.0, 0.0]), out)
            for scale in (4.0, 1.5):
                got = ours.forward_with_cfg(x, t, y, scale)
                assert torch.equal(got, off.forward_with_cfg(x, t, y, scale))
                # channels past 2 are each row's own: the conditional rows' and the unconditional ones'
                assert torch.equal(got[:2, 3:], out[:2, 3:])
                assert torch.equal(got[2:, 3:], ours(x[:2].repeat(2, 1, 1, 1), t, y)[2:, 3:])
        checks += 1
        log("config %d blocks, heads %s, head_dim %s: forward and forward_with_cfg == official" %
            (cfg.depth, cfg.num_heads, cfg.head_dims))

        # 4. per-row ratios: a mixed batch == each row alone; routed heads == K
        ratios = [0.1, 0.5, 0.75, 1.0, 0.0]
        n = len(ratios)
        x = torch.randn(n, C, L, L, generator=gen)
        t = torch.tensor([999, 640, 3, 250, 0])
        y = torch.tensor([0, 1, cfg.num_classes, 2, 1]) % (cfg.num_classes + 1)
        with torch.no_grad():
            out = ours(x, t, y, ratios)
            gates = [g.clone() for g in ours.gates()]
            for b, r in enumerate(ratios):
                ob = ours(x[b:b + 1], t[b:b + 1], y[b:b + 1], r)
                assert _close(out[b:b + 1], ob), (r, float((out[b:b + 1] - ob).abs().max()))
                for layer, (g_all, g_row) in enumerate(zip(gates, ours.gates())):
                    assert torch.equal(g_all[b:b + 1] != 0, g_row != 0)
                    _, _, S, K = cfg.layers()[layer]
                    if K > 0:
                        assert bool(((g_row[0, :, S:] != 0).sum(-1) == ours.layer_top_k(r)[layer]).all())
        checks += 1
        log("  mixed ratios %s == each row alone, routed heads == K" % ratios)

    # 5. the whole sampler == the official p_sample_loop (sample.py's sequence, global RNG) for
    #    one request; guidance 1 == sample_ddp.py's path without CFG
    cfg = DiTConfig(_TEST_CONFIGS[0])
    ours = randomize(DiT(cfg).eval(), gen)
    off = _official_model(official, cfg)
    off.load_state_dict(ours.state_dict())
    L = cfg.input_size
    for label, seed, steps, guidance in [(3, 7, 4, 4.0), (9, 123, 6, 1.0), (0, 5, 2, 1.5)]:
        with torch.no_grad():
            got = sample(ours, Request(label, seed, steps, guidance))
            torch.manual_seed(seed)  # sample.py 23, 49-63 / sample_ddp.py 110-127
            diffusion = official.create_diffusion(str(steps))
            z = torch.randn(1, cfg.in_channels, L, L)
            if guidance > 1:
                z = torch.cat([z, z], 0)
                y = torch.tensor([label, cfg.num_classes])
                kwargs, fn = dict(y=y, cfg_scale=guidance), off.forward_with_cfg
            else:
                kwargs, fn = dict(y=torch.tensor([label])), off.forward
            want = diffusion.p_sample_loop(fn, z.shape, z, clip_denoised=False, model_kwargs=kwargs,
                                           progress=False, device="cpu")
        assert torch.equal(got["latent"], want[0]), (label, seed, float((got["latent"] - want[0]).abs().max()))
        assert torch.equal(got["z"], z[0])
    checks += 1
    log("sampler == official p_sample_loop bit for bit (CFG 4 and 1.5, no CFG; 2, 4, 6 steps)")

    # 6. requests sampled together == each alone (float64: the routing margins do not matter)
    m64 = DiT(cfg).double().eval()
    m64.load_state_dict(ours.state_dict())
    reqs = [Request(1, 11, 4, 4.0, 0.5), Request(2, 12, 6, 1.0, 1.0), Request(3, 13, 3, 2.0, 0.0),
            Request(cfg.num_classes - 1, 14, 4, 1.0, 0.25)]
    with torch.no_grad():
        together = sample_batch(m64, reqs, torch.float64)
        for req, lat in zip(reqs, together):
            alone = sample(m64, req, torch.float64)["latent"]
            assert _close(lat, alone, 1e-10), float((lat - alone).abs().max())
    checks += 1
    log("requests of different steps, guidance and ratios sampled together == each alone")

    # 7. the VAE decoder: names, both attention namings, the conv-shaped weights, to_uint8
    vcfg = {"block_out_channels": [8, 16, 16], "layers_per_block": 1, "norm_num_groups": 4, "latent_channels": 4}
    vae = VaeDecoder(vcfg).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    sd = vae.state_dict()
    old = {}
    for k, v in sd.items():
        for new, o in (("to_q", "query"), ("to_k", "key"), ("to_v", "value"), ("to_out.0", "proj_attn")):
            if ".attentions.0.%s." % new in k:
                k = k.replace(".%s." % new, ".%s." % o)
                v = v[:, :, None, None] if k.endswith("weight") and o != "proj_attn" else v
        old[k] = v
    old["encoder.conv_in.weight"] = torch.zeros(8, 3, 3, 3)
    old["quant_conv.weight"] = torch.zeros(8, 8, 1, 1)
    assert {k: tuple(v.shape) for k, v in load_vae_tensors(old).items()} == {k: tuple(v.shape) for k, v in sd.items()}
    v2 = VaeDecoder(vcfg).eval()
    v2.load_state_dict(load_vae_tensors(old), strict=True)
    z = torch.randn(1, 4, 4, 4, generator=gen)
    with torch.no_grad():
        assert torch.equal(vae(z), v2(z)) and vae(z).shape == (1, 3, 16, 16)
    u8 = to_uint8(torch.tensor([[-2.0, -1.0, -0.999, 0.0, 0.5, 0.998, 1.0, 3.0]]))
    assert u8.tolist() == [[0, 0, 0, 128, 191, 255, 255, 255]], u8.tolist()
    checks += 1
    log("VAE decoder: old and new attention names, conv-shaped q/k/v, [1, 4, 4, 4] -> [1, 3, 16, 16]; to_uint8")

    # 8. ratios -> K, requests
    assert ref.k_for_ratio(0.5, 24, 16, 3) == 0 and ref.k_for_ratio(0.75, 24, 16, 3) == 2
    assert ref.k_for_ratio(1.0, 24, 14, 2) == 10 and ref.k_for_ratio(0.9, 8, 8, 0) == 0
    for bad in (lambda: Schedule(1), lambda: Schedule(1001), lambda: Request(0, 0, 4, 0.5)):
        try:
            bad()
            raise AssertionError("accepted")
        except ValueError:
            pass
    checks += 1
    print("self-test: OK (%d groups of checks)" % checks)


def _main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--self-test", action="store_true")
    sub = ap.add_subparsers(dest="cmd")
    run = sub.add_parser("run", help="sample one image and write it as PNG")
    run.add_argument("model_dir")
    run.add_argument("--class", dest="label", type=int, required=True)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--steps", type=int)
    run.add_argument("--guidance", type=float)
    run.add_argument("--ratio", type=float, default=0.0)
    run.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.self_test:
        self_test()
        return 0
    if args.cmd == "run":
        from PIL import Image

        model, vae = load_model(args.model_dir)
        c = model.config
        req = Request(args.label, args.seed, args.steps or c.default_steps,
                      c.default_guidance if args.guidance is None else args.guidance, args.ratio)
        with torch.no_grad():
            latent = sample(model, req)["latent"]
        u8 = decode_image(latent, vae, c.latent_scale).permute(1, 2, 0).numpy()
        Image.fromarray(u8[..., 0] if u8.shape[2] == 1 else u8).save(args.out)
        print("top_k per block:", model.layer_top_k(args.ratio))
        print("wrote", args.out, u8.shape)
        return 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
