#!/usr/bin/env bash
# Run the fdrollout benchmark (see docs/benchmarks.md) and print its JSON on stdout.
#   tests/bench/run_bench.sh [BUILD_DIR]      (default: build; fd_bench must be built there)
# Makes the random ~110M-parameter Llama once (BUILD_DIR/bench-models/llama-110m), then runs
# fd_bench on models/stories260K and that model at one thread. About 2-3 minutes on 2 cores.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-build}"
case "$BUILD" in /*) ;; *) BUILD="$REPO/$BUILD" ;; esac
BENCH="$BUILD/fd_bench"
if [[ ! -x "$BENCH" ]]; then
  echo "run_bench.sh: $BENCH not found; build it: cmake --build $BUILD --target fd_bench" >&2
  exit 1
fi
MODEL110="$BUILD/bench-models/llama-110m"
if [[ ! -f "$MODEL110/config.json" ]]; then
  echo "run_bench.sh: writing the random llama-110m checkpoint to $MODEL110" >&2
  /usr/bin/python3 "$REPO/scripts/make_random_checkpoint.py" --preset llama-110m --out "$MODEL110" >&2
fi
cd "$REPO"
"$BENCH" --model "models/stories260K,$MODEL110" --threads 1 \
         --batches 1,8,32,64 --prompt-len 128 --decode-steps 32 --seconds-min 1.0
