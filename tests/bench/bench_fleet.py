"""Fleet update latency (issue #13): `fdctl --hosts ... update-weights` (stage everywhere, commit
everywhere, verify) on 1, 2 and 4 daemons on loopback, each fed from one rsync store (a local
path), divided by a single-daemon `fdctl update-weights` measured in the same run on the same
daemons. Prints one JSON object (docs/benchmarks.md, "Fleet update").

Usage: /usr/bin/python3 tests/bench/bench_fleet.py [--model DIR] [--sizes 1,2,4] [--reps 5]
       [--bigger]   (also a random 4-layer 512-hidden F32 checkpoint, ~30 MB)
       [--with-1b]  (also the random TinyLlama-1.1B-shaped BF16 checkpoint, 2.2 GB, written into the
                     temp dir by scripts/make_random_checkpoint.py and deleted after; a fleet size
                     whose daemons would not fit MemAvailable (2 copies of the weights per daemon
                     between stage and commit, --mem-margin-gib to spare) is skipped and reported so)
       [--sizes-1b 1,2,4] [--ckpt-1b A,B]  (fleet sizes for it; two existing checkpoint dirs instead)
       [--staging persistent|transient]  (the daemons' --update-staging; default transient: a
                     daemon holds its staged copy only from stage to commit, so the fleet's peak is
                     n x 2 x weights for the seconds of an update, not for the whole run)

Memory (why 4 x 1.1B needs care on a small machine): during a fleet update every daemon holds its
serving weights and the staged copy until the fleet-wide commit (that is what makes the update
all-or-nothing), so the peak is n x 2 x weights of anonymous memory. The pulled copies of the
version are hard links into the local store (rsync --link-dest), so they add no disk writes and no
page cache beyond the store's one copy. Each run reports the daemons' summed peak RSS (VmHWM)."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from fdtest import copy_checkpoint, Daemon, fdctl, make_checkpoint, perturbed, STORIES  # noqa: E402


def timed(*args):
    t0 = time.perf_counter()
    rc, out, err = fdctl(0, *args, timeout=600)
    dt = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"fdctl {args} -> {rc}: {err}")
    return dt


def mem_available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def hwm_bytes(pid):
    """VmHWM (peak resident) of a process, in bytes (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def bench_model(name, model, sizes, reps, tmp, other=None, staging="transient", margin_gib=2.0):
    store = os.path.join(tmp, f"store-{name}")
    other = other or perturbed(model, os.path.join(tmp, f"{name}-b"), seed=1)
    for v, src in (("va", model), ("vb", other)):
        rc, _, err = fdctl(0, "publish", "--strategy", "rsync", "--from", src, "--store", store, "--version", v, timeout=600)
        assert rc == 0, err
    size_bytes = sum(os.path.getsize(os.path.join(store, "va", f)) for f in os.listdir(os.path.join(store, "va")))
    rows = []
    for n in sizes:
        need = n * 2 * size_bytes + int(margin_gib * 2**30)  # serving + staged copy per daemon, a margin for other processes
        if need > mem_available_bytes():
            rows.append({"daemons": n, "skipped": f"needs ~{need / 2**30:.1f} GiB, MemAvailable {mem_available_bytes() / 2**30:.1f} GiB"})
            continue
        daemons = []
        try:
            for i in range(n):
                cfg = {"source": store, "staging_dir": os.path.join(tmp, f"staging-{name}-{n}-{i}")}
                daemons.append(Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", json.dumps(cfg),
                                      "--threads", "1", "--kv-cache-bytes", "64MiB", "--max-model-len", "512",
                                      "--update-staging", staging, model=model, timeout=300))
            hosts = ",".join(f"127.0.0.1:{d.port}" for d in daemons)
            timed("--hosts", hosts, "pause")
            single, fleet = [], []
            versions = ["va", "vb"]
            timed("--hosts", hosts, "update-weights", "--version", "vb")  # warm-up: staging arenas faulted in
            for r in range(reps):
                v = versions[r % 2]
                single.append(timed("--transport", "v1", "--url", f"http://127.0.0.1:{daemons[0].port}", "update-weights", "--version", v))
                fleet.append(timed("--hosts", hosts, "update-weights", "--version", v))
            rows.append({"daemons": n, "single_s_median": statistics.median(single), "fleet_s_median": statistics.median(fleet),
                         "ratio_fleet_over_single": statistics.median(fleet) / statistics.median(single),
                         "single_s": single, "fleet_s": fleet,
                         "peak_rss_sum_gib": sum(hwm_bytes(d.proc.pid) for d in daemons) / 2**30,
                         "rss_sum_at_end_gib": sum(d.rss() for d in daemons) / 2**30,
                         "mem_available_at_end_gib": mem_available_bytes() / 2**30,
                         "pulls_hard_linked": sum(d.output().count("hard-linked from the local store") for d in daemons),
                         "pulls_copied": sum(d.output().count(", copied) in ") for d in daemons)})
        finally:
            for d in daemons:
                d.__exit__(None)
    return {"model": name, "checkpoint_bytes": size_bytes, "update_staging": staging, "runs": rows}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=STORIES)
    p.add_argument("--skip-default", action="store_true", help="only the --with-1b model")
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--bigger", action="store_true")
    p.add_argument("--with-1b", action="store_true")
    p.add_argument("--sizes-1b", default="1,2,4")
    p.add_argument("--staging", default="transient", choices=["persistent", "transient"])
    p.add_argument("--mem-margin-gib", type=float, default=2.0, help="MemAvailable to leave to other processes at the peak")
    p.add_argument("--ckpt-1b", default="")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    tmp = tempfile.mkdtemp(prefix="fd-fleet-bench-")
    try:
        out = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
               "load_avg_at_start": os.getloadavg()[0], "models": []}
        if not a.skip_default:
            model = copy_checkpoint(a.model, os.path.join(tmp, "m"))
            out["models"].append(bench_model(os.path.basename(a.model.rstrip("/")), model, sizes, a.reps, tmp, staging=a.staging,
                                             margin_gib=a.mem_margin_gib))
        if a.bigger:
            big = make_checkpoint(os.path.join(tmp, "big"), "--hidden", "512", "--intermediate", "1376", "--layers", "4",
                                  "--heads", "8", "--vocab", "512")
            out["models"].append(bench_model("random-512x4", big, sizes, a.reps, tmp, staging=a.staging, margin_gib=a.mem_margin_gib))
        if a.with_1b:
            if a.ckpt_1b:
                b1, b2 = a.ckpt_1b.split(",")
            else:
                b1 = make_checkpoint(os.path.join(tmp, "1b"), "--preset", "llama-1b-bf16-sharded", "--seed", "1")
                b2 = make_checkpoint(os.path.join(tmp, "1b-b"), "--preset", "llama-1b-bf16-sharded", "--seed", "2")
            sizes_1b = [int(s) for s in a.sizes_1b.split(",")]
            out["models"].append(bench_model("random-llama-1.1b-bf16", b1, sizes_1b, a.reps, tmp, other=b2, staging=a.staging,
                                             margin_gib=a.mem_margin_gib))
        out["load_avg_at_end"] = os.getloadavg()[0]
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
