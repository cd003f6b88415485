"""SIGTERM/SIGINT: stop accepting, let in-flight requests finish within the grace period, exit 0;
what outlives the grace period ends with finish_reason "abort"."""
import signal
import threading
import unittest

from fdtest import Daemon, merge_stream, wait_until

LONG = {"prompt": "Once upon a time", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "n": 24}


class Lifecycle(unittest.TestCase):
    def drain(self, sig, grace, expect_finish):
        with Daemon("--shutdown-grace-s", str(grace)) as d:
            results = {}

            def stream():
                chunks, done = d.stream(**LONG)
                results["stream"] = (merge_stream(chunks), done)

            def plain():
                results["plain"] = d.post("/v1/completions", LONG)

            threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
            for t in threads:
                t.start()
            # both requests admitted (24 + 24 choices) before the signal: what is refused after it is new work
            wait_until(lambda: d.get("/health")[1]["num_requests_running"] == 48, 60, "48 choices running")
            d.proc.send_signal(sig)
            # new work is refused once draining shows (not after a fixed sleep: under load the
            # daemon's signal thread may not have run yet, and a request sent before it does is
            # rightly admitted)
            try:
                wait_until(lambda: d.get("/health", timeout=5)[1]["status"] == "draining", 30, "draining in /health")
                status, j = d.post("/v1/completions", {"prompt": "Lily", "max_tokens": 2}, timeout=5)
                self.assertEqual(status, 503)
                # its own type (issue #26): a client retries elsewhere, not after a resume here
                self.assertEqual(j["error"]["type"], "shutting_down")
                self.assertIn("shutting down", j["error"]["message"])
            except OSError:
                pass  # the listener may already be closed (past a short grace period)
            for t in threads:
                t.join(60)
            self.assertEqual(d.proc.wait(60), 0)
            merged, done = results["stream"]
            self.assertTrue(done)
            self.assertEqual({m["finish_reason"] for m in merged.values()}, {expect_finish})
            status, j = results["plain"]
            self.assertEqual(status, 200)
            self.assertEqual({c["finish_reason"] for c in j["choices"]}, {expect_finish})
            if expect_finish == "length":
                self.assertTrue(all(len(c["token_ids"]) == 500 for c in j["choices"]))
            else:
                self.assertTrue(all(len(c["token_ids"]) < 500 for c in j["choices"]))
            self.assertIn("draining", d.output())

    def test_sigterm_lets_in_flight_requests_finish(self):
        self.drain(signal.SIGTERM, 60, "length")

    def test_sigint_past_the_grace_period_aborts_and_exits_zero(self):
        self.drain(signal.SIGINT, 0.05, "abort")

    def test_a_second_sigint_stops_the_drain_at_once(self):
        """The first Ctrl-C drains (and says how to stop now), a second one stops at once (issue #26)."""
        with Daemon("--shutdown-grace-s", "300", env={"FD_DEBUG_STEP_DELAY_MS": "50"}) as d:  # 500 steps: ~25 s
            results = {}

            def stream():
                results["stream"] = d.stream(**{**LONG, "n": 2})

            t = threading.Thread(target=stream)
            t.start()
            wait_until(lambda: d.get("/health")[1]["num_requests_running"] == 2, 60, "2 choices running")
            d.proc.send_signal(signal.SIGINT)
            wait_until(lambda: "Ctrl-C (or another SIGTERM) again to stop now" in d.output(), 30, "the drain message")
            self.assertIn("draining 2 choice(s), up to 300 s", d.output())
            self.assertIsNone(d.proc.poll())  # still draining
            d.proc.send_signal(signal.SIGINT)
            self.assertEqual(d.proc.wait(15), 0)
            t.join(30)
            chunks, done = results["stream"]
            self.assertTrue(done)
            self.assertEqual({m["finish_reason"] for m in merge_stream(chunks).values()}, {"abort"})


class DuringStartUp(unittest.TestCase):
    def test_a_signal_during_start_up_stops_it_at_once(self):
        """A probe: SIGTERM while the daemon loaded (here: pre-faulting a 3 GiB KV pool, several
        seconds on this machine) was held until start-up ended; the daemon then served and only
        then drained. Now start-up stops at once, exit 0, and leaves no control block."""
        import os
        import subprocess
        import time
        from fdtest import BIN, STORIES, free_port
        port = free_port()
        p = subprocess.Popen([BIN, "--model", STORIES, "--port", str(port), "--threads", "1", "--kv-cache-bytes", "3GiB"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_until(lambda: os.path.exists(f"/dev/shm/fdrollout.{port}"), 30, "the control block (start-up under way)")
            t0 = time.time()
            p.send_signal(signal.SIGTERM)
            out, _ = p.communicate(timeout=60)
            self.assertEqual(p.returncode, 0, out)
            self.assertLess(time.time() - t0, 2.0, out)
            self.assertIn("during start-up", out)
            self.assertNotIn("serving '", out)
            self.assertFalse(os.path.exists(f"/dev/shm/fdrollout.{port}"))
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


class Port(unittest.TestCase):
    def test_a_second_daemon_on_a_taken_port_is_refused(self):
        import subprocess
        from fdtest import BIN
        with Daemon() as d:
            p = subprocess.run([BIN, "--port", str(d.port)], capture_output=True, text=True, timeout=60)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn(f"already owns port {d.port}", p.stderr)
            self.assertIn("--port", p.stderr)
            self.assertNotIn("KV pool", p.stderr)  # refused before loading the model
            # the first one still answers every request
            for _ in range(10):
                self.assertEqual(d.get("/v1/models")[1]["data"][0]["id"], "stories260K")


if __name__ == "__main__":
    unittest.main()
