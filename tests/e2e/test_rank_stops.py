"""Rank stops and losses at the edges a probe found (tensor-parallel size 2, mp executor; the
liveness paths themselves: test_rank_liveness.py):

- two stops of a busy rank, each shorter than --rank-heartbeat-s, are not a failure (the time of
  the first stop stayed remembered while steps answered between the executor's looks, so the
  second failed the rank as "stopped for 2.6 s" and killed every request in flight);
- SIGTERM with stopped ranks exits within the grace (each stopped rank was asked to shut down and
  waited for 5 s, then 5 s more before its SIGKILL: 20 s with two, and a false "did not exit
  after SIGKILL" error);
- `fdctl wait` on a degraded daemon answers at once with rank_failed's exit code (--until
  serving waited the whole --timeout, --until paused exited 0);
- a pause mode=wait whose requests end with rank_failed answers rank_failed (it answered 200
  "drained": 3).
"""
import os
import signal
import threading
import time
import unittest

from fdtest import Daemon, fdctl, wait_control_in_flight, wait_until

EXIT_RANK_FAILED = 14
LONG = {"prompt": "Once upon a time", "max_tokens": 480, "temperature": 0, "ignore_eos": True}


class RankStops(unittest.TestCase):
    def daemon(self, *args, env=None):
        d = Daemon("--dynamic-load-weight", "--tensor-parallel-size", "2", "--threads", "1", "--control-timeout-s", "60", *args,
                   extra=False, env={"FD_DEBUG_STEP_DELAY_MS": "5", **(env or {})})
        self.addCleanup(d.__exit__)
        self.assertEqual(len(d.rank_pids()), 2)
        return d

    def streams(self, d, n):
        out = [None] * n

        def run(i):
            out[i] = d.stream(timeout=120, **LONG)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        wait_until(lambda: d.get("/health")[1]["num_requests_running"] >= n, 30, f"{n} streams decoding")
        return threads, out

    def test_two_short_stops_of_a_busy_rank_are_not_a_failure(self):
        d = self.daemon("--rank-heartbeat-s", "1")
        threads, out = self.streams(d, 2)
        victim = d.rank_pids()[1]
        for stop_s, run_s in ((0.6, 1.5), (0.15, 0.5)):
            os.kill(victim, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(victim, signal.SIGCONT)
            time.sleep(run_s)
            self.assertEqual(d.get("/health")[1]["state"], "serving", d.output()[-2000:])
        for t in threads:
            t.join(120)
        for chunks, done in out:
            self.assertTrue(done)
            self.assertEqual([c["error"] for c in chunks if "error" in c], [])
            self.assertEqual(sum(len(c["choices"][0]["token_ids"]) for c in chunks if c.get("choices")), LONG["max_tokens"])
        self.assertNotIn("is stopped", d.output())

    def test_sigterm_with_stopped_ranks_exits_within_the_grace(self):
        # a long heartbeat: the stops are not seen before the SIGTERM (the daemon is not degraded)
        d = self.daemon("--rank-heartbeat-s", "60", "--shutdown-grace-s", "1")
        ranks = d.rank_pids()
        for r in ranks:
            os.kill(r, signal.SIGSTOP)
        t0 = time.monotonic()
        rc = d.stop(timeout=60)
        took = time.monotonic() - t0
        self.assertEqual(rc, 0, d.output()[-2000:])
        self.assertLess(took, 8, d.output()[-2000:])  # 20 s before: 5 s per rank for its answer, then 5 s before its SIGKILL
        self.assertNotIn("did not exit after SIGKILL", d.output())
        for r in ranks:
            self.assertFalse(os.path.exists(f"/proc/{r}"), f"rank process {r} left behind")

    def lose_rank_1(self, d):
        os.kill(d.rank_pids()[1], signal.SIGKILL)
        wait_until(lambda: d.get("/health", timeout=5)[1]["state"] == "degraded", 30, "/health degraded")

    def test_fdctl_wait_on_a_degraded_daemon_is_rank_failed_at_once(self):
        d = self.daemon()
        self.lose_rank_1(d)
        for transport in ("shm", "v1"):
            for until in ("serving", "paused"):
                with self.subTest(transport=transport, until=until):
                    t0 = time.monotonic()
                    rc, out, err = fdctl(d.port, "--transport", transport, "--timeout", "20", "wait", "--until", until)
                    self.assertEqual(rc, EXIT_RANK_FAILED, (out, err))
                    self.assertLess(time.monotonic() - t0, 10)
                    self.assertIn("degraded", err)
                    self.assertIn("[1]", err)
        self.assertEqual(d.post("/v1/wakeup", timeout=120)[0], 200)
        rc, out, err = fdctl(d.port, "--timeout", "20", "wait", "--until", "serving")
        self.assertEqual((rc, out.strip()), (0, "state=serving"), err)

    def test_a_pause_wait_whose_requests_fail_answers_rank_failed(self):
        d = self.daemon()
        threads, out = self.streams(d, 3)
        answer = {}
        pause = threading.Thread(target=lambda: answer.update(r=d.post("/v1/pause?mode=wait", timeout=120)))
        pause.start()
        wait_control_in_flight(d, "pause")
        time.sleep(0.3)
        self.lose_rank_1(d)
        pause.join(60)
        for t in threads:
            t.join(60)
        status, j = answer["r"]
        self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
        self.assertIn("3 choice(s) drained", j["error"]["message"])
        for chunks, done in out:
            self.assertEqual([c["error"]["type"] for c in chunks if "error" in c], ["rank_failed"])


if __name__ == "__main__":
    unittest.main()
