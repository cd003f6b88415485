"""Delta versions of the rsync store (docs/weight_sources.md, "Delta versions"): a version that
holds only the elements that changed since another version, as (indices, values) per tensor in
HF (training) names. The rollout applies it in place while it serves exactly that base version
(409 otherwise), all ranks or none, as a delta weight stream is applied:

    from fdrollout import publish, changed_elements
    publish.publish_rsync(hf_v1, store="/data/store", version="v1", template_dir="/models/base")
    changes = {}
    for name in hf_v2:
        idx, vals = changed_elements(hf_v1[name], hf_v2[name])   # flat indices (int32 below 2**31 elements), sorted
        if idx.size:
            changes[name] = (idx, vals)                           # or hf_v2[name]: the tensor in full
    publish.publish_rsync_delta(changes, store="/data/store", version="v2", base_version="v1")

then `fdctl pause && fdctl update-weights --version v2 && fdctl resume` (or Client.update_weights).

A delta version dir holds `weights.fddelta` (the daemon's format, fd/weights/weight_delta.h:
"FDDELTA1", u64 LE header length, JSON header {"tensors": [{name, dtype, shape, dense, n,
index_bytes}]}, then per tensor its indices (absent when dense; int32 LE when the tensor has
< 2^31 elements, index_bytes 4, else int64) and its values in the tensor's dtype)
and `manifest.json` with `base_version` and `base_fingerprint` (the base manifest's
fingerprint, as fd::weights::manifest_fingerprint computes it): still named by its files'
SHA-256, and bound to the exact bytes of its base.
"""
import hashlib
import json
import mmap
import os
import struct

import numpy as np

from . import safetensors_np
from .publish import _publish_version, check_version, open_record

DELTA_FILE = "weights.fddelta"
_MAGIC = b"FDDELTA1"


def read_store_manifest(store, version):
    """The manifest.json of `store`/`version` as a dict. FileNotFoundError naming the version."""
    path = os.path.join(store, version, "manifest.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: version {version!r} is not in the store {store} (publish it first)")
    with open(path) as f:
        return json.load(f)


def manifest_fingerprint(manifest):
    """SHA-256 (64 hex) over every manifest file's "name\\nsize\\nsha256\\n", by name: what
    fd::weights::manifest_fingerprint says the version's bytes are."""
    h = hashlib.sha256()
    for name in sorted(manifest["files"], key=lambda n: n.encode()):
        f = manifest["files"][name]
        h.update(f"{name}\n{int(f['size'])}\n{f['sha256']}\n".encode())
    return h.hexdigest()


def store_tensor_specs(store, version):
    """{HF name: (dtype tag, shape)} of the tensors of store version `version` (a delta's: its
    full ancestor's, deltas never change a shape). ValueError on a cycle of bases."""
    seen = []
    while True:
        m = read_store_manifest(store, version)
        if "base_version" not in m:
            break
        seen.append(version)
        version = m["base_version"]
        if version in seen:
            raise ValueError(f"the store's delta versions {seen} form a cycle of bases")
    specs, vdir = {}, os.path.join(store, version)
    for name in sorted(os.listdir(vdir)):
        if name.endswith(".safetensors"):
            header, _ = safetensors_np.read_header(os.path.join(vdir, name))
            specs.update({k: (v["dtype"], [int(d) for d in v["shape"]]) for k, v in header.items() if k != "__metadata__"})
    return specs


def weight_delta_bytes(entries):
    """The bytes of a weights.fddelta holding `entries` [(name, dtype tag, shape, indices int64
    array or None (dense), values storage array)], unchecked."""
    def narrow(shape):  # int32 indices when every index fits (the daemon reads both widths)
        return int(np.prod(shape, dtype=np.int64)) <= 2**31 - 1

    header = {"tensors": [{"name": n, "dtype": tag, "shape": list(shape), "dense": idx is None, "n": int(vals.size),
                           "index_bytes": 4 if narrow(shape) else 8} for n, tag, shape, idx, vals in entries]}
    text = json.dumps(header, separators=(",", ":")).encode()
    parts = [_MAGIC, struct.pack("<Q", len(text)), text]
    for _, _, shape, idx, vals in entries:
        if idx is not None:
            parts.append(np.ascontiguousarray(idx, dtype="<i4" if narrow(shape) else "<i8").tobytes())
        parts.append(np.ascontiguousarray(vals).tobytes())
    return b"".join(parts)


def write_weight_delta(path, entries):
    """Write `entries` (as weight_delta_bytes) to `path` in the daemon's weights.fddelta format,
    unchecked (tests use it to write deltas the daemon must refuse)."""
    with open(path, "wb") as f:
        f.write(weight_delta_bytes(entries))


def _encode_change(name, change, tag, shape):
    """One tensor's (indices or None, values storage array) checked against its (tag, shape)."""
    numel = int(np.prod(shape, dtype=np.int64))
    if isinstance(change, tuple) and len(change) == 2:
        idx = np.asarray(change[0])
        vals = np.asarray(change[1]).reshape(-1)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise ValueError(f"{name}: indices must be a 1-D integer array (got {idx.dtype} with {idx.ndim} dims)")
        idx = idx.astype(np.int64)
        if idx.size != vals.size:
            raise ValueError(f"{name}: {idx.size} indices but {vals.size} values")
        if idx.size > numel:
            raise ValueError(f"{name}: {idx.size} indices for a tensor of {numel} elements")
        bad = np.flatnonzero((idx < 0) | (idx >= numel))
        if bad.size:
            raise ValueError(f"{name}: index {int(idx[bad[0]])} at position {int(bad[0])} is outside [0, {numel})")
        step = np.flatnonzero(np.diff(idx) <= 0)
        if step.size:
            raise ValueError(f"{name}: indices must be strictly increasing (sorted, unique): position {int(step[0]) + 1} "
                             f"holds {int(idx[step[0] + 1])} after {int(idx[step[0]])}")
    else:
        idx, vals = None, np.asarray(change)
        if list(vals.shape) != list(shape):
            raise ValueError(f"{name}: a full tensor of shape {list(vals.shape)}, the base holds {list(shape)}")
        vals = vals.reshape(-1)
    if vals.dtype.kind == "f" and not np.all(np.isfinite(vals)):
        raise ValueError(f"{name}: a value is not finite (NaN or Inf)")
    got, data = safetensors_np._encode(vals.astype(np.float32) if vals.dtype.kind == "f" else vals, tag)
    if got != tag:
        raise ValueError(f"{name}: values of dtype {vals.dtype} cannot be stored as the base's {tag}")
    return idx, data


def publish_rsync_delta(changes, store, version, base_version):
    """Publish version `version` of the rsync store `store` as a delta on `base_version`.

    `changes`: {HF name: (indices, values)} — flat element indices into the HF tensor (int,
    sorted, unique, in [0, numel)) and their new values — or {HF name: array}: the tensor in full.
    Tensors not named keep the base's bytes. Values are cast to the base tensor's dtype (F32,
    BF16, F16) as publish_rsync casts. Raises FileNotFoundError when the base is not in the
    store, ValueError naming the tensor (unknown name, bad indices, shape, non-finite value) and
    FileExistsError when `version` exists; nothing is written then. Returns the version dir."""
    check_version(version)
    check_version(base_version)
    if version == base_version:
        raise ValueError(f"version {version!r} cannot be a delta on itself")
    base_fp = manifest_fingerprint(read_store_manifest(store, base_version))
    specs = store_tensor_specs(store, base_version)
    entries = []
    for name in sorted(changes):
        if name not in specs:
            raise ValueError(f"{name}: not a tensor of the store's {base_version!r}")
        tag, shape = specs[name]
        idx, data = _encode_change(name, changes[name], tag, shape)
        entries.append((name, tag, shape, idx, data))

    def fill(tmp):
        write_weight_delta(os.path.join(tmp, DELTA_FILE), entries)

    return _publish_version(store, version, fill, base_version=base_version, base_fingerprint=base_fp)


# ---------------------------------------------------------------------------------------------
# ipc: the port's delta record (fd/shm/ipc_weights.h IpcDeltaHeader; docs/weight_streams.md,
# "Over ipc publishes")
# ---------------------------------------------------------------------------------------------

IPC_DELTA_MAGIC = 0x314C444350494446
IPC_DELTA_ABI = 1
_DELTA_HEADER = struct.Struct("<QIIQQQ136s136s200x")  # 512 bytes; the payload follows
_GEN_OFFSET = 16
assert _DELTA_HEADER.size == 512


def ipc_delta_path(port):
    return f"/dev/shm/fdrollout.{port}.weights.delta"


def checkpoint_tensor_specs(model_dir):
    """{HF name: (dtype tag, shape)} of the safetensors checkpoint in `model_dir` (its
    model_state.* rollout snapshots left out)."""
    specs = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors") and not name.startswith("model_state."):
            header, _ = safetensors_np.read_header(os.path.join(model_dir, name))
            specs.update({k: (v["dtype"], [int(d) for d in v["shape"]]) for k, v in header.items() if k != "__metadata__"})
    return specs


def write_ipc_delta_record(port, version, base_version, payload, magic=IPC_DELTA_MAGIC, abi=IPC_DELTA_ABI):
    """Write `payload` (weights.fddelta bytes) into the port's delta record under its seqlock
    (generation odd while written, then the next even value), unchecked: publish_ipc_delta checks
    first; tests call this directly to write records the daemon must refuse. Returns the new
    generation."""
    total = (_DELTA_HEADER.size + len(payload) + 4095) // 4096 * 4096
    fd = open_record(ipc_delta_path(port))
    try:
        gen = 0
        if os.fstat(fd).st_size >= _DELTA_HEADER.size:
            with mmap.mmap(fd, _DELTA_HEADER.size) as m:
                if struct.unpack_from("<Q", m, 0)[0] == IPC_DELTA_MAGIC:
                    gen = struct.unpack_from("<Q", m, _GEN_OFFSET)[0]
                    gen += gen % 2  # a publisher died mid-write: continue from the next even
                struct.pack_into("<Q", m, _GEN_OFFSET, gen + 1)  # odd: being written
                m.flush()
        if os.fstat(fd).st_size < total:  # grow only, as the weight records
            os.ftruncate(fd, total)
        with mmap.mmap(fd, total) as m:
            m[:_DELTA_HEADER.size] = _DELTA_HEADER.pack(magic, abi, 0, gen + 1, len(payload), total, version.encode(),
                                                        base_version.encode())
            m[_DELTA_HEADER.size:_DELTA_HEADER.size + len(payload)] = payload
            struct.pack_into("<Q", m, _GEN_OFFSET, gen + 2)  # even: complete
            m.flush()
    finally:
        os.close(fd)
    return gen + 2


def publish_ipc_delta(changes, port, version, base_version, template_dir):
    """Publish version `version` for the rollout on `port` (--load-strategy ipc) as a delta on
    `base_version`, into /dev/shm/fdrollout.<port>.weights.delta (mode 0600, one record for all
    ranks: the rollout splits it by its own layout).

    `changes` as publish_rsync_delta: {HF name: (indices, values)} (flat element indices into the
    HF tensor, sorted, unique, in [0, numel)) or {HF name: array} (the tensor in full); tensors
    not named keep the base's bytes. `template_dir`: the rollout's --model checkpoint (the HF
    names, dtypes and shapes it holds; values are cast to its dtypes). Then
    `update_weights {"version": version}` applies it in place: 409 unless the rollout serves
    exactly `base_version`, loaded from this port's weights records (publish_ipc) or ipc deltas on
    them. Raises ValueError naming the tensor (unknown name, bad indices, shape, non-finite value)
    before anything is written. Returns the record's new generation."""
    check_version(version)
    check_version(base_version)
    if version == base_version:
        raise ValueError(f"version {version!r} cannot be a delta on itself")
    specs = checkpoint_tensor_specs(template_dir)
    entries = []
    for name in sorted(changes):
        if name not in specs:
            raise ValueError(f"{name}: not a tensor of the checkpoint in {template_dir}")
        tag, shape = specs[name]
        idx, data = _encode_change(name, changes[name], tag, shape)
        entries.append((name, tag, shape, idx, data))
    return write_ipc_delta_record(port, version, base_version, weight_delta_bytes(entries))
