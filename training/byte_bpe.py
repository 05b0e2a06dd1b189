"""Byte-level BPE (GPT-2 style) learned from a text, written as a Hugging Face tokenizer.json.

The format is the one model/tokenizer.h reads and tests/reference/make_fixtures.py
writes: 256 byte tokens (id = byte value, GPT-2 bytes_to_unicode spelling), then one
token per merge, then the special tokens; ByteLevel pre-tokenizer (GPT-2 regex) and
decoder; a TemplateProcessing post-processor that puts <|begin_of_text|> first.
"""
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "tests", "reference"))
from gpt2_bytes import (bytes_to_unicode,  # noqa: E402
                        byte_level_bpe_tokenizer_json)

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"

# The GPT-2 pre-tokenizer regex restricted to what `re` expresses; equal to it on
# ASCII text (\p{L} -> [^\W\d_], \p{N} -> \d).  The corpus is ASCII.
PRETOKENIZE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


B2U = bytes_to_unicode()


def _word_counts(text):
    counts = {}
    for w in PRETOKENIZE.findall(text):
        counts[w] = counts.get(w, 0) + 1
    return counts


def train(text, num_merges):
    """Returns the merges [(left, right)] learned from `text` (most frequent pair first,
    ties broken by the pair's spelling), with incremental pair counts."""
    words, freqs = [], []
    for w, c in _word_counts(text).items():
        words.append([B2U[b] for b in w.encode("utf-8")])
        freqs.append(c)
    pair_count, where = {}, {}
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pair_count[p] = pair_count.get(p, 0) + freqs[i]
            where.setdefault(p, set()).add(i)
    merges = []
    while len(merges) < num_merges:
        if not pair_count:
            raise RuntimeError("BPE: text too short for %d merges" % num_merges)
        best = min(pair_count, key=lambda p: (-pair_count[p], p))
        merges.append(best)
        merged = best[0] + best[1]
        for i in sorted(where.pop(best, ())):
            w, c = words[i], freqs[i]
            for p in zip(w, w[1:]):  # remove this word's old pairs
                pair_count[p] -= c
                if pair_count[p] == 0:
                    del pair_count[p]
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == best[0] and w[j + 1] == best[1]:
                    out.append(merged)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for p in zip(out, out[1:]):
                pair_count[p] = pair_count.get(p, 0) + c
                where.setdefault(p, set()).add(i)
        pair_count.pop(best, None)
    return merges


class Encoder:
    """Encodes text with the learned merges exactly as the HF BPE model does: the
    lowest-ranked adjacent pair is merged first, repeatedly."""

    def __init__(self, merges):
        self.vocab = {B2U[b]: b for b in range(256)}
        for left, right in merges:
            self.vocab[left + right] = len(self.vocab)
        self.ranks = {p: i for i, p in enumerate(merges)}
        self.bos = len(self.vocab)
        self.eos = self.bos + 1
        self.vocab_size = self.eos + 1
        self.merges = list(merges)
        self.id_to_bytes = {}
        u2b = {u: b for b, u in B2U.items()}
        for token, i in self.vocab.items():
            self.id_to_bytes[i] = bytes(u2b[ch] for ch in token)
        self._cache = {}

    def _word(self, w):
        ids = self._cache.get(w)
        if ids is not None:
            return ids
        parts = [B2U[b] for b in w.encode("utf-8")]
        while len(parts) > 1:
            ranked = [(self.ranks.get(p, 1 << 30), k) for k, p in enumerate(zip(parts, parts[1:]))]
            rank, k = min(ranked)
            if rank == 1 << 30:
                break
            parts[k:k + 2] = [parts[k] + parts[k + 1]]
        ids = [self.vocab[p] for p in parts]
        self._cache[w] = ids
        return ids

    def encode(self, text, bos=False):
        ids = [self.bos] if bos else []
        for w in PRETOKENIZE.findall(text):
            ids.extend(self._word(w))
        return ids

    def decode(self, ids):
        return b"".join(self.id_to_bytes.get(i, b"") for i in ids).decode("utf-8", "replace")

    def tokenizer_json(self):
        return byte_level_bpe_tokenizer_json(self.vocab, self.merges, self.bos, self.eos,
                                             BOS_TOKEN, EOS_TOKEN)
