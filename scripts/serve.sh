#!/usr/bin/env bash
# Fresh Debian 12 machine → serving: install packages, build, run fdrollout on the embedded
# stories260K model at http://127.0.0.1:8000. Extra arguments go to fdrollout; --model, --host
# and --port given there (or as FD_MODEL / FD_HOST / FD_PORT) replace these defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
defaults=()
has() { for a in "${@:2}"; do [[ "$a" == "$1" || "$a" == "$1="* ]] && return 0; done; return 1; }
has --model "$@" || defaults+=(--model "${FD_MODEL:-models/stories260K}")
has --host "$@" || defaults+=(--host "${FD_HOST:-127.0.0.1}")
has --port "$@" || defaults+=(--port "${FD_PORT:-8000}")
exec "${BUILD_DIR:-build}/fdrollout" "${defaults[@]}" "$@"
