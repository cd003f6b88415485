"""A rank that dies or stops is noticed at once, in every wait on it (issue #29, defects 1, 3, 4).

Tensor-parallel size 2 (two rank processes, mp executor) on both CPU backends (shm, gloo), with
--control-timeout-s 60: before this issue a rank SIGKILLed during decode on shm stalled the
streams for half of it (30 s here) with /health "serving"; a rank killed while wakeup rebuilt the
gloo group blocked the wakeup as long; a stopped rank (SIGSTOP) was never caught before the
deadline (0.9 x the timeout). Now:

- SIGKILL rank 1 while 4 streams decode → every stream ends with a rank_failed error and /health
  says degraded [1] within LIVENESS_S (the bound the tests allow a loaded 2-core machine; the
  benchmark, tests/bench/rank_fault_latency.py, measures the real figure);
- SIGSTOP rank 1 (decoding, or idle) → the same within --rank-heartbeat-s (1 s here) + slack;
- after either, rank 0's late reply (it waited on rank 1 inside the all-reduce, past the step's
  survivor grace) sits unread in its link: the recovery still names rank 1 alone (it named
  [0, 1], "rank 0 closed its link", every time after a SIGSTOP and under load after a SIGKILL);
- rank 1 stuck in its main loop (FD_TEST_HANG_AT=forward, its beat thread still beating) → the
  same within --rank-stuck-s (2 s here) + slack, naming rank 1 only (rank 0 waits on it in the
  all-reduce, which is not "stuck"); with --rank-stuck-s 1, busy ranks are never called stuck;
- rank 1 SIGKILLed while wakeup rebuilds the group (FD_TEST_PAUSE_AT=comm_connect, the rank
  paused before it joins, its peer inside the rendezvous) → wakeup answers 503 rank_failed within
  LIVENESS_S; the next wakeup recovers;
- recovery clears what a two-phase update had staged: /health staged_weight_version null and a
  later commit_weights a 409, never a 500; no control call answers a 500 while degraded or after.
After each fault, wakeup respawns the ranks and the daemon serves the greedy output it served
before the fault (bit for bit: same tp, same backend)."""
import os
import shutil
import signal
import tempfile
import threading
import time
import unittest

from fdtest import Daemon, greedy, STORIES, wait_until

LIVENESS_S = 3.0   # the tests' bound for "at once" (the target, 0.1 s, is the benchmark's)
TIMEOUT = ("--control-timeout-s", "60")
STREAM = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
STEP_DELAY = {"FD_DEBUG_STEP_DELAY_MS": "5"}  # 400 tokens take > 2 s: the fault lands mid-decode


class Streams:
    """n streaming completions in threads; .out[i] = (chunks, saw_done) once each ends."""

    def __init__(self, d, n):
        self.out = [None] * n
        self.ended = [None] * n
        self.threads = [threading.Thread(target=self._run, args=(d, i)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, d, i):
        self.out[i] = d.stream(timeout=120, **STREAM)
        self.ended[i] = time.monotonic()

    def join(self):
        for t in self.threads:
            t.join(120)
        return self.out


def degraded(d):
    status, h = d.get("/health", timeout=5)
    return h if h["state"] == "degraded" else None


class RankLiveness(unittest.TestCase):
    def daemon(self, backend, *args, env=None):
        d = Daemon("--dynamic-load-weight", "--tensor-parallel-size", "2", "--threads", "1", "--dist-backend", backend, *TIMEOUT,
                   *args, extra=False, env={**STEP_DELAY, **(env or {})})
        self.addCleanup(d.__exit__)
        self.assertEqual(len(d.rank_pids()), 2)
        return d

    def ok(self, d, path, body=None):
        status, j = d.post(path, body, timeout=120)
        self.assertEqual(status, 200, j)
        return j["result"]

    def recovers(self, d, before, victim):
        res = self.ok(d, "/v1/wakeup")
        self.assertFalse(res["is_paused"])
        h = d.get("/health")[1]
        self.assertEqual((h["state"], h["degraded_ranks"]), ("serving", []), h)
        self.assertNotIn(victim, d.rank_pids())
        self.assertEqual(greedy(d), before)

    def fault_during_decode(self, backend, sig, *args):
        d = self.daemon(backend, *args)
        before = greedy(d)
        s = Streams(d, 4)
        wait_until(lambda: d.get("/health")[1]["num_requests_running"] >= 4, 30, "4 streams decoding")
        time.sleep(0.2)  # a few steps in: every stream has tokens
        self.assertTrue(all(o is None for o in s.out), "the streams ended before the fault")
        victim = d.rank_pids()[1]
        t0 = time.monotonic()
        os.kill(victim, sig)
        try:
            h = wait_until(lambda: degraded(d), 30, "/health degraded")
            t_health = time.monotonic() - t0
            s.join()
            t_streams = max(s.ended) - t0
        finally:
            if sig == signal.SIGSTOP:
                os.kill(victim, signal.SIGCONT)
        self.assertEqual(h["degraded_ranks"], [1], h)
        for chunks, done in s.out:
            self.assertTrue(done)
            errors = [c["error"] for c in chunks if "error" in c]
            self.assertEqual([e["type"] for e in errors], ["rank_failed"], chunks[-2:])
            self.assertIn("rank 1", errors[0]["message"])
            self.assertEqual(set(errors[0]), {"message", "type", "param", "code"})  # the shape of every error object
            self.assertGreater(sum(len(c["choices"][0]["token_ids"]) for c in chunks if c.get("choices")), 0)
        status, j = d.post("/v1/completions", {"prompt": "Once", "max_tokens": 2}, timeout=10)
        self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
        # Rank 0 waited on rank 1 inside the step's all-reduce; its error reply may come after the
        # step gave up on it and sits unread in its link. That is no sign of a dead rank: the
        # recovery (which looks again, well after the reply came) still names rank 1 alone.
        time.sleep(0.3)
        self.recovers(d, before, victim)
        self.assertIn("wakeup: recovering rank(s) [1]", d.output())
        self.assertNotIn("recovering rank(s) [0, 1]", d.output())
        return t_health, t_streams

    def test_a_rank_killed_during_decode_is_noticed_at_once(self):
        for backend in ("shm", "gloo"):
            with self.subTest(backend):
                t_health, t_streams = self.fault_during_decode(backend, signal.SIGKILL)
                print(f"\n{backend}: SIGKILL during decode -> /health degraded {t_health:.3f} s, streams ended {t_streams:.3f} s", end="")
                self.assertLess(t_health, LIVENESS_S)
                self.assertLess(t_streams, LIVENESS_S)

    def test_a_stopped_rank_is_caught_by_the_heartbeat(self):
        for backend in ("shm", "gloo"):
            with self.subTest(backend):
                t_health, t_streams = self.fault_during_decode(backend, signal.SIGSTOP, "--rank-heartbeat-s", "1")
                print(f"\n{backend}: SIGSTOP during decode -> /health degraded {t_health:.3f} s, streams ended {t_streams:.3f} s", end="")
                self.assertGreater(t_health, 0.9)  # the heartbeat's bound, not earlier: a stop is not an exit
                self.assertLess(t_health, 1.0 + LIVENESS_S)
                self.assertLess(t_streams, 1.0 + LIVENESS_S)

    def test_a_rank_stopped_while_idle_turns_health_degraded(self):
        d = self.daemon("shm", "--rank-heartbeat-s", "1")
        victim = d.rank_pids()[1]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        try:
            h = wait_until(lambda: degraded(d), 30, "/health degraded")
        finally:
            os.kill(victim, signal.SIGCONT)
        self.assertLess(time.monotonic() - t0, 1.0 + LIVENESS_S)
        self.assertEqual(h["degraded_ranks"], [1], h)
        status, j = d.post("/v1/update_weights", {}, timeout=10)
        self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
        self.assertIn("stopped", j["error"]["message"])

    def test_a_stuck_rank_is_caught_by_its_beat_and_its_waiting_peer_is_not_named(self):
        # FD_TEST_HANG_AT=forward:1:FILE, armed by deleting FILE: rank 1's next step hangs in its main
        # loop (no progress) while its beat thread beats, and rank 0 waits for it in the all-reduce.
        # Before the heartbeat carried progress, this waited for the deadline (0.9 x 60 s here).
        tmp = tempfile.mkdtemp(prefix="fd-stuck-")
        self.addCleanup(shutil.rmtree, tmp, True)
        for backend in ("shm", "gloo"):
            with self.subTest(backend):
                marker = os.path.join(tmp, f"hang-{backend}")
                open(marker, "w").close()  # disarmed until deleted
                d = self.daemon(backend, "--rank-heartbeat-s", "1", "--rank-stuck-s", "2",
                                env={"FD_TEST_HANG_AT": f"forward:1:{marker}"})
                before = greedy(d)
                s = Streams(d, 4)
                wait_until(lambda: d.get("/health")[1]["num_requests_running"] >= 4, 30, "4 streams decoding")
                time.sleep(0.2)
                victim = d.rank_pids()[1]
                t0 = time.monotonic()
                os.unlink(marker)  # armed: rank 1's next forward hangs
                h = wait_until(lambda: degraded(d), 30, "/health degraded")
                t_health = time.monotonic() - t0
                s.join()
                print(f"\n{backend}: rank stuck in its main loop -> /health degraded {t_health:.3f} s (--rank-stuck-s 2)", end="")
                self.assertEqual(h["degraded_ranks"], [1], h)  # rank 0, waiting on it in the all-reduce, is not named
                self.assertGreater(t_health, 1.9)  # the stuck bound, not earlier: it still beats
                self.assertLess(t_health, 2.0 + LIVENESS_S)
                for chunks, done in s.out:
                    errors = [c["error"] for c in chunks if "error" in c]
                    self.assertEqual([e["type"] for e in errors], ["rank_failed"], chunks[-2:])
                    self.assertIn("rank 1", errors[0]["message"])
                    self.assertIn("is stuck", errors[0]["message"])
                self.assertIn(victim, d.rank_pids())  # alive until recovery: it beats, it is not stopped
                self.recovers(d, before, victim)

    def test_busy_ranks_are_not_called_stuck_under_a_short_bound(self):
        # Negative control: with --rank-stuck-s 1, decoding, an update, sleep and wakeup all tick
        # (kernel jobs, weight bytes, requests, collectives): no rank is failed.
        d = self.daemon("shm", "--rank-heartbeat-s", "1", "--rank-stuck-s", "1")
        before = greedy(d)
        s = Streams(d, 4)
        s.join()
        for chunks, done in s.out:
            self.assertTrue(done)
            self.assertFalse([c for c in chunks if "error" in c], chunks[-2:])
        self.ok(d, "/v1/pause")
        self.ok(d, "/v1/update_weights", {"version": "b"})
        self.ok(d, "/v1/sleep")
        self.ok(d, "/v1/wakeup")
        h = d.get("/health")[1]
        self.assertEqual((h["state"], h["degraded_ranks"]), ("serving", []), h)
        self.assertEqual(greedy(d)[:2], before[:2])  # same weights, now labelled b
        self.assertNotIn("is stuck", d.output())

    def test_a_rank_killed_while_wakeup_rebuilds_the_group(self):
        tmp = tempfile.mkdtemp(prefix="fd-liveness-")
        self.addCleanup(shutil.rmtree, tmp, True)
        for backend in ("gloo", "shm"):
            with self.subTest(backend):
                marker = os.path.join(tmp, f"rebuild-{backend}")
                d = self.daemon(backend, env={"FD_TEST_PAUSE_AT": f"comm_connect:1:{marker}"})
                before = greedy(d)
                self.ok(d, "/v1/sleep", None)
                answer = {}
                t = threading.Thread(target=lambda: answer.update(r=d.post("/v1/wakeup", None, timeout=120)))
                t.start()
                wait_until(lambda: os.path.exists(marker) and os.path.getsize(marker) > 0, 30, "rank 1 at comm_connect")
                with open(marker) as f:
                    victim = int(f.read())
                time.sleep(0.2)  # rank 0 is inside the rendezvous, waiting for rank 1
                t0 = time.monotonic()
                os.kill(victim, signal.SIGKILL)
                t.join(120)
                took = time.monotonic() - t0
                status, j = answer["r"]
                print(f"\n{backend}: SIGKILL during the group rebuild -> wakeup answered {took:.3f} s", end="")
                self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
                self.assertIn(f"rank 1 (pid {victim})", j["error"]["message"])
                self.assertLess(took, LIVENESS_S)
                self.assertEqual(degraded(d)["degraded_ranks"], [1])
                self.recovers(d, before, victim)

    def test_recovery_clears_the_staged_version_and_no_control_call_is_a_500(self):
        d = self.daemon("shm")
        before = greedy(d)
        self.ok(d, "/v1/pause")
        res = self.ok(d, "/v1/update_weights", {"version": "b", "commit": False})
        self.assertTrue(res["staged"])
        self.assertEqual(d.get("/health")[1]["staged_weight_version"], "b")
        victim = d.rank_pids()[1]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: degraded(d), 30, "/health degraded")
        status, j = d.post("/v1/commit_weights", {"version": "b"})
        self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
        calls = [("/v1/pause", None), ("/v1/pause?mode=keep", None), ("/v1/resume", None), ("/v1/update_weights", {"version": "c"}),
                 ("/v1/update_weights", {"version": "c", "commit": False}), ("/v1/commit_weights", None),
                 ("/v1/drop_staged_weights", None), ("/v1/sleep?tags=kv_cache", None), ("/v1/abort", {"abort_all": True}),
                 ("/flush_cache", None)]
        for path, body in calls:  # degraded: 2xx, 4xx or 503, never a 500
            status, j = d.post(path, body)
            self.assertTrue(status < 500 or status == 503, (path, status, j))
        self.ok(d, "/v1/wakeup")
        h = d.get("/health")[1]
        self.assertEqual((h["state"], h["staged_weight_version"], h["weight_version"]), ("serving", None, "0"), h)
        self.assertEqual(greedy(d), before)
        self.ok(d, "/v1/pause")
        status, j = d.post("/v1/commit_weights", {"version": "b"})
        self.assertEqual((status, j["error"]["type"]), (409, "wrong_state"), j)
        status, j = d.post("/v1/commit_weights", None)
        self.assertEqual((status, j["error"]["type"]), (409, "wrong_state"), j)
        for path, body in calls + [("/v1/sleep", None), ("/v1/commit_weights", None), ("/v1/wakeup?tags=weight", None),
                                   ("/v1/wakeup", None), ("/v1/drop_staged_weights", None)]:  # after recovery: never a 5xx
            status, j = d.post(path, body)
            self.assertLess(status, 500, (path, status, j))
        # and a two-phase update still works end to end
        self.ok(d, "/v1/pause")
        self.ok(d, "/v1/update_weights", {"version": "b2", "commit": False})
        self.assertEqual(self.ok(d, "/v1/commit_weights", {"version": "b2"})["version"], "b2")
        self.ok(d, "/v1/resume")
        self.assertEqual(greedy(d)[:2], before[:2])  # --model unchanged: the same weights under a new label


if __name__ == "__main__":
    unittest.main(verbosity=2)
