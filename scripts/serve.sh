#!/usr/bin/env bash
# Fresh Debian 12 machine → serving: install packages, build, run fdrollout on the embedded
# stories260K model at http://127.0.0.1:8000 (extra arguments go to fdrollout).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
exec "${BUILD_DIR:-build}/fdrollout" --model models/stories260K --host 127.0.0.1 --port 8000 "$@"
