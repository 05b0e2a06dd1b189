"""Test data for the moh-server integration tests: decoding the fixture
tokenizer's ids, a long-running variant of the fixture LM, PNG encoding.

Re-exported by moh_testlib.
"""
import json
import math
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "reference"))
from gpt2_bytes import bytes_to_unicode  # noqa: E402

LM_EOS = 319

# --- the fixture tokenizer (byte-level BPE), for checking streamed text ---


class ByteLevelDecoder:
    """Decodes token ids of a byte-level BPE tokenizer.json (no specials)."""

    def __init__(self, tokenizer_json):
        with open(tokenizer_json) as f:
            t = json.load(f)
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        self.special = {a["id"] for a in t["added_tokens"] if a["special"]}
        self.token_bytes = {
            i: bytes(byte_of[c] for c in tok)
            for tok, i in t["model"]["vocab"].items()
        }

    def decode(self, ids):
        data = b"".join(self.token_bytes[i] for i in ids
                        if i not in self.special)
        return data.decode("utf-8", "replace")


# --- checkpoints derived from the fixtures ---


def make_long_lm(src_dir, dst_dir, max_positions):
    """A copy of the fixture LM that never picks EOS greedily and has more
    positions, for requests that must run for many steps.

    The LM has tied embeddings, so zeroing embedding row EOS makes its logit
    always exactly 0, below the greedy winner among 319 random-weight logits
    spread over about +-20 (checked: the tests assert finish_reason LENGTH).
    """
    import shutil
    os.makedirs(dst_dir, exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json",
                 "generation_config.json"):
        shutil.copy(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    with open(os.path.join(src_dir, "config.json")) as f:
        config = json.load(f)
    assert config.get("tie_word_embeddings"), config
    config["max_position_embeddings"] = max_positions
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(dst_dir, "model.safetensors"), "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        t = header["model.embed_tokens.weight"]
        assert t["dtype"] == "F32", t
        cols = t["shape"][1]
        f.seek(8 + n + t["data_offsets"][0] + LM_EOS * cols * 4)
        f.write(b"\0" * cols * 4)
    return dst_dir


# --- images ---


def _png(width, height, scanlines):
    """PNG (8-bit RGB) bytes of `scanlines` (each a filter byte, then RGB)."""
    import zlib

    def chunk(kind, data):
        body = kind + data
        return (struct.pack(">I", len(data)) + body +
                struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" +
            chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(scanlines, 1)) + chunk(b"IEND", b""))


def encode_png(pixels):
    """PNG (8-bit RGB) bytes of a [3][H][W] list of floats in [0, 1]."""
    c, h, w = len(pixels), len(pixels[0]), len(pixels[0][0])
    assert c == 3
    raw = bytearray()
    for y in range(h):
        raw.append(0)  # filter: none
        for x in range(w):
            for ch in range(3):
                v = pixels[ch][y][x]
                raw.append(max(0, min(255, int(round(v * 255)))))
    return _png(w, h, bytes(raw))


def solid_png(width, height, rgb=(128, 64, 32)):
    """A PNG of one colour: small to send, big to decode."""
    return _png(width, height, (b"\x00" + bytes(rgb) * width) * height)


def quantize(pixels):
    """The [C][H][W] values an 8-bit PNG of `pixels` decodes to."""
    return [[[max(0, min(255, int(round(v * 255)))) / 255.0 for v in row]
             for row in ch] for ch in pixels]


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [v / s for v in e]
