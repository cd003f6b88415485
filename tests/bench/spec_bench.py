"""Speculative decoding (issue #24): with ÷ without, same run. --method ngram (default) or mtp.

ngram: daemons with the same flags except --speculative-config:
  plain   no speculation (the reference)
  ngram   {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
           "disable_by_batch_size": 0} (speculation at every batch size)
  cutoff  the same with "disable_by_batch_size": --cutoff (B=64 runs plain steps)
in alternating rounds (figures are medians over rounds):

1. b1: one greedy request at a time, --gen tokens (ignore_eos), on a repetitive prompt and on a
   story prompt: decode tokens/s, ngram ÷ plain, and the mean tokens per target forward
   (generation tokens ÷ sequence forwards, /metrics) and acceptance rate of the ngram daemon.
2. b64: 64 requests in flight at once (8 story prompts x 8 seeded samples at temperature 0.8,
   --gen-batch tokens each): generated tokens per wall second, ngram ÷ plain and cutoff ÷ plain.
Every round checks that the daemons return identical tokens (`outputs_identical`).

mtp: the trained MTP fixture (scripts/make_mtp_fixture.py: stories260K in MiMo layout + an MTP
layer trained on its own text; made on first use, cached in the build dir), daemons plain,
mtp k=1/2/3 ({"method": "mtp", "disable_by_batch_size": 0}) and cutoff (mtp k=--k with no
disable_by_batch_size: the default cut-off, 8), in alternating rounds:
1. b1_k{1,2,3}: the 8 story prompts one greedy request at a time, --gen tokens each: tokens per
   target forward and acceptance (/metrics deltas), decode tokens/s, mtp ÷ plain.
2. b64: as for ngram (k = --k), mtp ÷ plain and cutoff (the default cut-off) ÷ plain.
3. stale: one --dynamic-load-weight daemon (k = --k) on a copy of the fixture serves B=1 greedy
   requests (the first 4 story prompts) at version "fresh0" (the trained layer), then update_weights to "stale" (the fixture's
   stale layer: an early training checkpoint, the same target), then to "fresh1" (the trained
   layer again), then to "untrained" (the layer before training): acceptance, tokens/s (÷ plain,
   interleaved) per version, and whether the acceptance-collapse report (/health, log line)
   appeared, against the documented rule (rate < 1/3 of the previous version's, both >= 64
   draft tokens).

mtp --tp T (T > 1; instead of 1-3): daemons tp 1 and tp T at k = 1, 2, 3 and a plain one of each,
B=1 greedy on the 8 story prompts in alternating rounds: tokens per target forward and acceptance
at tp 1 and tp T (the same drafts up to the last bits of the sharded sums), decode tokens/s with
MTP ÷ without at tp T and tp 1 (spec_mtp_bench.run_mtp_tp).

Usage: /usr/bin/python3 tests/bench/spec_bench.py [--method ngram|mtp] [--model DIR] [--k 3] [--gen 256]
       [--gen-batch 64] [--rounds 3] [--cutoff 16] [--threads 2] [--tp 1]
FD_MTP_FIXTURE=DIR: use that fixture (e.g. build/fixtures/mtp-stories260K-<hash>-quick, the CTest one)."""
import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fdtest import Daemon, STORIES  # noqa: E402

REPETITIVE = ("Tom and Lily played with the ball. They were happy. Tom and Lily played with the ball. "
              "They were happy. Tom and Lily played with the")
STORY = "Once upon a time"
PROMPTS = ["Once upon a time", "Lily and Tom", "The little dog", "One day, a girl named Sue",
           "Tom had a red ball. He", "The sun was", "Mom said", "There was a big tree in the park and"]


def series(m, name):
    """The value of `name` whatever its labels (one series)."""
    return next(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def metrics(d):
    out = {}
    for line in d.get("/metrics")[1].splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def spec_counts(d):
    m = metrics(d)
    s = lambda fam: sum(v for k, v in m.items() if k.startswith(fam + "{"))
    return {"tokens": series(m, "fdrollout_generation_tokens_total"), "forwards": m["fdrollout_sequence_forwards_total"],
            "proposed": s("fdrollout_spec_decode_num_draft_tokens_total"), "accepted": s("fdrollout_spec_decode_num_accepted_tokens_total")}


def one(d, body):
    t0 = time.perf_counter()
    status, j = d.post("/v1/completions", body, timeout=3600)
    assert status == 200, j
    return time.perf_counter() - t0, [c["token_ids"] for c in sorted(j["choices"], key=lambda c: c["index"])]


def batch(d, bodies):
    out = [None] * len(bodies)

    def worker(i):
        out[i] = one(d, bodies[i])[1]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3600)
    return time.perf_counter() - t0, out


def run_ngram(a):
    a.model = a.model or STORIES
    cfg = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "disable_by_batch_size": 0}
    common = ["--threads", str(a.threads), "--max-num-seqs", "64", "--max-model-len", "512"]
    flags = {"plain": [], "ngram": ["--speculative-config", json.dumps(cfg)],
             "cutoff": ["--speculative-config", json.dumps({**cfg, "disable_by_batch_size": a.cutoff})]}
    ds = {}
    res = {"k": a.k, "gen": a.gen, "gen_batch": a.gen_batch, "rounds": a.rounds, "cutoff": a.cutoff, "threads": a.threads,
           "model": os.path.basename(os.path.normpath(a.model)), "outputs_identical": True}
    try:
        for k, f in flags.items():
            ds[k] = Daemon(*common, *f, model=a.model, extra=False, timeout=600)
        for name, prompt in (("repetitive", REPETITIVE), ("story", STORY)):
            body = {"prompt": prompt, "max_tokens": a.gen, "temperature": 0, "ignore_eos": True}
            tps = {"plain": [], "ngram": []}
            c0 = spec_counts(ds["ngram"])
            for _ in range(a.rounds):
                toks = {}
                for k in ("plain", "ngram"):
                    dt, toks[k] = one(ds[k], body)
                    tps[k].append(a.gen / dt)
                res["outputs_identical"] &= toks["plain"] == toks["ngram"]
            c1 = spec_counts(ds["ngram"])
            res[f"b1_{name}"] = {
                "plain_tok_s": statistics.median(tps["plain"]), "ngram_tok_s": statistics.median(tps["ngram"]),
                "ngram_over_plain": statistics.median(tps["ngram"]) / statistics.median(tps["plain"]),
                "tokens_per_forward": (c1["tokens"] - c0["tokens"]) / (c1["forwards"] - c0["forwards"]),
                "acceptance_rate": (c1["accepted"] - c0["accepted"]) / max(1.0, c1["proposed"] - c0["proposed"])}
        bodies = [{"prompt": p, "max_tokens": a.gen_batch, "temperature": 0.8, "seed": 100 + i, "ignore_eos": True}
                  for p in PROMPTS for i in range(8)]
        tps = {k: [] for k in ds}
        c0 = spec_counts(ds["ngram"])
        for _ in range(a.rounds):
            outs = {}
            for k in ds:
                dt, outs[k] = batch(ds[k], bodies)
                tps[k].append(len(bodies) * a.gen_batch / dt)
            res["outputs_identical"] &= outs["plain"] == outs["ngram"] == outs["cutoff"]
        c1 = spec_counts(ds["ngram"])
        med = {k: statistics.median(v) for k, v in tps.items()}
        res["b64"] = {"plain_tok_s": med["plain"], "ngram_tok_s": med["ngram"], "cutoff_tok_s": med["cutoff"],
                      "ngram_over_plain": med["ngram"] / med["plain"], "cutoff_over_plain": med["cutoff"] / med["plain"],
                      "tokens_per_forward": (c1["tokens"] - c0["tokens"]) / (c1["forwards"] - c0["forwards"]),
                      "acceptance_rate": (c1["accepted"] - c0["accepted"]) / max(1.0, c1["proposed"] - c0["proposed"])}
    finally:
        for d in ds.values():
            d.__exit__(None, None, None)  # stop, remove its log
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", choices=("ngram", "mtp"), default="ngram")
    ap.add_argument("--model", help="ngram: default models/stories260K; mtp: default the trained fixture")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cutoff", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1, help="mtp: > 1 compares tp 1 with this tensor-parallel size (run_mtp_tp)")
    a = ap.parse_args()
    load0 = os.getloadavg()
    if a.method == "ngram":
        res = run_ngram(a)
    else:
        import spec_mtp_bench
        run = spec_mtp_bench.run_mtp_tp if a.tp > 1 else spec_mtp_bench.run_mtp
        res = run(a, sys.modules[__name__])
    res["loadavg_start_end"] = [round(load0[0], 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
