"""GPT-2's reversible byte -> printable unicode character map (the spelling of
byte-level BPE vocabularies: GPT-2, LLaMA-3), shared by the fixture writer,
the demo tokenizer's trainer and the tests' decoders."""


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
