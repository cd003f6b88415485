"""Delta weight-stream updates (issue 25): the time of a delta update with 1 % and 5 % of the
elements changed ÷ the time of a full stream update of the same model, into the same tp=2
daemon, in one run (targets ≤ 0.1 / ≤ 0.2).

Each rep: a full stream of W0 (the base, timed), a delta of W1 (1 % of every tensor's elements
changed) against it, a full stream of W0 again (timed), a delta of W2 (5 %) against it, each after
--gap-s idle seconds (a trainer step's stand-in: a full update's commit removes the dir it replaced
in a background thread, and in a training loop that runs during the next step). A time is
from opening the stream to the commit's answer (init, start, buckets, finish = stage + commit on
every rank); the trainer's diff (which elements changed) is computed before and not timed.
Reported: each ratio (delta ÷ the median full time of the rep), the delta's split into
buckets (wire + apply to the base copy) and finish, the bytes on the wire, and how busy the
machine's CPUs were while the bytes went out and while the finish ran (/proc/stat, 10 ms ticks:
1.0 = every CPU busy, so nothing run beside it would go faster).

  /usr/bin/python3 tests/bench/delta_stream_bench.py [--reps 3] [--hidden 512 --layers 8] [--bin B] [--daemon-log L] > out.json
(--daemon-log keeps the daemon's log: its per-stage timers for the seal, the ranks' read/write and the commit.)
Figures are ratios within one run: the machine may be loaded by other jobs (load is recorded).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from fdtest import Daemon, make_checkpoint  # noqa: E402
from fdrollout import Client, safetensors_np  # noqa: E402
from delta_fixtures import changed_everywhere  # noqa: E402



def cpu_times():
    """(all, idle) jiffies of every CPU since boot (/proc/stat; 10 ms ticks)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def busy(a, b):
    """The fraction of the machine's CPUs busy between cpu_times() a and b (coarse: 10 ms ticks)."""
    return round(1 - (b[1] - a[1]) / max(1, b[0] - a[0]), 2)


def timed(ws, send):
    """Time a stream: its start, the sends (until every byte left), the finish; and how busy the
    CPUs were while the bytes went out and while the finish ran."""
    t0 = time.perf_counter()
    with ws:
        c1 = cpu_times()
        send(ws)
        ws.flush()
        t_last, c2 = time.perf_counter(), cpu_times()
    t1, c3 = time.perf_counter(), cpu_times()
    return {"seconds": t1 - t0, "buckets_s": t_last - t0, "finish_s": t1 - t_last, "wire_bytes": ws.bytes_sent,
            "cpu_busy_sending": busy(c1, c2), "cpu_busy_finish": busy(c2, c3), "ranks": ws.result.get("ranks")}


def timed_full(c, tensors, version, land=False):
    ws = c.weight_stream(version, land=land)
    r = timed(ws, lambda ws: [ws.send(n, tensors[n]) for n in sorted(tensors)])
    assert ws.result["weight_version"] == version, ws.result
    return r


def timed_delta(c, deltas, version, base, land=False):
    ws = c.weight_stream(version, base_version=base, land=land)
    r = timed(ws, lambda ws: [ws.send_delta(n, *deltas[n]) for n in sorted(deltas)])
    assert ws.result["weight_version"] == version and ws.result["base_version"] == base, ws.result
    r["n_delta"] = ws.result["n_delta"]
    return r


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hidden", default="512")
    p.add_argument("--intermediate", default="1376")
    p.add_argument("--layers", default="8")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--bin", default=None, help="the daemon binary (default: FDROLLOUT_BIN or build/fdrollout); for A/B runs")
    p.add_argument("--daemon-log", default=None, help="copy the daemon's log (its stage timers) to this file at the end")
    p.add_argument("--gap-s", type=float, default=0.5,
                   help="idle seconds before each timed update, as a trainer step leaves (the commit before it removes the dir it "
                        "replaced in the background, ~15 ms per 100 MB; 0: back to back, that removal overlapping the next update)")
    p.add_argument("--land", action="store_true",
                   help="updates landed on the ranks (weight_stream(land=True)): the full ones, and the deltas (sent to each rank "
                        "straight, written in place at the finish) unless --delta-through-daemon")
    p.add_argument("--delta-through-daemon", action="store_true",
                   help="with --land: the deltas go through the daemon (its bucket, the delta file every rank reads), as before stop 55")
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="fd-delta-bench-")
    try:
        model = make_checkpoint(os.path.join(tmp, "m"), "--hidden", a.hidden, "--intermediate", a.intermediate, "--layers", a.layers,
                                "--heads", "8", "--vocab", "512")
        w0 = safetensors_np.load_file(os.path.join(model, "model.safetensors"))
        _, d1 = changed_everywhere(w0, 0.01, seed=1)
        _, d5 = changed_everywhere(w0, 0.05, seed=5)
        out = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(), "gap_s": a.gap_s,
               "load_avg_at_start": os.getloadavg()[0], "tp": a.tp, "model_bytes": sum(x.nbytes for x in w0.values()), "runs": []}
        tp_args = ["--tensor-parallel-size", str(a.tp), "--threads", "1"] if a.tp > 1 else []
        out["bin"] = a.bin
        out["land"] = a.land
        out["delta_land"] = a.land and not a.delta_through_daemon
        kw = {"bin": a.bin} if a.bin else {}
        with Daemon("--dynamic-load-weight", *tp_args, model=model, extra=False, timeout=300, **kw) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=300)
            timed_full(c, w0, "warm")  # first stream: page-in, allocations
            def gap():  # a trainer step between updates: the last commit's background work (removing the replaced dir) ends
                time.sleep(a.gap_s)
            for i in range(a.reps):
                gap()
                run = {"full_a": timed_full(c, w0, f"a{i}", a.land)}
                gap()
                run["delta_1pct"] = timed_delta(c, d1, f"d1-{i}", f"a{i}", a.land and not a.delta_through_daemon)
                gap()
                run["full_b"] = timed_full(c, w0, f"b{i}", a.land)
                gap()
                run["delta_5pct"] = timed_delta(c, d5, f"d5-{i}", f"b{i}", a.land and not a.delta_through_daemon)
                full_s = (run["full_a"]["seconds"] + run["full_b"]["seconds"]) / 2
                run["delta_1pct_over_full"] = run["delta_1pct"]["seconds"] / full_s
                run["delta_5pct_over_full"] = run["delta_5pct"]["seconds"] / full_s
                out["runs"].append(run)
                print(json.dumps(run), file=sys.stderr)
            if a.daemon_log:
                with open(a.daemon_log, "w") as f:
                    f.write(d.output())
        out["median"] = {k: median([r[k] for r in out["runs"]]) for k in ("delta_1pct_over_full", "delta_5pct_over_full")}
        for k in ("full_a", "delta_1pct", "delta_5pct"):
            out["median"][k + "_s"] = median([r[k]["seconds"] for r in out["runs"]])
            out["median"][k + "_finish_s"] = median([r[k]["finish_s"] for r in out["runs"]])
            for b in ("cpu_busy_sending", "cpu_busy_finish"):
                out["median"][f"{k}_{b}"] = median([r[k][b] for r in out["runs"]])
            out["median"][k + "_wire_bytes"] = out["runs"][0][k]["wire_bytes"]
        out["load_avg_at_end"] = os.getloadavg()[0]
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
