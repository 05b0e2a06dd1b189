"""Writes the checkpoints tests/checkpoint_test.cc reads, into argv[1].

One small random state dict in the four layouts moh-serve reads
(single/sharded safetensors, single/sharded torch.save .bin), the expected
values as F32, and .bin files that exercise the restricted unpickler and the
ZIP reader: views sharing a storage, a state_dict() `_metadata` attribute,
ZIP64 central directory fields, a DEFLATE-compressed entry and a malicious
pickle that would run a shell command if it were unpickled by Python.
"""
import collections
import os
import pickle
import struct
import sys
import zipfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_io  # noqa: E402


def state_dict():
    g = torch.Generator().manual_seed(1234)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g).to(torch.float16),
        "model.layers.0.input_layernorm.weight": torch.rand(8, generator=g),
        "model.norm.weight": torch.rand(8, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(16, 8, generator=g),
        "golden.positions": torch.arange(-3, 5, dtype=torch.int64) * (1 << 40),
        "golden.ids": torch.tensor([7, -1, 2147483647], dtype=torch.int32),
        "scalar": torch.tensor(2.5),
    }


def as_f32(tensors):
    return {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}


def mkdir(out, name):
    path = os.path.join(out, name)
    os.makedirs(path, exist_ok=True)
    return path


def save_views(out):
    """Tensors sharing one storage (views), plus a state_dict-style _metadata."""
    g = torch.Generator().manual_seed(99)
    base = torch.randn(4, 6, generator=g)
    half = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    tensors = collections.OrderedDict(
        [
            ("base", base),
            ("row", base[2]),
            ("tail", base[1:]),
            ("transposed", base.t()),
            ("strided", base[:, ::2]),
            ("bf16_column", half[:, 1]),
            ("empty", base[4:]),
        ]
    )
    tensors._metadata = collections.OrderedDict([("", {"version": 1})])
    torch.save(tensors, os.path.join(mkdir(out, "views"), "pytorch_model.bin"))
    expected = {k: v.contiguous() for k, v in tensors.items() if k != "empty"}
    checkpoint_io.save_safetensors(expected, os.path.join(mkdir(out, "views_expected"), "model.safetensors"))


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


def save_evil(out):
    """A zip laid out like torch.save whose data.pkl calls os.system."""
    path = os.path.join(mkdir(out, "evil"), "pytorch_model.bin")
    payload = pickle.dumps({"w": _Evil(os.path.join(out, "evil_marker"))}, protocol=2)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/version", "3\n")


def recompress(src, dst):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))


def rewrite_as_zip64(src, dst):
    """Rewrites src with every central directory size/offset in a ZIP64 extra
    field and saturated (0xFFFFFFFF) fixed fields, as for files over 4 GiB."""
    data = open(src, "rb").read()
    eocd = data.rfind(b"PK\x05\x06")
    _, _, _, _, count, cd_size, cd_offset, _ = struct.unpack("<IHHHHIIH", data[eocd:eocd + 22])
    if cd_offset == 0xFFFFFFFF or count == 0xFFFF:  # Already ZIP64: read its record.
        locator = data[eocd - 20:eocd]
        record = struct.unpack("<Q", locator[8:16])[0]
        count, _, cd_size, cd_offset = struct.unpack("<QQQQ", data[record + 24:record + 56])
    entries, pos = [], cd_offset
    for _ in range(count):
        fixed = bytearray(data[pos:pos + 46])
        name_len, extra_len, comment_len = struct.unpack("<HHH", fixed[28:34])
        compressed, uncompressed = struct.unpack("<II", fixed[20:28])
        local = struct.unpack("<I", fixed[42:46])[0]
        rest = data[pos + 46:pos + 46 + name_len + extra_len + comment_len]
        name, extra, comment = rest[:name_len], rest[name_len:name_len + extra_len], rest[name_len + extra_len:]
        zip64 = struct.pack("<HHQQQ", 1, 24, uncompressed, compressed, local)
        fixed[20:28] = struct.pack("<II", 0xFFFFFFFF, 0xFFFFFFFF)
        fixed[42:46] = struct.pack("<I", 0xFFFFFFFF)
        fixed[30:32] = struct.pack("<H", extra_len + len(zip64))
        entries.append(bytes(fixed) + name + extra + zip64 + comment)
        pos += 46 + name_len + extra_len + comment_len
    cd = b"".join(entries)
    record_offset = cd_offset + len(cd)
    record = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, len(cd), cd_offset)
    locator = struct.pack("<IIQI", 0x07064B50, 0, record_offset, 1)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    with open(dst, "wb") as f:
        f.write(data[:cd_offset] + cd + record + locator + end)


def with_byteorder(src, dst, order):
    """src plus the byteorder entry torch >= 2.1 writes."""
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read())
    with zipfile.ZipFile(dst, "a", zipfile.ZIP_STORED) as z:
        prefix = z.namelist()[0].split("/")[0]
        z.writestr(prefix + "/byteorder", order)


def main():
    out = sys.argv[1]
    tensors = state_dict()
    checkpoint_io.save_safetensors(tensors, os.path.join(mkdir(out, "single_st"), "model.safetensors"))
    checkpoint_io.save_sharded_safetensors(tensors, mkdir(out, "sharded_st"), 700)
    checkpoint_io.save_torch_bin(tensors, os.path.join(mkdir(out, "single_bin"), "pytorch_model.bin"))
    checkpoint_io.save_sharded_torch_bin(tensors, mkdir(out, "sharded_bin"), 700)
    checkpoint_io.save_safetensors(as_f32(tensors), os.path.join(mkdir(out, "expected_f32"), "model.safetensors"))
    save_views(out)
    one = os.path.join(mkdir(out, "one_tensor"), "pytorch_model.bin")
    torch.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, one)
    with_byteorder(one, os.path.join(mkdir(out, "little_endian"), "pytorch_model.bin"), "little")
    with_byteorder(one, os.path.join(mkdir(out, "big_endian"), "pytorch_model.bin"), "big")
    recompress(one, os.path.join(mkdir(out, "compressed"), "pytorch_model.bin"))
    rewrite_as_zip64(os.path.join(out, "single_bin", "pytorch_model.bin"),
                     os.path.join(mkdir(out, "zip64"), "pytorch_model.bin"))
    save_evil(out)


if __name__ == "__main__":
    main()
