#!/usr/bin/env bash
# Nightly maintenance for a fdrollout rollout server, e.g. from cron:
#   17 3 * * *  FDCTL=/opt/fdrollout/build/fdctl /opt/fdrollout/scripts/cron_maintenance.sh --port 8000 >> /var/log/fdrollout-maint.log 2>&1
# Health check, then a sleep/wakeup cycle (returns and re-maps weight and KV memory, reloading
# the weights from their source), then a health check again. One log line per run; the exit
# code is fdctl's (see `fdctl --help`).
set -uo pipefail
PORT=8000
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT=$2; shift 2 ;;
    *) echo "usage: $0 [--port P]" >&2; exit 2 ;;
  esac
done
FDCTL=${FDCTL:-fdctl}
ctl() { "$FDCTL" --port "$PORT" --timeout 300 "$@"; }
log() { echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) fdrollout:$PORT $*"; }

before=$(ctl status) || { rc=$?; log "FAIL health check (exit $rc)"; exit "$rc"; }
case "$before" in
  state=serving*) ;;
  *) log "SKIP not serving ($before)"; exit 0 ;;
esac
slept=$(ctl sleep) || { rc=$?; log "FAIL sleep (exit $rc)"; exit "$rc"; }
ctl wakeup --quiet || { rc=$?; log "FAIL wakeup (exit $rc); daemon stays paused: $(ctl status)"; exit "$rc"; }
ctl wait --until serving --quiet --timeout 60 || { rc=$?; log "FAIL not serving after wakeup (exit $rc)"; exit "$rc"; }
log "OK sleep/wakeup: $slept; now $(ctl status)"
