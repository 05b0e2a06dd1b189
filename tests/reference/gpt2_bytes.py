"""GPT-2's reversible byte -> printable unicode character map (the spelling of
byte-level BPE vocabularies: GPT-2, LLaMA-3), and the tokenizer.json of such a
vocabulary; shared by the fixture writer, the demo tokenizer's trainer and the
tests' decoders."""


def bytes_to_unicode():
    """{byte: char} in GPT-2's vocabulary order (printable bytes first, then
    the others mapped to 256 + n); iteration follows that order."""
    bs = (list(range(ord("!"), ord("~") + 1)) +
          list(range(ord("\xa1"), ord("\xac") + 1)) +
          list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def byte_level_bpe_tokenizer_json(vocab, merges, bos_id, eos_id,
                                  bos_token="<|begin_of_text|>",
                                  eos_token="<|end_of_text|>"):
    """A Hugging Face tokenizer.json (as a dict) for a byte-level BPE with
    `vocab` {token: id} and `merges` [(left, right)] in rank order: GPT-2's
    pre-tokenizer and decoder, `bos_token` prepended, no normalizer."""
    def special(i, content):
        return {"id": i, "content": content, "single_word": False, "lstrip": False,
                "rstrip": False, "normalized": False, "special": True}

    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [special(bos_id, bos_token), special(eos_id, eos_token)],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos_token, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos_token, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos_token, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos_token: {"id": bos_token, "ids": [bos_id],
                                           "tokens": [bos_token]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": ["%s %s" % m for m in merges],
        },
    }
