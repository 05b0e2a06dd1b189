"""Writes the checkpoints tests/model/checkpoint/checkpoint_test.cc reads, into argv[1].

One small random state dict in the four layouts moh-serve reads
(single/sharded safetensors, single/sharded torch.save .bin), the expected
values as F32, and .bin files that exercise the restricted unpickler and the
ZIP reader: views sharing a storage, a state_dict() `_metadata` attribute,
ZIP64 central directory fields, a DEFLATE-compressed entry and a malicious
pickle that would run a shell command if it were unpickled by Python.

Training containers as released checkpoints are (torch.save of a dict around
the state dict): MoH-ViT's {model, optimizer (AdamW after one step),
lr_scheduler, epoch, scaler, args (argparse.Namespace), max_accuracy} and
MoH-DiT's {model, ema, opt, args}, a DDP-prefixed state dict, dicts that are
neither, and pickles that the restricted unpickler must refuse (refused/*.pth).
"""
import argparse
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
    save_pickle_zip(path, payload)


def save_pickle_zip(path, payload):
    """A zip laid out like torch.save whose data.pkl is `payload`."""
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


class TinyVit(torch.nn.Module):
    """Parameters and buffers named like a ViT's, with int64 and bf16 ones."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.patch_embed = torch.nn.Linear(6, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 3)
        self.register_buffer("position_ids", torch.arange(5))
        self.register_buffer("rel_bias", torch.randn(2, 3).to(torch.bfloat16))

    def forward(self, x):
        return self.head(self.norm(self.patch_embed(x))).square().sum()


def trained(seed):
    """A TinyVit and its AdamW optimizer after one step (state: step,
    exp_avg, exp_avg_sq tensors per parameter, keyed by int)."""
    model = TinyVit(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    model(torch.randn(2, 6, generator=torch.Generator().manual_seed(seed))).backward()
    opt.step()
    return model, opt


def vit_args(**overrides):
    """The kind of argparse.Namespace MoH-ViT's main.py saves as 'args'."""
    fields = dict(model="moh_transnext_small_75", input_size=224, lr=1e-3,
                  batch_size=128, epochs=300, drop_path=0.45, clip_grad=1.0,
                  pretrain_size=None, fp32_resume=False, opt_betas=None,
                  data_path="/data/imagenet", output_dir="results/moh_transnext_small_75",
                  seed=1 << 40, local_rank=-1, smoothing=0.1)
    fields.update(overrides)
    return argparse.Namespace(**fields)


def vit_container(model, opt, args):
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "lr_scheduler": {"t_initial": 300, "lr_min": 1e-5, "warmup_t": 5, "base_values": [1e-3],
                         "metric": None, "noise_range_t": None, "t_in_epochs": True,
                         "param_group_field": "lr", "cycle_mul": 1.0},
        "epoch": 3,
        "scaler": {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                   "growth_interval": 2000, "_growth_tracker": 17},
        "args": args,
        "max_accuracy": 81.2,
    }


class ArgsSubclass(argparse.Namespace):
    pass


class _Eval:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (eval, ("open(%r, 'w')" % self.marker,))


def namespace_with_state(state):
    """Protocol-2 bytes: GLOBAL argparse.Namespace, EMPTY_TUPLE, NEWOBJ, then
    `state` (pickle opcodes) and BUILD, as pickle emits for a Namespace."""
    return b"cargparse\nNamespace\n)\x81" + state + b"b"


def in_container(value):
    """{'args': value} around hand-written pickle bytes."""
    return b"\x80\x02}X\x04\x00\x00\x00args" + value + b"s."


# Hand-written data.pkl files the restricted unpickler must refuse.
HAND_WRITTEN = {
    "os_system": in_container(b"cos\nsystem\nX\x04\x00\x00\x00true\x85R"),
    "builtins_eval": in_container(b"cbuiltins\neval\nX\x01\x00\x00\x001\x85R"),
    "argument_parser": in_container(b"cargparse\nArgumentParser\n)\x81"),
    "newobj_ordered_dict": in_container(b"ccollections\nOrderedDict\n)\x81"),
    "newobj_storage": in_container(b"ctorch\nFloatStorage\n)\x81"),
    "newobj_rebuild_tensor": in_container(b"ctorch._utils\n_rebuild_tensor_v2\n)\x81"),
    "newobj_not_a_global": in_container(b"))\x81"),
    "newobj_namespace_with_arguments": in_container(b"cargparse\nNamespace\nK\x01\x85\x81"),
    "reduce_namespace": in_container(b"cargparse\nNamespace\n)R"),
    "namespace_built_twice": in_container(namespace_with_state(b"}") + b"}b"),
    "namespace_list_state": in_container(namespace_with_state(b"]")),
    # 32 nested lists in the state dict: the Namespace would be 33 deep (the
    # limit is 32; the state dict alone is 32).
    "namespace_too_deep": in_container(
        namespace_with_state(b"}X\x01\x00\x00\x00k" + b"]" * 32 + b"a" * 31 + b"s")),
}


def save_containers(out):
    model, opt = trained(1234)
    torch.save(vit_container(model, opt, vit_args()),
               os.path.join(mkdir(out, "vit_container"), "moh_transnext_small_75.pth"))
    checkpoint_io.save_safetensors(model.state_dict(),
                                   os.path.join(mkdir(out, "vit_expected"), "model.safetensors"))
    ema = {k: v * 0.5 if v.is_floating_point() else v for k, v in TinyVit(77).state_dict().items()}
    torch.save({"model": model.state_dict(), "ema": ema, "opt": opt.state_dict(),
                "args": argparse.Namespace(model="DiT-XL/2", image_size=256, num_classes=1000)},
               os.path.join(mkdir(out, "dit_container"), "0050000.pth"))
    checkpoint_io.save_safetensors(ema, os.path.join(mkdir(out, "dit_ema_expected"), "model.safetensors"))
    ddp = collections.OrderedDict(("module." + k, v) for k, v in model.state_dict().items())
    torch.save(ddp, os.path.join(mkdir(out, "ddp"), "pytorch_model.bin"))
    t = torch.arange(4.0)
    torch.save({"model": t, "args": t * 2}, os.path.join(mkdir(out, "tensor_named_model"), "pytorch_model.bin"))
    torch.save({"epoch": 3, "weights": {"w": t}, 7: "seven"},
               os.path.join(mkdir(out, "no_state_dict"), "checkpoint.pth"))
    torch.save({"model": {"w": t, "step": 3}}, os.path.join(mkdir(out, "model_not_state_dict"), "checkpoint.pth"))

    refused = mkdir(out, "refused")
    marker = os.path.join(out, "evil_marker")
    torch.save(vit_container(model, opt, vit_args(hook=_Evil(marker))),
               os.path.join(refused, "args_calls_system.pth"))
    torch.save({"model": model.state_dict(), "args": _Eval(marker)}, os.path.join(refused, "eval.pth"))
    torch.save({"model": model.state_dict(), "counts": collections.Counter(a=1)},
               os.path.join(refused, "counter.pth"))
    torch.save({"model": model.state_dict(), "args": ArgsSubclass(model="moh_transnext_small_75")},
               os.path.join(refused, "namespace_subclass.pth"))
    for name, payload in HAND_WRITTEN.items():
        save_pickle_zip(os.path.join(refused, name + ".pth"), payload)


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
    save_containers(out)


if __name__ == "__main__":
    main()
