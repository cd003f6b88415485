#!/usr/bin/env bash
# Tensor-parallel forward bench (issue #9): llama-110m at tp 1 vs tp 2, one thread per rank,
# decode tok/s at B=1 and B=64 and prefill tok/s, with ratios against tp 1 measured in the same
# run. Prints fd_tp_bench's JSON on stdout.
#   tests/bench/run_tp_bench.sh [BUILD_DIR] [fd_tp_bench args...]
# Makes the random llama-110m checkpoint once (BUILD_DIR/bench-models/llama-110m, as
# run_bench.sh does). Needs at least 2 idle cores for a meaningful tp 2 figure.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-build}"
case "$BUILD" in /*) ;; *) BUILD="$REPO/$BUILD" ;; esac
BENCH="$BUILD/fd_tp_bench"
if [[ ! -x "$BENCH" ]]; then
  echo "run_tp_bench.sh: $BENCH not found; build it: cmake --build $BUILD --target fd_tp_bench" >&2
  exit 1
fi
MODEL110="$BUILD/bench-models/llama-110m"
if [[ ! -f "$MODEL110/config.json" ]]; then
  echo "run_tp_bench.sh: writing the random llama-110m checkpoint to $MODEL110" >&2
  /usr/bin/python3 "$REPO/scripts/make_random_checkpoint.py" --preset llama-110m --out "$MODEL110" >&2
fi
"$BENCH" --model "${FD_BENCH_MODEL:-$MODEL110}" --tp 2 --threads 1 --batches 1,64 --prompt-len 128 \
         --decode-steps 16 --prefill-len 512 --repeats 3 "${@:2}"
