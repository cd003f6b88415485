#!/usr/bin/env bash
# Peer comparison for issue 28: fdrollout (fd_bench --compute-dtype float32,bfloat16) against
# llama.cpp on the same BF16 weights, same run, ratios fdrollout ÷ llama.cpp row by row.
#
#   tests/bench/llamacpp_peer.sh [STEP...]      STEP: fetch build model check bench server all
#                                               (default: all = every step in this order)
#
# Everything lands in build/llamacpp/ (or $LLAMACPP_DIR) and is cached: a step whose output
# exists is skipped. Never part of the default test run (it needs npm and ~15 min of -j2 build).
#  fetch  npm pack node-llama-cpp@$NODE_LLAMA_CPP_VERSION (default 3.21.1, the last release that
#         bundles llama.cpp tag v0.4.0: package/llama/llama.cpp.info.json) and clone the llama.cpp
#         sources from the git bundle it ships (package/llama/gitRelease.bundle; no GitHub access).
#  build  cmake Release, CPU only, GGML_NATIVE (the machine's ISA), -j2 under nice -n 10:
#         llama-bench, llama-batched-bench, llama-server (LLAMA_BUILD_SERVER=0 skips the server).
#  model  the benchmark checkpoint of docs/benchmarks.md "bf16 compute" (random BF16 Llama h512,
#         8 layers, vocab 8192, seed 28; scripts/make_random_checkpoint.py) and its GGUF BF16
#         copy written by tests/bench/llamacpp_gguf.py with llama.cpp's own gguf-py.
#  check  greedy tokens and their log-probabilities for a prompt of token ids, llama.cpp
#         (tests/bench/llamacpp_greedy.cpp on its libllama; BF16 and exact-F32 GGUF) against
#         fdrollout's daemon (/v1/completions, float32 and bfloat16 compute) — llamacpp_peer.py check.
#  bench  1 and 2 threads: llama-bench -p 128,512,2048 -n 64 and llama-batched-bench B=8/32/64,
#         fd_bench the same shapes; JSON with ratios to $OUT (default
#         docs/bench-results/issue28_llamacpp_peer.json).
#  server 64-client server comparison (llama-server -np 64 vs fdrollout), tests/bench/llamacpp_peer.py server.
# PEER_ARGS: extra llamacpp_peer.py bench arguments (e.g. "--threads 1 --bf16-batches 1 --bf16-prefill 128").
# Env: FD_BUILD (fdrollout build dir, default build), LLAMACPP_DIR, LLAMACPP_JOBS (default 2).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FD_BUILD="${FD_BUILD:-$REPO/build}"
DIR="${LLAMACPP_DIR:-$REPO/build/llamacpp}"
VERSION="${NODE_LLAMA_CPP_VERSION:-3.21.1}"
JOBS="${LLAMACPP_JOBS:-2}"
PY=/usr/bin/python3
SRC="$DIR/src"
BLD="$DIR/build"
CKPT="$DIR/model-bf16"
GGUF="$DIR/model-bf16.gguf"
mkdir -p "$DIR"

step_fetch() {
  if [[ -f "$SRC/CMakeLists.txt" ]]; then return; fi
  echo "llamacpp_peer: npm pack node-llama-cpp@$VERSION" >&2
  rm -rf "$DIR/npm" && mkdir -p "$DIR/npm"
  (cd "$DIR/npm" && npm pack --silent "node-llama-cpp@$VERSION" >/dev/null 2>&1 &&
     tar xzf node-llama-cpp-"$VERSION".tgz package/llama/llama.cpp.info.json package/llama/gitRelease.bundle)
  cat "$DIR/npm/package/llama/llama.cpp.info.json" >&2
  git clone -q "$DIR/npm/package/llama/gitRelease.bundle" "$SRC" 2>/dev/null
  git -C "$SRC" log --oneline -1 >&2
}

step_build() {
  local targets=(llama-bench llama-batched-bench)
  [[ "${LLAMA_BUILD_SERVER:-1}" == 1 ]] && targets+=(llama-server)
  local missing=0 t
  for t in "${targets[@]}"; do [[ -x "$BLD/bin/$t" ]] || missing=1; done
  [[ $missing == 0 ]] && return
  local launcher=()  # ccache where the machine has it (a fresh Debian machine has not)
  command -v ccache >/dev/null && launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  nice -n 10 cmake -S "$SRC" -B "$BLD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DCMAKE_PROJECT_INCLUDE="$REPO/tests/bench/llamacpp_unity.cmake" "${launcher[@]}" >"$DIR/cmake.log" 2>&1
  # the bench tools first (206 of the 284 steps): the benchmarks can start before the server is built
  nice -n 10 cmake --build "$BLD" -j "$JOBS" --target llama-bench llama-batched-bench >"$DIR/build.log" 2>&1 ||
    { tail -30 "$DIR/build.log" >&2; exit 1; }
  nice -n 10 cmake --build "$BLD" -j "$JOBS" --target "${targets[@]}" >>"$DIR/build.log" 2>&1 ||
    { tail -30 "$DIR/build.log" >&2; exit 1; }
}

step_model() {
  if [[ ! -f "$CKPT/config.json" ]]; then
    # the checkpoint of docs/benchmarks.md "bf16 compute (fd_bench --compute-dtype, issue 28)"
    "$PY" "$REPO/scripts/make_random_checkpoint.py" --out "$CKPT" --arch llama --hidden 512 \
      --intermediate 1536 --layers 8 --heads 8 --kv-heads 8 --vocab 8192 --max-pos 4096 \
      --dtype BF16 --embed-std 0.1 --no-tie --seed 28 >&2
  fi
  # BF16 for the benchmarks; an exact F32 widening of the same weights for the conversion check
  [[ -f "$GGUF" ]] || "$PY" "$REPO/tests/bench/llamacpp_gguf.py" --checkpoint "$CKPT" \
    --gguf-py "$SRC/gguf-py" --out "$GGUF" --dtype bf16
  [[ -f "$DIR/model-f32.gguf" ]] || "$PY" "$REPO/tests/bench/llamacpp_gguf.py" --checkpoint "$CKPT" \
    --gguf-py "$SRC/gguf-py" --out "$DIR/model-f32.gguf" --dtype f32
}

step_check() {
  # llama.cpp's greedy continuation of a prompt of token ids (one C++ file on the peer's libllama)
  if [[ ! -x "$BLD/bin/llamacpp_greedy" ]]; then
    nice -n 10 g++ -O2 -std=c++17 -I "$SRC/include" -I "$SRC/ggml/include" "$REPO/tests/bench/llamacpp_greedy.cpp" \
      -o "$BLD/bin/llamacpp_greedy" -L "$BLD/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$BLD/bin"
  fi
  "$PY" "$REPO/tests/bench/llamacpp_peer.py" check --llama-bin "$BLD/bin" --gguf "$GGUF" \
    --checkpoint "$CKPT" --fd-build "$FD_BUILD" \
    --out "${CHECK_OUT:-$REPO/docs/bench-results/issue28_llamacpp_peer_check.json}"
}

step_bench() {
  "$PY" "$REPO/tests/bench/llamacpp_peer.py" bench --llama-bin "$BLD/bin" --gguf "$GGUF" \
    --checkpoint "$CKPT" --fd-build "$FD_BUILD" \
    --out "${OUT:-$REPO/docs/bench-results/issue28_llamacpp_peer.json}" ${PEER_ARGS:-}
}

step_server() {
  "$PY" "$REPO/tests/bench/llamacpp_peer.py" server --llama-bin "$BLD/bin" --gguf "$GGUF" \
    --checkpoint "$CKPT" --fd-build "$FD_BUILD" \
    --out "${SERVER_OUT:-$REPO/docs/bench-results/issue28_llamacpp_peer_server.json}"
}

steps=("$@")
[[ ${#steps[@]} == 0 || "${steps[0]}" == all ]] && steps=(fetch build model check bench server)
for s in "${steps[@]}"; do
  case "$s" in
    fetch|build|model|check|bench|server) "step_$s" ;;
    *) echo "llamacpp_peer.sh: unknown step '$s' (fetch build model check bench server all)" >&2; exit 2 ;;
  esac
done
