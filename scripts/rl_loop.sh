#!/usr/bin/env bash
# An RL loop over the `rsync` weight strategy, end to end on one host (docs/weight_sources.md):
#
#   rsync --daemon (loopback) serves a versioned store  <--  fdctl publish --strategy rsync
#   fdrollout --load-strategy rsync pulls versions from it on update-weights
#
# Each round: roll out a batch (POST /v1/completions), `fdctl pause`, a "trainer step" (numpy:
# a deterministic change of the current version's weights, written as a Hugging Face checkpoint
# dir), `fdctl publish` it as version N+1, `fdctl update-weights --version N+1 --verify-checksum`,
# `fdctl resume`, then check that the greedy outputs equal those of a fresh fdrollout started on
# that version's checkpoint dir. Prints one "round N: ..." line per round with the update time
# (the update result's total_cost). Exits non-zero on the first failure; cleans up on any exit.
#
#   scripts/rl_loop.sh [--rounds 5]
#
# Environment: FDROLLOUT_BIN, FDCTL_BIN (default BUILD_DIR/fdrollout, BUILD_DIR/fdctl;
# BUILD_DIR default <repo>/build), FD_PYTHON (/usr/bin/python3 with numpy), MODEL (default the
# embedded models/stories260K), KEEP_WORKDIR=1 keeps the temp dir.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
FDROLLOUT_BIN=${FDROLLOUT_BIN:-$BUILD_DIR/fdrollout}
FDCTL_BIN=${FDCTL_BIN:-$BUILD_DIR/fdctl}
PYTHON=${FD_PYTHON:-/usr/bin/python3}
MODEL=${MODEL:-$REPO/models/stories260K}
ROUNDS=5
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    *) echo "usage: $0 [--rounds N]" >&2; exit 2 ;;
  esac
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/fd-rl-loop.XXXXXX")
STORE=$WORK/store
PIDS=()
cleanup() {
  local rc=$?
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -9 "$pid" 2>/dev/null || true
  done
  if [ "$rc" -ne 0 ]; then
    for log in "$WORK"/*.log; do [ -f "$log" ] && { echo "--- $log" >&2; tail -n 20 "$log" >&2; }; done
  fi
  [ "${KEEP_WORKDIR:-0}" = 1 ] || rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
json_get() { "$PYTHON" -c 'import json, sys; v = json.load(sys.stdin); [v := v[int(k) if k.isdigit() else k] for k in sys.argv[1:]]; print(json.dumps(v) if not isinstance(v, str) else v)' "$@"; }
ctl() { "$FDCTL_BIN" --port "$PORT" --timeout 120 "$@"; }
wait_port() {  # wait_port PORT: up to 10 s for a listener
  for _ in $(seq 200); do
    "$PYTHON" -c 'import socket, sys; s = socket.socket(); sys.exit(s.connect_ex(("127.0.0.1", int(sys.argv[1]))))' "$1" && return 0
    sleep 0.05
  done
  echo "nothing listens on port $1 after 10 s" >&2; return 1
}
greedy() {  # greedy PORT -> {"ids": [...], "logprobs": [...]} of one greedy completion
  curl -sf --max-time 60 "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "logprobs": 1}' |
    "$PYTHON" -c 'import json, sys; c = json.load(sys.stdin)["choices"][0]; print(json.dumps({"ids": c["token_ids"], "logprobs": c["logprobs"]["token_logprobs"]}))'
}

# Version 0 = the starting checkpoint, published like every later one.
mkdir -p "$WORK/ckpt/0"
find "$MODEL" -maxdepth 1 -type f -exec cp {} "$WORK/ckpt/0/" \;
"$FDCTL_BIN" publish --strategy rsync --from "$WORK/ckpt/0" --store "$STORE" --version 0 --quiet

RSYNC_PORT=$(free_port)
cat > "$WORK/rsyncd.conf" <<EOF
use chroot = no
pid file = $WORK/rsyncd.pid
[store]
path = $STORE
read only = yes
EOF
rsync --daemon --no-detach --config="$WORK/rsyncd.conf" --port="$RSYNC_PORT" --address=127.0.0.1 >"$WORK/rsyncd.log" 2>&1 &
PIDS+=($!)
wait_port "$RSYNC_PORT"

PORT=$(free_port)
"$FDROLLOUT_BIN" --model "$WORK/ckpt/0" --port "$PORT" --dynamic-load-weight --load-strategy rsync \
  --rsync-config "{\"source\": \"rsync://127.0.0.1:$RSYNC_PORT/store\", \"staging_dir\": \"$WORK/staging\", \"timeout_s\": 60}" \
  >"$WORK/fdrollout.log" 2>&1 &
PIDS+=($!)
ctl wait --until serving --quiet
echo "rl_loop: fdrollout on port $PORT pulls from rsync://127.0.0.1:$RSYNC_PORT/store ($ROUNDS rounds)"

for N in $(seq 0 $((ROUNDS - 1))); do
  NEXT=$((N + 1))
  # 1. rollout: a sampled batch, all from the version now served
  out=$(curl -sf --max-time 60 "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
        -d '{"prompt": ["Once upon a time", "Lily and Tom", "The cat"], "max_tokens": 16, "temperature": 0.8, "seed": '"$NEXT"', "n": 2}')
  n_choices=$(printf '%s' "$out" | json_get choices | "$PYTHON" -c 'import json, sys; print(len(json.load(sys.stdin)))')
  served=$(printf '%s' "$out" | json_get weight_version)
  [ "$n_choices" = 6 ] && [ "$served" = "$N" ] || { echo "round $NEXT: rollout gave $n_choices choices from version $served, expected 6 from $N" >&2; exit 1; }
  # 2. pause at a safe boundary
  ctl pause --quiet
  # 3. trainer step: version N's weights -> version N+1 (deterministic), as an HF checkpoint dir
  "$PYTHON" - "$WORK/ckpt/$N" "$WORK/ckpt/$NEXT" "$NEXT" "$REPO/scripts" <<'EOF'
import os, shutil, sys
import numpy as np
src, dst, step, scripts = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, scripts)
import safetensors_np
os.makedirs(dst)
for name in os.listdir(src):
    if os.path.isfile(os.path.join(src, name)) and not name.endswith(".safetensors"):
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
rng = np.random.default_rng(1000 + step)
for name in sorted(n for n in os.listdir(src) if n.endswith(".safetensors")):
    header, _ = safetensors_np.read_header(os.path.join(src, name))
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    t = safetensors_np.load_file(os.path.join(src, name))
    for k in sorted(t):  # a fake gradient step: small noise scaled to each tensor's spread
        v = t[k]
        t[k] = (v - 0.03 * (float(v.std()) + 1e-3) * rng.standard_normal(v.shape)).astype(v.dtype)
    safetensors_np.save_file(t, os.path.join(dst, name), dtype="BF16" if dtypes == {"BF16"} else None)
EOF
  # 4. publish N+1 to the store, 5. load it all-or-nothing with checksums, 6. resume
  "$FDCTL_BIN" publish --strategy rsync --from "$WORK/ckpt/$NEXT" --store "$STORE" --version "$NEXT" --quiet
  res=$(ctl update-weights --version "$NEXT" --verify-checksum --json)
  cost=$(printf '%s' "$res" | json_get result ranks 0 total_cost)
  verified=$(printf '%s' "$res" | json_get result checksum_verified)
  [ "$verified" = true ] || { echo "round $NEXT: checksums were not verified: $res" >&2; exit 1; }
  ctl resume --quiet
  # 7. the served version's greedy outputs equal a fresh daemon's on the same checkpoint
  got=$(greedy "$PORT")
  FRESH_PORT=$(free_port)
  "$FDROLLOUT_BIN" --model "$WORK/ckpt/$NEXT" --port "$FRESH_PORT" >"$WORK/fresh-$NEXT.log" 2>&1 &
  fresh_pid=$!
  PIDS+=($fresh_pid)
  "$FDCTL_BIN" --port "$FRESH_PORT" --timeout 60 wait --until serving --quiet
  want=$(greedy "$FRESH_PORT")
  kill "$fresh_pid"
  [ "$got" = "$want" ] || { echo "round $NEXT: greedy outputs differ from a fresh daemon on ckpt $NEXT:
  got  $got
  want $want" >&2; exit 1; }
  [ "$got" != "${prev:-}" ] || { echo "round $NEXT: greedy outputs did not change with the new version" >&2; exit 1; }
  prev=$got
  # nothing staged is left (the rsync source keeps only its pull lock, .pull.lock)
  LEFT=$(ls -A "$WORK/staging" | grep -vx '.pull.lock' || true)
  [ -z "$LEFT" ] || { echo "round $NEXT: staging dir not empty: $LEFT" >&2; exit 1; }
  printf 'round %d: served %s, published and loaded version %s with checksums in %.3f s (update_weights total_cost); greedy outputs equal a fresh daemon\n' \
    "$NEXT" "$N" "$NEXT" "$cost"
done
echo "rl_loop: $ROUNDS rounds OK"
