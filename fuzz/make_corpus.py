#!/usr/bin/python3
"""Writes the seed corpora of the fuzz targets into fuzz/corpus/<target>/.

Run from anywhere with Debian's python3 (python3-torch for the torch.save
seeds, stdlib otherwise); the files are committed, so this is only needed to
change them:
  /usr/bin/python3 fuzz/make_corpus.py
Each target gets a few valid inputs and a few edge cases, a few KB in all.
"""
import io
import json
import os
import struct
import sys
import zipfile
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CORPUS = os.path.join(HERE, "corpus")
sys.path.insert(0, os.path.join(ROOT, "tests", "testdata"))
import tokenizer_make_testdata  # noqa: E402


def write(target, name, data):
    os.makedirs(os.path.join(CORPUS, target), exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(os.path.join(CORPUS, target, name), "wb") as f:
        f.write(data)


def compact(obj):
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# --- safetensors --------------------------------------------------------

def safetensors(tensors, metadata=None, pad=True):
    """tensors: [(name, dtype, shape, bytes)] laid out in order."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = compact(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def safetensors_corpus():
    f32 = struct.pack("<4f", 1.0, -2.0, 0.5, 3.25)
    write("safetensors_fuzzer", "two_tensors.safetensors", safetensors(
        [("w", "F32", [2, 2], f32), ("b", "I64", [1], struct.pack("<q", 7))],
        metadata={"format": "pt"}))
    write("safetensors_fuzzer", "dtypes.safetensors", safetensors(
        [("h", "F16", [2], b"\x00\x3c\x00\xc0"),
         ("bf", "BF16", [1, 2], b"\x80\x3f\x00\x40"),
         ("i", "I32", [], struct.pack("<i", -1)),
         ("empty", "F32", [0, 3], b"")]))
    write("safetensors_fuzzer", "empty_header.safetensors",
          safetensors([], pad=False))
    write("safetensors_fuzzer", "overlap.safetensors",
          struct.pack("<Q", 100) + compact(
              {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
               "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}
          ).encode()[:100].ljust(100) + b"\0" * 8)
    write("safetensors_fuzzer", "truncated.safetensors",
          safetensors([("w", "F32", [2, 2], f32)])[:-5])
    write("safetensors_fuzzer", "huge_length.safetensors",
          struct.pack("<Q", 2**63) + b"{}")


# --- torch.save (.bin) -------------------------------------------------

def torch_corpus():
    import argparse
    import torch
    from collections import OrderedDict
    torch.manual_seed(0)

    def saved(obj):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    base = torch.arange(6, dtype=torch.float32).view(2, 3)
    state = OrderedDict([("w", base), ("w_t", base.t()),
                         ("row", base[1]),
                         ("h", torch.tensor([1.5, -2.0], dtype=torch.float16)),
                         ("bf", torch.tensor([0.25], dtype=torch.bfloat16)),
                         ("i", torch.tensor([3, 4], dtype=torch.int64)),
                         ("i32", torch.tensor(5, dtype=torch.int32))])
    cases = {
        "state_dict.bin": state,
        "plain_dict.bin": {"x": torch.ones(2, 2), "y": torch.zeros(0)},
        "empty.bin": {},
        "nn_linear.bin": torch.nn.Linear(2, 2, bias=True).state_dict(),
        # A release-style training container: optimizer state (int keys,
        # tensors outside the state dict) and an argparse.Namespace.
        "training_container.bin": {
            "model": OrderedDict([("w", base)]),
            "optimizer": {"state": {0: {"step": 3, "exp_avg": torch.ones(2, 3)}},
                          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999),
                                            "params": [0]}]},
            "epoch": 3,
            "args": argparse.Namespace(model="moh_transnext_small_75",
                                       input_size=224, lr=1e-3),
            "max_accuracy": 81.2,
        },
    }
    for name, obj in cases.items():
        data = saved(obj)
        write("torch_bin_fuzzer", name, data)
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl")][0]
            write("torch_pickle_fuzzer", name.replace(".bin", ".pkl"),
                  z.read(pkl))
    full = saved(state)
    write("torch_bin_fuzzer", "truncated.bin", full[:len(full) // 2])
    write("torch_bin_fuzzer", "list_not_dict.bin", saved([torch.ones(1)]))
    # Edge cases for the unpickler: a refused global, an empty dict, a list.
    write("torch_pickle_fuzzer", "os_system.pkl",
          b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00idq\x00\x85R.")
    write("torch_pickle_fuzzer", "empty_dict.pkl", b"\x80\x02}q\x00.")
    write("torch_pickle_fuzzer", "nested_lists.pkl",
          b"\x80\x02" + b"]" * 40 + b"a" * 39 + b".")


# --- tokenizers ----------------------------------------------------------

def tokenizer_corpus():
    target = "tokenizer_json_fuzzer"
    bytelevel = tokenizer_make_testdata.bytelevel()
    metaspace = tokenizer_make_testdata.metaspace()
    write(target, "bytelevel.json", compact(bytelevel))
    write(target, "metaspace.json", compact(metaspace))
    small_vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3, "a": 4,
                   "b": 5, "\u2581a": 6, "ab": 7, "<0x41>": 8}
    bpe = {"type": "BPE", "unk_token": "<unk>", "fuse_unk": False,
           "byte_fallback": True, "ignore_merges": False,
           "vocab": small_vocab, "merges": [["\u2581", "a"], "a b"]}
    write(target, "metaspace_pretokenizer.json", compact({
        "added_tokens": [{"id": 1, "content": "<s>", "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                          "prepend_scheme": "first", "split": True},
        "post_processor": None,
        "decoder": {"type": "Metaspace", "replacement": "\u2581",
                    "prepend_scheme": "always"},
        "model": bpe}))
    write(target, "split_string.json", compact({
        "added_tokens": [{"id": 2, "content": "</s>", "special": True,
                          "lstrip": True, "rstrip": True,
                          "single_word": True, "normalized": True}],
        "normalizer": {"type": "Replace", "pattern": {"String": "x"},
                       "content": "a"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": "b"},
                          "behavior": "MergedWithNext", "invert": True},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"Sequence": {"id": "A"}},
                                      {"SpecialToken": {"id": "</s>"}}],
                           "special_tokens": {"</s>": {"ids": [2]}}},
        "decoder": None,
        "model": dict(bpe, byte_fallback=False)}))
    write(target, "split_regex.json", compact({
        "pre_tokenizer": {"type": "Split",
                          "pattern": {"Regex": "\\p{L}+|\\s+(?!\\S)"},
                          "behavior": "Contiguous"},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 1}]},
        "model": bpe}))
    write(target, "not_bpe.json", compact({"model": {"type": "WordPiece"}}))
    write(target, "bad_id.json", compact({
        "added_tokens": [{"id": 99999999, "content": "x"}], "model": bpe}))

    # Codec inputs: flags byte, text, 0xFF, little-endian 16-bit ids.
    target = "tokenizer_codec_fuzzer"
    ids = struct.pack("<8H", 0, 1, 2, 39, 72, 220, 300, 301)
    for flags in range(3):
        write(target, "hello_%d" % flags, bytes([flags]) +
              "Hello world! café 你好 <|begin_of_text|> <s> </s>".encode()
              + b"\xff" + ids)
    write(target, "invalid_utf8", b"\x10\xc3\x28 \xe2\x82 \xf0\x9f\x98" +
          b"\xff" + struct.pack("<4H", 3, 0xC3 + 3, 0x80 + 3, 65535))
    write(target, "byte_tokens", b"\x21a\xff" +
          struct.pack("<6H", 0xE4 + 3, 0xBD + 3, 0xA0 + 3, 259, 0xF0 + 3, 2))
    write(target, "empty", b"\x00")


# --- images -----------------------------------------------------------------

def png(width, height, color_type, rows, bit_depth=8, interlace=0,
        palette=None):
    def chunk(kind, body):
        return (struct.pack(">I", len(body)) + kind + body +
                struct.pack(">I", zlib.crc32(kind + body)))
    raw = b"".join(b"\x00" + row for row in rows)
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(
        ">IIBBBBB", width, height, bit_depth, color_type, 0, 0, interlace))
    if palette:
        out += chunk(b"PLTE", palette)
    return out + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def jpeg(width, height, dc_values):
    """Baseline JPEG, 8x8 blocks carrying only a DC value per component
    (dc_values: one list of block DC differences per component, each in
    [-255, 255]); quantization 1, DC codes: category 0 -> '0', 8 -> '10'."""
    components = len(dc_values)
    out = b"\xff\xd8"
    out += b"\xff\xdb" + struct.pack(">HB", 67, 0) + bytes([1] * 64)
    sof = struct.pack(">BHHB", 8, height, width, components)
    for c in range(components):
        sof += bytes([c + 1, 0x11, 0])
    out += b"\xff\xc0" + struct.pack(">H", 2 + len(sof)) + sof
    dc = bytes([0x00, 1, 1] + [0] * 14 + [0, 8])  # lengths 1: {0}, 2: {8}
    ac = bytes([0x10, 1] + [0] * 15 + [0x00])      # length 1: {EOB}
    out += b"\xff\xc4" + struct.pack(">H", 2 + len(dc) + len(ac)) + dc + ac
    sos = bytes([components])
    for c in range(components):
        sos += bytes([c + 1, 0x00])
    sos += bytes([0, 63, 0])
    out += b"\xff\xda" + struct.pack(">H", 2 + len(sos)) + sos
    bits = ""
    blocks = ((width + 7) // 8) * ((height + 7) // 8)
    for b in range(blocks):
        for c in range(components):
            v = dc_values[c][b % len(dc_values[c])]
            if v == 0:
                bits += "0"
            else:  # category 8 holds |v| in [128, 255]
                assert 128 <= abs(v) <= 255
                bits += "10" + format(v if v > 0 else v + 255, "08b")
            bits += "0"  # EOB
    bits += "1" * (-len(bits) % 8)
    data = bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))
    out += data.replace(b"\xff", b"\xff\x00")
    return out + b"\xff\xd9"


def image_corpus():
    target = "image_decoder_fuzzer"
    # First byte: bit 0 -> 3 channels, bits 1-6 -> side 1 + (b >> 1) % 64,
    # bit 7 -> Pillow's path (bicubic, shorter side then centre crop).
    rgb3 = bytes([1 | (2 << 1)])
    grey8 = bytes([0 | (7 << 1)])
    pillow_rgb5 = bytes([0x80 | 1 | (4 << 1)])
    pillow_grey3 = bytes([0x80 | 0 | (2 << 1)])
    write(target, "grey_2x2.png", grey8 + png(2, 2, 0, [b"\x00\xff",
                                                         b"\x80\x40"]))
    write(target, "rgb_2x2.png", rgb3 + png(2, 2, 2, [b"\xff\0\0\0\xff\0",
                                                       b"\0\0\xff\xff\xff\xff"]))
    write(target, "rgba_2x2.png", rgb3 + png(2, 2, 6, [b"\xff\0\0\x80" * 2,
                                                        b"\0\0\xff\xff" * 2]))
    write(target, "palette_2x1.png", grey8 + png(
        2, 1, 3, [b"\x00\x01"], palette=b"\x10\x20\x30\xf0\xe0\xd0"))
    write(target, "grey16_3x3.png", rgb3 + png(
        3, 3, 0, [b"\x00\x00\x12\x34\xff\xff"] * 3, bit_depth=16))
    write(target, "grey_2x2.jpg", grey8 + jpeg(2, 2, [[0]]))
    write(target, "rgb_9x9.jpg", rgb3 + jpeg(9, 9, [[200, -200, 0, 0],
                                                    [0], [-130, 130]]))
    write(target, "pillow_rgba_7x3.png", pillow_rgb5 + png(
        7, 3, 6, [bytes(range(i, i + 28)) for i in (0, 90, 180)]))
    write(target, "pillow_rgb_9x9.jpg", pillow_grey3 + jpeg(
        9, 9, [[200, -200, 0, 0], [0], [-130, 130]]))
    write(target, "huge_header.png", rgb3 + png(8192, 8192, 0, [])[:33])
    write(target, "truncated.png", grey8 + png(2, 2, 0, [b"\0\0", b"\0\0"])[:40])
    write(target, "gif_signature", grey8 + b"GIF89a\x01\x00\x01\x00")


# --- request validation ----------------------------------------------------------

def validation_corpus():
    target = "activation_fuzzer"
    ratios = [(0.0, 0.0), (0.5, 0.25), (1.0, 0.0), (0.0, 0.1),
              (float("nan"), 0.0), (2.0, -1.0)]
    configs = []
    for model in ("demo-lm", "demo-vit", "demo-dit"):
        with open(os.path.join(ROOT, "models", model, "config.json")) as f:
            configs.append((model, compact(json.load(f))))
    configs.append(("dense", compact({
        "model_type": "llama", "hidden_size": 16, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2,
        "intermediate_size": 32, "vocab_size": 10})))
    configs.append(("per_layer_k", compact({
        "model_type": "llama", "hidden_size": 32, "num_attention_heads": 8,
        "num_key_value_heads": 8, "num_hidden_layers": 3,
        "intermediate_size": 32, "vocab_size": 10,
        "moh_router": "query_norm", "moh_shared_heads": 0,
        "moh_routed_top_k": [1, 4, 8]})))
    for i, (name, text) in enumerate(configs):
        for ratio, min_ratio in ratios[i::2]:
            write(target, "%s_%g_%g" % (name, ratio, min_ratio),
                  struct.pack("<ff", ratio, min_ratio) + text.encode())

    # Sampling: FuzzedDataProvider reads integers from the end and strings
    # from the start; these are only starting points for the mutator.
    target = "sampling_fuzzer"
    write(target, "stops", b"\x04END\x02\n\n\x01.Hello. The END is near\n\n" +
          bytes(range(64)))
    write(target, "greedy", bytes(64))
    write(target, "random", bytes((i * 37 + 11) % 256 for i in range(200)))


# --- the HTTP API's requests ---------------------------------------------

OPENAI_TARGET = "openai_request_fuzzer"


def openai_corpus():
    """Request bodies as the official openai client sends them (the first
    byte picks the endpoint: 0 completions, 1 chat), captured from the real
    client talking to a stub server. Needs the client: run with the test
    environment's Python (scripts/install_deps.sh --test), e.g.
    bash tests/python_for_tests.sh fuzz/make_corpus.py;
    without it the committed files are kept."""
    try:
        import openai
    except ImportError:
        print("make_corpus: no openai client: %s kept" % OPENAI_TARGET)
        return
    import http.server
    import threading
    captured = []

    class Stub(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            captured.append((self.path, body))
            chat = self.path.endswith("/chat/completions")
            if json.loads(body).get("stream"):
                payload, kind = b"data: [DONE]\n\n", "text/event-stream"
            else:
                payload = compact({
                    "id": "x", "created": 0, "model": "m", "choices": [],
                    "object": "chat.completion" if chat else "text_completion",
                }).encode()
                kind = "application/json"
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % server.server_port,
                           api_key="k", max_retries=0)
    calls = [
        lambda: client.completions.create(
            model="demo-lm", prompt="In the beginning", max_tokens=32,
            temperature=0),
        lambda: client.completions.create(
            model="demo-lm", prompt=[[318, 5, 9, 17]], max_tokens=8, n=2,
            logprobs=2, stop=["\n\n", "END"], seed=7, top_p=0.9,
            extra_body={"activation_ratio": 0.5, "min_p": 0.05,
                        "stop_token_ids": [319], "ignore_eos": False}),
        lambda: list(client.completions.create(
            model="demo-lm", prompt="Who begat Enos?", max_tokens=16,
            stream=True, stream_options={"include_usage": True},
            presence_penalty=0.5, frequency_penalty=0.25, user="u")),
        lambda: client.chat.completions.create(
            model="demo-lm", max_completion_tokens=48, temperature=0.8,
            messages=[{"role": "system", "content": "Answer as the Preacher."},
                      {"role": "user", "content": "What is vanity?"}]),
        lambda: list(client.chat.completions.create(
            model="demo-lm", stream=True, logprobs=True, top_logprobs=3,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "In the beginning"},
                {"type": "text", "text": " was the Word"}]}],
            extra_body={"activation_ratio": 0.75, "min_activation_ratio": 0.5,
                        "priority": 1, "repetition_penalty": 1.1})),
        lambda: client.chat.completions.create(
            model="demo-lm", max_tokens=4, response_format={"type": "text"},
            messages=[{"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"},
                      {"role": "user", "content": "Bye"}]),
    ]
    for call in calls:
        try:
            call()
        except Exception:  # noqa: BLE001 - the stub's answers are minimal
            pass
    server.shutdown()
    for i, (path, body) in enumerate(captured):
        chat = path.endswith("/chat/completions")
        write(OPENAI_TARGET, "%s_%d.json" % ("chat" if chat else "completion", i),
              bytes([1 if chat else 0]) + body)
    print("make_corpus: %d requests of openai %s" % (len(captured),
                                                    openai.__version__))


def main():
    # Files are (over)written, never removed: some seeds (the chat templates,
    # the tokenizer codecs) were written by hand or by other means.
    openai_corpus()
    safetensors_corpus()
    torch_corpus()
    tokenizer_corpus()
    image_corpus()
    validation_corpus()


if __name__ == "__main__":
    main()
