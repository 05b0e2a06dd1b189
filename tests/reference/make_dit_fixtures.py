"""MoH-DiT fixtures: tiny checkpoints, tiny VAEs, golden samples and images, the variants' manifest.

Called by make_fixtures.py (which stamps and places OUTDIR); writes into OUTDIR:
  dit_tiny/            config.json, 0000100.pt (the container MoH-DiT/train.py saves: model, ema,
                       opt, args; "ema" is served), golden.json; latent space through dit_tiny_vae
  dit_tiny_vae/        a tiny AutoencoderKL (diffusers layout, new attention names):
                       config.json, diffusion_pytorch_model.safetensors (encoder included)
  dit_tiny_vae_old/    the same weights in the old attention names (query, key, value,
                       proj_attn) in diffusion_pytorch_model.bin, with an old-style config.json
  dit_tiny_pixels/     pixel space (1 channel, 8 x 8, no VAE), a plain state dict in
                       moh-dit-pixels.pt (as the released DiT-XL-2-256x256.pt), golden.json
  dit_manifest.json    name -> shape of every tensor of the eight released variants
tests/reference/README.md describes the formats.
"""
import argparse
import math
import os
import time
from collections import OrderedDict

import torch

import checkpoint_io
import make_transnext_fixtures as mtf
import moh_dit as md

LABELS_TINY = ["tench", "goldfish", "white shark", "tiger shark", "hammerhead", "electric ray", "stingray",
               "cock", "hen", "ostrich"]
# every router path: block 0 re-weights only (S == H == 4), block 1 S == 2 with top-2 of 4 and
# head_dim 8 (6 * 8 = 48 != 32), block 2 S == 0 with top-2 of 4 (head_dim 12), block 3 S == 3
# with top-3 of 5 (head_dim 6); null in the head_dim list = hidden / heads
DIT_TINY_CONFIG = OrderedDict([
    ("model_type", "moh_dit"), ("input_size", 8), ("patch_size", 2), ("in_channels", 4), ("hidden_size", 32),
    ("depth", 4), ("num_heads", [4, 6, 4, 8]), ("head_dim", [None, 8, 12, 6]), ("mlp_ratio", 2.5),
    ("num_classes", 10), ("learn_sigma", True), ("moh_shared_heads", [4, 2, 0, 3]),
    ("moh_routed_top_k", [0, 2, 2, 3]), ("labels", LABELS_TINY), ("vae", "../dit_tiny_vae"),
    ("latent_scale", 0.18215), ("default_steps", 6), ("default_guidance", 4.0),
])
# the demo's kind: 1-channel 8 x 8 pixels, 10 digits, no VAE; num_heads an int, head_dim null
DIT_PIXELS_CONFIG = OrderedDict([
    ("model_type", "moh_dit"), ("input_size", 8), ("patch_size", 2), ("in_channels", 1), ("hidden_size", 32),
    ("depth", 3), ("num_heads", 4), ("head_dim", None), ("mlp_ratio", 4.0), ("num_classes", 10),
    ("learn_sigma", True), ("moh_shared_heads", [4, 2, 0]), ("moh_routed_top_k", [0, 1, 2]),
    ("labels", [str(i) for i in range(10)]), ("vae", None), ("latent_scale", 0.18215), ("default_steps", 50),
    ("default_guidance", 2.0),
])
VAE_CONFIG = OrderedDict([  # diffusers AutoencoderKL config.json, as save_pretrained writes it
    ("_class_name", "AutoencoderKL"), ("_diffusers_version", "0.21.4"), ("act_fn", "silu"),
    ("block_out_channels", [8, 16, 16]), ("down_block_types", ["DownEncoderBlock2D"] * 3), ("force_upcast", True),
    ("in_channels", 3), ("latent_channels", 4), ("layers_per_block", 1), ("norm_num_groups", 4),
    ("out_channels", 3), ("sample_size", 32), ("scaling_factor", 0.18215),
    ("up_block_types", ["UpDecoderBlock2D"] * 3),
])
# the released sd-vae-ft-ema's config.json is of this older form (no scaling_factor, force_upcast)
VAE_OLD_CONFIG = OrderedDict((k, v) for k, v in VAE_CONFIG.items() if k not in ("scaling_factor", "force_upcast"))
VAE_OLD_CONFIG["_diffusers_version"] = "0.4.2"

# (class, seed, steps, guidance, ratio); guidance 1 = no CFG
SAMPLES_TINY = [(3, 0, 4, 1.0, 0.0), (7, 1, 4, 4.0, 0.0), (7, 1, 4, 4.0, 0.5), (7, 1, 4, 4.0, 1.0),
                (2, 42, 6, 4.0, 0.0), (5, 2 ** 32 + 5, 6, 1.0, 0.5), (0, 9, 6, 1.5, 1.0)]
SAMPLES_PIXELS = [(4, 0, 4, 1.0, 0.0), (4, 0, 4, 2.0, 0.0), (8, 3, 6, 2.0, 0.5), (1, 77, 6, 1.0, 1.0)]
FORWARD_RATIOS = [[0.0] * 4, [0.5] * 4, [1.0] * 4, [0.0, 0.5, 1.0, 0.25]]
FORWARD_T = [999, 500, 1, 0]
SCHEDULE_STEPS = [4, 6]
TIMESTEP_MAP_STEPS = [2, 3, 5, 7, 10, 25, 50, 100, 250, 999, 1000]
MIN_TOPK_MARGIN = 1e-3
MAX_SEEDS = 200
EMA_DECAY = 0.9999  # train.py update_ema


# ----------------------------------------------------------------------------------
# Golden outputs
# ----------------------------------------------------------------------------------
def _forward_inputs(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, cfg.in_channels, cfg.input_size, cfg.input_size, generator=gen)
    y = [0, 3, cfg.num_classes, cfg.num_classes - 1]  # a null-class row
    return x, torch.tensor(FORWARD_T), torch.tensor(y)


class _Recorder:
    """Collects, per model forward, the routing margin and which gates are nonzero."""

    def __init__(self):
        self.margin, self.used, self.counts = math.inf, [], None

    def __call__(self, model):
        self.margin = min([self.margin] + [mtf.topk_margin(s, k) for s, k in model.routing_records()])
        gates = model.gates()
        for g, a in zip(gates, model.attentions()):
            assert torch.equal(g != 0, a.last_used), "a gate underflowed to 0"
        self.used.append([g != 0 for g in gates])
        counts = [g.sum(dim=(0, 1)) for g in self.used[-1]]
        self.counts = counts if self.counts is None else [a + b for a, b in zip(self.counts, counts)]


def golden(models, cfg, requests=None, forward_seed=20241201):
    """Everything in float64 (model, VAE) with float32 twins for the error bounds.

    requests: the samples' (class, seed, steps, guidance, ratio), by default the fixture's;
    forward_seed: the seed of forward_inputs' x.  Also used by training/train_demo_dit.py for
    models/demo-dit's golden.json.  Returns (golden dict, float32 results for the roundtrip
    check)."""
    m64, m32 = models
    rec_all = _Recorder()
    f32 = {"forwards": [], "latents": []}
    errors = OrderedDict([("forward", 0.0), ("latent", 0.0), ("latent_relative", 0.0), ("image", 0.0)])
    x, t, y = _forward_inputs(cfg, forward_seed)
    forwards = []
    for ratios in FORWARD_RATIOS:
        r64, r32 = _Recorder(), _Recorder()
        with torch.no_grad():
            out = m64(x.double(), t, y, ratios)
            r64(m64)
            gates = m64.gates()
            out32 = m32(x, t, y, ratios)
            r32(m32)
        assert all(torch.equal(a, b) for a, b in zip(r64.used[0], r32.used[0])), "float32 routes differently"
        rec_all.margin = min(rec_all.margin, r64.margin)
        errors["forward"] = max(errors["forward"], float((out32.double() - out).abs().max()))
        f32["forwards"].append(out32)
        forwards.append({"ratios": ratios, "top_k": [list(k) for k in zip(*[m64.layer_top_k(r) for r in ratios])],
                         "output": out.tolist(), "head_token_counts": md.head_token_counts(gates)})
    samples = []
    if requests is None:
        requests = SAMPLES_TINY if cfg.in_channels == 4 else SAMPLES_PIXELS
    for label, seed, steps, guidance, ratio in requests:
        req = md.Request(label, seed, steps, guidance, ratio)
        r64, r32 = _Recorder(), _Recorder()
        with torch.no_grad():
            s64 = md.sample(m64, req, torch.float64, r64)
            s32 = md.sample(m32, req, torch.float32, r32)
        assert len(r64.used) == len(r32.used) == steps
        for u64, u32 in zip(r64.used, r32.used):
            assert all(torch.equal(a, b) for a, b in zip(u64, u32)), "float32 routes differently"
        rec_all.margin = min(rec_all.margin, r64.margin)
        assert torch.equal(s64["z"], s32["z"]) and torch.equal(s64["first_noise"], s32["first_noise"])
        err = float((s32["latent"].double() - s64["latent"]).abs().max())
        errors["latent"] = max(errors["latent"], err)
        errors["latent_relative"] = max(errors["latent_relative"], err / float(s64["latent"].abs().max()))
        f32["latents"].append(s32["latent"])
        samples.append({"class": label, "seed": seed, "steps": steps, "guidance": guidance, "ratio": ratio,
                        "cfg": req.cfg, "model_rows": req.rows, "top_k": m64.layer_top_k(ratio),
                        "timestep_map": md.Schedule(steps).timestep_map,
                        "z": s64["z"].tolist(), "first_noise": s64["first_noise"].tolist(),
                        "latent": s64["latent"].tolist(),
                        "head_token_counts": [c.tolist() for c in r64.counts]})
    layers = [{"block": i, "num_heads": H, "head_dim": hd, "shared_heads": S, "trained_top_k": K,
               "tokens": cfg.tokens} for i, (H, hd, S, K) in enumerate(cfg.layers())]
    schedules = OrderedDict()
    for n in SCHEDULE_STEPS:
        s = md.Schedule(n)
        schedules[str(n)] = OrderedDict([("timestep_map", s.timestep_map)] + list(s.tables().items()))
    g = OrderedDict([
        ("model_key", "ema"), ("dtype", "float64"), ("latent_scale", cfg.latent_scale), ("layers", layers),
        ("forward_inputs", {"x": x.tolist(), "t": t.tolist(), "y": y.tolist()}), ("forwards", forwards),
        ("samples", samples), ("schedules", schedules),
        ("timestep_maps", OrderedDict((str(n), md.Schedule(n).timestep_map) for n in TIMESTEP_MAP_STEPS)),
        ("min_topk_margin", rec_all.margin), ("max_abs_f32_error", errors),
    ])
    return g, f32


def add_images(g, vaes, cfg, latents32):
    """image_u8 per sample (through the VAE, or the sample itself in pixel space) in float64;
    counts the bytes that the float32 path (float32 sample, float32 VAE) rounds differently."""
    mismatches, err, f32 = 0, 0.0, []
    for s, lat32 in zip(g["samples"], latents32):
        lat = torch.tensor(s["latent"], dtype=torch.float64)
        if vaes is None:
            u8, u8_32 = md.to_uint8(lat), md.to_uint8(lat32)
        else:
            with torch.no_grad():
                img = vaes[0](lat[None] / cfg.latent_scale)[0]
                img32 = vaes[1](lat32[None] / cfg.latent_scale)[0]
            err = max(err, float((img32.double() - img).abs().max()))
            u8, u8_32 = md.to_uint8(img), md.to_uint8(img32)
        mismatches += int((u8 != u8_32).sum())
        assert int((u8.int() - u8_32.int()).abs().max()) <= 1
        s["image_u8"] = u8.tolist()
        f32.append(u8_32)
    g["max_abs_f32_error"]["image"] = err
    g["u8_f32_mismatches"] = mismatches
    g["image_shape"] = list(torch.tensor(g["samples"][0]["image_u8"]).shape)
    return f32


def search(cfg, log, ema=False):
    """The first weight seed whose routing is well separated everywhere; ema: the pos_embed as
    train.py's EMA leaves it (the golden is of the tensors as stored)."""
    for seed in range(MAX_SEEDS):
        model = md.randomize(md.DiT(cfg).eval(), torch.Generator().manual_seed(seed))
        tensors = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
        if ema:
            tensors["pos_embed"] = ema_pos_embed(tensors["pos_embed"])
        models = (md.DiT(cfg).double().load_tensors(tensors).eval(), md.DiT(cfg).load_tensors(tensors).eval())
        try:
            g, f32 = golden(models, cfg)
        except AssertionError as e:  # float32 routed differently somewhere
            log("seed %d rejected: %s" % (seed, e))
            continue
        if g["min_topk_margin"] >= MIN_TOPK_MARGIN:
            log("seed %d: min topk margin %.3g, max |f32 - f64| forward %.2g latent %.2g" % (
                seed, g["min_topk_margin"], g["max_abs_f32_error"]["forward"], g["max_abs_f32_error"]["latent"]))
            g["seed"] = seed
            return tensors, models, g, f32
    raise RuntimeError("no seed < %d gives well separated routing" % MAX_SEEDS)


# ----------------------------------------------------------------------------------
# Tiny VAE (diffusers AutoencoderKL layout)
# ----------------------------------------------------------------------------------
def vae_encoder_shapes(cfg):
    """The encoder half of an AutoencoderKL state dict (vae.py 41-106; not used for decoding)."""
    c = dict(md.VAE_DEFAULTS, **cfg)
    ch, n, L = list(c["block_out_channels"]), c["layers_per_block"], c["latent_channels"]
    out = OrderedDict()

    def conv(name, cout, cin, k):
        out[name + ".weight"] = (cout, cin, k, k)
        out[name + ".bias"] = (cout,)

    def norm(name, n_ch):
        out[name + ".weight"] = (n_ch,)
        out[name + ".bias"] = (n_ch,)

    def resnet(p, cin, cout):
        norm(p + ".norm1", cin)
        conv(p + ".conv1", cout, cin, 3)
        norm(p + ".norm2", cout)
        conv(p + ".conv2", cout, cout, 3)
        if cin != cout:
            conv(p + ".conv_shortcut", cout, cin, 1)

    conv("encoder.conv_in", ch[0], c["in_channels"], 3)
    for i, cout in enumerate(ch):
        cin = ch[i - 1] if i else ch[0]
        for j in range(n):
            resnet("encoder.down_blocks.%d.resnets.%d" % (i, j), cin if j == 0 else cout, cout)
        if i < len(ch) - 1:
            conv("encoder.down_blocks.%d.downsamplers.0.conv" % i, cout, cout, 3)
    resnet("encoder.mid_block.resnets.0", ch[-1], ch[-1])
    norm("encoder.mid_block.attentions.0.group_norm", ch[-1])
    for k in ("to_q", "to_k", "to_v", "to_out.0"):
        out["encoder.mid_block.attentions.0.%s.weight" % k] = (ch[-1], ch[-1])
        out["encoder.mid_block.attentions.0.%s.bias" % k] = (ch[-1],)
    resnet("encoder.mid_block.resnets.1", ch[-1], ch[-1])
    norm("encoder.conv_norm_out", ch[-1])
    conv("encoder.conv_out", 2 * L, ch[-1], 3)
    conv("quant_conv", 2 * L, 2 * L, 1)
    return out


def vae_tensors(cfg, seed, input_std):
    """A full AutoencoderKL state dict (new names): random decoder with post_quant_conv scaled
    so that latents of std input_std reach the decoder at about unit size; random encoder."""
    gen = torch.Generator().manual_seed(seed)
    dec = md.VaeDecoder(cfg)
    out = OrderedDict()
    for name, shape in vae_encoder_shapes(cfg).items():
        out[name] = 0.1 * torch.randn(shape, generator=gen)
    for name, p in dec.state_dict().items():
        if "norm" in name:  # group norms: weight about 1, bias about 0
            v = (1.0 + 0.1 * torch.randn(p.shape, generator=gen)) if name.endswith("weight") else \
                0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith(".bias"):
            v = 0.05 * torch.randn(p.shape, generator=gen)
        else:
            v = torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel())
            if name.startswith("post_quant_conv"):
                v = v / input_std
            if name.startswith("decoder.conv_out"):
                v = 0.6 * v
        out[name] = v
    return out


def old_names(tensors):
    """The same weights in the names of the first diffusers releases (sd-vae-ft-ema as published)."""
    out = OrderedDict()
    for k, v in tensors.items():
        for new, old in (("to_q", "query"), ("to_k", "key"), ("to_v", "value"), ("to_out.0", "proj_attn")):
            if ".attentions.0.%s." % new in k:
                k = k.replace(".%s." % new, ".%s." % old)
        out[k] = v
    return out


# ----------------------------------------------------------------------------------
# The release containers
# ----------------------------------------------------------------------------------
def ema_pos_embed(pos_embed, steps=2000):
    """What train.py's update_ema (decay 0.9999, over named_parameters, pos_embed included) makes of
    a pos_embed that never changes: e = e * d + p * (1 - d) in float32, `steps` times."""
    e = pos_embed.clone()
    for _ in range(steps):
        e.mul_(EMA_DECAY).add_(pos_embed, alpha=1 - EMA_DECAY)
    return e


def train_container(cfg, ema_tensors):
    """{"model", "ema", "opt", "args"} as MoH-DiT/train.py 259-264 saves it: "ema" holds
    ema_tensors; "model" differs (EMA lags the model) and was stepped once by AdamW."""
    model = md.DiT(cfg).load_tensors(ema_tensors).train()
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        model.pos_embed.copy_(torch.from_numpy(md.get_2d_sincos_pos_embed(cfg.hidden_size, cfg.grid)).float()[None])
        for n, p in model.named_parameters():
            if n != "pos_embed":
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)  # train.py 160
    L = cfg.input_size
    x = torch.randn(4, cfg.in_channels, L, L, generator=gen)
    t = torch.randint(0, 1000, (4,), generator=gen)
    y = torch.randint(0, cfg.num_classes, (4,), generator=gen)
    loss = model(x, t, y)[:, :cfg.in_channels].pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    args = argparse.Namespace(
        data_path="/data/imagenet/train", results_dir="results", model="MoH-DiT-S/2-90", image_size=8 * L,
        num_classes=cfg.num_classes, epochs=1400, global_batch_size=256, global_seed=0, vae="ema", num_workers=16,
        log_every=100, ckpt_every=100, moh_loss_coeff=0.01)
    return {"model": model.state_dict(), "ema": OrderedDict(ema_tensors), "opt": opt.state_dict(), "args": args}


def _verify(directory, g, f32, f32_images):
    """Reloads the written directory: float32 forwards, samples and images == the search's, bit for bit."""
    model, vae = md.load_model(directory)
    cfg = model.config
    x = torch.tensor(g["forward_inputs"]["x"], dtype=torch.float32)
    t, y = torch.tensor(g["forward_inputs"]["t"]), torch.tensor(g["forward_inputs"]["y"])
    with torch.no_grad():
        for case, want in zip(g["forwards"], f32["forwards"]):
            assert torch.equal(model(x, t, y, case["ratios"]), want), directory
        for s, want, want_u8 in zip(g["samples"], f32["latents"], f32_images):
            got = md.sample(model, md.Request(s["class"], s["seed"], s["steps"], s["guidance"], s["ratio"]))
            assert torch.equal(got["latent"], want), directory
            assert torch.equal(md.decode_image(got["latent"], vae, cfg.latent_scale), want_u8), directory


def generate(outdir, log):
    """Writes the MoH-DiT fixtures into the existing directory outdir."""
    t0 = time.time()
    # latent space
    cfg = md.DiTConfig(DIT_TINY_CONFIG)
    tensors, models, g, f32 = search(cfg, lambda m: log("dit_tiny " + m), ema=True)
    sincos = torch.from_numpy(md.get_2d_sincos_pos_embed(cfg.hidden_size, cfg.grid)).float()[None]
    g["ema_pos_embed_max_drift"] = float((tensors["pos_embed"] - sincos).abs().max())
    std = float(torch.tensor([s["latent"] for s in g["samples"]]).std()) / cfg.latent_scale
    vae_t = vae_tensors(VAE_CONFIG, 5, std)
    vaes = (md.VaeDecoder(VAE_CONFIG).double(), md.VaeDecoder(VAE_CONFIG))
    for v in vaes:
        v.load_state_dict({k: t.to(v.post_quant_conv.weight.dtype) for k, t in md.load_vae_tensors(vae_t).items()})
        v.eval()
    f32_images = add_images(g, vaes, cfg, f32["latents"])
    d = os.path.join(outdir, "dit_tiny_vae")
    os.makedirs(d)
    mtf._write_json(os.path.join(d, "config.json"), VAE_CONFIG)
    checkpoint_io.save_safetensors(vae_t, os.path.join(d, "diffusion_pytorch_model.safetensors"), {"format": "pt"})
    d = os.path.join(outdir, "dit_tiny_vae_old")
    os.makedirs(d)
    mtf._write_json(os.path.join(d, "config.json"), VAE_OLD_CONFIG)
    torch.save(old_names(vae_t), os.path.join(d, "diffusion_pytorch_model.bin"))
    d = os.path.join(outdir, "dit_tiny")
    os.makedirs(d)
    mtf._write_json(os.path.join(d, "config.json"), DIT_TINY_CONFIG)
    torch.save(train_container(cfg, tensors), os.path.join(d, "0000100.pt"))
    mtf._write_json(os.path.join(d, "golden.json"), g, compact=True)
    _verify(d, g, f32, f32_images)
    # the same model decoding through the old-named VAE
    old = md.load_vae(os.path.join(outdir, "dit_tiny_vae_old"))
    new = md.load_vae(os.path.join(outdir, "dit_tiny_vae"))
    with torch.no_grad():
        z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
        assert torch.equal(old(z), new(z)), "the old-named VAE decodes differently"
    log("dit_tiny: %d samples, %d image bytes rounded differently in float32" % (
        len(g["samples"]), g["u8_f32_mismatches"]))

    # pixel space, a plain state dict
    cfg = md.DiTConfig(DIT_PIXELS_CONFIG)
    tensors, models, g, f32 = search(cfg, lambda m: log("dit_tiny_pixels " + m))
    f32_images = add_images(g, None, cfg, f32["latents"])
    d = os.path.join(outdir, "dit_tiny_pixels")
    os.makedirs(d)
    mtf._write_json(os.path.join(d, "config.json"), DIT_PIXELS_CONFIG)
    torch.save(OrderedDict(tensors), os.path.join(d, "moh-dit-pixels.pt"))
    mtf._write_json(os.path.join(d, "golden.json"), g, compact=True)
    _verify(d, g, f32, f32_images)

    mtf._write_json(os.path.join(outdir, "dit_manifest.json"), md.variant_manifest(), compact=True)
    log("dit: %.1fs" % (time.time() - t0))
