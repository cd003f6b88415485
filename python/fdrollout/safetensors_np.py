"""Minimal numpy-only reader/writer for the safetensors format.

File layout (https://github.com/huggingface/safetensors):
  * 8 bytes: little-endian uint64 N, the length of the JSON header;
  * N bytes: UTF-8 JSON {name: {"dtype", "shape", "data_offsets": [begin, end]},
    optional "__metadata__": {str: str}}, padded with spaces so 8 + N is a
    multiple of 8 (keeps every tensor's data 8-byte aligned);
  * the tensor bytes, contiguous and little-endian, offsets relative to the
    byte just after the header.

Tensors are written sorted by name, in the same order as the header.
numpy has no bfloat16: BF16 tensors are stored as the upper 16 bits of the
float32 pattern (round-to-nearest-even) and expanded back to float32 on load.
"""
import json
import os
import stat
import struct

import numpy as np

# safetensors dtype tag -> numpy storage dtype (little-endian).
_STORAGE = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}
# numpy dtype -> safetensors tag, for arrays saved without a conversion.
_TAG = {np.dtype(v).newbyteorder("="): k for k, v in _STORAGE.items()
        if k not in ("BF16",)}
_FLOAT_TAGS = ("F32", "F16", "BF16")


def is_torch(value):
    """True for a torch tensor (checked without importing torch, which is never required)."""
    return type(value).__module__.split(".")[0] == "torch"


def from_torch(value):
    """(numpy array, "BF16" or None) of a CPU (or other) torch tensor: a bfloat16 one as its
    uint16 bits tagged "BF16" (np.asarray raised an unnamed "Got unsupported ScalarType
    BFloat16": a probe), any other as tensor.numpy(); a non-torch value as np.asarray."""
    if not is_torch(value):
        return np.asarray(value), None
    t = value.detach().cpu().contiguous()
    if str(t.dtype) == "torch.bfloat16":
        import torch  # present: t is a torch tensor
        return t.view(torch.int16).numpy().view(np.uint16), "BF16"
    return t.numpy(), None


def _f32_to_bf16_bits(a):
    """float32 array -> uint16 bf16 bit patterns, round-to-nearest-even; a NaN stays a (quiet)
    NaN. In uint32 (only a NaN can carry past 2^32: the largest other pattern, -Inf 0xFF800000,
    becomes 0xFF807FFF before the shift) and in
    chunks that stay in cache: 14x faster than the uint64 form this replaced on a 2048 x 5632
    array (0.28 -> 0.02 s here), same bits (tests/python/test_safetensors_np.py: torch's)."""
    f = np.ascontiguousarray(a, dtype=np.float32)
    u = f.reshape(-1).view(np.uint32)
    out = np.empty(u.shape, dtype=np.uint16)
    step = 1 << 18
    for i in range(0, u.size, step):
        c = u[i:i + step]
        r = c >> 16
        r &= 1
        r += c
        r += np.uint32(0x7FFF)
        r >>= 16
        out[i:i + step] = r
    nan = np.isnan(f.reshape(-1))
    if nan.any():  # rounding could carry a NaN into Inf (or wrap): keep its top half, quiet bit set
        out[nan] = (u[nan] >> 16) | 0x40
    return out.reshape(f.shape)


def _bf16_bits_to_f32(bits):
    """uint16 bf16 bit patterns -> float32 (exact)."""
    bits = np.asarray(bits)
    wide = bits.astype(np.uint32).reshape(-1) << 16  # 1-D: 0-d can't be viewed
    return wide.view(np.float32).reshape(bits.shape)


def bf16_round(a):
    """Return `a` as float32 with every value rounded to the nearest bf16."""
    return _bf16_bits_to_f32(_f32_to_bf16_bits(a)).reshape(np.shape(a))


def _encode(arr, dtype):
    """(tag, contiguous little-endian storage array) for one tensor (numpy, or torch: a bfloat16
    one stays BF16 bits, or is widened exactly to float32 first when `dtype` is another).
    Errors  ValueError for a dtype that cannot be stored."""
    arr, tag = from_torch(arr)
    if tag == "BF16":
        if dtype in (None, "BF16"):
            return "BF16", np.ascontiguousarray(arr)
        arr = _bf16_bits_to_f32(arr)
    if dtype is not None and arr.dtype.kind == "f":
        if dtype not in _FLOAT_TAGS:
            raise ValueError(f"unsupported dtype {dtype!r}; use F32, F16 or BF16")
        if dtype == "BF16":
            return "BF16", _f32_to_bf16_bits(arr).reshape(arr.shape)
        return dtype, np.ascontiguousarray(arr, dtype=_STORAGE[dtype])
    tag = _TAG.get(arr.dtype.newbyteorder("="))
    if tag is None:
        raise ValueError(f"cannot store numpy dtype {arr.dtype} in safetensors")
    return tag, np.ascontiguousarray(arr, dtype=_STORAGE[tag])


def save_file(tensors, path, metadata=None, dtype=None):
    """Write `tensors` ({name: array}) to `path` in safetensors format.

    dtype: None keeps each array's own dtype (float32 -> F32, float16 -> F16, a torch
    bfloat16 tensor -> BF16);
    "F32" / "F16" / "BF16" converts every floating array to that type
    (integer arrays are never converted). A value may also be a tuple
    (array, dtype) to override the conversion for that one tensor.
    metadata: optional {str: str}, stored as "__metadata__".
    Writes `path + ".tmp"` first and renames it, so readers never see a
    partial file. Returns the number of tensor data bytes written.
    """
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        value = tensors[name]
        arr, dt = value if isinstance(value, tuple) else (value, dtype)
        tag, data = _encode(arr, dt)
        header[name] = {"dtype": tag, "shape": list(data.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        blobs.append(data)
        offset += data.nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * (-(8 + len(hjson)) % 8)  # pad so data starts 8-aligned
    tmp = str(path) + ".tmp"
    with open(tmp, "wb") as f:
        # Never writable by other users, whatever the umask: the daemon refuses (403) to load such
        # a file (a probe: under umask 002 an ipc_snapshot published fine and never loaded).
        os.fchmod(f.fileno(), stat.S_IMODE(os.fstat(f.fileno()).st_mode) & ~0o022)
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for data in blobs:
            f.write(data.tobytes())
    os.replace(tmp, path)
    return offset


def read_header(path):
    """Return (header dict, byte offset of the data section) of a file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n).decode("utf-8"))
    return header, 8 + n


def load_file(path):
    """Read a safetensors file into {name: np.ndarray}.

    F32 / F16 / BF16 tensors come back as float32; every other dtype
    (integers, bool, F64) comes back in its own numpy dtype.
    """
    header, base = read_header(path)
    header.pop("__metadata__", None)
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            tag, shape = info["dtype"], tuple(info["shape"])
            begin, end = info["data_offsets"]
            storage = np.dtype(_STORAGE[tag])
            count = int(np.prod(shape, dtype=np.int64))
            if end - begin != count * storage.itemsize:
                raise ValueError(f"{path}: {name}: {end - begin} bytes for "
                                 f"{tag}{list(shape)}")
            f.seek(base + begin)
            arr = np.frombuffer(f.read(end - begin), dtype=storage).reshape(shape)
            if tag == "BF16":
                arr = _bf16_bits_to_f32(arr)
            elif tag in _FLOAT_TAGS:
                arr = arr.astype(np.float32)
            else:
                arr = arr.astype(storage.newbyteorder("="))
            out[name] = arr
    return out
