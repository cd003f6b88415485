"""rsync delta versions and ipc delta records (issue 25, docs/weight_sources.md "Delta versions",
docs/weight_streams.md "Over ipc publishes"): the time of a 1 % delta publish + update ÷ the time
of a full publish + update of the same model, into the same daemon, in one run; rsync through a
real `rsync --daemon` on loopback (default), ipc (`--strategy ipc`) through the port's shared-memory
weights records (publish_ipc, one per rank) and its delta record (publish_ipc_delta).

Each rep: a full version F (publish_rsync + pause / update_weights / resume, timed), a delta D1
on F with 1 % of every tensor's elements changed (publish_rsync_delta + update, timed: the first
delta after a full pull also copies the base from the store into the daemon's serving dir), a
delta D2 on D1 with another 1 % (timed: the steady state of a chain of deltas, written into the
same copy; with ipc both deltas cost the same: nothing is copied). The trainer's diff (which
elements changed) and, for ipc, the HF -> rollout-name conversion of the full weights are
computed before and not timed.
Reported per rep: each time split into publish and update, and D1 ÷ F, D2 ÷ F.

  /usr/bin/python3 tests/bench/rsync_delta_bench.py [--strategy rsync|ipc] [--reps 3] [--tp 2] [--bin B] > out.json
Figures are ratios within one run: the machine may be loaded by other jobs (load is recorded).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import Daemon, make_checkpoint  # noqa: E402
from test_rsync import RsyncDaemon  # noqa: E402
from fdrollout import Client, changed_elements, publish, safetensors_np  # noqa: E402
from delta_fixtures import changed_everywhere  # noqa: E402



def timed(c, publish_fn, version):
    t0 = time.perf_counter()
    publish_fn()
    t1 = time.perf_counter()
    c.pause()
    r = c.update_weights(version=version)
    c.resume()
    t2 = time.perf_counter()
    assert r["version"] == version, r
    return {"seconds": t2 - t0, "publish_s": t1 - t0, "update_s": t2 - t1}


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hidden", default="512")
    p.add_argument("--intermediate", default="1376")
    p.add_argument("--layers", default="8")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--bin", default=None, help="the daemon binary (default: FDROLLOUT_BIN or build/fdrollout)")
    p.add_argument("--strategy", choices=("rsync", "ipc"), default="rsync")
    a = p.parse_args()
    if a.strategy == "ipc":
        return main_ipc(a)
    tmp = tempfile.mkdtemp(prefix="fd-rsdelta-bench-")
    rsyncd = None
    try:
        model = make_checkpoint(os.path.join(tmp, "m"), "--hidden", a.hidden, "--intermediate", a.intermediate, "--layers", a.layers,
                                "--heads", "8", "--vocab", "512")
        w0 = safetensors_np.load_file(os.path.join(model, "model.safetensors"))
        w1, d1 = changed_everywhere(w0, 0.01, seed=1)
        _, d2 = changed_everywhere(w1, 0.01, seed=2)
        store = os.path.join(tmp, "store")
        os.makedirs(store)
        rsyncd = RsyncDaemon(tmp, {"store": store})
        out = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
               "load_avg_at_start": os.getloadavg()[0], "tp": a.tp, "model_bytes": sum(x.nbytes for x in w0.values()),
               "bin": a.bin, "runs": []}
        tp_args = ["--tensor-parallel-size", str(a.tp), "--threads", "1"] if a.tp > 1 else []
        kw = {"bin": a.bin} if a.bin else {}
        cfg = {"source": rsyncd.url(), "staging_dir": os.path.join(tmp, "staging"), "timeout_s": 300}
        with Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", json.dumps(cfg), "--control-timeout-s", "300",
                    *tp_args, model=model, extra=False, timeout=300, **kw) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=300)
            timed(c, lambda: publish.publish_rsync(w0, store, "warm", model), "warm")  # page-in, allocations
            for i in range(a.reps):
                f, v1, v2 = f"f{i}", f"d1-{i}", f"d2-{i}"
                run = {"full": timed(c, lambda: publish.publish_rsync(w0, store, f, model), f)}
                run["delta_first"] = timed(c, lambda: publish.publish_rsync_delta(d1, store, v1, f), v1)
                run["delta_chain"] = timed(c, lambda: publish.publish_rsync_delta(d2, store, v2, v1), v2)
                run["delta_bytes"] = os.path.getsize(os.path.join(store, v1, "weights.fddelta"))
                run["delta_first_over_full"] = run["delta_first"]["seconds"] / run["full"]["seconds"]
                run["delta_chain_over_full"] = run["delta_chain"]["seconds"] / run["full"]["seconds"]
                out["runs"].append(run)
                print(json.dumps(run), file=sys.stderr)
        out["median"] = {k: median([r[k] for r in out["runs"]]) for k in ("delta_first_over_full", "delta_chain_over_full")}
        for k in ("full", "delta_first", "delta_chain"):
            for part in ("seconds", "publish_s", "update_s"):
                out["median"][f"{k}_{part}"] = median([r[k][part] for r in out["runs"]])
        out["load_avg_at_end"] = os.getloadavg()[0]
        print(json.dumps(out, indent=1))
    finally:
        if rsyncd:
            rsyncd.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main_ipc(a):
    tmp = tempfile.mkdtemp(prefix="fd-ipcdelta-bench-")
    port = None
    try:
        model = make_checkpoint(os.path.join(tmp, "m"), "--hidden", a.hidden, "--intermediate", a.intermediate, "--layers", a.layers,
                                "--heads", "8", "--vocab", "512")
        cfg = publish.load_config(model)
        w0 = safetensors_np.load_file(os.path.join(model, "model.safetensors"))
        w1, d1 = changed_everywhere(w0, 0.01, seed=1)
        _, d2 = changed_everywhere(w1, 0.01, seed=2)
        shards = [publish.to_rollout_names(w0, cfg, tp=a.tp, rank=r) for r in range(a.tp)]
        out = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(), "strategy": "ipc",
               "load_avg_at_start": os.getloadavg()[0], "tp": a.tp, "model_bytes": sum(x.nbytes for x in w0.values()),
               "bin": a.bin, "runs": []}
        tp_args = ["--tensor-parallel-size", str(a.tp), "--threads", "1"] if a.tp > 1 else []
        kw = {"bin": a.bin} if a.bin else {}
        with Daemon("--dynamic-load-weight", "--load-strategy", "ipc", "--control-timeout-s", "300", *tp_args, model=model,
                    extra=False, timeout=300, **kw) as d:
            port = d.port
            c = Client(f"127.0.0.1:{port}", timeout=300)

            def full(version):
                for r in range(a.tp):
                    publish.publish_ipc(shards[r], port, version, rank=r, tp_size=a.tp)

            timed(c, lambda: full("warm"), "warm")  # page-in, allocations
            for i in range(a.reps):
                f, v1, v2 = f"f{i}", f"d1-{i}", f"d2-{i}"
                run = {"full": timed(c, lambda: full(f), f)}
                run["delta_first"] = timed(c, lambda: publish.publish_ipc_delta(d1, port, v1, f, model), v1)
                run["delta_bytes"] = os.path.getsize(publish.ipc_delta_path(port))
                run["delta_chain"] = timed(c, lambda: publish.publish_ipc_delta(d2, port, v2, v1, model), v2)
                run["delta_first_over_full"] = run["delta_first"]["seconds"] / run["full"]["seconds"]
                run["delta_chain_over_full"] = run["delta_chain"]["seconds"] / run["full"]["seconds"]
                out["runs"].append(run)
                print(json.dumps(run), file=sys.stderr)
        out["median"] = {k: median([r[k] for r in out["runs"]]) for k in ("delta_first_over_full", "delta_chain_over_full")}
        for k in ("full", "delta_first", "delta_chain"):
            for part in ("seconds", "publish_s", "update_s"):
                out["median"][f"{k}_{part}"] = median([r[k][part] for r in out["runs"]])
        out["load_avg_at_end"] = os.getloadavg()[0]
        print(json.dumps(out, indent=1))
    finally:
        if port is not None:
            for name in [f"fdrollout.{port}.weights.tp{r}" for r in range(a.tp)] + [f"fdrollout.{port}.weights.delta"]:
                try:
                    os.remove(os.path.join("/dev/shm", name))
                except FileNotFoundError:
                    pass
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
