#!/usr/bin/env bash
# update_weights over --load-strategy rsync vs its floor (plain rsync of the same version dir +
# the in-memory apply of local files), on the ~1B random BF16 checkpoint. Prints one JSON object
# on stdout (see tests/bench/rsync_bench.py for the fields; target "ratio" <= 1.25).
#
#   tests/bench/run_rsync_bench.sh [BUILD_DIR]        (default: build; fdrollout + fdctl built there)
#
# Environment: FD_BENCH_CKPT  the checkpoint (read only; default BUILD_DIR/bench-models/llama-1b-bf16,
#                             written with make_random_checkpoint.py --preset llama-1b-bf16-sharded
#                             when missing, ~2.2 GB)
#              FD_BENCH_WORK  scratch dir for the store, staging and the plain copy (~7 GB free
#                             needed; default a new dir under $TMPDIR), removed afterwards
#              FD_BENCH_REPS  repetitions per measurement (median; default 3)
# Not part of the default ctest run. Takes about a minute on 2 cores.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-build}"
case "$BUILD" in /*) ;; *) BUILD="$REPO/$BUILD" ;; esac
for bin in fdrollout fdctl; do
  [[ -x "$BUILD/$bin" ]] || { echo "run_rsync_bench.sh: $BUILD/$bin not found; build it first" >&2; exit 1; }
done
command -v rsync >/dev/null || { echo "run_rsync_bench.sh: rsync is not installed" >&2; exit 1; }
CKPT="${FD_BENCH_CKPT:-$BUILD/bench-models/llama-1b-bf16}"
if [[ ! -f "$CKPT/config.json" ]]; then
  echo "run_rsync_bench.sh: writing the random llama-1b-bf16 checkpoint to $CKPT" >&2
  /usr/bin/python3 "$REPO/scripts/make_random_checkpoint.py" --preset llama-1b-bf16-sharded --out "$CKPT" >&2
fi
WORK="${FD_BENCH_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/fd-rsync-bench.XXXXXX")}"
mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT
FDROLLOUT_BIN="$BUILD/fdrollout" FDCTL_BIN="$BUILD/fdctl" FD_REPO="$REPO" \
  /usr/bin/python3 "$REPO/tests/bench/rsync_bench.py" --ckpt "$CKPT" --work "$WORK" --reps "${FD_BENCH_REPS:-3}" \
  --threads 2 --kv-cache-bytes 256MiB
