#!/usr/bin/env bash
# Fresh Debian 12 machine → every test: install packages, build, run the whole CTest suite
# (unit, kernels, model, e2e). Benchmarks are excluded (label bench; see tests/bench/run_bench.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -LE bench -j "${FD_TEST_JOBS:-2}" --timeout 900
