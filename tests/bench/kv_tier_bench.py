"""The multi-level KV cache (issue #27): host-tier prefix hits against recompute.

Two daemons with the same flags (prefix caching on, a small device KV pool) except the host tier:
  tier        + --swap-space: prefix blocks the device pool evicts go to the host and come back
  recompute   no host pool: an evicted prefix is computed again
run in alternating rounds (each figure is the median over rounds):

1. ttft: a shared prompt of --shared-len tokens is asked once, then two other prompts of the same
   length evict its blocks from the device pool (it holds one such prompt), then the shared prompt
   is asked again with max_tokens 1: the wall time of that request is its time to first token.
   Ratio recompute / tier (how many times faster the host-tier hit is).
2. grpo: --prompts prompts of --grpo-len tokens, n = --n seeded samples each (temperature 1),
   --gen tokens, all in flight at once over a pool that holds only a few of them: prefix tokens
   served from each tier (/metrics), and generated tokens per wall second, tier / recompute.
Both parts check that the two daemons return identical tokens and logprobs (`outputs_identical`).

Usage: /usr/bin/python3 tests/bench/kv_tier_bench.py [--model DIR] [--shared-len 2048] [--grpo-len 256]
       [--prompts 64] [--n 8] [--gen 32] [--threads 2] [--rounds 3]"""
import argparse
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from fdtest import Daemon, STORIES  # noqa: E402
from swap_bench import kv_block_bytes, metrics  # noqa: E402  (one /metrics reader, one block-size rule)


def prompt(seed, n, vocab):
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]


def ttft_round(d, shared, evictors):
    for p in [shared, *evictors]:
        status, j = d.post("/v1/completions", {"prompt": p, "max_tokens": 1, "temperature": 0}, timeout=3600)
        assert status == 200, j
    t0 = time.perf_counter()
    status, j = d.post("/v1/completions", {"prompt": shared, "max_tokens": 1, "temperature": 0, "logprobs": 1}, timeout=3600)
    dt = time.perf_counter() - t0
    assert status == 200, j
    c = j["choices"][0]
    u = j["usage"]["prompt_tokens_details"]
    return dt, (c["token_ids"], c["logprobs"]["token_logprobs"]), u


def grpo_round(d, prompts, n, gen):
    m0 = metrics(d)
    outs = [None] * len(prompts)

    def one(i):
        status, j = d.post("/v1/completions", {"prompt": prompts[i], "n": n, "max_tokens": gen, "temperature": 1.0, "seed": 1000 + i,
                                               "logprobs": 0, "ignore_eos": True}, timeout=3600)
        assert status == 200, j
        outs[i] = [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in sorted(j["choices"], key=lambda c: c["index"])]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    m1 = metrics(d)
    dm = {k: m1.get("fdrollout_" + k, 0) - m0.get("fdrollout_" + k, 0) for k in
          ("generation_tokens_total", "prompt_tokens_total", "prompt_tokens_cached_total", "prompt_tokens_host_cached_total",
           "kv_host_tier_in_bytes_total", "kv_host_tier_out_bytes_total", "preemptions_total", "kv_host_tier_offloads_total",
           "kv_host_tier_offloads_background_total", "kv_host_tier_hits_total", "kv_host_tier_loads_total",
           "swap_preemptions_total", "recompute_preemptions_total", "kv_swap_out_bytes_total", "kv_swap_in_bytes_total")}
    r = {"seconds": dt, "tok_per_s": dm["generation_tokens_total"] / dt, **dm,
         "prefix_tokens_device": dm["prompt_tokens_cached_total"] - dm["prompt_tokens_host_cached_total"],
         "prefix_tokens_host": dm["prompt_tokens_host_cached_total"]}
    return r, outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=STORIES)
    ap.add_argument("--shared-len", type=int, default=2048)
    ap.add_argument("--grpo-len", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--grpo-pool-prompts", type=float, default=4.0, help="device pool for the grpo part, in prompts' full length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with open(os.path.join(a.model, "config.json")) as f:
        mc = json.load(f)
    vocab = min(mc["vocab_size"], 500)
    bs = 16
    bb = kv_block_bytes(a.model, bs)
    common = ["--threads", str(a.threads), "--block-size", str(bs), "--enable-prefix-caching",
              "--max-num-batched-tokens", str(max(2048, a.shared_len)), "--max-num-seqs", str(max(8, a.n * 4))]

    # 1. ttft
    shared, evictors = prompt(1, a.shared_len, vocab), [prompt(2, a.shared_len, vocab), prompt(3, a.shared_len, vocab)]
    pool = (a.shared_len + 1 + bs - 1) // bs + 2  # one such prompt
    host = 4 * pool
    ttft = {"tier": [], "recompute": []}
    got, usage = {}, {}
    for _ in range(a.rounds):
        for name, extra in (("tier", ["--swap-space", repr(host * bb / (1 << 30))]), ("recompute", [])):
            with Daemon(*common, "--max-model-len", str(a.shared_len + bs), "--kv-cache-bytes", str(pool * bb), *extra, model=a.model,
                        timeout=600, extra=False) as d:
                ttft_round(d, shared, evictors)  # warm-up round (page faults, threads)
                dt, got[name], usage[name] = ttft_round(d, shared, evictors)
                ttft[name].append(dt)
    med = {k: sorted(v)[len(v) // 2] for k, v in ttft.items()}

    # 2. grpo
    prompts = [prompt(100 + i, a.grpo_len, vocab) for i in range(a.prompts)]
    gpool = int(a.grpo_pool_prompts * ((a.grpo_len + a.gen + bs - 1) // bs)) + 2
    ghost = a.prompts * ((a.grpo_len + bs - 1) // bs) + 8
    grpo = {"tier": [], "recompute": []}
    gouts = {}
    for _ in range(a.rounds):
        for name, extra in (("tier", ["--swap-space", repr(ghost * bb / (1 << 30))]), ("recompute", [])):
            with Daemon(*common, "--max-model-len", str(a.grpo_len + a.gen + bs), "--kv-cache-bytes", str(gpool * bb), *extra,
                        model=a.model, timeout=600, extra=False) as d:
                r, gouts[name] = grpo_round(d, prompts, a.n, a.gen)
                grpo[name].append(r)
    gmed = {k: sorted(v, key=lambda r: r["tok_per_s"])[len(v) // 2] for k, v in grpo.items()}

    print(json.dumps({
        "bench": "kv_tier",
        "model": os.path.basename(os.path.normpath(a.model)), "threads": a.threads, "rounds": a.rounds, "block_bytes": bb,
        "ttft": {"shared_len": a.shared_len, "device_pool_blocks": pool, "seconds": ttft, "median_s": med,
                 "usage_tier": usage["tier"], "usage_recompute": usage["recompute"],
                 "recompute_over_tier": med["recompute"] / med["tier"]},
        "grpo": {"prompts": a.prompts, "n": a.n, "prompt_len": a.grpo_len, "gen": a.gen, "device_pool_blocks": gpool,
                 "host_pool_blocks": ghost, "median": gmed, "tok_per_s_rounds": {k: [r["tok_per_s"] for r in v] for k, v in grpo.items()},
                 "tier_over_recompute": gmed["tier"]["tok_per_s"] / gmed["recompute"]["tok_per_s"]},
        "outputs_identical": got["tier"] == got["recompute"] and gouts["tier"] == gouts["recompute"],
        "host_tier_hit": usage["tier"].get("host_cached_tokens", 0) > 0,
    }, indent=1))


if __name__ == "__main__":
    main()
