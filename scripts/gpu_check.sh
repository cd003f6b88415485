#!/usr/bin/env bash
# GPU check (issue #10): configure a CUDA build (-DFD_WITH_CUDA=ON, sm_90), build the GPU tests,
# the daemon and the GPU benchmark, run `ctest -L gpu` in three passes (the units first, then the
# benchmark, then the e2e passes; logs gpu_ctest_units.log / gpu_ctest_e2e.log / gpu_bench.json)
# (the ops, the VMM allocator, the backend,
# the Worker on cuda vs cpu, and the daemon e2e on --device cuda: greedy equal to cpu, logprobs
# within 5e-5, sleep frees >= 97%, 50 sleep/wakeup cycles leak nothing; CUDA graphs replayed bitwise
# equal to eager; NcclComm and the staged comm; tp=2 on cuda equal to tp=1 and cpu with per-rank
# device memory in /health and sleep, an NCCL communicator destroyed by sleep and rebuilt by wakeup,
# and the rank-fault suite at tp=2 on cuda; a full and a delta weight stream over NCCL from torch,
# python_test_nccl_sender) and fd_gpu_bench (JSON; with decode tok/s at B=1/64/256,
# eager and graphs, on a random ~1B BF16 model written to a temp dir). Meant to finish within 8 minutes on
# one H200; record its output in docs/benchmarks.md. Without a GPU every gpu test reports Skipped
# (exit 77) and the script says "no GPU: N tests skipped" and exits 0.
# It runs scripts/install_deps.sh first (a lent machine starts bare).
#   BUILD_DIR (default build-gpu), FD_JOBS (default: all cores), FD_GPU_BENCH_SECONDS (per point, 0.3),
#   FD_SKIP_INSTALL_DEPS=1 (skip install_deps.sh), FD_GPU_TEST_TIMEOUT (seconds per test, 300),
#   FD_GPU_LOG_DIR (also write the ctest logs and the bench JSON there), FD_GPU_EXTRA_E2E (more
#   tests/e2e scripts to run over --device cuda, reported and not counted),
#   FD_GPU_PREBUILT=1: no install, no build; unpack what scripts/gpu_bundle.sh packed into .gpu/
#   here (for a lent machine with no network and no Debian -dev packages, like the device tool's).
#   FD_GPU_SKIP_BENCH=1 (no 1B checkpoint, no fd_gpu_bench: ~60 s of device time less, for a rerun
#   of the tests), FD_GPU_E2E_REGEX (the e2e pass's ctest -R, default '^(e2e|python)_').
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-gpu}
JOBS=${FD_JOBS:-$(nproc)}
LOG_DIR=${FD_GPU_LOG_DIR:-$BUILD_DIR}
TEST_TIMEOUT=${FD_GPU_TEST_TIMEOUT:-300}
PYTHON=/usr/bin/python3
start=$(date +%s)
echo "gpu_check: $(uname -srm); $(ldd --version 2>&1 | head -1); $(grep -m1 'model name' /proc/cpuinfo)"

if [[ "${FD_GPU_PREBUILT:-0}" == 1 ]]; then
  # The CTest files name the checkout the bundle was built in: link that path to this copy.
  built_in=$(cat .gpu/root)
  if [[ "$(pwd -P)" != "$built_in" ]]; then
    if [[ -e "$built_in" && ! -L "$built_in" ]]; then echo "gpu_check: $built_in exists here; cannot link it" >&2; exit 1; fi
    mkdir -p "$(dirname "$built_in")"; ln -sfn "$(pwd -P)" "$built_in"
  fi
  tar -xJf .gpu/bundle.tar.xz
  # The bundle's libraries, then the machine's own CUDA runtime, cuBLAS and NCCL, wherever they are.
  libs=$(pwd -P)/.gpu/lib
  for so in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    f=$(find /usr/local/cuda/lib64 /usr/local/cuda/targets /usr/lib /opt -name "$so" 2>/dev/null | head -1 || true)
    if [[ -n "$f" ]]; then libs+=:$(dirname "$f"); else echo "gpu_check: $so not found on this machine"; fi
  done
  export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PATH=$PATH:$(pwd -P)/.gpu/bin
  PYTHON=$(pwd -P)/.gpu/python3
  built=$(date +%s)
  echo "gpu_check: prebuilt bundle unpacked in $((built - start)) s"
else

  # A lent GPU machine starts bare: the Debian packages first (idempotent; says so when all
  # present). FD_SKIP_INSTALL_DEPS=1 skips it (a machine set up by hand).
  if [[ "${FD_SKIP_INSTALL_DEPS:-0}" != 1 ]]; then scripts/install_deps.sh; fi
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFD_WITH_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
  # Only what the GPU check runs (the whole tree builds with scripts/build.sh); fdrollout + fdctl
  # for the e2e passes (the daemon on --device cuda vs cpu).
  cmake --build "$BUILD_DIR" -j "$JOBS" --target fd_gpu_test_cuda_ops fd_gpu_test_cuda_kv_bf16 \
        fd_gpu_test_cuda_vmm fd_gpu_test_cuda_backend fd_gpu_test_cuda_worker fd_gpu_test_cuda_graph \
        fd_gpu_test_nccl_comm fd_gpu_test_cuda_kv_copier fd_gpu_bench fdrollout fdctl cuda_ipc_publisher
  built=$(date +%s)
  echo "gpu_check: built in $((built - start)) s"
fi
mkdir -p "$LOG_DIR"

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
fi

# ctest over the tests matching $1 (the ops' units first: seconds each, and what every later
# failure needs); its log in $LOG_DIR/gpu_ctest_$2.log.
run_ctest() {
  (cd "$BUILD_DIR" && ctest -L gpu -R "$1" --output-on-failure --timeout "$TEST_TIMEOUT") 2>&1 |
    tee "$LOG_DIR/gpu_ctest_$2.log"
  return "${PIPESTATUS[0]}"
}
set +e
run_ctest '^gpu_' units; units_rc=$?
set -e
n_total=$(grep -Eo 'out of [0-9]+' "$LOG_DIR/gpu_ctest_units.log" | tail -1 | grep -Eo '[0-9]+' || echo 0)
n_skipped=$(grep -c '\*\*\*Skipped' "$LOG_DIR/gpu_ctest_units.log" || true)
if [[ "$n_total" -gt 0 && "$n_skipped" -eq "$n_total" ]]; then
  set +e; run_ctest '^(e2e|python)_' e2e; set -e
  echo "no GPU: $n_skipped unit tests skipped (and the e2e passes above)"
  "$BUILD_DIR/fd_gpu_bench" >/dev/null || true
  exit 0
fi

set +e
bench_rc=0
if [[ "${FD_GPU_SKIP_BENCH:-0}" != 1 ]]; then
  # The decode benchmark's ~1B BF16 random model (TinyLlama-1.1B shape, 22 layers), removed on exit.
  ck_dir=$(mktemp -d)
  trap 'rm -rf "$ck_dir"' EXIT
  "$PYTHON" scripts/make_random_checkpoint.py --preset llama-1b-bf16-sharded --tokenizer-from '' --out "$ck_dir/ck_1b" >/dev/null
  echo "gpu_check: 1B checkpoint written in $(( $(date +%s) - built )) s"
  bench_json=$("$BUILD_DIR/fd_gpu_bench" "${FD_GPU_BENCH_SECONDS:-0.3}" "$ck_dir/ck_1b")
  bench_rc=$?
  echo "$bench_json" | tee "$LOG_DIR/gpu_bench.json"
  echo "gpu_check: bench rc $bench_rc at $(( $(date +%s) - start )) s"
fi
run_ctest "${FD_GPU_E2E_REGEX:-^(e2e|python)_}" e2e; e2e_rc=$?
# FD_GPU_EXTRA_E2E: more e2e scripts (tests/e2e/*.py) over --device cuda, written for the CPU
# daemon; reported, not counted (a look at what else holds on a GPU).
for t in ${FD_GPU_EXTRA_E2E:-}; do
  t0=$(date +%s)
  FDROLLOUT_BIN=$(pwd -P)/$BUILD_DIR/fdrollout FDCTL_BIN=$(pwd -P)/$BUILD_DIR/fdctl FD_REPO=$(pwd -P) FD_PYTHON=$PYTHON \
    FD_TEST_DAEMON_ARGS="--device cuda" timeout "$TEST_TIMEOUT" "$PYTHON" "tests/e2e/$t" >"$LOG_DIR/extra_$(basename "${t%.py}").log" 2>&1
  echo "gpu_check: extra $t over --device cuda: rc $? in $(( $(date +%s) - t0 )) s"
done
set -e
end=$(date +%s)
echo "gpu_check: units rc $units_rc, bench rc $bench_rc, e2e rc $e2e_rc, $((end - start)) s in all"
[[ $units_rc -eq 0 && $bench_rc -eq 0 && $e2e_rc -eq 0 ]]
