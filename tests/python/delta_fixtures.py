"""Weight changes shared by the delta tests (tests/python/test_{delta_stream,rsync_delta,
ipc_delta}.py) and benches (tests/bench/{delta_stream,rsync_delta}_bench.py), issue 25: sparse
changes of a checkpoint's tensors and the (indices, values) delta between two versions.
Importers put tests/e2e and python/ on sys.path first (fdrollout.changed_elements)."""
import numpy as np

from fdrollout import changed_elements

NAME = "model.layers.0.mlp.down_proj.weight"   # [64, 172]: split by columns at tp=2
QKV = "model.layers.1.self_attn.k_proj.weight"  # fused into qkv by the rollout


def sparse_change(base, fraction, seed):
    """`base` with `fraction` of the elements of every other tensor (and NAME, QKV) set to new
    values (the rest bit for bit the same); tensors left alone keep every bit."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, (name, a) in enumerate(sorted(base.items())):
        b = a.copy()
        if i % 2 == 0 or name in (NAME, QKV):
            flat = b.reshape(-1)
            k = max(1, int(flat.size * fraction))
            idx = rng.choice(flat.size, size=k, replace=False)
            flat[idx] = (flat[idx] + rng.normal(0, 0.1 * (float(a.std()) + 1e-3), k)).astype(a.dtype)
        out[name] = b
    return out


def delta_of(old, new):
    """{name: (indices, values)} of the elements of `new` that differ from `old` (tensors with none left out)."""
    out = {}
    for name in sorted(new):
        idx, vals = changed_elements(old[name], new[name])
        if idx.size:
            out[name] = (idx, vals)
    return out


def changed_everywhere(base, fraction, seed):
    """(base with `fraction` of EVERY tensor's elements changed, {name: (indices, values)}): the
    benches' delta of a training step."""
    rng = np.random.default_rng(seed)
    out, deltas = {}, {}
    for name, a in sorted(base.items()):
        b = a.copy()
        flat = b.reshape(-1)
        k = max(1, int(round(flat.size * fraction)))
        idx = rng.choice(flat.size, size=k, replace=False)
        flat[idx] = (flat[idx] + np.float32(0.01) + rng.normal(0, 0.01, k)).astype(a.dtype)
        out[name] = b
        deltas[name] = changed_elements(a, b)
    return out, deltas


def sparse_delta_class(cls, prefix):
    """setUpClass of the delta suites (test_delta_stream, test_land_delta): cls.tmp, cls.base
    (stories260K's tensors), cls.new (sparse_change 1 %, seed 3), the references cls.ref_new and
    cls.ref_base (greedy (ids, logprobs) of fresh daemons at cls.TP_ARGS on each), cls.d (a daemon
    on stories260K, --dynamic-load-weight) and cls.c (its Client)."""
    import os
    import tempfile

    from fdtest import STORIES, Daemon, copy_checkpoint, fresh_daemon, greedy, rewrite_tensors
    from fdrollout import Client, safetensors_np
    cls.tmp = tempfile.mkdtemp(prefix=prefix)
    cls.base = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
    cls.new = sparse_change(cls.base, 0.01, seed=3)
    new_dir = os.path.join(cls.tmp, "new")
    rewrite_tensors(copy_checkpoint(STORIES, new_dir), lambda t: t.update({k: v.copy() for k, v in cls.new.items()}))
    with fresh_daemon(new_dir, *cls.TP_ARGS) as ref:
        cls.ref_new = greedy(ref)[:2]
    with fresh_daemon(STORIES, *cls.TP_ARGS) as ref:
        cls.ref_base = greedy(ref)[:2]
    assert cls.ref_new != cls.ref_base, "the sparse change must show in the greedy probe"
    cls.d = Daemon("--dynamic-load-weight", "--control-timeout-s", "20", *cls.TP_ARGS, model=STORIES, extra=False)
    cls.c = Client(f"127.0.0.1:{cls.d.port}", timeout=20)
