#!/usr/bin/python3
"""Trains the demo MoH-ViT classifier (models/demo-vit) on handwritten digits.

Data: the 1797 8x8 grey digits that Debian's python3-sklearn ships
(sklearn/datasets/data/digits.csv.gz: 64 values 0..16, then the class), scaled to
[0, 1] (value / 16). Split: sklearn's stratified train_test_split, 20% held out,
random_state 0 (360 test images).

Model: MoH-ViT (tests/reference/moh_reference.py, timm layout), 8x8 input, 1 channel,
2x2 patches (16 patches + class token), hidden 64, 4 layers, 8 heads of 8, MLP 128,
learned two-stage router with S = 2 shared heads and K = 3 of the 6 routed heads
(trained ratio 0.625), 0.01 load-balance loss. Augmentation: random shifts of up to
one pixel.

Writes OUT (default models/demo-vit): config.json, model.safetensors, heldout.json
(the held-out split, values 0..16), golden.json (a few held-out images -> the Python
model's probabilities at several ratios), metadata.json (held-out accuracy per
ratio, the number the serving test holds the server to), samples/digit-N.png.

Usage: /usr/bin/python3 training/train_demo_vit.py [--out DIR] [--epochs N]
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see demo_common.setup

import gzip
import time

import torch
import torch.nn.functional as F

import demo_common as dc

SEED = 1234
DIGITS = "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz"
RATIOS = [0.5, 0.625, 0.75, 0.875, 1.0]
GOLDEN_IMAGES = 8
GOLDEN_RATIOS = [0.0, 0.5, 1.0]

CONFIG = {
    "model_type": "moh_vit",
    "image_size": 8,
    "patch_size": 2,
    "num_channels": 1,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "intermediate_size": 128,
    "layer_norm_eps": 1e-6,
    "labels": [str(d) for d in range(10)],
    "moh_router": "learned",
    "moh_shared_heads": 2,
    "moh_routed_top_k": 3,
}

BATCH = 64
PEAK_LR = 2e-3
WARMUP = 100


def load_digits():
    """(values [N, 64] int 0..16, labels [N]) from the CSV shipped by python3-sklearn."""
    rows = [list(map(int, line.split(","))) for line in
            gzip.open(DIGITS, "rt").read().split("\n") if line.strip()]
    data = torch.tensor(rows, dtype=torch.long)
    assert data.shape == (1797, 65), data.shape
    return data[:, :64], data[:, 64]


def split(values, labels):
    from sklearn.model_selection import train_test_split
    idx_train, idx_test = train_test_split(list(range(len(labels))), test_size=0.2,
                                           random_state=0, stratify=labels.tolist())
    return torch.tensor(idx_train), torch.tensor(idx_test)


def pixels(values):
    """[N, 64] 0..16 -> [N, 1, 8, 8] in [0, 1] (what a client sends as `pixels`)."""
    return values.float().div(16.0).view(-1, 1, 8, 8)


def shift(x, gen):
    """Random shifts of up to one pixel in each direction (zero fill)."""
    padded = F.pad(x, (1, 1, 1, 1))
    shifted = torch.stack([padded[:, :, dy:dy + 8, dx:dx + 8] for dy in range(3) for dx in range(3)])
    choice = torch.randint(0, 9, (x.shape[0],), generator=gen)
    return shifted[choice, torch.arange(x.shape[0])]


def build_model():
    model = dc.ref.MoHViT(CONFIG)
    for name, p in model.named_parameters():
        if p.dim() >= 2 or name in ("cls_token", "pos_embed"):
            torch.nn.init.trunc_normal_(p, std=0.02)
        elif name.endswith(".bias"):
            torch.nn.init.zeros_(p)
    return model


@torch.no_grad()
def predict(model, x, ratio=None):
    logits, _, _ = model(x, ratios=ratio)
    return logits


def normalize(x, mean, std):
    return (x - mean) / std


def train(model, x_train, y_train, mean, std, epochs, clock):
    lb = dc.LoadBalanceLoss([(b.attn, k) for b, k in zip(model.blocks, model.routed_top_k)])
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "pos_embed"]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and n != "pos_embed")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}], lr=PEAK_LR)
    gen = torch.Generator().manual_seed(SEED)
    steps_per_epoch = (len(y_train) + BATCH - 1) // BATCH
    total = epochs * steps_per_epoch
    step = 0
    for epoch in range(epochs):
        order = torch.randperm(len(y_train), generator=gen)
        model.train()
        lb.enabled = True
        for i in range(0, len(order), BATCH):
            idx = order[i:i + BATCH]
            lr = dc.cosine_lr(step, total, PEAK_LR, WARMUP)
            for group in opt.param_groups:
                group["lr"] = lr
            x = normalize(shift(x_train[idx], gen), mean, std)
            logits, _, _ = model(x)
            loss = F.cross_entropy(logits, y_train[idx], label_smoothing=0.1)
            balance = lb.take()
            opt.zero_grad(set_to_none=True)
            (loss + balance).backward()
            opt.step()
            step += 1
        if epoch % 20 == 0 or epoch == epochs - 1:
            dc.log("vit epoch %d/%d loss %.3f balance %.4f lr %.2g  %.0fs" % (
                epoch, epochs, loss.item(), balance.item() / dc.LOAD_BALANCE_WEIGHT, lr, clock()))
    lb.enabled = False
    model.eval()


def png_grey(values8x8):
    """An 8-bit greyscale PNG of a [8][8] list of 0..16 values (value * 255 / 16)."""
    return dc.png_grey([[round(v * 255 / 16) for v in row] for row in values8x8])


def write_outputs(out, model, config, x_test, values_test, y_test, stats):
    os.makedirs(os.path.join(out, "samples"), exist_ok=True)
    dc.write_json(os.path.join(out, "config.json"), config)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    dc.checkpoint_io.save_safetensors(state, os.path.join(out, "model.safetensors"), {"format": "pt"})
    mean, std = config["image_mean"][0], config["image_std"][0]
    xn = normalize(x_test, mean, std)
    accuracy = {}
    for r in [0.0] + RATIOS:
        pred = predict(model, xn, None if r == 0 else r).argmax(-1)
        accuracy[str(r)] = round((pred == y_test).float().mean().item(), 4)
    dc.write_json(os.path.join(out, "heldout.json"), {
        "about": "held-out split of sklearn's digits (train_test_split(test_size=0.2, "
                 "random_state=0, stratify=y)); pixel = value / 16",
        "labels": y_test.tolist(), "values": values_test.tolist()}, indent=None)
    golden = {"about": "probabilities of the Python model for held-out images (pixels = values / 16)",
              "cases": []}
    for i in range(GOLDEN_IMAGES):
        case = {"heldout_index": i, "label": int(y_test[i]), "probabilities": {}}
        for r in GOLDEN_RATIOS:
            logits = predict(model, xn[i:i + 1], None if r == 0 else r)[0]
            case["probabilities"][str(r)] = dc.rounded(F.softmax(logits.double(), -1).tolist(), 7)
        golden["cases"].append(case)
    dc.write_json(os.path.join(out, "golden.json"), golden)
    # One sample PNG per digit: the first held-out image of that digit that the model
    # classifies right with probability >= 0.6 at every golden ratio (so the 8-bit PNG
    # rounding cannot flip it).
    probs = {r: F.softmax(predict(model, xn, None if r == 0 else r), -1) for r in GOLDEN_RATIOS}
    samples = {}
    for digit in range(10):
        of_digit = [j for j in range(len(y_test)) if int(y_test[j]) == digit]
        confidence = {j: min(probs[r][j, digit].item() for r in GOLDEN_RATIOS) for j in of_digit}
        i = next((j for j in of_digit if confidence[j] >= 0.6),
                 max(of_digit, key=confidence.get))  # an undertrained model: its best
        rows = values_test[i].view(8, 8).tolist()
        name = "digit-%d.png" % digit
        with open(os.path.join(out, "samples", name), "wb") as f:
            f.write(png_grey(rows))
        samples[name] = {"heldout_index": i, "label": str(digit)}
    meta = {
        "data": "sklearn digits (python3-sklearn: sklearn/datasets/data/digits.csv.gz), "
                "1797 8x8 images; held-out 20% stratified, random_state 0",
        "train_images": int(stats.pop("train_images")),
        "heldout_images": len(y_test),
        "default_ratio": (config["moh_shared_heads"] + config["moh_routed_top_k"]) /
                         config["num_attention_heads"],
        "heldout_accuracy": accuracy["0.0"],
        "heldout_accuracy_by_ratio": accuracy,
        "samples": samples,
        "seed": SEED,
    }
    return dc.save_metadata(out, meta, stats)


def main():
    args, clock = dc.start(__doc__, "demo-vit", "--epochs", 150, SEED)
    values, labels = load_digits()
    idx_train, idx_test = split(values, labels)
    x_train, y_train = pixels(values[idx_train]), labels[idx_train]
    x_test, y_test = pixels(values[idx_test]), labels[idx_test]
    config = dict(CONFIG, image_mean=[round(x_train.mean().item(), 4)],
                  image_std=[round(x_train.std().item(), 4)])
    model = build_model()
    dc.log("vit: %d train / %d held-out images, %d parameters" % (
        len(y_train), len(y_test), sum(p.numel() for p in model.parameters())))
    t0 = time.time()
    train(model, x_train, y_train, config["image_mean"][0], config["image_std"][0], args.epochs, clock)
    meta = write_outputs(args.out, model, config, x_test, values[idx_test], y_test, {
        "train_images": len(y_train), "train_epochs": args.epochs,
        "train_seconds": round(time.time() - t0), "total_seconds": round(clock()),
        "torch": torch.__version__, "threads": 1})
    dc.log("vit: held-out accuracy by ratio %s; %.0fs in all" % (meta["heldout_accuracy_by_ratio"], clock()))
    dc.log("vit wrote " + args.out)


if __name__ == "__main__":
    main()
