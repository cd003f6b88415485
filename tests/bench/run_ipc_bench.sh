#!/usr/bin/env bash
# Copy-in bandwidth of the same-host weight sources (docs/weight_sources.md) and print its JSON.
#   tests/bench/run_ipc_bench.sh [BUILD_DIR] [MODEL_DIR]
#   (or FD_BENCH_MODEL=DIR; default BUILD_DIR/bench-models/llama-1b-bf16, made by
#    tests/bench/run_control_bench.sh; the model dir is only read, never written)
#
# For each of `ipc` and `ipc_snapshot`: start fdrollout (--threads 2, --kv-cache-bytes 256MiB,
# --dynamic-load-weight --load-strategy S), publish the checkpoint with fdctl publish, pause, and
# time POST /v1/update_weights (client wall clock, best of FD_BENCH_UPDATES=3). bytes = the
# checkpoint's tensor bytes (the update's "bytes"). The ratio divides bytes/s by this run's
# single-thread memcpy bandwidth (a numpy copy of 512 MiB, best of 5): target >= 0.8.
# ipc_snapshot publishes into a temp dir of symlinks to the model's files; ipc into
# /dev/shm/fdrollout.<port>.weights.tp0. Both are removed at the end. Needs ~7 GB of free memory
# for the 1B model (weights + staging + the published copy); about 1-2 minutes on 2 cores.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-build}"
case "$BUILD" in /*) ;; *) BUILD="$REPO/$BUILD" ;; esac
MODEL="${2:-${FD_BENCH_MODEL:-$BUILD/bench-models/llama-1b-bf16}}"
for bin in fdrollout fdctl; do
  if [[ ! -x "$BUILD/$bin" ]]; then echo "run_ipc_bench.sh: $BUILD/$bin not found; build first" >&2; exit 1; fi
done
if [[ ! -f "$MODEL/config.json" ]]; then
  echo "run_ipc_bench.sh: no checkpoint at $MODEL (run tests/bench/run_control_bench.sh, or pass MODEL_DIR)" >&2
  exit 1
fi
export FDROLLOUT_BIN="$BUILD/fdrollout" FDCTL_BIN="$BUILD/fdctl" FD_REPO="$REPO" FD_BENCH_MODEL="$MODEL"
exec /usr/bin/python3 - <<'PY'
import json, os, shutil, sys, tempfile, time
sys.path.insert(0, os.path.join(os.environ["FD_REPO"], "tests", "e2e"))
import numpy as np
from fdtest import Daemon, fdctl

MODEL = os.path.abspath(os.environ["FD_BENCH_MODEL"])
N_UPDATES = int(os.environ.get("FD_BENCH_UPDATES", "3"))
ARGS = ["--threads", "2", "--kv-cache-bytes", "256MiB", "--dynamic-load-weight"]


def memcpy_bytes_per_s(mib=512, reps=5):
    src = np.ones(mib << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(reps))
    return src.nbytes / best


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def check(rc_out_err, what):
    rc, out, err = rc_out_err
    if rc != 0:
        raise SystemExit(f"run_ipc_bench.sh: {what} failed ({rc}): {err}")
    return out


def run(strategy, model, publish):
    with Daemon(*ARGS, "--load-strategy", strategy, model=model, timeout=300) as d:
        try:
            check(publish(d.port), f"fdctl publish --strategy {strategy}")
            status, j = d.post("/v1/pause")
            assert status == 200, j
            times, bytes_ = [], 0
            for i in range(N_UPDATES):
                t0 = time.perf_counter()
                status, j = d.post("/v1/update_weights", {"version": f"{strategy}{i}"}, timeout=600)
                times.append(time.perf_counter() - t0)
                assert status == 200, j
                bytes_ = j["result"]["bytes"]
            return {"bytes": bytes_, "seconds": [round(t, 4) for t in times], "best_s": round(min(times), 4),
                    "bytes_per_s": bytes_ / min(times)}
        finally:
            for rank_file in [f"/dev/shm/fdrollout.{d.port}.weights.tp0"]:
                if os.path.exists(rank_file):
                    os.unlink(rank_file)


memcpy = memcpy_bytes_per_s()
result = {"model": MODEL, "threads": 2, "update_staging": "persistent (default: the first update faults the staging arena in)", "updates": N_UPDATES, "memcpy_bytes_per_s": round(memcpy), "target_ratio": 0.8}

ipc = run("ipc", MODEL, lambda port: fdctl(port, "publish", "--strategy", "ipc", "--from", MODEL, "--version", "bench",
                                           timeout=600))
tmp = tempfile.mkdtemp(prefix="fd-ipc-bench-")
try:
    for name in os.listdir(MODEL):  # a writable --model dir that reads the checkpoint's files
        os.symlink(os.path.join(MODEL, name), os.path.join(tmp, name))
    snap = run("ipc_snapshot", tmp, lambda port: fdctl(port, "publish", "--strategy", "ipc_snapshot", "--from", MODEL,
                                                        "--model", tmp, timeout=600))
finally:
    shutil.rmtree(tmp, ignore_errors=True)

for name, r in (("ipc", ipc), ("ipc_snapshot", snap)):
    r["bytes_per_s"] = round(r["bytes_per_s"])
    r["ratio"] = round(r["bytes_per_s"] / memcpy, 3)
    r["meets_target"] = r["ratio"] >= 0.8
    result[name] = r
print(json.dumps(result, indent=2))
PY
