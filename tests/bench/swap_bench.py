"""Decode throughput with forced preemption, host swap vs recompute (issue #10, "Swap").

The same workload (B concurrent greedy sequences, a P-token prompt each, G generated tokens,
ignore_eos, all B sent in one request so they reach the scheduler together) runs on three daemons started one after another with the same flags except:
  no_preemption  a KV pool big enough for every sequence at once (the reference)
  recompute      a KV pool that holds about `--pool-fraction` of the sequences' full length (more
                 of them are admitted on their prompts than fit once grown), no swap pool:
                 every preemption releases the victim's KV and prefills its tokens again
  swap           the same small pool plus --swap-space: victims' KV goes to the host pool and back
Throughput = generated tokens / wall seconds of the whole batch. Prints one JSON object with the
three throughputs, swap / recompute and each / no_preemption, the preemption counts from
/metrics, and whether the outputs of all three are identical (they must be).

Usage: /usr/bin/python3 tests/bench/swap_bench.py [--model DIR] [--batch 16] [--prompt-len 256]
       [--gen 64] [--pool-fraction 0.6] [--threads 2] [--block-size 16] [--rounds 1]"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from fdtest import Daemon, STORIES  # noqa: E402


def kv_block_bytes(model_dir, block_size):
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    kv_dim = c.get("num_key_value_heads", heads) * head_dim
    return 2 * c["num_hidden_layers"] * block_size * kv_dim * 4


def metrics(d):
    _, text = d.get("/metrics")
    out = {}
    for line in text.splitlines():
        if line.startswith("fdrollout_") and "_bucket" not in line:
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def run(d, prompts, body):
    """All prompts go in ONE completion request (a list of token-id prompts): the engine admits a
    request's sequences together, in the same step, so they are all in the scheduler at once and
    hold KV blocks at the same time. (One request per prompt on its own thread only overlapped by
    chance: a short sequence could finish before the others arrived, and then the small pool was
    never exhausted.) Returns ([(token_ids, token_logprobs)] in prompt order, figures)."""
    d.complete(**{**body, "prompt": prompts[0], "max_tokens": 2})  # warm-up (page faults, thread pool)
    m0 = metrics(d)
    t0 = time.perf_counter()
    status, j = d.post("/v1/completions", {**body, "prompt": prompts}, timeout=3600)
    assert status == 200, (status, j)
    choices = sorted(j["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(len(prompts))), [c["index"] for c in choices]
    outs = [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]
    dt = time.perf_counter() - t0
    m1 = metrics(d)
    delta = {k.removeprefix("fdrollout_"): m1[k] - m0.get(k, 0) for k in
             ("fdrollout_generation_tokens_total", "fdrollout_swap_preemptions_total", "fdrollout_recompute_preemptions_total",
              "fdrollout_kv_swap_out_bytes_total", "fdrollout_kv_swap_in_bytes_total", "fdrollout_prompt_tokens_total")}
    gen = delta["generation_tokens_total"]
    return outs, {"seconds": dt, "generated_tokens": gen, "decode_tok_per_s": gen / dt, **delta}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=STORIES)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--pool-fraction", type=float, default=0.6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()

    bs = a.block_size
    seq_len = a.prompt_len + a.gen
    blocks_per_seq = (seq_len + bs - 1) // bs
    block_bytes = kv_block_bytes(a.model, bs)
    small_blocks = max(blocks_per_seq + 1, int(a.pool_fraction * a.batch * blocks_per_seq))
    swap_gib = (a.batch * blocks_per_seq + 1) * block_bytes / (1 << 30)
    common = ["--threads", str(a.threads), "--block-size", str(bs), "--max-model-len", str(seq_len + bs),
              "--max-num-seqs", str(a.batch), "--max-num-batched-tokens", str(max(2048, a.prompt_len))]
    # Distinct prompts (token ids: BOS then a per-sequence ramp) so no two sequences share KV.
    prompts = [[1] + [(5 + 31 * i + 7 * t) % 400 + 3 for t in range(a.prompt_len - 1)] for i in range(a.batch)]
    body = {"max_tokens": a.gen, "temperature": 0, "logprobs": 0, "ignore_eos": True}
    configs = {
        "no_preemption": ["--kv-cache-bytes", str((a.batch * blocks_per_seq + 1) * block_bytes)],
        "recompute": ["--kv-cache-bytes", str(small_blocks * block_bytes)],
        "swap": ["--kv-cache-bytes", str(small_blocks * block_bytes), "--swap-space", repr(swap_gib)],
    }
    # Rounds alternate the three daemons (no_preemption, recompute, swap, no_preemption, ...) so a
    # change in machine load hits all three; each figure is the median over the rounds.
    runs, outputs = {k: [] for k in configs}, {}
    for _ in range(a.rounds):
        for name, flags in configs.items():
            with Daemon(*common, *flags, model=a.model, timeout=600, extra=False) as d:
                outputs[name], r = run(d, prompts, body)
                runs[name].append(r)
    results = {k: {**sorted(v, key=lambda r: r["decode_tok_per_s"])[len(v) // 2], "decode_tok_per_s_rounds": [r["decode_tok_per_s"] for r in v]}
               for k, v in runs.items()}
    tps = {k: v["decode_tok_per_s"] for k, v in results.items()}
    print(json.dumps({
        "bench": "swap_vs_recompute",
        "model": os.path.basename(os.path.normpath(a.model)),
        "batch": a.batch, "prompt_len": a.prompt_len, "gen": a.gen, "threads": a.threads, "block_size": bs, "rounds": a.rounds,
        "kv_blocks_small_pool": small_blocks, "kv_blocks_per_seq": blocks_per_seq, "kv_block_bytes": block_bytes,
        "results": results,
        "ratios": {"swap_over_recompute": tps["swap"] / tps["recompute"],
                   "swap_over_no_preemption": tps["swap"] / tps["no_preemption"],
                   "recompute_over_no_preemption": tps["recompute"] / tps["no_preemption"]},
        "outputs_identical": outputs["swap"] == outputs["no_preemption"] == outputs["recompute"],
        "preemption_forced": results["recompute"]["recompute_preemptions_total"] > 0 and results["swap"]["swap_preemptions_total"] > 0,
    }, indent=1))


if __name__ == "__main__":
    main()
