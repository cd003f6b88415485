"""Control latency at tensor-parallel size 2 against size 1 (issue #9, "pause, sleep, wakeup and
update latency at tp=2 / tp=1"). One daemon per configuration on the same checkpoint (random
llama-110m by default; 1 thread per rank), the same calls over HTTP, wall time of each call
from sending it to its answer, median over --trials:
  pause    POST /v1/pause (default mode) while --batch greedy ignore_eos completions decode; the
           engine answers once paused (it aborts the batch, so the latency is one step at most)
  sleep    POST /v1/sleep?tags=weight,kv_cache on the paused engine
  wakeup   POST /v1/wakeup (both tags: KV remapped, weights reloaded from the checkpoint)
  update   POST /v1/update_weights {"version": "bench-i"} (paused again first; the same checkpoint dir)
Configurations: tp1 (in-process, the default), tp1_mp (one rank process) and tp2 (two rank
processes over --dist-backend, default auto); ratios tp2 / tp1 and tp2 / tp1_mp. One JSON object.

Usage: /usr/bin/python3 tests/bench/bench_tp_control.py [--model DIR] [--trials 5] [--batch 8]
       [--configs tp1,tp1_mp,tp2] [--tp2-args "--dist-backend gloo"]"""
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
from fdtest import Daemon, make_checkpoint  # noqa: E402

CONFIGS = {
    "tp1": [],
    "tp1_mp": ["--distributed-executor-backend", "mp"],
    "tp2": ["--tensor-parallel-size", "2"],
}


def timed(d, path, body=None):
    t0 = time.perf_counter()
    code, j = d.post(path, body, timeout=600)
    dt = time.perf_counter() - t0
    assert code == 200, (path, code, j)
    return dt


def pause_under_load(d, batch):
    errors = []

    def run(i):
        code, j = d.post("/v1/completions", {"prompt": f"Once upon a time {i}", "max_tokens": 200, "temperature": 0,
                                             "ignore_eos": True}, timeout=600)
        if code != 200:
            errors.append((code, j))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    deadline = time.time() + 120
    while d.get("/health")[1]["num_requests_running"] < batch:
        assert time.time() < deadline and not errors, f"the batch never ran: {errors[:1]}"
        time.sleep(0.005)
    time.sleep(0.3)  # decoding
    dt = timed(d, "/v1/pause")
    for t in threads:
        t.join(60)
    return dt


def bench(model, extra, trials, batch):
    with Daemon("--threads", "1", "--max-num-seqs", str(batch), "--kv-cache-bytes", "256MiB", "--dynamic-load-weight", *extra, model=model,
                timeout=300, extra=False) as d:
        rows = {"pause": [], "sleep": [], "wakeup": [], "update": []}
        for i in range(trials):
            rows["pause"].append(pause_under_load(d, batch))
            rows["sleep"].append(timed(d, "/v1/sleep?tags=weight,kv_cache"))
            rows["wakeup"].append(timed(d, "/v1/wakeup"))
            timed(d, "/v1/pause")  # wakeup resumed the engine; update_weights needs it paused
            rows["update"].append(timed(d, "/v1/update_weights", {"version": f"bench-{i}"}))
            timed(d, "/v1/resume")
        h = d.get("/health")[1]
        return {"executor": h.get("executor"), "comm_backend": h.get("comm_group", {}).get("backend"),
                **{f"{k}_s": statistics.median(v) for k, v in rows.items()}, "runs": rows}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="checkpoint dir (default: a random llama-110m-shaped one)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--configs", default="tp1,tp1_mp,tp2")
    p.add_argument("--tp2-args", default="", help="extra daemon flags for tp2 (e.g. --dist-backend gloo)")
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="fd-tp-control-bench-")
    try:
        model = a.model or make_checkpoint(os.path.join(tmp, "m"), "--preset", "llama-110m")
        out = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
               "load_avg_at_start": os.getloadavg()[0], "model": a.model or "random llama-110m", "batch": a.batch,
               "trials": a.trials, "configs": {}}
        for name in a.configs.split(","):
            extra = CONFIGS[name] + (a.tp2_args.split() if name == "tp2" else [])
            out["configs"][name] = bench(model, extra, a.trials, a.batch)
        c = out["configs"]
        for base in ("tp1", "tp1_mp"):
            if "tp2" in c and base in c:
                out[f"tp2_over_{base}"] = {k: c["tp2"][f"{k}_s"] / c[base][f"{k}_s"] for k in ("pause", "sleep", "wakeup", "update")}
        out["load_avg_at_end"] = os.getloadavg()[0]
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
