#!/usr/bin/env bash
# A/B of two fd_bench binaries on the same machine, interleaved (A B, B A, A B, ...), printing each
# figure's median per binary and B/A. Fixed work per run (--seconds-min 0), so the process CPU
# time (user + sys, /usr/bin/time) compares as well as the wall-clock rates.
#   tests/bench/run_ab_bench.sh A_FD_BENCH B_FD_BENCH [RUNS=3] [MODEL_DIR=build/bench-models/llama-110m]
# Raw JSON and times go to $AB_OUT (default: a fresh directory under build/), which it prints.
set -euo pipefail
A=$1 B=$2 RUNS=${3:-3}
MODEL=${4:-build/bench-models/llama-110m}
OUT=${AB_OUT:-$(mktemp -d "${PWD}/build/ab_bench.XXXXXX")}
ARGS=(--model "$MODEL" --threads 1 --batches 1,16 --prompt-len 64 --decode-steps 16 --seconds-min 0 --bw-mib 128
      --no-breakdown --prefill-lens 64 --linear-m 64 --decode-ctx-batches 1 --decode-ctx 128)
if [[ -z "${OPENBLAS_CORETYPE:-}" ]] && grep -qw avx512f /proc/cpuinfo; then export OPENBLAS_CORETYPE=SkylakeX; fi
for i in $(seq 1 "$RUNS"); do
  order="a b"; (( i % 2 == 0 )) && order="b a"   # alternate which goes first
  for who in $order; do
    bin=$A; [[ $who == b ]] && bin=$B
    /usr/bin/time -f "%U %S" -o "$OUT/${who}_$i.time" "$bin" "${ARGS[@]}" > "$OUT/${who}_$i.json" 2>/dev/null
    echo "run $i $who: cpu(user sys) $(cat "$OUT/${who}_$i.time"), loadavg $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  done
done
echo "raw: $OUT" >&2
/usr/bin/python3 - "$OUT" <<'PY'
import glob, json, statistics as st, sys
out = sys.argv[1]
def runs(who):
    rows = []
    for f in sorted(glob.glob(f"{out}/{who}_*.json")):
        m = json.load(open(f))["models"][0]
        r = {"prefill_tok_s": m["prefill"][0]["tok_s"], "prefill_tok_per_cpu_s": m["prefill"][0]["tok_per_cpu_s"]}
        for d in m["decode"]:
            r[f"decode_b{d['batch']}_tok_s"] = d["tok_s"]
        u, s = open(f[:-5] + ".time").read().split()
        r["process_cpu_s"] = float(u) + float(s)
        rows.append(r)
    return rows
a, b = runs("a"), runs("b")
res = {}
for k in a[0]:
    ma, mb = st.median(r[k] for r in a), st.median(r[k] for r in b)
    res[k] = {"a_median": ma, "b_median": mb, "b_over_a": round(mb / ma, 3), "a": [r[k] for r in a], "b": [r[k] for r in b]}
print(json.dumps(res, indent=1))
PY
