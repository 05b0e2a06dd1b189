"""Shared pieces of the demo-model recipes (training/train_demo_lm.py, train_demo_vit.py).

The models are the independent reference transcription of the official MoH code
(tests/reference/moh_reference.py); training adds only the load-balance loss of the
official MoH-ViT code (attention.py 58-63, engine.py 44):

    per layer with routed heads:  l_aux = E * E * mean_i(P_i * f_i)
        P_i = mean over tokens of softmax(wg(x))_i   (router probability of head i)
        f_i = mean over tokens of mask_i             (top-K selections of head i)
    loss = task loss + 0.01 * mean over layers of l_aux

It is collected by a forward hook on each `wg` (the router's logits), so the forward
itself is exactly the one the serving tests compare against.
"""
import argparse
import json
import os
import random
import re
import struct
import sys
import time
import zlib

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "reference"))

import checkpoint_io  # noqa: E402,F401  (re-exported for the recipes)
import moh_reference as ref  # noqa: E402,F401

LOAD_BALANCE_WEIGHT = 0.01  # official MoH-ViT engine.py 44


def setup(seed, threads):
    """Fixed seeds and thread count (the recipe targets a 2-core machine).

    The recipes set OPENBLAS_NUM_THREADS=1 before importing torch: Debian's torch
    calls OpenBLAS, whose own threads fight LibTorch's intra-op threads (measured on
    the 2-core machine: a ViT step 12x and an LM step 2-4x slower with both at 2).
    """
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    random.seed(seed)


class LoadBalanceLoss:
    """Collects l_aux of every routed attention layer of `model` during training.

    `attention_modules`: (module, trained K) pairs; each module has a `wg` Linear.
    """

    def __init__(self, attention_modules):
        self.losses = []
        self.enabled = True
        for module, top_k in attention_modules:
            if getattr(module, "wg", None) is not None and top_k > 0:
                module.wg.register_forward_hook(self._hook(top_k))

    def _hook(self, top_k):
        def hook(_module, _inputs, logits):
            if not self.enabled:
                return
            gates = F.softmax(logits, dim=1)
            num_experts = gates.shape[1]
            _, indices = torch.topk(gates, k=top_k, dim=1)
            mask = F.one_hot(indices, num_classes=num_experts).sum(dim=1)
            me = gates.mean(dim=0)
            ce = mask.float().mean(dim=0)
            self.losses.append(torch.mean(me * ce) * num_experts * num_experts)

        return hook

    def take(self):
        """0.01 * mean of the collected l_aux values; clears them."""
        if not self.losses:
            return torch.zeros(())
        loss = LOAD_BALANCE_WEIGHT * torch.stack(self.losses).mean()
        self.losses = []
        return loss


def cosine_lr(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * 3.141592653589793)).item()))


def write_json(path, obj, indent=2):
    """JSON with lists of numbers or short strings kept on one line."""
    text = json.dumps(obj, indent=indent)
    if indent is not None:
        text = re.sub(r"\[[^\[\]{}]*\]", lambda m: re.sub(r"\s*\n\s*", " ", m.group(0))
                      .replace("[ ", "[").replace(" ]", "]"), text)
    with open(path, "w") as f:
        f.write(text + "\n")


def save_metadata(out, meta, stats):
    """metadata.json of a demo model: `meta` with the training `stats`."""
    meta.update(stats)
    write_json(os.path.join(out, "metadata.json"), meta)
    return meta


def start(doc, default_out, option, default, seed, more_flags=None):
    """Parses a recipe's flags (--out, its length `option`, and what `more_flags(parser)`
    adds), seeds and pins torch; returns (args, clock)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(REPO, "models", default_out))
    parser.add_argument(option, type=int, default=default)
    if more_flags is not None:
        more_flags(parser)
    args = parser.parse_args()
    setup(seed, threads=1)
    return args, Clock()


def rounded(values, digits=6):
    """Floats for golden files: enough digits for a 1e-4 comparison, small files."""
    return [float("%.*g" % (digits, v)) for v in values]


def png_grey(rows):
    """An 8-bit greyscale PNG of a [H][W] list of 0..255 values."""
    h, w = len(rows), len(rows[0])
    raw = b"".join(b"\x00" + bytes(row) for row in rows)

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


class Clock:
    def __init__(self):
        self.start = time.time()

    def __call__(self):
        return time.time() - self.start


def log(msg):
    print(msg, flush=True)
