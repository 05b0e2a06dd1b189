#!/usr/bin/python3
"""Writes the tiny tokenizer.json files used by tests/model/tokenizer/tokenizer_test.cc.

Run once (stdlib only) from anywhere; the JSON files are committed:
  /usr/bin/python3 tests/testdata/tokenizer_make_testdata.py

tokenizer_bytelevel.json  LLaMA-3 layout: ids 0..255 are the 256 byte tokens
    in GPT-2 vocab order (the order of bytes_to_unicode's `bs` list, so
    "!" = 0, "Ġ" (space) = 220, "Ċ" (newline) = 198), then a few merges,
    "Ġthere" without merges (for ignore_merges), and special tokens at 300+
    (ids 272..299 are a deliberate gap).
tokenizer_metaspace.json  LLaMA-2 layout: <unk> <s> </s>, <0x00>..<0xFF> at
    3..258, then "▁"-pieces and merges, byte_fallback, Prepend/Replace
    normalizer and the Replace/ByteFallback/Fuse/Strip decoder.
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "reference"))
from gpt2_bytes import bytes_to_unicode  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def added(i, content, special=True, lstrip=False, rstrip=False):
    return {"id": i, "content": content, "single_word": False,
            "lstrip": lstrip, "rstrip": rstrip, "normalized": False,
            "special": special}


def bytelevel():
    vocab = {c: i for i, (_, c) in enumerate(bytes_to_unicode().items())}
    merges = [["H", "e"], ["l", "l"], ["He", "ll"], ["Hell", "o"],
              ["Ġ", "w"], ["o", "r"], ["Ġw", "or"], ["l", "d"],
              ["Ġwor", "ld"], ["Ã", "©"], ["h", "Ã©"], ["ä", "½"],
              ["ä½", "ł"], ["3", "4"], ["ł", "Â"]]
    for a, b in merges[:13]:
        vocab[a + b] = len(vocab)
    vocab["Ġthere"] = len(vocab)  # 269: reachable only via ignore_merges.
    vocab["34"] = len(vocab)      # 270
    vocab["łÂ"] = len(vocab)      # 271: spans two NBSPs (C2 A0 C2 A0).
    llama3_regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
                    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                    r"\s+(?!\S)|\s+")
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added(300, "<|begin_of_text|>"),
                         added(301, "<|end_of_text|>")],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": llama3_regex},
             "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False,
             "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True,
             "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<|begin_of_text|>",
                                          "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [],
             "special_tokens": {"<|begin_of_text|>": {
                 "id": "<|begin_of_text|>", "ids": [300],
                 "tokens": ["<|begin_of_text|>"]}}}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                    "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
    }


def metaspace():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = 3 + b
    for piece in ["▁", "H", "e", "l", "o", "w", "r", "d", "é", "你"]:
        vocab[piece] = len(vocab)  # 259..268
    merges = ["▁ H", "l l", "▁H e", "▁He ll", "▁Hell o", "▁ w", "o r",
              "▁w or", "l d", "▁wor ld", "▁ h"]
    for m in merges:
        vocab[m.replace(" ", "")] = len(vocab)  # 269..279
    vocab["h"] = len(vocab)  # 280
    vocab["i"] = len(vocab)  # 281
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>"),
                         added(282, "<sep>", special=False, lstrip=True,
                               rstrip=True)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1],
                                       "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def main():
    for name, data in [("tokenizer_bytelevel.json", bytelevel()),
                       ("tokenizer_metaspace.json", metaspace())]:
        with open(os.path.join(HERE, name), "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
