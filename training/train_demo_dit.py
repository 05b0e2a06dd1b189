#!/usr/bin/python3
"""Trains the demo MoH-DiT digit generator (models/demo-dit): class-conditional, pixel space.

Data: the 1797 8x8 grey digits of Debian's python3-sklearn, the training split of demo-vit
(train_test_split(test_size=0.2, random_state=0, stratify=labels): 1437 images), pixels
value / 16 mapped to [-1, 1] (2 * value / 16 - 1). No VAE: the model denoises the pixels.

Model: MoH-DiT (tests/reference/moh_dit.py, the forward the server is tested against), 8x8
input, 1 channel, 2x2 patches (16 tokens), learn_sigma (2 output channels), 10 classes + the
null class 10. See CONFIG for the widths and the MoH heads.

Objective: the official one, MoH-DiT/train.py with create_diffusion(timestep_respacing=""):
1000 linear-beta steps, t uniform, loss = MSE(eps) + VLB term of the learned range variance
with the mean detached (gaussian_diffusion.py training_losses, LossType.MSE), plus 0.01 x the
mean load-balance loss of the routers (train.py moh_loss_coeff; demo_common.LoadBalanceLoss).
Classifier-free guidance training: each label is replaced by the null class with probability
0.1 (models.py LabelEmbedder.token_drop). AdamW with weight decay 0 and a constant learning
rate (train.py; here 1e-3 after 200 warm-up steps, not 1e-4: the run is 2,500 steps of 128,
not 400,000 of 256), models.py's initialization (adaLN-Zero). The shipped weights are an EMA
of every parameter (train.py update_ema, pos_embed included) with decay 0.995, not
train.py's 0.9999: that one averages over ~10,000 steps, longer than this run (after 2,500
steps 0.9999 would keep 78% of the initial weights, 0.999 8%, 0.995 4e-6); 0.995 averages
over the last ~200 steps (18 epochs).

Writes OUT (default models/demo-dit): config.json, model.safetensors (the EMA), golden.json
(reference samples for the server's test, the fixtures' schema), metadata.json,
samples/grid.png (ten classes x ratios 0.5, trained, 1.0; made with the reference sampler).

Usage: /usr/bin/python3 training/train_demo_dit.py [--out DIR] [--steps N] [--classifier DIR]
           [--quality-per-class N]
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see demo_common.setup

import math
import time
from collections import OrderedDict

import numpy as np
import torch

import demo_common as dc
import dit_quality as dq
import train_demo_vit as vit

import make_dit_fixtures as mdf  # tests/reference (demo_common put it on the path)
import moh_dit as md

SEED = 4321
NULL_CLASS = 10
CLASS_DROPOUT = 0.1  # models.py DiT(class_dropout_prob=0.1)

# Depth 6, hidden 128, 8 heads of 16: blocks 0-4 route (S = 2 shared + top-3 of 6 routed:
# 5 of 8 heads per token), block 5 is dense (S = H = 8: the router only re-weights), as the
# released S and B variants keep their last blocks dense.  Trained effective ratio
# (5 * 5 + 8) / 48 = 0.6875 of the (token, head) pairs.
CONFIG = OrderedDict([
    ("model_type", "moh_dit"), ("input_size", 8), ("patch_size", 2), ("in_channels", 1),
    ("hidden_size", 128), ("depth", 6), ("num_heads", 8), ("head_dim", 16), ("mlp_ratio", 4.0),
    ("num_classes", 10), ("learn_sigma", True),
    ("moh_shared_heads", [2, 2, 2, 2, 2, 8]), ("moh_routed_top_k", [3, 3, 3, 3, 3, 0]),
    ("labels", [str(d) for d in range(10)]), ("vae", None),
    ("default_steps", 50), ("default_guidance", 2.0),
])

STEPS = 2500
BATCH = 128
PEAK_LR = 1e-3
WARMUP = 200
EMA_DECAY = 0.995

# golden.json: (class, seed, steps, guidance, ratio) templates; the seed is the first of
# GOLDEN_SEED_TRIES from the template's whose routing is well separated (golden_requests)
GOLDEN_TEMPLATES = [(3, 0, 50, 2.0, 0.0), (7, 1, 50, 2.0, 0.5), (7, 1, 50, 2.0, 1.0), (0, 42, 10, 1.0, 0.0),
                    (5, 2 ** 32 + 5, 10, 4.0, 0.75)]
GOLDEN_SEED_TRIES = 200
FORWARD_SEED_TRIES = range(20241201, 20241401)
GOLDEN_MIN_MARGIN = 1e-4
ROUTING_SEEDS = 5  # per class, for metadata's "routing"


# ----------------------------------------------------------------------------------
# Data and model
# ----------------------------------------------------------------------------------
def pixels(values):
    """[N, 64] values 0..16 -> [N, 1, 8, 8] in [-1, 1] (train.py's Normalize(0.5, 0.5) of value / 16)."""
    return (values.float() / 16.0 * 2.0 - 1.0).view(-1, 1, 8, 8)


def build_model(config):
    """md.DiT with models.py initialize_weights (302-341): xavier-uniform Linear weights (the
    routers too) and zero biases, the sin-cos pos_embed, the patch conv as a Linear, N(0, 0.02)
    label table and timestep MLP, and zero adaLN modulations and output layer (adaLN-Zero)."""
    model = md.DiT(config)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
    c = model.config
    with torch.no_grad():
        model.pos_embed.copy_(torch.from_numpy(md.get_2d_sincos_pos_embed(c.hidden_size, c.grid)).float()[None])
    w = model.x_embedder.proj.weight.data
    torch.nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
    torch.nn.init.zeros_(model.x_embedder.proj.bias)
    torch.nn.init.normal_(model.y_embedder.embedding_table.weight, std=0.02)
    torch.nn.init.normal_(model.t_embedder.mlp[0].weight, std=0.02)
    torch.nn.init.normal_(model.t_embedder.mlp[2].weight, std=0.02)
    for layer in [b.adaLN_modulation[-1] for b in model.blocks] + [
            model.final_layer.adaLN_modulation[-1], model.final_layer.linear]:
        torch.nn.init.zeros_(layer.weight)
        torch.nn.init.zeros_(layer.bias)
    return model


# ----------------------------------------------------------------------------------
# The training objective (MoH-DiT/diffusion/gaussian_diffusion.py, diffusion_utils.py)
# ----------------------------------------------------------------------------------
class TrainingDiffusion:
    """The 1000-step process of create_diffusion(""): the float64 tables of md.Schedule(1000)
    (respace.py rebuilds the betas from the kept alphas_cumprod even when all are kept, so
    these are train.py's), read as float32 per timestep (_extract_into_tensor)."""

    def __init__(self):
        s = md.Schedule(md.NUM_TRAIN_TIMESTEPS)
        self.num_timesteps = s.steps
        self.sqrt_alphas_cumprod = np.sqrt(s.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - s.alphas_cumprod)
        self.sched = s

    @staticmethod
    def extract(table, t, shape):
        """_extract_into_tensor: table[t] as float32, broadcast to shape."""
        res = torch.from_numpy(np.asarray(table))[t].float()
        return res.view(-1, *([1] * (len(shape) - 1))) + torch.zeros(shape)

    def q_sample(self, x_start, t, noise):
        return (self.extract(self.sqrt_alphas_cumprod, t, x_start.shape) * x_start +
                self.extract(self.sqrt_one_minus_alphas_cumprod, t, x_start.shape) * noise)

    def q_posterior_mean_log_variance(self, x_start, x_t, t):
        s = self.sched
        mean = (self.extract(s.posterior_mean_coef1, t, x_t.shape) * x_start +
                self.extract(s.posterior_mean_coef2, t, x_t.shape) * x_t)
        return mean, self.extract(s.posterior_log_variance_clipped, t, x_t.shape)

    def p_mean_log_variance(self, model_output, x, t):
        """p_mean_variance for LEARNED_RANGE, EPSILON, clip_denoised=False."""
        s = self.sched
        C = x.shape[1]
        eps, var_values = torch.split(model_output, C, dim=1)
        min_log = self.extract(s.posterior_log_variance_clipped, t, x.shape)
        max_log = self.extract(s.log_betas, t, x.shape)
        frac = (var_values + 1) / 2
        log_variance = frac * max_log + (1 - frac) * min_log
        pred_xstart = (self.extract(s.sqrt_recip_alphas_cumprod, t, x.shape) * x -
                       self.extract(s.sqrt_recipm1_alphas_cumprod, t, x.shape) * eps)
        mean, _ = self.q_posterior_mean_log_variance(pred_xstart, x, t)
        return mean, log_variance

    def vb_terms_bpd(self, model_output, x_start, x_t, t):
        """_vb_terms_bpd: KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) in bits per dimension,
        the discretized decoder NLL at t == 0; [N]."""
        true_mean, true_log_variance = self.q_posterior_mean_log_variance(x_start, x_t, t)
        mean, log_variance = self.p_mean_log_variance(model_output, x_t, t)
        kl = mean_flat(normal_kl(true_mean, true_log_variance, mean, log_variance)) / math.log(2.0)
        decoder_nll = -discretized_gaussian_log_likelihood(x_start, mean, 0.5 * log_variance)
        decoder_nll = mean_flat(decoder_nll) / math.log(2.0)
        return torch.where(t == 0, decoder_nll, kl)

    def training_losses(self, model, x_start, t, y, noise):
        """LossType.MSE with LEARNED_RANGE: {"loss", "mse", "vb"}, each [N]; the VLB term
        sees the eps prediction detached (it trains only the variance)."""
        x_t = self.q_sample(x_start, t, noise)
        model_output = model(x_t, t, y)
        C = x_t.shape[1]
        eps, var_values = torch.split(model_output, C, dim=1)
        frozen = torch.cat([eps.detach(), var_values], dim=1)
        vb = self.vb_terms_bpd(frozen, x_start, x_t, t)
        mse = mean_flat((noise - eps) ** 2)
        return {"loss": mse + vb, "mse": mse, "vb": vb}


def mean_flat(x):
    return x.mean(dim=list(range(1, x.dim())))


def normal_kl(mean1, logvar1, mean2, logvar2):
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)), elementwise (diffusion_utils.py)."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) +
                  ((mean1 - mean2) ** 2) * torch.exp(-logvar2))


def approx_standard_normal_cdf(x):
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def discretized_gaussian_log_likelihood(x, means, log_scales):
    """log P(x) of a Gaussian discretized to bins of width 2/255 on [-1, 1], the edge bins
    open (diffusion_utils.py); nats, elementwise."""
    centered = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_cdf_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta))


# ----------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------
@torch.no_grad()
def update_ema(ema, model, decay):
    """train.py update_ema: every named parameter, pos_embed included."""
    ema_params = OrderedDict(ema.named_parameters())
    for name, param in model.named_parameters():
        ema_params[name].mul_(decay).add_(param.data, alpha=1 - decay)


def train(model, ema, x_train, y_train, steps, clock, log_every=250):
    diffusion = TrainingDiffusion()
    lb = dc.LoadBalanceLoss([(b.attn, k) for b, k in zip(model.blocks, model.config.routed_top_k)])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=PEAK_LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(SEED)
    update_ema(ema, model, 0.0)  # train.py: the EMA starts as the model
    model.train()
    n = len(y_train)
    order, pos = torch.randperm(n, generator=gen), 0
    history, running = [], {"loss": 0.0, "mse": 0.0, "vb": 0.0, "balance": 0.0}
    for step in range(steps):
        if pos + BATCH > n:  # drop_last, as train.py's loader
            order, pos = torch.randperm(n, generator=gen), 0
        idx = order[pos:pos + BATCH]
        pos += BATCH
        lr = PEAK_LR * min(1.0, (step + 1) / WARMUP)
        for group in opt.param_groups:
            group["lr"] = lr
        x = x_train[idx]
        y = torch.where(torch.rand(BATCH, generator=gen) < CLASS_DROPOUT, NULL_CLASS, y_train[idx])
        t = torch.randint(0, diffusion.num_timesteps, (BATCH,), generator=gen)
        noise = torch.randn(x.shape, generator=gen)
        terms = diffusion.training_losses(model, x, t, y, noise)
        loss = terms["loss"].mean()
        balance = lb.take()
        opt.zero_grad(set_to_none=True)
        (loss + balance).backward()
        opt.step()
        update_ema(ema, model, EMA_DECAY)
        for k in ("loss", "mse", "vb"):
            running[k] += terms[k].mean().item()
        running["balance"] += balance.item() / dc.LOAD_BALANCE_WEIGHT
        if (step + 1) % log_every == 0 or step + 1 == steps:
            m = (step % log_every) + 1
            row = OrderedDict([("step", step + 1)] + [(k, round(v / m, 4)) for k, v in running.items()] +
                              [("seconds", round(clock()))])
            history.append(row)
            dc.log("dit step %(step)d loss %(loss).4f mse %(mse).4f vb %(vb).4f balance %(balance).3f  %(seconds)ds"
                   % row)
            running = {k: 0.0 for k in running}
    lb.enabled = False
    model.eval()
    ema.eval()
    return history


@torch.no_grad()
def heldout_loss(model, x, y, seed=7, repeats=8):
    """Mean MSE(eps) and VLB term over the held-out images, fixed t and noise (a diagnostic)."""
    diffusion = TrainingDiffusion()
    gen = torch.Generator().manual_seed(seed)
    sums = {"mse": 0.0, "vb": 0.0}
    for _ in range(repeats):
        t = torch.randint(0, diffusion.num_timesteps, (len(y),), generator=gen)
        noise = torch.randn(x.shape, generator=gen)
        terms = diffusion.training_losses(model, x, t, y, noise)
        for k in sums:
            sums[k] += terms[k].mean().item() / repeats
    return {k: round(v, 4) for k, v in sums.items()}


def golden_requests(model, cfg, log):
    """The golden dict (make_dit_fixtures.golden's schema) of the first forward seed, and of
    each template's first seed (counting from its own), whose routing agrees in float32 and
    float64 with top-K margins >= GOLDEN_MIN_MARGIN in every forward, so that a float32 engine
    routes every token as the reference does.  Returns (golden, float32 results, images)."""
    models = (md.DiT(cfg).double().load_tensors(model).eval(), md.DiT(cfg).load_tensors(model).eval())

    def margin(requests, forward_seed):
        try:
            g, _ = mdf.golden(models, cfg, requests, forward_seed)
        except AssertionError:  # float32 routed differently somewhere
            return 0.0
        return g["min_topk_margin"]

    forward_seed = next(f for f in FORWARD_SEED_TRIES if margin([], f) >= GOLDEN_MIN_MARGIN)
    chosen = []
    for label, seed, steps, guidance, ratio in GOLDEN_TEMPLATES:
        s = next((s for s in range(seed, seed + GOLDEN_SEED_TRIES)
                  if margin([(label, s, steps, guidance, ratio)], forward_seed) >= GOLDEN_MIN_MARGIN), None)
        if s is None:
            raise RuntimeError("no seed for golden request %s" % ((label, seed, steps, guidance, ratio),))
        chosen.append((label, s, steps, guidance, ratio))
    g, f32 = mdf.golden(models, cfg, chosen, forward_seed)
    f32_images = mdf.add_images(g, None, cfg, f32["latents"])
    log("dit golden: requests %s, forward seed %d, min top-K margin %.3g" % (chosen, forward_seed,
                                                                           g["min_topk_margin"]))
    return g, f32, f32_images


@torch.no_grad()
def routing_use(model, seeds=ROUTING_SEEDS):
    """How the trained routers choose (trained K; every class, `seeds` seeds, default steps and
    guidance): per block, the fraction of (token, step) rows that use each head, and how many
    of the possible sets of routed heads occur."""
    c = model.config
    used = [torch.zeros(H) for H in c.num_heads]
    sets = [set() for _ in c.num_heads]
    rows = [0]

    def record(m):
        for i, a in enumerate(m.attentions()):
            u = a.last_used.reshape(-1, a.last_used.shape[-1])  # [rows * tokens, H]
            used[i] += u.sum(0)
            sets[i].update(map(tuple, u[:, c.shared_heads[i]:].tolist()))
        rows[0] += u.shape[0]

    for label in range(c.num_classes):
        for seed in range(seeds):
            md.sample(model, md.Request(label, seed, c.default_steps, c.default_guidance), on_forward=record)
    return OrderedDict([
        ("about", "trained K, %d classes x %d seeds, %d steps, guidance %g: per block, the fraction of "
                  "token rows using each head; the distinct sets of routed heads seen, of the possible"
                  % (c.num_classes, seeds, c.default_steps, c.default_guidance)),
        ("head_use", [dc.rounded((u / rows[0]).tolist(), 3) for u in used]),
        ("routed_sets_seen", [len(s_) if K else 0 for s_, K in zip(sets, c.routed_top_k)]),
        ("routed_sets_possible", [math.comb(H - S, K) if K else 0 for H, _, S, K in c.layers()]),
    ])


def write_outputs(out, ema, config, x_test, y_test, stats, clock, args):
    os.makedirs(out, exist_ok=True)
    dc.write_json(os.path.join(out, "config.json"), config)
    state = OrderedDict((k, v.detach().clone().contiguous()) for k, v in ema.state_dict().items())
    dc.checkpoint_io.save_safetensors(state, os.path.join(out, "model.safetensors"), {"format": "pt"})
    cfg = md.DiTConfig(config)
    t0 = time.time()
    g, f32, f32_images = golden_requests(state, cfg, dc.log)
    g["about"] = ("tests/reference/moh_dit.py on the shipped weights (float64; make_dit_fixtures.golden's "
                  "schema, tests/reference/README.md): forwards, and whole samples with their draws, "
                  "final latents and uint8 images [1][8][8]")
    dc.write_json(os.path.join(out, "golden.json"), g, indent=None)
    mdf._verify(out, g, f32, f32_images)  # the written directory reloads to the same float32 results
    golden_seconds = time.time() - t0
    t0, cpu0 = time.time(), time.process_time()
    source = dq.ReferenceSource(out)
    classifier = dq.DigitsClassifier(args.classifier)
    quality = dq.measure(source, classifier, per_class=args.quality_per_class)
    unguided = dq.measure(source, classifier, per_class=args.quality_per_class, guidance=1.0)
    grid = dq.grid_png(source, os.path.join(out, "samples", "grid.png"))
    quality_seconds, quality_cpu_seconds = time.time() - t0, time.process_time() - cpu0
    trained = dq.effective_ratio(cfg, 0.0)
    meta = OrderedDict([
        ("data", "sklearn digits (python3-sklearn: sklearn/datasets/data/digits.csv.gz), 1797 8x8 images; "
                 "the training split of demo-vit (held-out 20% stratified, random_state 0)"),
        ("pixels", "value / 16 * 2 - 1 in [-1, 1]; an image is the final sample through save_image's "
                   "mapping (clamp to [-1, 1], (x + 1) / 2 * 255 + 0.5, truncated to uint8)"),
        ("train_images", int(stats.pop("train_images"))),
        ("heldout_images", len(y_test)),
        ("parameters", sum(v.numel() for k, v in state.items() if k != "pos_embed")),
        ("default_ratio", round(trained, 4)),
        ("default_ratio_about", "fraction of (token, head) pairs at the trained K: blocks 0-4 use 2 shared "
                                "+ 3 of 6 routed heads, block 5 all 8"),
        ("objective", "MoH-DiT/train.py: 1000 linear-beta steps, MSE(eps) + VLB of the learned-range "
                      "variance (eps detached), + %g x mean router load-balance loss; labels dropped to "
                      "the null class %d with probability %g" % (dc.LOAD_BALANCE_WEIGHT, NULL_CLASS,
                                                                 CLASS_DROPOUT)),
        ("optimizer", OrderedDict([("name", "AdamW"), ("lr", PEAK_LR), ("warmup_steps", WARMUP),
                                   ("weight_decay", 0.0), ("batch", BATCH)])),
        ("ema_decay", EMA_DECAY),
        ("shipped_weights", "ema"),
        ("heldout_loss_ema", heldout_loss(ema, x_test, y_test)),
        ("quality", quality),
        ("quality_unguided", unguided),
        ("routing", routing_use(source.model)),
        ("grid", OrderedDict([("file", "samples/grid.png")] + list(grid.items()))),
        ("golden_seconds", round(golden_seconds)),
        ("quality_seconds", round(quality_seconds)),
        ("quality_cpu_seconds", round(quality_cpu_seconds)),
        ("seed", SEED),
    ])
    stats["total_seconds"] = round(clock())
    return dc.save_metadata(out, meta, stats)


def main():
    def more_flags(parser):
        parser.add_argument("--classifier", default=os.path.join(dc.REPO, "models", "demo-vit"),
                            help="the digits classifier of the quality measure (dit_quality.py)")
        parser.add_argument("--quality-per-class", type=int, default=dq.PER_CLASS,
                            help="images per class and ratio of the quality measure")

    args, clock = dc.start(__doc__, "demo-dit", "--steps", STEPS, SEED, more_flags)
    values, labels = vit.load_digits()
    idx_train, idx_test = vit.split(values, labels)
    x_train, y_train = pixels(values[idx_train]), labels[idx_train]
    x_test, y_test = pixels(values[idx_test]), labels[idx_test]
    model = build_model(CONFIG)
    ema = build_model(CONFIG)
    for p in ema.parameters():
        p.requires_grad_(False)
    dc.log("dit: %d train / %d held-out images, %d parameters" % (
        len(y_train), len(y_test), sum(p.numel() for p in model.parameters())))
    t0, cpu0 = time.time(), time.process_time()
    history = train(model, ema, x_train, y_train, args.steps, clock)
    train_seconds, train_cpu_seconds = time.time() - t0, time.process_time() - cpu0
    dc.log("dit: trained %d steps in %.0fs (%.0fs of CPU); held-out loss: model %s, EMA %s" % (
        args.steps, train_seconds, train_cpu_seconds, heldout_loss(model, x_test, y_test),
        heldout_loss(ema, x_test, y_test)))
    meta = write_outputs(args.out, ema, CONFIG, x_test, y_test, OrderedDict([
        ("train_images", len(y_train)), ("train_steps", args.steps), ("train_history", history),
        ("train_seconds", round(train_seconds)), ("train_cpu_seconds", round(train_cpu_seconds)),
        ("torch", torch.__version__), ("threads", 1)]), clock, args)
    for key in ("quality", "quality_unguided"):
        dc.log("dit: %s (guidance %g): accuracy by ratio %s" % (key, meta[key]["guidance"], OrderedDict(
            (r, v["accuracy"]) for r, v in meta[key]["by_ratio"].items())))
    dc.log("dit: %.0fs in all" % clock())
    dc.log("dit wrote " + args.out)


if __name__ == "__main__":
    main()
