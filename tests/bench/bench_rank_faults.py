"""How fast a lost rank is noticed (issue #29): tensor-parallel size 2 on stories260K, per CPU
backend (shm, gloo), --control-timeout-s 10 (so a wait that still ran to a deadline shows as 5 s
or 9 s, not as a fast figure), median and max over --trials:
  kill_decode   rank 1 SIGKILLed while 4 streams decode (every step all-reduces): seconds to the
                first rank_failed answer (a stream's error chunk) and to /health "degraded"
  kill_rebuild  rank 1 SIGKILLed while wakeup rebuilds the comm group (FD_TEST_PAUSE_AT=
                comm_connect: rank 1 paused before it joins, rank 0 inside the rendezvous):
                seconds to wakeup's 503 rank_failed answer and to /health "degraded"
  stop_decode   rank 1 SIGSTOPped while the streams decode, --rank-heartbeat-s 1: seconds to the
                first rank_failed answer and to /health "degraded" (bound: 1.2 x the heartbeat)
  stuck_decode  rank 1's main loop hangs while the streams decode (FD_TEST_HANG_AT=forward, armed
                by deleting its file: the process runs and beats, no progress), --rank-heartbeat-s
                1 --rank-stuck-s 1 (bound: the stuck bound + heartbeat/10 + a look = 1.2 s)
  remote_stop   (backend gloo only: two "nodes" on this host, node 1's agent on 127.0.0.2) node 1's
                rank SIGSTOPped while the streams decode, --rank-heartbeat-s 1: node 0 sees no
                process of it, only its missing beats (bound: 1.2 x the heartbeat)
Targets: kill ≤ 0.1 s; stop and stuck ≤ the heartbeat bound. Each figure is also printed as a ratio to its
bound measured against the same run's /health round trip (the reference: one idle HTTP answer).
With --ref-bin (an fdrollout built from an older commit), the same cases run on it and the ratio
new / ref is printed (kill_rebuild needs the comm_connect hook: skipped on a binary without it).

Usage: /usr/bin/python3 tests/bench/bench_rank_faults.py [--trials 3] [--backends shm,gloo]
       [--ref-bin PATH] [--json]"""
import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from fdtest import BIN, STORIES, Daemon, free_port  # noqa: E402

STREAM = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
ENV = {"FD_DEBUG_STEP_DELAY_MS": "5"}


def start(bin_, backend, *args, env=None):
    return Daemon("--dynamic-load-weight", "--tensor-parallel-size", "2", "--threads", "1", "--dist-backend", backend,
                  "--control-timeout-s", "10", *args, extra=False, bin=bin_, env={**ENV, **(env or {})})


class HealthWatch:
    """Polls /health every ~2 ms from a thread; .t = monotonic time it first said degraded."""

    def __init__(self, d):
        self.d, self.t, self.stop = d, None, False
        self.thread = threading.Thread(target=self.run)
        self.thread.start()

    def run(self):
        while not self.stop and self.t is None:
            try:
                if self.d.get("/health", timeout=30)[1]["state"] == "degraded":
                    self.t = time.monotonic()
            except (OSError, KeyError, TypeError):
                pass
            time.sleep(0.002)

    def join(self, timeout=30):
        self.thread.join(timeout)
        self.stop = True
        return self.t


def stream_until_error(port, first_error):
    """One streaming completion; records the monotonic time of the first error chunk of any stream."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(STREAM), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        while True:
            line = resp.readline()
            if not line:
                return
            if line.startswith(b"data: ") and b'"error"' in line:
                first_error.append(time.monotonic())
                return
    except OSError:
        return
    finally:
        conn.close()


def decode_then(d, fault):
    """4 streams on `d`; once they decode, `fault()` (returns the undo); seconds to the first error chunk, to /health degraded."""
    errors = []
    threads = [threading.Thread(target=stream_until_error, args=(d.port, errors)) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while d.get("/health")[1]["num_requests_running"] < 4:
        assert time.time() < deadline, "the streams never ran"
        time.sleep(0.005)
    time.sleep(0.3)
    watch = HealthWatch(d)
    t0 = time.monotonic()
    undo = fault()
    for t in threads:
        t.join(60)
    t_health = watch.join()
    if undo:
        undo()
    return (min(errors) - t0 if errors else float("nan")), (t_health - t0 if t_health else float("nan"))


def stuck_during_decode(bin_, backend, tmp, trial):
    marker = os.path.join(tmp, f"hang-{backend}-{trial}")
    open(marker, "w").close()  # disarmed until deleted
    d = start(bin_, backend, "--rank-heartbeat-s", "1", "--rank-stuck-s", "1", env={"FD_TEST_HANG_AT": f"forward:1:{marker}"})
    try:
        return decode_then(d, lambda: os.unlink(marker))
    finally:
        d.__exit__()


def remote_stop_during_decode(bin_, tmp, trial):
    """Node 0 (this daemon, rank 0) and node 1 (an agent on 127.0.0.2, rank 1) on this host."""
    import subprocess
    token = os.path.join(tmp, "token")
    if not os.path.exists(token):
        with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(os.urandom(32).hex())
    port = free_port()
    node = subprocess.Popen([bin_, "--model", STORIES, "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), "--node-addr", "127.0.0.2",
                             "--dist-token-file", token, "--control-timeout-s", "10"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **ENV})
    try:
        d = Daemon("--dynamic-load-weight", "--tensor-parallel-size", "2", "--threads", "1", "--nnodes", "2", "--node-rank", "0",
                   "--master-addr", "127.0.0.1", "--master-port", str(port), "--dist-token-file", token, "--control-timeout-s", "10",
                   "--rank-heartbeat-s", "1", extra=False, bin=bin_, env=ENV)
        try:
            from fdtest import children, cmdline
            [victim] = [c for c in children(node.pid) if b"--fd-rank-process" in cmdline(c)]

            def stop():
                os.kill(victim, signal.SIGSTOP)
                return lambda: os.kill(victim, signal.SIGCONT)
            return decode_then(d, stop)
        finally:
            d.__exit__()
    finally:
        node.terminate()
        try:
            node.wait(30)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()


def fault_during_decode(bin_, backend, sig, *args):
    d = start(bin_, backend, *args)
    try:
        errors = []
        threads = [threading.Thread(target=stream_until_error, args=(d.port, errors)) for _ in range(4)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while d.get("/health")[1]["num_requests_running"] < 4:
            assert time.time() < deadline, "the streams never ran"
            time.sleep(0.005)
        time.sleep(0.3)
        victim = d.rank_pids()[1]
        watch = HealthWatch(d)
        t0 = time.monotonic()
        os.kill(victim, sig)
        for t in threads:
            t.join(60)
        t_health = watch.join()
        if sig == signal.SIGSTOP:
            os.kill(victim, signal.SIGCONT)
        return (min(errors) - t0 if errors else float("nan")), (t_health - t0 if t_health else float("nan"))
    finally:
        d.__exit__()  # SIGTERM: the daemon removes its control block


def kill_during_rebuild(bin_, backend, tmp, trial):
    marker = os.path.join(tmp, f"rebuild-{abs(hash(bin_))}-{backend}-{trial}")
    d = start(bin_, backend, env={"FD_TEST_PAUSE_AT": f"comm_connect:1:{marker}"})
    try:
        code, j = d.post("/v1/sleep")
        assert code == 200, j
        answer = {}
        t = threading.Thread(target=lambda: answer.update(r=d.post("/v1/wakeup", timeout=60), t=time.monotonic()))
        t.start()
        deadline = time.time() + 5
        while not (os.path.exists(marker) and os.path.getsize(marker) > 0):
            if time.time() > deadline or "r" in answer:
                t.join(60)
                return None  # no comm_connect hook in this binary: the wakeup just succeeded
            time.sleep(0.005)
        with open(marker) as f:
            victim = int(f.read())
        time.sleep(0.2)
        watch = HealthWatch(d)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        t.join(60)
        t_health = watch.join()
        code, j = answer["r"]
        assert (code, j["error"]["type"]) == (503, "rank_failed"), (code, j)
        return answer["t"] - t0, (t_health - t0 if t_health else float("nan"))
    finally:
        d.__exit__()  # SIGTERM: the daemon removes its control block


def health_rtt(bin_):
    d = start(bin_, "shm")
    try:
        samples = []
        for _ in range(50):
            t0 = time.perf_counter()
            d.get("/health")
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    finally:
        d.__exit__()


def run_cases(bin_, backends, trials, tmp):
    out = {}
    for backend in backends:
        cases = {
            "kill_decode": lambda: fault_during_decode(bin_, backend, signal.SIGKILL),
            "kill_rebuild": lambda i=[0]: (i.__setitem__(0, i[0] + 1), kill_during_rebuild(bin_, backend, tmp, i[0]))[1],
            "stop_decode": lambda: fault_during_decode(bin_, backend, signal.SIGSTOP, *(["--rank-heartbeat-s", "1"] if bin_ == BIN else [])),
        }
        if bin_ == BIN:  # the hang hook and --rank-stuck-s are new
            cases["stuck_decode"] = lambda i=[0]: (i.__setitem__(0, i[0] + 1), stuck_during_decode(bin_, backend, tmp, i[0]))[1]
        if bin_ == BIN and backend == "gloo":  # --nnodes 2 runs gloo
            cases["remote_stop"] = lambda i=[0]: (i.__setitem__(0, i[0] + 1), remote_stop_during_decode(bin_, tmp, i[0]))[1]
        for name, case in cases.items():
            runs = []
            for _ in range(trials):
                runs.append(case())
                if runs[-1] is None:
                    break
            if any(r is None for r in runs):
                continue
            print(f"{'ref' if bin_ != BIN else 'new'} {backend}/{name}: {runs}", file=sys.stderr, flush=True)
            answer, health = [r[0] for r in runs], [r[1] for r in runs]
            out[f"{backend}/{name}"] = {"answer_s_median": statistics.median(answer), "answer_s_max": max(answer),
                                        "health_s_median": statistics.median(health), "health_s_max": max(health)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--backends", default="shm,gloo")
    ap.add_argument("--ref-bin", default=None, help="an older fdrollout to measure the same cases on")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fd-bench-faults-")
    try:
        backends = a.backends.split(",")
        rtt = health_rtt(BIN)
        new = run_cases(BIN, backends, a.trials, tmp)
        ref = run_cases(a.ref_bin, backends, a.trials, tmp) if a.ref_bin else {}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"health_rtt_s": rtt, "trials": a.trials, "new": new, "ref": ref}
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(f"/health round trip (reference): {rtt * 1e3:.2f} ms; trials {a.trials}; --control-timeout-s 10")
    print(f"{'case':22} {'answer med/max s':>18} {'health med/max s':>18} {'bound s':>8} {'max/bound':>9} {'ref answer s':>13} {'new/ref':>8}")
    for key, v in new.items():
        bound = 1.2 if key.endswith(("stop_decode", "stuck_decode", "remote_stop")) else 0.1
        worst = max(v["answer_s_max"], v["health_s_max"])
        r = ref.get(key)
        print(f"{key:22} {v['answer_s_median']:8.3f}/{v['answer_s_max']:<8.3f} {v['health_s_median']:8.3f}/{v['health_s_max']:<8.3f} "
              f"{bound:8.2f} {worst / bound:9.2f} {(r['answer_s_median'] if r else float('nan')):13.3f} "
              f"{(v['answer_s_median'] / r['answer_s_median'] if r else float('nan')):8.3f}")


if __name__ == "__main__":
    main()
