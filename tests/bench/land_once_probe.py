"""What a "land once" weight stream could reach on this machine (issue 25; docs/weight_streams.md
"Not yet"): a model of the transport with plain sockets, no daemon. One sender process sends
--mib MiB over loopback TCP
  - to one receiver that recv_intos one reused 256 KiB buffer (discard: stream_bench.py's
    iperf-style baseline, the target's reference), or that lands every byte in one buffer of the
    whole size (land);
  - split between --ranks receiver processes, one sender thread each (sendall releases the GIL),
    each landing its share in one persistent buffer (land: as ranks would land their shards in
    their persistent staging arenas) or discarding it.
Each receiver process serves --reps connections into the same buffer, so rep 1 is the first
write to its pages (slow on a PVM guest) and reps 2+ the steady state. Prints JSON: GB/s per rep
and the medians of reps 2+, with each configuration ÷ the 1 -> 1 discard baseline.

  /usr/bin/python3 tests/bench/land_once_probe.py [--mib 103] [--reps 5] [--ranks 2] [--rounds 2]
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loopback_receiver import RECEIVER  # noqa: E402


def run(data, receivers, mode, reps):
    """GB/s of each rep: len(data) bytes split over `receivers` processes in `mode`."""
    share = len(data) // receivers
    ps = [subprocess.Popen([sys.executable, "-c", RECEIVER, str(share), mode, str(reps)], stdout=subprocess.PIPE, text=True)
          for _ in range(receivers)]
    try:
        ports = [int(p.stdout.readline()) for p in ps]
        out = []
        for _ in range(reps):
            socks = [socket.create_connection(("127.0.0.1", port), timeout=60) for port in ports]  # every wait bounded
            views = [memoryview(data)[i * share:(i + 1) * share] for i in range(receivers)]
            t0 = time.perf_counter()
            if receivers == 1:  # as stream_bench.py's baseline sends: from the main thread
                socks[0].sendall(views[0])
            else:
                ths = [threading.Thread(target=socks[i].sendall, args=(views[i],)) for i in range(receivers)]
                for t in ths:
                    t.start()
                for t in ths:
                    t.join()
            got = sum(int(s.recv(64)) for s in socks)
            dt = time.perf_counter() - t0
            for s in socks:
                s.close()
            assert got == share * receivers, (got, share * receivers)
            out.append(share * receivers / dt / 1e9)
        return out
    finally:
        for p in ps:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=103, help="bytes sent per rep (MiB; stream_bench's model is ~99 MiB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2, help="receivers of the split configurations (the tp size)")
    ap.add_argument("--rounds", type=int, default=2, help="the configurations run this many times, interleaved")
    a = ap.parse_args()
    data = np.ones(a.mib << 20, dtype=np.uint8)
    configs = [(1, "discard"), (1, "land"), (a.ranks, "land"), (a.ranks, "discard")]
    runs = {f"{r}->{m}": [] for r, m in configs}
    for _ in range(a.rounds):
        for r, m in configs:
            runs[f"{r}->{m}"].append(run(data, r, m, a.reps))
    steady = {k: statistics.median(x for rep in v for x in rep[1:]) for k, v in runs.items()}
    base = steady["1->discard"]
    out = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(), "mib": a.mib,
           "reps": a.reps, "load_avg_at_start": os.getloadavg()[0],
           "gbs_per_rep": {k: [[round(x, 2) for x in rep] for rep in v] for k, v in runs.items()},
           "steady_median_gbs": {k: round(v, 2) for k, v in steady.items()},
           "steady_vs_iperf_baseline": {k: round(v / base, 3) for k, v in steady.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
