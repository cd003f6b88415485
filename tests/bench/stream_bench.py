"""Weight-stream throughput (issue 25): a trainer process streams a model into a tp=2 daemon on
this host, against two references measured in the same run:
  - loopback TCP: the same bytes over one loopback connection to another process (sendall of the
    arrays; iperf-style, recv_into one reused 256 KiB buffer), the transport's ceiling (the target's
    reference); and "land": the same, every byte kept in one pre-touched buffer of the whole size;
  - (the stream runs twice per repetition: through the daemon, and landed on the ranks, `land=True`);
  - ipc_snapshot: the trainer writes each rank's model_state.tp{r}.safetensors into --model and
    calls /v1/update_weights (the file path a stream replaces).
Reported: bytes/s of each and the ratios, the stream's split (buckets vs finish = stage+commit),
and the time from the trainer's last send to the first completion with the new version.

  /usr/bin/python3 tests/bench/stream_bench.py [--reps 3] [--hidden 512 --layers 8] > out.json
Figures are ratios within one run: the machine may be loaded by other jobs (load is recorded).
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # loopback_receiver.py, also when imported from elsewhere
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import PYTHON, Daemon, copy_checkpoint, make_checkpoint  # noqa: E402
from fdrollout import Client, publish, safetensors_np  # noqa: E402
from loopback_receiver import RECEIVER  # noqa: E402


# The baselines' receiver (loopback_receiver.py): "discard" is the iperf-style reference the
# issue's target names, "land" keeps every byte. (Until 2026-12-03 the only baseline was "land"
# with the buffer allocated after accept: its page faults were timed, which weakened it more the
# larger the model, and the ratios against it read high.)


def loopback_bytes_per_s(arrays, mode="discard"):
    """The same arrays over one loopback TCP connection to another process, as the stream sends them."""
    total = sum(a.nbytes for a in arrays)
    p = subprocess.Popen([PYTHON, "-c", RECEIVER, str(total), mode], stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        s = socket.create_connection(("127.0.0.1", port))
        t0 = time.perf_counter()
        for a in arrays:
            s.sendall(memoryview(a.reshape(-1).view(np.uint8)))
        got = int(s.recv(64))  # the receiver's count: every byte arrived
        dt = time.perf_counter() - t0
        s.close()
    finally:
        p.wait(60)
        p.stdout.close()
    assert got == total
    return total / dt


def first_new_version(c, version, t_last_send):
    while True:
        j = c.completions("Once upon a time", max_tokens=1, temperature=0)
        if j["weight_version"] == version:
            return time.perf_counter() - t_last_send


def bench_stream(c, tensors, version, land=False):
    names = sorted(tensors)
    t0 = time.perf_counter()
    with c.weight_stream(version, land=land) as ws:
        for n in names:
            ws.send(n, tensors[n])
        ws.flush()
        t_last = time.perf_counter()
    t_done = time.perf_counter()
    to_new = first_new_version(c, version, t_last)
    nbytes = sum(tensors[n].nbytes for n in names)
    return {"bytes": nbytes, "seconds": t_done - t0, "buckets_s": t_last - t0, "finish_s": t_done - t_last,
            "last_send_to_new_version_s": to_new, "bytes_per_s": nbytes / (t_done - t0),
            "buckets_bytes_per_s": nbytes / (t_last - t0)}


def bench_snapshot(c, tensors, cfg, model_dir, tp, version):
    t0 = time.perf_counter()
    for r in range(tp):
        part = publish.to_rollout_names(tensors, cfg, tp=tp, rank=r)
        publish.publish_ipc_snapshot({k: v for k, v in part.items()}, model_dir, rank=r)
    t_written = time.perf_counter()
    c.pause(mode="wait")
    c.update_weights(version=version)
    c.resume()
    t_done = time.perf_counter()
    to_new = first_new_version(c, version, t_written)
    nbytes = sum(a.nbytes for a in tensors.values())
    return {"bytes": nbytes, "seconds": t_done - t0, "write_s": t_written - t0, "update_s": t_done - t_written,
            "last_write_to_new_version_s": to_new, "bytes_per_s": nbytes / (t_done - t0)}


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
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="fd-stream-bench-")
    try:
        model = make_checkpoint(os.path.join(tmp, "m"), "--hidden", a.hidden, "--intermediate", a.intermediate, "--layers", a.layers,
                                "--heads", "8", "--vocab", "512")
        tensors = safetensors_np.load_file(os.path.join(model, "model.safetensors"))
        cfg = publish.load_config(model)
        arrays = [tensors[n] for n in sorted(tensors)]
        out = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
               "load_avg_at_start": os.getloadavg()[0], "tp": a.tp, "model_bytes": sum(x.nbytes for x in arrays), "runs": []}
        tp_args = ["--tensor-parallel-size", str(a.tp), "--threads", "1"] if a.tp > 1 else []
        snap_dir = copy_checkpoint(model, os.path.join(tmp, "snap"))
        with Daemon("--dynamic-load-weight", *tp_args, model=model, extra=False, timeout=300) as d, \
                Daemon("--dynamic-load-weight", "--load-strategy", "ipc_snapshot", *tp_args, model=snap_dir, extra=False, timeout=300) as ds:
            c, cs = Client(f"127.0.0.1:{d.port}", timeout=300), Client(f"127.0.0.1:{ds.port}", timeout=300)
            for i in range(a.reps):
                run = {"loopback_bytes_per_s": loopback_bytes_per_s(arrays),
                       "loopback_land_bytes_per_s": loopback_bytes_per_s(arrays, "land"),
                       "stream": bench_stream(c, tensors, f"s{i}"),
                       "landed": bench_stream(c, tensors, f"l{i}", land=True),
                       "ipc_snapshot": bench_snapshot(cs, tensors, cfg, snap_dir, a.tp, f"p{i}")}
                run["stream_over_loopback"] = run["stream"]["bytes_per_s"] / run["loopback_bytes_per_s"]
                run["stream_buckets_over_loopback"] = run["stream"]["buckets_bytes_per_s"] / run["loopback_bytes_per_s"]
                run["stream_over_loopback_land"] = run["stream"]["bytes_per_s"] / run["loopback_land_bytes_per_s"]
                run["stream_buckets_over_loopback_land"] = run["stream"]["buckets_bytes_per_s"] / run["loopback_land_bytes_per_s"]
                run["stream_over_ipc_snapshot"] = run["stream"]["bytes_per_s"] / run["ipc_snapshot"]["bytes_per_s"]
                run["landed_over_loopback"] = run["landed"]["bytes_per_s"] / run["loopback_bytes_per_s"]
                run["landed_over_loopback_land"] = run["landed"]["bytes_per_s"] / run["loopback_land_bytes_per_s"]
                run["landed_over_ipc_snapshot"] = run["landed"]["bytes_per_s"] / run["ipc_snapshot"]["bytes_per_s"]
                out["runs"].append(run)
                print(json.dumps(run), file=sys.stderr)
        out["median"] = {k: median([r[k] for r in out["runs"]]) for k in
                         ("stream_over_loopback", "stream_buckets_over_loopback", "stream_over_loopback_land",
                          "stream_buckets_over_loopback_land", "stream_over_ipc_snapshot", "landed_over_loopback",
                          "landed_over_loopback_land", "landed_over_ipc_snapshot")}
        out["median"]["last_send_to_new_version_s"] = median([r["stream"]["last_send_to_new_version_s"] for r in out["runs"]])
        out["median"]["landed_last_send_to_new_version_s"] = median([r["landed"]["last_send_to_new_version_s"] for r in out["runs"]])
        out["load_avg_at_end"] = os.getloadavg()[0]
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
