#!/usr/bin/env bash
# Run the weight-control benchmark (see docs/benchmarks.md, "Weight control") and print its JSON.
#   tests/bench/run_control_bench.sh [BUILD_DIR]   (default: build; fd_control_bench must be built there)
# Makes the random TinyLlama-1.1B-shaped BF16 checkpoint once (BUILD_DIR/bench-models/llama-1b-bf16,
# ~2.2 GB, about 1 minute), then runs fd_control_bench on models/stories260K and that model with
# 2 engine threads and a 256 MiB KV pool for the large model. About 1.5 minutes on 2 cores; needs
# ~10 GB of free memory.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-build}"
case "$BUILD" in /*) ;; *) BUILD="$REPO/$BUILD" ;; esac
BENCH="$BUILD/fd_control_bench"
if [[ ! -x "$BENCH" ]]; then
  echo "run_control_bench.sh: $BENCH not found; build it: cmake --build $BUILD --target fd_control_bench" >&2
  exit 1
fi
MODEL1B="$BUILD/bench-models/llama-1b-bf16"
if [[ ! -f "$MODEL1B/config.json" ]]; then
  echo "run_control_bench.sh: writing the random llama-1b-bf16 checkpoint to $MODEL1B" >&2
  /usr/bin/python3 "$REPO/scripts/make_random_checkpoint.py" --preset llama-1b-bf16-sharded --out "$MODEL1B" >&2
fi
cd "$REPO"
"$BENCH" --model "models/stories260K,$MODEL1B" --threads 2 --kv-cache-bytes auto \
         --updates 5 --tiny-updates 100 --rtt-calls 200 --pause-batch 64 --sleep-cycles 3 --memcpy-mib 512
