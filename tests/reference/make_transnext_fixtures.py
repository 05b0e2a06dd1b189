"""MoH-ViT (TransNeXt) fixtures: tiny checkpoints, golden outputs, preprocessing, manifest.

Called by make_fixtures.py (which stamps and places OUTDIR); writes into OUTDIR:
  transnext_tiny/       config.json, checkpoint.pth (the container MoH-ViT/main.py saves:
                        model, optimizer, lr_scheduler, epoch, scaler, args, max_accuracy),
                        golden.json
  transnext_tiny_st/    the same tensors as one F32 model.safetensors, config.json, golden.json
  transnext_tiny_b/     a second config (96 px, pretrain 64, ...), F32 model.safetensors
  preprocess/           PNG / JPEG images, expected.safetensors, expected.json
  transnext_manifest.json  name -> shape of every tensor of the four released variants
tests/reference/README.md describes the formats.
"""
import argparse
import json
import math
import os
import time
from collections import OrderedDict

import numpy as np
import PIL
import torch
import torch.nn.functional as F
from PIL import Image

import checkpoint_io
import moh_transnext as mt
import pil_resample

RATIOS = [0.0, 0.5, 0.75, 1.0]
MIXED = [[0.5, 0.0, 1.0], [0.1, 1.0, 0.75]]  # one ratio per image
BATCH = 3
MIN_TOPK_MARGIN = 1e-3   # relative gap (s_K - s_{K+1}) / s_K of the routing scores
MIN_CLASS_MARGIN = 1e-2  # top-1 minus top-2 logit
MAX_SEEDS = 200


# ----------------------------------------------------------------------------------
# Golden outputs
# ----------------------------------------------------------------------------------
def topk_margin(scores, top_k_rows):
    """moh_reference.topk_margin, vectorized: min over rows with 0 < K < E of (s_K - s_{K+1}) / s_K."""
    if scores is None:
        return math.inf
    s, _ = torch.sort(scores.double(), dim=1, descending=True)
    k = top_k_rows.long()
    sel = (k > 0) & (k < s.shape[1])
    if not bool(sel.any()):
        return math.inf
    rows = torch.nonzero(sel).squeeze(1)
    upper, lower = s[rows, k[sel] - 1], s[rows, k[sel]]
    return float(((upper - lower) / upper).min())


def fixed_pixels(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    s = cfg["image_size"]
    return torch.randint(0, 256, (BATCH, cfg["num_channels"], s, s), generator=gen, dtype=torch.uint8)


def _run(models, x, ratios):
    """Forward in float64 (the golden) and float32 (its noise); returns a case dict + stats."""
    m64, m32 = models
    with torch.no_grad():
        logits = m64(x.double(), ratios)
        gates = m64.gates()
        logits32 = m32(x, ratios)
    for a64, a32 in zip(m64.attentions(), m32.attentions()):
        assert torch.equal(a64.last_gates != 0, a64.last_used), "a gate underflowed to 0"
        assert torch.equal(a32.last_gates != 0, a64.last_gates != 0), "float32 routes differently"
    margin = min([topk_margin(s, k) for s, k in m64.routing_records()] + [math.inf])
    top2 = torch.topk(logits, 2, dim=1).values
    stats = {"topk": margin, "class": float((top2[:, 0] - top2[:, 1]).min()),
             "f32": float((logits32.double() - logits).abs().max())}
    case = {"logits": logits.tolist(), "head_token_counts": mt.head_token_counts(gates)}
    return case, stats, logits32


def golden(models, cfg, pixels):
    x = mt.normalize_pixels(pixels, cfg["image_mean"], cfg["image_std"])
    m64 = models[0]
    cases, mixed, stats, logits32 = [], [], [], []
    for r in RATIOS:
        case, st, l32 = _run(models, x, r)
        cases.append(dict({"ratio": r, "top_k": m64.layer_top_k(r)}, **case))
        stats.append(st)
        logits32.append(l32)
    for rs in MIXED:
        case, st, l32 = _run(models, x, rs)
        per_row = [m64.layer_top_k(r) for r in rs]
        mixed.append(dict({"ratios": rs, "top_k": [list(k) for k in zip(*per_row)]}, **case))
        stats.append(st)
        logits32.append(l32)
    c = m64.config
    layers = [{"name": "block%d.%d" % (i + 1, j), "stage": i + 1, "block": j, "num_heads": H,
               "shared_heads": S, "trained_top_k": K, "tokens": c.resolutions[i] ** 2}
              for i, j, H, S, K in c.layers()]
    g = {"batch": BATCH, "pixels_u8": pixels.tolist(), "layers": layers, "ratios": RATIOS,
         "cases": cases, "mixed": mixed,
         "min_topk_margin": min(s["topk"] for s in stats),
         "min_class_margin": min(s["class"] for s in stats),
         "max_abs_f32_error": max(s["f32"] for s in stats),
         "logits_dtype": "float64"}
    return g, logits32


def tiny_tensors(cfg, seed):
    model = mt.randomize(mt.TransNeXt(cfg), torch.Generator().manual_seed(seed))
    return OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())


def search(cfg, pixels, log):
    for seed in range(MAX_SEEDS):
        tensors = tiny_tensors(cfg, seed)
        models = (mt.TransNeXt(cfg).double().load_tensors(tensors).eval(),
                  mt.TransNeXt(cfg).load_tensors(tensors).eval())
        g, logits32 = golden(models, cfg, pixels)
        if g["min_topk_margin"] >= MIN_TOPK_MARGIN and g["min_class_margin"] >= MIN_CLASS_MARGIN:
            log("seed %d: min topk margin %.3g, min class margin %.3g, max |f32 - f64| %.2g" % (
                seed, g["min_topk_margin"], g["min_class_margin"], g["max_abs_f32_error"]))
            g["seed"] = seed
            return tensors, g, logits32
    raise RuntimeError("no seed < %d gives well separated routing/logits" % MAX_SEEDS)


def _verify_roundtrip(directory, cfg, g, logits32):
    """Reloads the written checkpoint; float32 logits must be bit-identical to the search's."""
    model = mt.load_model(directory)
    x = mt.normalize_pixels(torch.tensor(g["pixels_u8"], dtype=torch.uint8), cfg["image_mean"], cfg["image_std"])
    with torch.no_grad():
        for case, want in zip(g["cases"] + g["mixed"], logits32):
            got = model(x, case["ratio"] if "ratio" in case else case["ratios"])
            assert torch.equal(got, want), "%s: reloaded checkpoint differs" % directory


# ----------------------------------------------------------------------------------
# The release container (MoH-ViT/main.py 451-459)
# ----------------------------------------------------------------------------------
NO_WEIGHT_DECAY = ("query_embedding", "relative_pos_bias_local", "cpb", "temperature")  # transnext.py 258


def release_container(cfg, tensors, name):
    """{'model', 'optimizer', 'lr_scheduler', 'epoch', 'scaler', 'args', 'max_accuracy'}; the
    optimizer state comes from one AdamW step on a copy, 'model' holds `tensors` unchanged."""
    saved = mt.TransNeXt(cfg).load_tensors(tensors).eval()
    trained = mt.TransNeXt(cfg).load_tensors(tensors).train()
    decay, no_decay = [], []
    for n, p in trained.named_parameters():
        skip = p.dim() == 1 or n.endswith(".bias") or any(k in n for k in NO_WEIGHT_DECAY)
        (no_decay if skip else decay).append(p)
    lr = 1e-3
    opt = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.05}],
                            lr=lr, betas=(0.9, 0.999), eps=1e-8)
    gen = torch.Generator().manual_seed(7)
    s = cfg["image_size"]
    x = torch.randn(4, cfg["num_channels"], s, s, generator=gen)
    target = torch.randint(0, len(cfg["labels"]), (4,), generator=gen)
    F.cross_entropy(trained(x), target, label_smoothing=0.1).backward()
    opt.step()
    lr_scheduler = {  # timm CosineLRScheduler.state_dict()
        "param_group_field": "lr", "_initial_param_group_field": "initial_lr", "base_values": [lr, lr],
        "metric": None, "t_in_epochs": True, "noise_range_t": None, "noise_pct": 0.67, "noise_type": "normal",
        "noise_std": 1.0, "noise_seed": 42, "t_initial": 300, "lr_min": 1e-5, "cycle_mul": 1.0,
        "cycle_decay": 0.1, "cycle_limit": 1, "warmup_t": 5, "warmup_lr_init": 1e-6, "warmup_prefix": False,
        "k_decay": 1.0, "warmup_steps": [(lr - 1e-6) / 5, (lr - 1e-6) / 5],
    }
    args = argparse.Namespace(
        fp32_resume=False, batch_size=128, epochs=300, update_freq=1, config="./configs/%s.py" % name,
        model=name, input_size=s, pretrain_size=None, fixed_pool_size=None, drop=0.0, drop_path=0.1,
        opt="adamw", opt_eps=1e-8, opt_betas=None, clip_grad=1.0, momentum=0.9, weight_decay=0.05,
        sched="cosine", lr=lr, warmup_lr=1e-6, min_lr=1e-5, warmup_epochs=5, smoothing=0.1,
        mixup=0.8, cutmix=1.0, data_path="/data/imagenet", data_set="IMNET", output_dir="results/" + name,
        device="cuda", seed=0, resume="", start_epoch=0, eval=False, num_workers=32, pin_mem=True,
        world_size=8, rank=0, gpu=0, distributed=True, dist_backend="nccl", dist_url="env://",
        nb_classes=len(cfg["labels"]), crop_pct=224 / 256)
    return {
        "model": saved.state_dict(),
        "optimizer": opt.state_dict(),
        "lr_scheduler": lr_scheduler,
        "epoch": 299,
        "scaler": {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                   "_growth_tracker": 417},
        "args": args,
        "max_accuracy": 81.25,
    }


# ----------------------------------------------------------------------------------
# Preprocessing fixtures
# ----------------------------------------------------------------------------------
def _pattern(w, h, phase):
    """A smooth image with hard edges and a fine checkerboard (bicubic overshoot -> clipping)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 127.5 + 127.5 * np.sin(x / (7.0 + phase) + y / 23.0)
    g = 255.0 * x / max(w - 1, 1)
    b = 255.0 * ((x // 9 + y // 9 + phase) % 2)
    rect = (x > w / 3) & (x < 2 * w / 3) & (y > h / 4) & (y < h / 2)
    r[rect], g[rect] = 255.0, 0.0
    checker = (x < w / 4) & (y > 3 * h / 4)
    g[checker] = 255.0 * ((x[checker] + y[checker]) % 2)
    return np.clip(np.stack([r, g, b], axis=-1).round(), 0, 255).astype(np.uint8)


def _rgba(w, h):
    alpha = np.broadcast_to(np.arange(w).clip(0, 255).astype(np.uint8), (h, w))
    return np.concatenate([_pattern(w, h, 2), alpha[..., None]], axis=-1)


def _palette(w, h):
    img = Image.fromarray(((np.arange(h)[:, None] * 5 + np.arange(w)[None, :] * 3) % 256).astype(np.uint8), "P")
    img.putpalette([((i * 37) % 256, (i * 11) % 256, 255 - i)[c] for i in range(256) for c in range(3)])
    return img


# file, how it is made, the (resize_size, image_size) cases, whether the decoded RGB is stored.
# Only three images get the 224 case (0.6 MB each); the JPEG's decoded pixels depend on the
# decoder, so they are stored; so are those of the RGBA and palette files (convert('RGB')).
IMAGES = [
    ("rgb_300x200.png", lambda: Image.fromarray(_pattern(300, 200, 0), "RGB"), [(256, 224), (73, 64)], False),
    ("gray_150x401.png", lambda: Image.fromarray(_pattern(150, 401, 1)[..., 0], "L"), [(256, 224), (73, 64)], False),
    ("photo_320x240.jpg", lambda: Image.fromarray(_pattern(320, 240, 3), "RGB"), [(256, 224), (73, 64)], True),
    ("rgba_257x257.png", lambda: Image.fromarray(_rgba(257, 257), "RGBA"), [(73, 64)], True),
    ("palette_64x48.png", lambda: _palette(64, 48), [(73, 64)], True),
]


def write_preprocess(d):
    os.makedirs(d)
    tensors, entries = {}, []
    for name, make, sizes, keep_rgb in IMAGES:
        path = os.path.join(d, name)
        make().save(path, **({"quality": 90} if name.endswith(".jpg") else {}))
        with Image.open(path) as img:
            mode, (w, h) = img.mode, img.size
            rgb = mt.to_rgb(img)
        entry = {"file": name, "mode": mode, "width": w, "height": h}
        if keep_rgb:
            entry["rgb"] = name + "@rgb"
            tensors[entry["rgb"]] = torch.from_numpy(np.array(rgb, dtype=np.uint8, copy=True))
        entry["cases"] = []
        for resize_size, image_size in sizes:
            rw, rh = mt.resized_size(w, h, resize_size)
            left, top = mt.center_crop_origin(rw, rh, image_size)
            key = "%s@%d" % (name, image_size)
            tensors[key] = mt.preprocess_image(rgb, resize_size, image_size)
            # the stated arithmetic (pil_resample.py) gives the same bytes as PIL here too
            crop = pil_resample.resize_bicubic(np.asarray(rgb), rw, rh)[top:top + image_size, left:left + image_size]
            assert torch.equal(mt.normalize_pixels(torch.from_numpy(crop.copy()).permute(2, 0, 1),
                                                   mt.IMAGENET_MEAN, mt.IMAGENET_STD), tensors[key]), key
            entry["cases"].append({"resize_size": resize_size, "image_size": image_size, "resized_width": rw,
                                   "resized_height": rh, "crop_left": left, "crop_top": top, "tensor": key})
        entries.append(entry)
    checkpoint_io.save_safetensors(tensors, os.path.join(d, "expected.safetensors"), {"format": "pt"})
    _write_json(os.path.join(d, "expected.json"), {
        "image_mean": mt.IMAGENET_MEAN, "image_std": mt.IMAGENET_STD, "resample": "PIL BICUBIC",
        "pil_version": PIL.__version__, "images": entries})


# ----------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------
def _write_json(path, obj, compact=False):
    with open(path, "w") as f:
        if compact:
            json.dump(obj, f, separators=(",", ":"), allow_nan=False)
        else:
            json.dump(obj, f, indent=2)
        f.write("\n")


def _model_dir(d, cfg, g):
    os.makedirs(d)
    _write_json(os.path.join(d, "config.json"), cfg)
    _write_json(os.path.join(d, "golden.json"), g, compact=True)


def generate(outdir, log):
    """Writes the TransNeXt fixtures into the existing directory outdir."""
    t0 = time.time()
    cfg = mt.TINY_CONFIG
    pixels = fixed_pixels(cfg, 20241101)
    tensors, g, logits32 = search(cfg, pixels, lambda m: log("transnext_tiny " + m))
    d = os.path.join(outdir, "transnext_tiny")
    _model_dir(d, cfg, g)
    torch.save(release_container(cfg, tensors, "moh_transnext_tiny"), os.path.join(d, "checkpoint.pth"))
    _verify_roundtrip(d, cfg, g, logits32)
    d = os.path.join(outdir, "transnext_tiny_st")
    _model_dir(d, cfg, g)
    checkpoint_io.save_safetensors(tensors, os.path.join(d, "model.safetensors"), {"format": "pt"})
    _verify_roundtrip(d, cfg, g, logits32)

    cfg = mt.TINY_B_CONFIG
    pixels = fixed_pixels(cfg, 20241102)
    tensors, g, logits32 = search(cfg, pixels, lambda m: log("transnext_tiny_b " + m))
    d = os.path.join(outdir, "transnext_tiny_b")
    _model_dir(d, cfg, g)
    checkpoint_io.save_safetensors(tensors, os.path.join(d, "model.safetensors"), {"format": "pt"})
    _verify_roundtrip(d, cfg, g, logits32)

    write_preprocess(os.path.join(outdir, "preprocess"))
    _write_json(os.path.join(outdir, "transnext_manifest.json"), mt.variant_manifest(), compact=True)
    log("transnext: %.1fs" % (time.time() - t0))
