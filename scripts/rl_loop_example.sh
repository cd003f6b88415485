#!/usr/bin/env bash
# An RL loop driving fdrollout with fdctl: each round rolls out a batch, pauses, runs a
# "trainer step" that writes the next checkpoint into the daemon's --model dir, loads it
# all-or-nothing with update-weights, and resumes. Every step checks its exit code.
#
#   scripts/rl_loop_example.sh [--port 8000] [--rounds 3] [--train-cmd 'CMD']
#
# CMD runs with STEP=<round> in its environment (default: no-op, i.e. same weights).
# Needs: curl, a daemon started with --dynamic-load-weight, and fdctl: FDCTL_BIN (as in
# rl_loop.sh; FDCTL is read too), default the repo's own build/fdctl, else fdctl on PATH.
set -euo pipefail
PORT=8000 ROUNDS=3 TRAIN_CMD=true
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --train-cmd) TRAIN_CMD=$2; shift 2 ;;
    *) echo "usage: $0 [--port P] [--rounds N] [--train-cmd CMD]" >&2; exit 2 ;;
  esac
done
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FDCTL_BIN=${FDCTL_BIN:-${FDCTL:-}}
if [ -z "$FDCTL_BIN" ]; then
  if [ -x "$REPO/build/fdctl" ]; then FDCTL_BIN=$REPO/build/fdctl; else FDCTL_BIN=fdctl; fi
fi
ctl() { "$FDCTL_BIN" --port "$PORT" --timeout 120 "$@"; }

ctl wait --until serving --quiet
for STEP in $(seq 1 "$ROUNDS"); do
  # 1. rollout: a batch of sampled completions with the weight version that produced them
  out=$(curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
        -d '{"prompt": ["Once upon a time", "Lily and Tom"], "max_tokens": 16, "temperature": 0.8, "seed": '"$STEP"', "n": 2}')
  version=$(printf '%s' "$out" | sed -n 's/.*"weight_version":"\([^"]*\)".*/\1/p')
  echo "round $STEP: rollout of 4 completions from weight_version $version"
  # 2. pause at a safe boundary, 3. train, 4. load the new weights, 5. resume
  ctl pause --quiet
  STEP=$STEP bash -c "$TRAIN_CMD"
  t0=$(date +%s.%N)
  ctl update-weights --version "step-$STEP" --quiet || {
    rc=$?
    echo "round $STEP: update-weights failed (exit $rc); the previous weights keep serving" >&2
    ctl resume --quiet
    exit "$rc"
  }
  t1=$(date +%s.%N)
  ctl resume --quiet
  echo "round $STEP: now serving step-$STEP (update took $(awk "BEGIN { printf \"%.3f\", $t1 - $t0 }") s)"
done
