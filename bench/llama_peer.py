#!/usr/bin/env python3
"""The benchmark suite's peer: llama.cpp decode and prefill tokens/s, as JSON.

Runs in the bench virtual environment (llama-cpp-python, scripts/
bench_venv.env) on a GGUF that bench/make_gguf.py wrote, through llama.cpp's
own C API (llama_cpp's low-level ctypes bindings: llama_batch, llama_decode,
one KV sequence per row), so no Python-level sampler or tokenizer is timed:

  decode:  --batch sequences, each a --prompt_tokens prompt (one llama_decode
           call, not timed), then --tokens steps of one llama_decode call that
           carries one token per sequence; greedy (argmax of the logits).
           tokens/s = batch x tokens / the steps' time.
  prefill: --batch prompts of --prompt_tokens tokens in one llama_decode call
           (llama.cpp splits it into its default 512-token micro-batches),
           logits of each prompt's last token. tokens/s = batch x prompt /
           the call's time.
  greedy:  --ids=PROMPT_IDS: prints the first sequence's --tokens greedy ids
           (the suite's check that the GGUF computes the model moh-serve does).

Everything else is llama.cpp's default context: K and V cache types
(--kv=f16, the default, or f32), flash attention "auto" (the JSON says what it
resolved to), --threads for both n_threads and n_threads_batch. The figure is
the median of --repeat runs after one warm-up run; the KV cache is cleared
between runs.

  $MOH_BENCH_VENV/bin/python bench/llama_peer.py --model M.gguf --mode decode \\
      --batch 16 --prompt_tokens 16 --tokens 64 --threads 2 --kv f16
"""
import argparse
import ctypes
import json
import re
import statistics
import sys
import time

import numpy as np

import llama_cpp as L

_log = []


@L.llama_log_callback
def _capture_log(level, text, user_data):
    _log.append(text.decode("utf-8", "replace"))


def load(path, threads, kv, n_seq, n_ctx_per_seq, n_batch):
    L.llama_log_set(_capture_log, ctypes.c_void_p(0))
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        sys.exit("llama_peer: cannot load %s:\n%s" % (path, "".join(_log)))
    cparams = L.llama_context_default_params()
    cparams.n_seq_max = n_seq
    # Default (non-unified) KV: each sequence gets n_ctx / n_seq_max cells.
    cparams.n_ctx = n_seq * n_ctx_per_seq
    cparams.n_batch = max(cparams.n_batch, n_batch)
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    kv_type = {"f16": L.GGML_TYPE_F16, "f32": L.GGML_TYPE_F32}[kv]
    cparams.type_k = kv_type
    cparams.type_v = kv_type
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        sys.exit("llama_peer: cannot create a context:\n%s" % "".join(_log))
    vocab = L.llama_model_get_vocab(model)
    return model, ctx, L.llama_vocab_n_tokens(vocab), cparams


class Batch:
    def __init__(self, capacity):
        self.b = L.llama_batch_init(capacity, 0, 1)

    def fill(self, rows):
        """rows: (token, position, sequence, wants logits) tuples."""
        b = self.b
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(rows)
        return b


def decode(ctx, batch):
    rc = L.llama_decode(ctx, batch)
    if rc != 0:
        sys.exit("llama_peer: llama_decode returned %d:\n%s" %
                 (rc, "".join(_log[-20:])))


def argmax_rows(ctx, rows, n_vocab):
    logits = np.ctypeslib.as_array(L.llama_get_logits(ctx),
                                   shape=(rows * n_vocab,))
    return logits.reshape(rows, n_vocab).argmax(axis=1)


def prompts(batch, length, n_vocab):
    # Fixed synthetic ids (the bench model's text does not matter).
    return [[(7 + 131 * s + 17 * t) % n_vocab for t in range(length)]
            for s in range(batch)]


def prefill_all(ctx, buf, prompt_ids):
    rows = []
    for s, ids in enumerate(prompt_ids):
        rows += [(tok, t, s, t == len(ids) - 1) for t, tok in enumerate(ids)]
    decode(ctx, buf.fill(rows))


def run_decode(ctx, n_vocab, args, buf):
    ids = prompts(args.batch, args.prompt_tokens, n_vocab)
    prefill_all(ctx, buf, ids)
    L.llama_synchronize(ctx)
    nxt = argmax_rows(ctx, args.batch, n_vocab)
    start = time.perf_counter()
    for step in range(args.tokens):
        pos = args.prompt_tokens + step
        decode(ctx, buf.fill([(int(nxt[s]), pos, s, True)
                              for s in range(args.batch)]))
        nxt = argmax_rows(ctx, args.batch, n_vocab)
    return args.batch * args.tokens / (time.perf_counter() - start)


def run_prefill(ctx, n_vocab, args, buf):
    ids = prompts(args.batch, args.prompt_tokens, n_vocab)
    start = time.perf_counter()
    prefill_all(ctx, buf, ids)
    argmax_rows(ctx, args.batch, n_vocab)
    return args.batch * args.prompt_tokens / (time.perf_counter() - start)


def run_greedy(ctx, n_vocab, args, buf):
    ids = [int(x) for x in args.ids.split(",")]
    prefill_all(ctx, buf, [ids])
    out = [int(argmax_rows(ctx, 1, n_vocab)[0])]
    while len(out) < args.tokens:
        decode(ctx, buf.fill([(out[-1], len(ids) + len(out) - 1, 0, True)]))
        out.append(int(argmax_rows(ctx, 1, n_vocab)[0]))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF")
    parser.add_argument("--mode", choices=["decode", "prefill", "greedy"],
                        default="decode")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt_tokens", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64,
                        help="decode steps (greedy: tokens to print)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv", choices=["f16", "f32"], default="f16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ids", help="greedy: comma-separated prompt ids")
    args = parser.parse_args()
    if args.mode == "greedy":
        args.batch, args.prompt_tokens = 1, len(args.ids.split(","))
    per_seq = args.prompt_tokens + args.tokens + 1
    n_ctx_per_seq = max(256, -(-per_seq // 256) * 256)
    model, ctx, n_vocab, cparams = load(args.model, args.threads, args.kv,
                                        args.batch, n_ctx_per_seq,
                                        args.batch * args.prompt_tokens)
    buf = Batch(max(args.batch * args.prompt_tokens, args.batch))
    mem = L.llama_get_memory(ctx)
    result = {"mode": args.mode, "batch": args.batch,
              "prompt_tokens": args.prompt_tokens, "threads": args.threads,
              "kv": args.kv, "n_ubatch": cparams.n_ubatch}
    if args.mode == "greedy":
        result["token_ids"] = run_greedy(ctx, n_vocab, args, buf)
    else:
        fn = run_decode if args.mode == "decode" else run_prefill
        rates = []
        for i in range(args.repeat + 1):  # the first is a warm-up
            L.llama_memory_clear(mem, True)
            rate = fn(ctx, n_vocab, args, buf)
            if i:
                rates.append(rate)
        result["tokens_per_s"] = statistics.median(rates)
        result["runs"] = rates
    # Flash attention "auto" resolves on the first llama_decode.
    m = re.search(r"Flash Attention (enabled|not supported)", "".join(_log))
    result["flash_attn"] = ("auto: " + (m.group(1) if m else "unknown"))
    result["llama_cpp_python"] = L.__version__
    L.llama_batch_free(buf.b)
    L.llama_free(ctx)
    L.llama_model_free(model)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
