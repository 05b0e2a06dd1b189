#!/usr/bin/python3
"""Trains the demo MoH language model (models/demo-lm) on the King James Bible.

Corpus: Debian package `bible-kjv-text` (public-domain KJV text, read with the
`bible` program of package `bible-kjv`): every verse of Genesis 1:1 .. Revelation
22:21, one verse per line, chapters separated by <|end_of_text|>. The last chapters
(>= 5% of the bytes) are the held-out split; the tokenizer and the model see only the
rest.

Tokenizer: byte-level BPE (training/byte_bpe.py), 510 merges learned from the training
split -> 256 + 510 + 2 special = 768 tokens.

Model: MoH-LLaMA (tests/reference/moh_reference.py, the transcription the server is
tested against), 4 layers, hidden 128, 8 heads of 16 (4 KV heads), SwiGLU 384, RoPE,
tied embeddings, learned two-stage router with S = 2 shared heads and K = 4 of the
6 routed heads (trained ratio 0.75), 0.01 load-balance loss.

Writes OUT (default models/demo-lm): config.json, model.safetensors, tokenizer.json,
generation_config.json, tokenizer_config.json (special tokens and a chat template for
/v1/chat/completions: the model was not trained on dialogue, so the template lays a
conversation out as verses it can continue), golden.json (prompts -> greedy tokens and label
log-likelihoods, for the serving tests), eval_chunks.json (held-out chunks for
training/quality_vs_ratio.py, with the Python model's log-likelihoods), metadata.json.

Usage: /usr/bin/python3 training/train_demo_lm.py [--out DIR] [--steps N]
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see demo_common.setup

import math
import re
import subprocess
import time

import torch
import torch.nn.functional as F

import byte_bpe
import demo_common as dc

SEED = 1234
NUM_MERGES = 510
HELDOUT_FRACTION = 0.05
RATIOS = [0.5, 0.625, 0.75, 0.875, 1.0]

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "intermediate_size": 384,
    "vocab_size": 768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "float32",
    "moh_router": "learned",
    "moh_shared_heads": 2,
    "moh_routed_top_k": 4,
}

# Two phases: most steps on 128-token windows (cheap), the rest on 256 (the model's
# full context), same number of tokens per step.
PHASES = [(128, 24), (256, 12)]
PHASE1_FRACTION = 0.8
PEAK_LR = 3e-3
WARMUP = 100

GOLDEN_PROMPTS = ["Once upon a time", "In the beginning God",
                  "And the LORD spake unto Moses, saying,"]
GOLDEN_LABELS = [" and", " the", " he said", " Jesus"]
GOLDEN_RATIOS = [0.0, 0.5, 1.0]
GOLDEN_NEW_TOKENS = 12
MIN_GREEDY_MARGIN = 0.02  # logits; a continuation is cut before a closer call

NUM_CHUNKS = 32
CONTEXT_BYTES = 300
CONTINUATION_BYTES = 120


# ----------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------
def read_kjv():
    """Chapters of the KJV, each a list of verse texts (numbers and headings dropped)."""
    raw = subprocess.run(["bible", "-l0", "Gen1:1-Rev22:21"], check=True,
                         capture_output=True, text=True).stdout
    chapters = []
    for line in raw.splitlines():
        m = re.match(r"^ +\d+ (.*)$", line)
        if m:
            chapters[-1].append(m.group(1).strip())
        elif line.strip():
            chapters.append([])
    assert len(chapters) == 1189 and sum(map(len, chapters)) == 31102, "unexpected KJV text"
    return ["\n".join(c) + "\n" for c in chapters]


def split_chapters(chapters):
    total = sum(map(len, chapters))
    held, n = [], 0
    while n < HELDOUT_FRACTION * total:
        held.insert(0, chapters.pop())
        n += len(held[0])
    return chapters, held


def token_stream(encoder, chapters):
    ids = []
    for c in chapters:
        ids.extend(encoder.encode(c))
        ids.append(encoder.eos)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------
def build_model():
    model = dc.ref.LlamaForCausalLM(dc.ref.LlamaConfig(CONFIG))
    n_layers = CONFIG["num_hidden_layers"]
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            continue
        std = 0.02
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            std = 0.02 / math.sqrt(2 * n_layers)
        torch.nn.init.normal_(p, std=std)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    return model


def export_tensors(model):
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
            if k != "lm_head.weight"}


def batch_windows(stream, bos, seq, size, gen):
    """[size, seq + 1]: <|begin_of_text|> then seq tokens from random places."""
    starts = torch.randint(0, len(stream) - seq, (size,), generator=gen)
    rows = torch.stack([stream[s:s + seq] for s in starts.tolist()])
    return torch.cat([torch.full((size, 1), bos, dtype=torch.long), rows], dim=1)


def eval_windows(stream, bos, seq):
    n = (len(stream) - 1) // seq
    rows = stream[:n * seq].view(n, seq)
    return torch.cat([torch.full((n, 1), bos, dtype=torch.long), rows], dim=1)


@torch.no_grad()
def mean_nll(model, windows, ratio=None, batch=32):
    """Mean next-token NLL (nats) over windows [N, T+1]; ratio None = trained K."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch]
        logits, _, _ = model(x[:, :-1], ratios=ratio)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += x[:, 1:].numel()
    return total / count


def train(model, train_stream, held_windows, bos, steps, clock):
    lb = dc.LoadBalanceLoss([(layer.self_attn, k) for layer, k in
                             zip(model.model.layers, model.config.routed_top_k)])
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=PEAK_LR, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(SEED)
    phase1 = int(steps * PHASE1_FRACTION)
    for step in range(steps):
        seq, size = PHASES[0] if step < phase1 else PHASES[1]
        lr = dc.cosine_lr(step, steps, PEAK_LR, WARMUP)
        for group in opt.param_groups:
            group["lr"] = lr
        x = batch_windows(train_stream, bos, seq, size, gen)
        model.train()
        lb.enabled = True
        logits, _, _ = model(x[:, :-1])
        lm_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        balance = lb.take()
        opt.zero_grad(set_to_none=True)
        (lm_loss + balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            lb.enabled = False
            model.eval()
            msg = "lm step %d/%d loss %.3f balance %.4f lr %.2g  %.0fs" % (
                step, steps, lm_loss.item(), balance.item() / dc.LOAD_BALANCE_WEIGHT, lr, clock())
            if step % 500 == 0 or step == steps - 1:
                msg += "  held-out nll %.3f" % mean_nll(model, held_windows[:16])
            dc.log(msg)
    lb.enabled = False
    model.eval()


# ----------------------------------------------------------------------------------
# Evaluation files
# ----------------------------------------------------------------------------------
def _word_boundaries(text):
    """Offsets p where text[p] == ' ' between two words (a pre-token boundary)."""
    return [m.start() for m in re.finditer(r"(?<=\S) (?=[A-Za-z(])", text)]


def eval_chunks(held_text):
    """NUM_CHUNKS (context, continuation) pairs spread over the held-out text; both
    split at a space so that tokenizing them apart equals tokenizing them together."""
    bounds = _word_boundaries(held_text)
    chunks = []
    for j in range(NUM_CHUNKS):
        target = int((j + 0.5) * len(held_text) / NUM_CHUNKS)
        p = next(b for b in bounds if b >= target)
        start = next(b for b in bounds if b >= p - CONTEXT_BYTES) + 1  # context starts at a word
        end = max(b for b in bounds if b <= p + CONTINUATION_BYTES)  # continuation ends at a word
        chunks.append({"context": held_text[start:p], "continuation": held_text[p:end]})
    return chunks


@torch.no_grad()
def continuation_log_likelihood(model, encoder, context, continuation, ratio):
    ctx = encoder.encode(context, bos=True)
    cont = encoder.encode(continuation)
    x = torch.tensor([ctx + cont])
    logits, _, _ = model(x, ratios=None if ratio == 0 else ratio)
    logp = F.log_softmax(logits[0].double(), dim=-1)
    return sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))


@torch.no_grad()
def greedy(model, ids, ratio, steps, eos):
    """Greedy continuation (ends at eos), cut before the first step whose top-2 logit gap
    is small."""
    out = []
    ids = list(ids)
    for _ in range(steps):
        logits, _, _ = model(torch.tensor([ids]), ratios=None if ratio == 0 else ratio)
        top = torch.topk(logits[0, -1], 2)
        margin = (top.values[0] - top.values[1]).item()
        if margin < MIN_GREEDY_MARGIN:
            break
        out.append(int(top.indices[0]))
        ids.append(out[-1])
        if out[-1] == eos:
            break
    return out


def write_tokenizer_config(out):
    dc.write_json(os.path.join(out, "tokenizer_config.json"), {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE})


def unigram_bits_per_byte(train_text, text):
    counts = [1] * 256  # add-one
    for b in train_text.encode():
        counts[b] += 1
    total = sum(counts)
    return -sum(math.log2(counts[b] / total) for b in text.encode()) / len(text.encode())


# The chat template (Jinja, as Hugging Face's apply_chat_template renders it): the
# system text, then each turn on its own line, and the model's turn opened last.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] | trim }}\n"
    "{% elif message['role'] == 'user' %}Q: {{ message['content'] | trim }}\n"
    "{% elif message['role'] == 'assistant' %}A: {{ message['content'] | trim }}\n"
    "{% else %}{{ raise_exception('roles are system, user and assistant') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}")


def write_outputs(out, model, encoder, train_text, held_text, held_windows, stats):
    os.makedirs(out, exist_ok=True)
    config = dict(CONFIG, bos_token_id=encoder.bos, eos_token_id=encoder.eos)
    dc.write_json(os.path.join(out, "config.json"), config)
    # Sampling defaults that read well (greedy decoding soon repeats itself);
    # the server applies them to requests that leave these fields out.
    dc.write_json(os.path.join(out, "generation_config.json"),
                  {"bos_token_id": encoder.bos, "eos_token_id": encoder.eos,
                   "do_sample": True, "temperature": 0.8, "top_p": 0.95})
    dc.write_json(os.path.join(out, "tokenizer.json"), encoder.tokenizer_json(), indent=None)
    write_tokenizer_config(out)
    dc.checkpoint_io.save_safetensors(export_tensors(model), os.path.join(out, "model.safetensors"),
                                      {"format": "pt"})
    # Golden outputs of the Python model, for the serving tests.
    golden = {"new_tokens": GOLDEN_NEW_TOKENS, "cases": []}
    for prompt in GOLDEN_PROMPTS:
        ids = encoder.encode(prompt, bos=True)
        case = {"prompt": prompt, "prompt_ids": ids, "greedy": {}, "labels": GOLDEN_LABELS,
                "label_log_likelihoods": {}}
        for r in GOLDEN_RATIOS:
            case["greedy"][str(r)] = greedy(model, ids, r, GOLDEN_NEW_TOKENS, encoder.eos)
            case["label_log_likelihoods"][str(r)] = dc.rounded(
                [continuation_log_likelihood(model, encoder, prompt, lab, r) for lab in GOLDEN_LABELS], 8)
        golden["cases"].append(case)
    dc.write_json(os.path.join(out, "golden.json"), golden)
    # Held-out chunks for bits per byte through the server.
    chunks = eval_chunks(held_text)
    scored = "".join(c["continuation"] for c in chunks)
    n_bytes = len(scored.encode())
    python_bpb = {}
    for r in [0.0] + RATIOS:
        ll = sum(continuation_log_likelihood(model, encoder, c["context"], c["continuation"], r)
                 for c in chunks)
        python_bpb[str(r)] = round(-ll / n_bytes / math.log(2), 4)
    dc.write_json(os.path.join(out, "eval_chunks.json"), {
        "about": "held-out KJV chunks; bits/byte = -sum log p(continuation | context) / bytes / ln 2",
        "bytes": n_bytes,
        "unigram_bits_per_byte": round(unigram_bits_per_byte(train_text, scored), 4),
        "python_bits_per_byte": python_bpb,
        "chunks": chunks})
    bytes_per_token = len(held_text.encode()) / (held_windows[:, 1:].numel())
    held_bpb = mean_nll(model, held_windows) / bytes_per_token / math.log(2)
    meta = {
        "corpus": "King James Bible, Debian packages bible-kjv-text + bible-kjv "
                  "(`bible -l0 Gen1:1-Rev22:21`), public domain",
        "train_bytes": len(train_text.encode()),
        "heldout_bytes": len(held_text.encode()),
        "heldout_first_line": held_text.splitlines()[0][:60],
        "tokenizer": "byte-level BPE, %d merges, vocab %d" % (NUM_MERGES, encoder.vocab_size),
        "default_ratio": (CONFIG["moh_shared_heads"] + CONFIG["moh_routed_top_k"]) /
                         CONFIG["num_attention_heads"],
        "heldout_bits_per_byte": round(held_bpb, 4),
        "heldout_unigram_bits_per_byte": round(unigram_bits_per_byte(train_text, held_text), 4),
        "chunks_python_bits_per_byte": python_bpb,
        "seed": SEED,
    }
    return dc.save_metadata(out, meta, stats)


def main():
    args, clock = dc.start(__doc__, "demo-lm", "--steps", 1600, SEED)
    chapters = read_kjv()
    train_ch, held_ch = split_chapters(chapters)
    train_text, held_text = "".join(train_ch), "".join(held_ch)
    merges = byte_bpe.train(train_text, NUM_MERGES)
    encoder = byte_bpe.Encoder(merges)
    assert encoder.vocab_size == CONFIG["vocab_size"]
    train_stream = token_stream(encoder, train_ch)
    held_stream = torch.tensor([t for c in held_ch for t in encoder.encode(c)], dtype=torch.long)
    held_windows = eval_windows(held_stream, encoder.bos, 255)
    dc.log("lm corpus: %d train bytes -> %d tokens, %d held-out bytes -> %d tokens (%.0fs)" % (
        len(train_text), len(train_stream), len(held_text), len(held_stream), clock()))
    model = build_model()
    dc.log("lm model: %d parameters" % sum(p.numel() for p in model.parameters()))
    t0 = time.time()
    train(model, train_stream, held_windows, encoder.bos, args.steps, clock)
    train_seconds = time.time() - t0
    meta = write_outputs(args.out, model, encoder, train_text, held_text, held_windows, {
        "train_steps": args.steps, "train_seconds": round(train_seconds),
        "total_seconds": round(clock()), "torch": torch.__version__, "threads": 1})
    dc.log("lm: held-out %.3f bits/byte (unigram %.3f), chunks %s; %.0fs in all" % (
        meta["heldout_bits_per_byte"], meta["heldout_unigram_bits_per_byte"],
        meta["chunks_python_bits_per_byte"], clock()))
    dc.log("lm wrote " + args.out)


if __name__ == "__main__":
    main()
