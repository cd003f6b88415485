#!/usr/bin/env bash
# Run the fdrollout benchmark (see docs/benchmarks.md) and print its JSON on stdout.
#   tests/bench/run_bench.sh [BUILD_DIR] [fd_bench args...]   (default: build; fd_bench built there,
#   or FD_BENCH_BIN=path to another fd_bench binary)
# Makes the random ~110M-parameter Llama and its Llama-3- and Qwen3-shaped peers once
# (BUILD_DIR/bench-models/{llama-110m,llama3-110m,qwen3-110m}), then runs fd_bench on
# models/stories260K and those models at one thread. About 2-3 minutes on 2 cores.
# FD_BENCH_MODELS (comma-separated directories) replaces the model list; extra arguments go to
# fd_bench (e.g. --decode-ctx 128,2048,8192); FD_BENCH_THREADS sets --threads (default 1),
# FD_BENCH_BATCHES --batches (default 1,8,32,64).
# On an AVX-512 CPU OpenBLAS is given its AVX-512 (SkylakeX) kernels unless OPENBLAS_CORETYPE
# is set: on AMD Zen it would otherwise pick its AVX2 kernels, about half as fast.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-build}"
case "$BUILD" in /*) ;; *) BUILD="$REPO/$BUILD" ;; esac
BENCH="${FD_BENCH_BIN:-$BUILD/fd_bench}"
if [[ ! -x "$BENCH" ]]; then
  echo "run_bench.sh: $BENCH not found; build it: cmake --build $BUILD --target fd_bench" >&2
  exit 1
fi
# llama-110m and the Llama-3- and Qwen3-shaped models of its size (make_random_checkpoint.py presets)
for preset in llama-110m llama3-110m qwen3-110m; do
  if [[ ! -f "$BUILD/bench-models/$preset/config.json" ]]; then
    echo "run_bench.sh: writing the random $preset checkpoint to $BUILD/bench-models/$preset" >&2
    /usr/bin/python3 "$REPO/scripts/make_random_checkpoint.py" --preset "$preset" --out "$BUILD/bench-models/$preset" >&2
  fi
done
MODEL110="$BUILD/bench-models/llama-110m"
cd "$REPO"
if [[ -z "${OPENBLAS_CORETYPE:-}" ]] && grep -qw avx512f /proc/cpuinfo; then export OPENBLAS_CORETYPE=SkylakeX; fi
"$BENCH" --model "${FD_BENCH_MODELS:-models/stories260K,$MODEL110,$BUILD/bench-models/llama3-110m,$BUILD/bench-models/qwen3-110m}" --threads "${FD_BENCH_THREADS:-1}" \
         --batches "${FD_BENCH_BATCHES:-1,8,32,64}" --prompt-len 128 --decode-steps 32 --seconds-min 1.0 \
         --prefill-lens 128,512,2048 --linear-m 64,512,2048 --decode-ctx 128,2048,8192 \
         --decode-ctx-batches 1,64 "${@:2}"
