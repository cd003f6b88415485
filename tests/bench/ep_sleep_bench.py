"""Sleep / wakeup under expert parallelism (issue 23): bytes freed per tag, RSS, comm group state and
times for a tp=2 TP-MoE daemon and a tp=2 --enable-expert-parallel one on the same checkpoint, after
one 16 x 65-token prefill and 4 decode steps (the ep_buffer is sized by the largest step).
Usage: FDROLLOUT_BIN=build/fdrollout python3 tests/bench/ep_sleep_bench.py MODEL_DIR   (JSON on stdout)"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from fdtest import Daemon  # noqa: E402


def main(model):
    out = {}
    for name, args in (("tp2", ()), ("tp2_ep", ("--enable-expert-parallel",))):
        with Daemon("--tensor-parallel-size", "2", "--threads", "1", "--dynamic-load-weight", "--max-num-seqs", "16",
                    "--max-model-len", "256", *args, model=model, timeout=300) as d:
            d.complete(prompt=[[1] + list(range(10, 74))] * 16, max_tokens=4, temperature=0, ignore_eos=True)
            t0 = time.time()
            _, j = d.post("/v1/sleep?tags=weight")
            ts = time.time() - t0
            h = d.get("/health")[1]
            t0 = time.time()
            s2, _ = d.post("/v1/wakeup")
            tw = time.time() - t0
            out[name] = {"freed_bytes": j["result"]["freed_bytes"], "rss_before": j["result"]["rss_before_bytes"],
                         "rss_after": j["result"]["rss_after_bytes"], "sleep_s": round(ts, 3), "wakeup_s": round(tw, 3),
                         "comm_group_after_sleep": h["comm_group"], "on_weight_sleep": h["comm_group_on_weight_sleep"], "wakeup_status": s2}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
