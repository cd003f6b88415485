"""Pause latency per mode at B=64 (issue #13): 64 greedy completions (ignore_eos) decoding on
one daemon, then `POST /v1/pause?mode=M`; the latency is from sending the pause to its answer
(the engine is paused when it answers: abort and keep at once, wait once every request has run
to its end). Also reported: for abort, the time until every aborted client has its answer; for
keep, how long resume takes until the kept requests finish, against the same 64 requests run
without a pause in the same run. Prints one JSON object (docs/benchmarks.md, "Pause latency").

Usage: /usr/bin/python3 tests/bench/bench_pause.py [--model DIR] [--batch 64] [--max-tokens 256] [--reps 5]"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from fdtest import copy_checkpoint, Daemon, make_checkpoint, STORIES  # noqa: E402


def launch(d, batch, max_tokens):
    """`batch` completions from threads; returns (threads, results, t_done[i])."""
    results, t_done = [None] * batch, [0.0] * batch

    def run(i):
        results[i] = d.post("/v1/completions", {"prompt": f"Once upon a time {i}", "max_tokens": max_tokens, "temperature": 0,
                                                "ignore_eos": True}, timeout=600)
        t_done[i] = time.perf_counter()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    return threads, results, t_done


def wait_decoding(d, batch, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = d.get("/health")[1]
        if h["num_requests_running"] >= batch:
            time.sleep(0.2)  # every request is decoding
            return
        time.sleep(0.005)
    raise TimeoutError(f"the batch never ran: {h}")


def one(d, mode, batch, max_tokens):
    threads, results, t_done = launch(d, batch, max_tokens)
    wait_decoding(d, batch)
    t0 = time.perf_counter()
    code, j = d.post(f"/v1/pause?mode={mode}", timeout=600)
    t_paused = time.perf_counter()
    assert code == 200 and j["result"]["is_paused"], j
    row = {"pause_s": t_paused - t0, "engine_s": j["result"]["elapsed_s"]}
    if mode == "keep":
        assert j["result"]["kept"] == batch, j
        t_resume = time.perf_counter()
        assert d.post("/v1/resume")[0] == 200
        for t in threads:
            t.join()
        row["resume_to_all_done_s"] = max(t_done) - t_resume
    else:
        if mode == "abort":
            assert j["result"]["aborted"] == batch, j
        for t in threads:
            t.join()
        row["pause_to_all_answered_s"] = max(t_done) - t0
        assert d.post("/v1/resume")[0] == 200
    n_tokens = [len(r[1]["choices"][0]["token_ids"]) for r in results]
    row["tokens_generated_mean"] = statistics.mean(n_tokens)
    if mode != "abort":
        assert all(n == max_tokens for n in n_tokens), n_tokens
    return row


def bench(name, model, batch, max_tokens, reps):
    with Daemon("--max-num-seqs", str(batch), "--threads", "2", "--kv-cache-bytes", "512MiB", model=model, timeout=300) as d:
        threads, _, t_done = launch(d, batch, max_tokens)  # warm-up, and the unpaused reference
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        unpaused = max(t_done) - t0
        out = {"model": name, "batch": batch, "max_tokens": max_tokens, "unpaused_batch_s": unpaused, "modes": {}}
        for mode in ("abort", "keep", "wait"):
            rows = [one(d, mode, batch, max_tokens) for _ in range(reps)]
            out["modes"][mode] = {"pause_s_median": statistics.median(r["pause_s"] for r in rows), "runs": rows}
        return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=STORIES)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--bigger", action="store_true", help="also a random llama-110m-shaped checkpoint")
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="fd-pause-bench-")
    try:
        out = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
               "load_avg_at_start": os.getloadavg()[0], "models": []}
        model = copy_checkpoint(a.model, os.path.join(tmp, "m"))
        out["models"].append(bench(os.path.basename(a.model.rstrip("/")), model, a.batch, a.max_tokens, a.reps))
        if a.bigger:
            big = make_checkpoint(os.path.join(tmp, "big"), "--preset", "llama-110m")
            out["models"].append(bench("random-llama-110m", big, a.batch, min(a.max_tokens, 64), a.reps))
        out["load_avg_at_end"] = os.getloadavg()[0]
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
