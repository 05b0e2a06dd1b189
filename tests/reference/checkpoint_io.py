"""Writers for the checkpoint layouts moh-serve reads, and a safetensors
reader for what it writes, independent of the C++ code.

safetensors is written by hand from its published format (8-byte little-endian
header length, JSON header, raw little-endian data) so that the tests need no
package beyond Debian's python3-torch. `.bin` files are written by torch.save
(zip format), exactly as Hugging Face `save_pretrained` does.
"""
import json
import os
import struct

import torch

_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def tensor_bytes(t):
    """Raw little-endian bytes of a tensor (row-major)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def save_safetensors(tensors, path, metadata=None):
    """Writes `tensors` (name -> torch.Tensor) to one .safetensors file."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        data = tensor_bytes(t)
        header[name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * ((8 - len(header_bytes) % 8) % 8)  # align data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for b in blobs:
            f.write(b)


def load_safetensors(path):
    """Reads a .safetensors file: ({name: tensor}, metadata, data start).

    Checks what the published format requires: the header is a JSON object,
    each tensor's data_offsets span exactly its bytes inside the data area,
    and the tensors do not overlap.
    """
    dtypes = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length].decode("utf-8"))
    start = 8 + length
    metadata = header.pop("__metadata__", None)
    tensors, spans = {}, []
    for name, entry in header.items():
        dtype = dtypes[entry["dtype"]]
        begin, end = entry["data_offsets"]
        shape = entry["shape"]
        numel = 1
        for d in shape:
            numel *= d
        assert end - begin == numel * torch.tensor([], dtype=dtype).element_size(), name
        assert start + end <= len(data), name
        spans.append((begin, end))
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            raw = bytearray(data[start + begin:start + end])
            tensors[name] = torch.frombuffer(raw, dtype=dtype).reshape(shape)
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "overlapping tensors"
    return tensors, metadata, start


def _shard(tensors, max_shard_bytes):
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if current and size + n > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += n
    if current:
        shards.append(current)
    return shards


def _write_index(directory, index_name, weight_map, tensors):
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, index_name), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def save_sharded_safetensors(tensors, directory, max_shard_bytes):
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
    shards = _shard(tensors, max_shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        save_safetensors(shard, os.path.join(directory, fname), {"format": "pt"})
        weight_map.update({name: fname for name in shard})
    _write_index(directory, "model.safetensors.index.json", weight_map, tensors)
    return len(shards)


def save_torch_bin(tensors, path):
    """One pytorch_model.bin (torch.save zip format, an OrderedDict of tensors)."""
    from collections import OrderedDict

    torch.save(OrderedDict((k, tensors[k].contiguous()) for k in sorted(tensors)), path)


def save_sharded_torch_bin(tensors, directory, max_shard_bytes):
    """pytorch_model-0000i-of-0000n.bin + pytorch_model.bin.index.json (as released)."""
    shards = _shard(tensors, max_shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "pytorch_model-%05d-of-%05d.bin" % (i + 1, len(shards))
        save_torch_bin(shard, os.path.join(directory, fname))
        weight_map.update({name: fname for name in shard})
    _write_index(directory, "pytorch_model.bin.index.json", weight_map, tensors)
    return len(shards)
