"""Publish trainer weights to fdrollout without C++: numpy only (Debian's python3-numpy).

The three layouts of docs/weight_sources.md, written atomically (a reader never sees half a
version, even if this process dies midway):

    import numpy as np
    from fdrollout import publish as fdpublish   # (scripts/fdpublish.py is a shim for this module)
    # HF (training) names -> float32 arrays, e.g. {k: v.float().cpu().numpy() for k, v in sd.items()}
    hf = fdpublish.load_checkpoint("/models/base")            # or your trainer's state dict
    cfg = fdpublish.load_config("/models/base")

    # rsync: a versioned store the rollout pulls with rsync (--load-strategy rsync)
    fdpublish.publish_rsync(hf, store="/data/store", version="42", template_dir="/models/base", dtype="BF16")
    # ipc_snapshot: per-rank files in the rollout's --model dir, in inference names
    fdpublish.publish_ipc_snapshot(fdpublish.to_rollout_names(hf, cfg), "/models/base", dtype="BF16")
    # a rollout on --tensor-parallel-size 2 --enable-expert-parallel: one file per rank, each with
    # only its experts (whole)
    for r in range(2):
        fdpublish.publish_ipc_snapshot(fdpublish.to_rollout_names(hf, cfg, tp=2, rank=r, expert_parallel=True),
                                       "/models/base", rank=r)
    # ipc: POSIX shared memory read by the rollout on --port 8000
    fdpublish.publish_ipc(fdpublish.to_rollout_names(hf, cfg), port=8000, version="42", dtype="BF16")

    # rsync, a delta on a published version (publish_delta.py): only the changed elements
    fdpublish.publish_rsync_delta({name: (indices, values)}, store="/data/store", version="43", base_version="42")
    # ipc, a delta on the version the rollout serves (HF names, any tp: one record per port)
    fdpublish.publish_ipc_delta({name: (indices, values)}, port=8000, version="43", base_version="42",
                                template_dir="/models/base")

then `fdctl pause && fdctl update-weights --version 42 && fdctl resume`.

`dtype` must match what the rollout holds (the dtype of its --model checkpoint; F16 models are
held as F32): "F32", "BF16" or "F16"; None keeps each array's dtype (float32 -> F32; a CPU torch
bfloat16 tensor -> BF16, widened exactly to F32 with dtype="F32"). A value may also be
(array, dtype) for one tensor.
"""
import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import re
import shutil
import stat
import struct

import numpy as np

from . import cuda_ipc, safetensors_np

VERSION_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")  # no leading '.': the store's and staging dir's own names
STORE_FORMAT = "fdrollout-store/1"


def check_version(version):
    """A version names a directory of the store: [A-Za-z0-9._-]{1,128}, never starting with '.'."""
    if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
        raise ValueError(f"version {version!r} must match [A-Za-z0-9._-]{{1,128}} and not start with '.'")


def load_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def load_checkpoint(model_dir):
    """Every tensor of an HF checkpoint dir as float32 arrays, by HF name."""
    out = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors") and not name.startswith("model_state."):
            out.update(safetensors_np.load_file(os.path.join(model_dir, name)))
    return out


# ---------------------------------------------------------------------------------------------
# Inference names (what RolloutModel / `fdctl model-info` print)
# ---------------------------------------------------------------------------------------------

def _dims(cfg):
    h = cfg["hidden_size"]
    n_heads = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_heads)
    qwen3 = cfg.get("architectures", [""])[0] == "Qwen3ForCausalLM"
    head_dim = cfg.get("head_dim") or (128 if qwen3 else h // n_heads)  # Qwen3Config's default is 128
    # A Qwen-MoE model whose layers are all sparse may omit intermediate_size (its experts' width is
    # moe_intermediate_size, checked per expert).
    return h, n_heads * head_dim, n_kv * head_dim, cfg.get("intermediate_size", 0), cfg["vocab_size"]


def n_experts(cfg):
    """num_experts (Mixtral: num_local_experts) of an HF config; 0 for a dense model."""
    mixtral = cfg.get("architectures", [""])[0] == "MixtralForCausalLM"
    return int(cfg.get("num_local_experts" if mixtral else "num_experts", 0) or 0)


def rank_experts(cfg, tp=1, rank=0, expert_parallel=False):
    """The experts range(begin, end) of each sparse layer that `rank` of `tp` holds: all of them
    without expert parallelism, [rank*E/tp, (rank+1)*E/tp) with it (the daemon's
    --enable-expert-parallel; fd/checkpoint/layout.h rank_experts). ValueError on a dense model
    or when tp does not divide the experts (naming both numbers)."""
    e = n_experts(cfg)
    if not expert_parallel:
        return range(0, e)
    if e == 0:
        raise ValueError(f"expert parallel needs a mixture-of-experts model; {cfg.get('architectures', ['?'])[0]} is dense "
                         "(no num_experts)")
    if e % tp:
        raise ValueError(f"num_experts = {e} is not divisible by the expert parallel size {tp} (tp with expert_parallel)")
    return range(rank * e // tp, (rank + 1) * e // tp)


_V5_MIXTRAL = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.(?:gate_up_proj|down_proj)|experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj)\.weight)$")
_V5_LEAF = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def v4_names(hf, cfg):
    """`hf` under the names the rollout maps from: transformers v5 calls Mixtral's sparse block
    `mlp` (mlp.gate, and the stacked mlp.experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I]);
    v4 and the rollout call it block_sparse_moe (experts' w1 | w3, w2). Other models unchanged.
    ValueError naming layer and expert when a tensor is given under both names."""
    if cfg.get("architectures", [""])[0] != "MixtralForCausalLM":
        return hf
    out = {}
    for k, v in hf.items():
        m = _V5_MIXTRAL.match(k)
        if m:
            if m.group(3) is not None:
                k = f"{m.group(1)}.block_sparse_moe.experts.{m.group(3)}.{_V5_LEAF[m.group(4)]}.weight"
            else:
                k = f"{m.group(1)}.block_sparse_moe.{m.group(2)}"
            if k in hf or k in out:
                raise ValueError(f"{k}: given twice, under its v4 name and transformers v5's")
        out[k] = v
    return out


def _moe_block(hf, cfg, p, rows, cols, cat, like, arr, experts, whole):
    """A sparse MoE layer's rollout tensors (docs/architectures.md, "Mixture of experts"): the
    router whole, each of `experts`' gate|up rows and down columns sliced like the dense MLP
    (`whole`: expert parallel, each expert and the shared expert whole), Qwen2-MoE's shared expert
    and gate. Experts per expert or stacked (experts.gate_up_proj [E, 2I, H])."""
    mixtral = cfg["architectures"][0] == "MixtralForCausalLM"
    b = p + ("block_sparse_moe." if mixtral else "mlp.")
    if whole:
        rows = cols = lambda v, n: v  # noqa: E731  (expert parallel: no expert is sliced)
    g, u, d = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    fused = "w13" if mixtral else "gate_up_proj"
    out = {b + "gate.weight": hf[b + "gate.weight"]}
    stacked = next((b + "experts." + n for n in ("gate_up_proj", "gate_up_proj.weight") if b + "experts." + n in hf), None)
    for e in experts:
        x = f"{b}experts.{e}."
        if stacked:
            gu = arr(hf[stacked])[e]
            half = gu.shape[0] // 2
            gate, up = like(hf[stacked], gu[:half]), like(hf[stacked], gu[half:])
            down_key = stacked.replace("gate_up_proj", "down_proj")
            down = like(hf[down_key], arr(hf[down_key])[e])
        else:
            gate, up, down = hf[x + g + ".weight"], hf[x + u + ".weight"], hf[x + d + ".weight"]
        mf = arr(gate).shape[0]
        out[x + fused + ".weight"] = cat(rows(gate, mf), rows(up, mf))
        out[x + d + ".weight"] = cols(down, mf)
    if b + "shared_expert.gate_proj.weight" in hf:
        s = b + "shared_expert."
        sf = arr(hf[s + "gate_proj.weight"]).shape[0]
        out[s + "gate_up_proj.weight"] = cat(rows(hf[s + "gate_proj.weight"], sf), rows(hf[s + "up_proj.weight"], sf))
        out[s + "down_proj.weight"] = cols(hf[s + "down_proj.weight"], sf)
        out[b + "shared_expert_gate.weight"] = hf[b + "shared_expert_gate.weight"]
    return out


def to_rollout_names(hf, cfg, tp=1, rank=0, expert_parallel=False):
    """HF-named tensors -> the rollout's state dict for `rank` of `tp` (docs/weight_sources.md):
    q|k|v fused into qkv_proj, gate|up into gate_up_proj, sharded Megatron-style when tp > 1,
    lm_head dropped when the embeddings are tied. Values keep their (array, dtype) form.
    numpy arrays or torch tensors (CPU or CUDA: fused and column-sliced results are new
    contiguous tensors on the same device, which publish_ipc can hand over by CUDA IPC; keep
    the returned dict alive until the update returned).
    `expert_parallel` (a rollout started with --enable-expert-parallel): each sparse layer keeps
    only this rank's experts (rank_experts), each whole; attention and the rest stay tp-sliced."""
    h, q_dim, kv_dim, ff, vocab = _dims(cfg)
    experts = rank_experts(cfg, tp, rank, expert_parallel)
    hf = v4_names(hf, cfg)
    if expert_parallel and cfg["architectures"][0] == "MixtralForCausalLM":
        ff = 0  # Mixtral's intermediate_size is its experts' width: whole under expert parallelism
    for what, n in (("q_dim", q_dim), ("kv_dim", kv_dim), ("intermediate_size", ff), ("vocab_size", vocab)):
        if n % tp:
            raise ValueError(f"{what} {n} is not divisible by tp {tp}")

    def arr(v):
        return v[0] if isinstance(v, tuple) else v

    def like(v, a):
        return (a, v[1]) if isinstance(v, tuple) else a

    def rows(v, n):  # this rank's slice of dim 0 (n rows in total)
        a = arr(v)
        return like(v, a[rank * n // tp:(rank + 1) * n // tp])

    def cols(v, n):
        a = arr(v)
        s = a[:, rank * n // tp:(rank + 1) * n // tp]
        return like(v, s.contiguous() if safetensors_np.is_torch(s) else s)  # torch: publish_ipc takes contiguous CUDA tensors

    def cat(*vs):
        xs = [arr(v) for v in vs]
        if safetensors_np.is_torch(xs[0]):
            import torch
            return like(vs[0], torch.cat(xs, 0))
        return like(vs[0], np.concatenate(xs, axis=0))

    out = {}
    n_layers = cfg["num_hidden_layers"]
    out["model.embed_tokens.weight"] = rows(hf["model.embed_tokens.weight"], vocab)
    # MiMo's MTP layers (model.mtp_layers.N.*, num_nextn_predict_layers) are part of the state
    # dict: a decoder block like the others plus their own norms and input_proj (replicated).
    n_mtp = cfg.get("num_nextn_predict_layers", 0) if cfg.get("architectures", [""])[0] == "MiMoForCausalLM" else 0
    blocks = [f"model.layers.{i}." for i in range(n_layers)] + [f"model.mtp_layers.{m}." for m in range(n_mtp)]
    for p in blocks:
        out[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        a = p + "self_attn."
        out[a + "qkv_proj.weight"] = cat(rows(hf[a + "q_proj.weight"], q_dim), rows(hf[a + "k_proj.weight"], kv_dim),
                                         rows(hf[a + "v_proj.weight"], kv_dim))
        if a + "q_proj.bias" in hf:
            out[a + "qkv_proj.bias"] = cat(rows(hf[a + "q_proj.bias"], q_dim), rows(hf[a + "k_proj.bias"], kv_dim),
                                           rows(hf[a + "v_proj.bias"], kv_dim))
        for norm in ("q_norm.weight", "k_norm.weight"):  # Qwen3: per-head, replicated
            if a + norm in hf:
                out[a + norm] = hf[a + norm]
        out[a + "o_proj.weight"] = cols(hf[a + "o_proj.weight"], q_dim)
        m = p + "mlp."
        if m + "gate_proj.weight" in hf:
            out[m + "gate_up_proj.weight"] = cat(rows(hf[m + "gate_proj.weight"], ff), rows(hf[m + "up_proj.weight"], ff))
            out[m + "down_proj.weight"] = cols(hf[m + "down_proj.weight"], ff)
        else:
            out.update(_moe_block(hf, cfg, p, rows, cols, cat, like, arr, experts, expert_parallel))
    out["model.norm.weight"] = hf["model.norm.weight"]
    for m in range(n_mtp):
        p = f"model.mtp_layers.{m}."
        for leaf in ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight"):
            out[p + leaf] = hf[p + leaf]
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = rows(hf["lm_head.weight"], vocab)
    return out


# ---------------------------------------------------------------------------------------------
# rsync store
# ---------------------------------------------------------------------------------------------

def _sha256_file(path, start=0, length=None, chunk=8 << 20):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = length
        while left is None or left > 0:
            b = f.read(chunk if left is None else min(chunk, left))
            if not b:
                break
            h.update(b)
            if left is not None:
                left -= len(b)
    return h.hexdigest()


def _fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def write_manifest(version_dir, version, base_version=None, base_fingerprint=None):
    """Hash every file (and every tensor of every .safetensors file) of `version_dir` into
    manifest.json (docs/weight_sources.md); a delta version also records its `base_version` and
    that version's `base_fingerprint` (manifest_fingerprint). Returns the manifest dict."""
    files, tensors = {}, {}
    for name in sorted(os.listdir(version_dir)):
        path = os.path.join(version_dir, name)
        if name == "manifest.json" or not os.path.isfile(path):
            continue
        files[name] = {"size": os.path.getsize(path), "sha256": _sha256_file(path)}
        if name.endswith(".safetensors"):
            header, data_start = safetensors_np.read_header(path)
            for t, info in header.items():
                if t == "__metadata__":
                    continue
                b, e = info["data_offsets"]
                tensors[t] = {"file": name, "sha256": _sha256_file(path, data_start + b, e - b)}
    manifest = {"format": STORE_FORMAT, "version": version, "files": files, "tensors": tensors}
    if base_version is not None:
        manifest.update(base_version=base_version, base_fingerprint=base_fingerprint)
    with open(os.path.join(version_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def _tag_of(value, dtype):
    """The safetensors dtype tag `value` would be stored as (without converting it)."""
    arr, dt = value if isinstance(value, tuple) else (value, dtype)
    arr, tag = safetensors_np.from_torch(arr)
    if tag is not None:  # torch bfloat16: stored as BF16 unless dtype= says another float
        return dt or tag
    if dt is not None and arr.dtype.kind == "f":
        return dt
    return safetensors_np._TAG.get(arr.dtype.newbyteorder("="), str(arr.dtype))


def check_dtypes_like(tensors, model_dir, dtype=None):
    """Raise ValueError naming the first tensor whose stored dtype would differ from the same
    tensor in `model_dir`'s checkpoint (the rollout would refuse it with 422)."""
    held = {}
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors") and not name.startswith("model_state."):
            header, _ = safetensors_np.read_header(os.path.join(model_dir, name))
            held.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
    for name in sorted(tensors):
        if name in held and _tag_of(tensors[name], dtype) != held[name]:
            raise ValueError(f"{name}: would be published as {_tag_of(tensors[name], dtype)}, but {model_dir} holds "
                             f"{held[name]} (pass dtype={held[name]!r})")


# The non-weight files of a checkpoint version (as fd::weights::store::is_checkpoint_file):
# what a published version holds besides its *.safetensors; README.md, LICENSE etc. stay out.
CHECKPOINT_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                    "chat_template.jinja", "chat_template.json"}


def _publish_version(store, version, fill, base_version=None, base_fingerprint=None):
    """Write version `version` of `store` atomically: `fill(tmp_dir)` writes its files into a
    private temp dir, the manifest is written last, the dir renamed into place, then `latest`."""
    os.makedirs(store, exist_ok=True)
    mode = os.stat(store).st_mode
    if stat.S_ISDIR(mode) and mode & stat.S_IWOTH:  # as fdctl publish: anyone could forge a version or `latest` there
        raise PermissionError(f"the store {store} is writable by every user (mode {stat.S_IMODE(mode):04o}); chmod o-w it; nothing was published")
    # The store's own names (as fdctl's store writer): a version called "latest" became a dir that
    # every later publish failed to rename `latest` over (a probe).
    if version == "latest" or version.startswith("latest.tmp-") or version.startswith(".tmp-"):
        raise ValueError(f"version {version!r} is reserved in the store layout; pick another name")
    final = os.path.join(store, version)
    if os.path.exists(final):
        raise FileExistsError(f"{final} exists: versions are immutable, publish a new one")
    for name in os.listdir(store):  # publishes of dead processes (versions and `latest`)
        m = re.match(r"^(?:\.tmp-.*|latest\.tmp)-(\d+)$", name)
        if m and not _pid_alive(int(m.group(1))):
            path = os.path.join(store, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
    tmp = os.path.join(store, f".tmp-{version}-{os.getpid()}")
    os.makedirs(tmp)
    try:
        fill(tmp)
        for name in os.listdir(tmp):
            _fsync_path(os.path.join(tmp, name))
        write_manifest(tmp, version, base_version, base_fingerprint)
        _fsync_path(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_path(store)
    latest_tmp = os.path.join(store, f"latest.tmp-{os.getpid()}")
    try:
        with open(latest_tmp, "w") as f:
            f.write(version + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(store, "latest"))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(latest_tmp)
        raise
    return final


def publish_rsync(tensors, store, version, template_dir, dtype=None):
    """Write `tensors` (HF names) as version `version` of the rsync store `store`: an HF
    checkpoint dir (model.safetensors + the config, tokenizer and generation-config files of `template_dir`, version.yaml
    `step: version`) with manifest.json written last, renamed into place, then `latest`.
    Versions are immutable. Raises FileExistsError if the version exists, ValueError if a
    tensor's dtype differs from `template_dir`'s checkpoint (nothing is written then).
    Returns the version dir."""
    check_version(version)
    check_dtypes_like(tensors, template_dir, dtype)

    def fill(tmp):
        for name in sorted(os.listdir(template_dir)):
            src = os.path.join(template_dir, name)
            if name not in CHECKPOINT_FILES:
                continue
            # as fdctl publish: a regular file after following links, else an error naming it (never
            # left out); the copy never more readable than its source (0644 at most)
            try:
                st = os.stat(src)
            except OSError as e:
                raise ValueError(f"{src}: a checkpoint file that cannot be read ({e.strerror}); nothing was published") from e
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{src}: a checkpoint file that is not a regular file; nothing was published")
            dst = os.path.join(tmp, name)
            shutil.copyfile(src, dst)
            os.chmod(dst, (st.st_mode & 0o644) | 0o600)
        with open(os.path.join(tmp, "version.yaml"), "w") as f:
            f.write(f"step: {version}\n")
        safetensors_np.save_file(tensors, os.path.join(tmp, "model.safetensors"), dtype=dtype)

    return _publish_version(store, version, fill)


# ---------------------------------------------------------------------------------------------
# ipc_snapshot
# ---------------------------------------------------------------------------------------------

def publish_ipc_snapshot(tensors, model_dir, rank=0, dtype=None):
    """Write `tensors` (inference names, this rank's shards) to
    `model_dir`/model_state.tp{rank}.safetensors (via a .tmp file and a rename). Stale
    model_state.tp{rank}.part*.safetensors files are removed first, since parts take precedence."""
    for name in os.listdir(model_dir):
        if re.match(rf"^model_state\.tp{rank}\.part\d+\.safetensors$", name):
            os.remove(os.path.join(model_dir, name))
    path = os.path.join(model_dir, f"model_state.tp{rank}.safetensors")
    safetensors_np.save_file(tensors, path, dtype=dtype)
    return path


# ---------------------------------------------------------------------------------------------
# ipc (POSIX shared memory; layout of shm/include/fd/shm/ipc_weights.h)
# ---------------------------------------------------------------------------------------------

IPC_MAGIC = 0x5043494457524446
IPC_ABI = 1
IPC_DTYPES = {"F32": 0, "BF16": 1, "F16": 2}
IPC_INLINE, IPC_CUDA = 0, 1                   # IpcLocation
_HEADER = struct.Struct("<QIIQ136siiQQ72x")   # 256 bytes
_ENTRY = struct.Struct("<192sIIII4qQQ64s")    # 320 bytes
_GEN_OFFSET = 16
assert _HEADER.size == 256 and _ENTRY.size == 320


def open_record(path):
    """Open the shared-memory record `path` for writing, creating it with mode 0600: never
    through a symlink (O_NOFOLLOW), and only an object of this user that nobody else may open,
    as the daemon requires of what it reads (another local user's planted object or link would
    otherwise get the weights, or have a root publisher overwrite the file it points to). Returns
    the fd. Raises PermissionError naming the owner and mode (remove the object), OSError(ELOOP)
    for a symlink."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:  # as fdctl (exit 13): a link is never followed
            raise PermissionError(f"{path} is a symbolic link, which is never followed: remove it") from e
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(f"{path} is owned by uid {st.st_uid} with mode {st.st_mode & 0o7777:o}, not a record of this user "
                              f"(uid {os.geteuid()}, mode 600): refusing to write weights into it; remove it")
    # One publisher per record at a time (fdctl takes the same lock): two at once interleaved their
    # bytes under one even generation, served under one label (a probe). Held until fd closes.
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        os.close(fd)
        raise BlockingIOError(errno.EWOULDBLOCK, f"another publisher is writing {path} (one publisher per port at a time); "
                                                 "nothing was written: retry when it is done") from e
    return fd


def ipc_path(port, rank=0):
    return f"/dev/shm/fdrollout.{port}.weights.tp{rank}"


def publish_ipc(tensors, port, version, rank=0, tp_size=1, dtype=None):
    """Publish `tensors` (inference names) into /dev/shm/fdrollout.<port>.weights.tp<rank>.

    The record's generation is odd while this writes and moves to the next even value when the
    publish is complete, so the rollout never consumes a half-written publish; the rollout
    copies the data, so the caller may publish again as soon as update_weights returned. The
    port's ipc delta record (publish_ipc_delta), if any, is removed: a full publish supersedes it.

    A torch CUDA tensor is published as its CUDA IPC handle (location kIpcCudaIpc;
    fdrollout.cuda_ipc): no bytes leave the GPU here, and the rollout copies it device to device
    (or to host for a CPU rank). Such tensors must be contiguous, in the dtype the model holds
    (`dtype` does not cast them), and stay alive and unchanged until update_weights returned.
    Other torch tensors are copied as numpy arrays (bfloat16: BF16, or widened with dtype="F32").
    Returns the new generation.
    Errors  ValueError naming a tensor that cannot be published (dtype, name, rank > 4)."""
    check_version(version)
    encoded = []
    for name in sorted(tensors):
        value = tensors[name]
        arr, dt = value if isinstance(value, tuple) else (value, dtype)
        if len(name.encode()) >= 192:
            raise ValueError(f"{name}: name too long")
        if cuda_ipc.is_cuda_tensor(arr):
            handle, off, nbytes, tag, shape = cuda_ipc.ipc_handle(name, arr)
            if dt is not None and dt != tag:
                raise ValueError(f"{name}: a CUDA tensor is published in its own dtype {tag}; cast it on the device first (and keep it alive)")
            if len(shape) > 4:
                raise ValueError(f"{name}: more than 4 dims")
            encoded.append((name, tag, (handle, off, nbytes, shape)))
            continue
        tag, data = safetensors_np._encode(arr, dt)
        if tag not in IPC_DTYPES:
            raise ValueError(f"{name}: dtype {tag} cannot be published (F32, BF16, F16)")
        if data.ndim > 4:
            raise ValueError(f"{name}: more than 4 dims")
        encoded.append((name, tag, data))
    table_end = _HEADER.size + _ENTRY.size * len(encoded)
    offset = (table_end + 4095) // 4096 * 4096
    entries, data_bytes = [], 0
    for name, tag, data in encoded:
        if isinstance(data, tuple):  # a CUDA IPC entry: its handle and the offset in that allocation, no bytes here
            handle, off, nbytes, shape = data
            entries.append(_ENTRY.pack(name.encode(), IPC_DTYPES[tag], IPC_CUDA, len(shape), 0, *(shape + [0] * (4 - len(shape))),
                                       off, nbytes, handle))
            data_bytes += nbytes
            continue
        shape = list(data.shape) + [0] * (4 - data.ndim)
        entries.append(_ENTRY.pack(name.encode(), IPC_DTYPES[tag], IPC_INLINE, data.ndim, 0, *shape, offset, data.nbytes, b""))
        offset = (offset + data.nbytes + 63) // 64 * 64
        data_bytes += data.nbytes
    total = offset
    path = ipc_path(port, rank)
    fd = open_record(path)
    try:
        gen = 0
        if os.fstat(fd).st_size >= _HEADER.size:
            with mmap.mmap(fd, _HEADER.size) as m:
                magic, abi = struct.unpack_from("<QI", m, 0)
                if magic == IPC_MAGIC and abi == IPC_ABI:
                    gen = struct.unpack_from("<Q", m, _GEN_OFFSET)[0]
                    gen += gen % 2  # a publisher died mid-write: continue from the next even
                struct.pack_into("<Q", m, _GEN_OFFSET, gen + 1)  # odd: being written
                m.flush()
        if os.fstat(fd).st_size < total:  # grow only: a reader of the previous generation never reads past the end (docs)
            os.ftruncate(fd, total)
        with mmap.mmap(fd, total) as m:
            header = _HEADER.pack(IPC_MAGIC, IPC_ABI, len(encoded), gen + 1, version.encode(), rank, tp_size, total, data_bytes)
            m[:_HEADER.size] = header
            pos = _HEADER.size
            for e in entries:
                m[pos:pos + _ENTRY.size] = e
                pos += _ENTRY.size
            for (name, tag, data), e in zip(encoded, entries):
                if isinstance(data, tuple):
                    continue  # on the GPU: the rollout copies it through the handle
                off = _ENTRY.unpack(e)[9]
                m[off:off + data.nbytes] = data.tobytes()
            struct.pack_into("<Q", m, _GEN_OFFSET, gen + 2)  # even: complete
            m.flush()
    finally:
        os.close(fd)
    try:  # a full publish supersedes the port's delta record (publish_ipc_delta)
        os.unlink(f"/dev/shm/fdrollout.{port}.weights.delta")
    except FileNotFoundError:
        pass
    return gen + 2


# Delta versions of the rsync store (publish_delta.py), importable from here and from the
# scripts/fdpublish.py shim as before.
from .publish_delta import (manifest_fingerprint, publish_rsync_delta, write_weight_delta,  # noqa: E402,F401
                            ipc_delta_path, publish_ipc_delta)
