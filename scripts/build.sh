#!/usr/bin/env bash
# Configure and build fdrollout (Release, Ninja) into ${BUILD_DIR:-build}. Uses at most 2 jobs
# unless FD_JOBS says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" -j "${FD_JOBS:-2}"
