"""A stopped daemon is a timeout, not "gone", and a command reported as failed never takes effect
later (issue 12, defect 2; CTest label `reliability`).

fdctl over the control block: under SIGSTOP (heartbeat stale, pid alive) `fdctl --timeout 3 pause`
exits 7 saying the command was withdrawn; after SIGCONT the daemon drops it (a logged line) and
its state is unchanged. The same holds for a command queued behind a slow one. Over HTTP a client
deadline (X-Request-Timeout: seconds from receipt, X-Request-Deadline: Unix time, which fdctl
--transport v1 sends) withdraws a command the engine has not started by then: 504, not run.
"""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import unittest

from fdtest import FDCTL, Daemon, fdctl, greedy, stop_process, wait_control_in_flight

EXIT_TIMEOUT = 7
# The slow command the queued ones wait behind (FD_DEBUG_CONTROL_DELAY_MS): it must outlast the
# queued command's start (an fdctl exec, then its 0.7 s --timeout).
SLOW_PAUSE_MS = 2500


def state(d):
    """(is_paused, sleeping_tags) from /health."""
    j = d.get("/health")[1]
    return j["is_paused"], j["sleeping_tags"]


class Stopped:
    """SIGSTOP the daemon for the with-block; SIGCONT on the way out, whatever happens."""

    def __init__(self, d):
        self.pid = d.proc.pid

    def __enter__(self):
        stop_process(self.pid)
        return self

    def __exit__(self, *exc):
        os.kill(self.pid, signal.SIGCONT)


def wait_log(d, text, timeout=10):
    """Wait until the daemon log contains text; returns whether it did."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in d.output():
            return True
        time.sleep(0.05)
    return False


class StalledDaemon(unittest.TestCase):
    def test_fdctl_against_a_stopped_daemon_is_a_timeout_and_nothing_runs_after_sigcont(self):
        with Daemon("--dynamic-load-weight") as d:
            before = greedy(d)
            with Stopped(d):
                time.sleep(2.5)  # past the 2 s heartbeat window: the block looks stale, the pid lives
                rc, _, err = fdctl(d.port, "--timeout", "3", "pause", timeout=30)
                self.assertEqual(rc, EXIT_TIMEOUT, err)  # was 8 "gone"
                self.assertIn("withdrawn", err)
                self.assertIn("stopped (SIGSTOP) or stalled", err)
                # The next caller takes an idle mailbox slot (not the one holding the unanswered
                # pause): its command is withdrawn at its own deadline too.
                rc, _, err = fdctl(d.port, "--timeout", "1", "sleep", "--tags", "kv_cache", timeout=30)
                self.assertEqual(rc, EXIT_TIMEOUT, err)
                self.assertIn("withdrawn", err)
            # Continued: the withdrawn pause is dropped, logged, never run.
            self.assertTrue(wait_log(d, "dropped mailbox command 'pause'"), d.output())
            rc, out, err = fdctl(d.port, "--timeout", "10", "--json", "status")
            self.assertEqual(rc, 0, err)
            self.assertEqual((json.loads(out)["is_paused"], json.loads(out)["sleeping_tags"]), (False, []))
            self.assertEqual(state(d), (False, []))
            self.assertEqual(greedy(d), before)
            # And the mailbox works again at once.
            rc, out, err = fdctl(d.port, "--timeout", "10", "pause")
            self.assertEqual(rc, 0, err)
            self.assertEqual(state(d), (True, []))

    def test_random_stops_around_fdctl_calls_every_reported_outcome_is_the_truth(self):
        # Toggle pause/resume through fdctl while the daemon is stopped for random spans that end
        # before, at or after fdctl's random --timeout, so the deadline often falls right when the
        # daemon picks the command up. After each call: exit 0 => applied; exit 7 "withdrawn",
        # "nothing was sent" or the daemon's own "not started before the caller's deadline: dropped,
        # nothing changed" (it saw the deadline pass first) => not applied, also after SIGCONT.
        seed = int(os.environ.get("FD_STALL_SEED", str(int(time.time()))))
        print(f"FD_STALL_SEED={seed}", file=sys.stderr)
        rng = random.Random(seed)
        outcomes = {"ok": 0, "withdrawn": 0, "not sent": 0, "dropped": 0}
        with Daemon("--dynamic-load-weight") as d:
            paused = False
            for _ in range(int(os.environ.get("FD_STALL_TRIALS", "16"))):
                op = "resume" if paused else "pause"
                stop_s, timeout_s = rng.uniform(0, 1.2), rng.uniform(0.2, 1.2)
                os.kill(d.proc.pid, signal.SIGSTOP)
                timer = threading.Timer(stop_s, os.kill, (d.proc.pid, signal.SIGCONT))
                timer.start()
                try:
                    rc, _, err = fdctl(d.port, "--timeout", f"{timeout_s:.3f}", op, timeout=30)
                finally:
                    timer.join()
                    os.kill(d.proc.pid, signal.SIGCONT)
                if rc == 0:
                    paused = not paused
                    outcomes["ok"] += 1
                else:
                    self.assertEqual(rc, EXIT_TIMEOUT, err)
                    kind = ("withdrawn" if "withdrawn" in err else "not sent" if "nothing was sent" in err
                            else "dropped" if "not started before the caller's deadline: dropped, nothing changed" in err else None)
                    self.assertIsNotNone(kind, err)
                    outcomes[kind] += 1
                # Let the continued daemon drain its mailbox, then compare with what fdctl said.
                rc, out, err = fdctl(d.port, "--timeout", "20", "--json", "status")
                self.assertEqual(rc, 0, err)
                time.sleep(0.2)
                self.assertEqual(state(d), (paused, []), (op, stop_s, timeout_s))
        print(f"outcomes: {outcomes}", file=sys.stderr)

    def test_a_stop_shorter_than_the_timeout_is_just_a_slow_answer(self):
        with Daemon("--dynamic-load-weight") as d:
            with Stopped(d):
                p = subprocess.Popen([FDCTL, "--port", str(d.port), "--timeout", "20", "pause"], stderr=subprocess.PIPE, text=True)
                time.sleep(3)  # heartbeat stale for a while: fdctl must keep waiting, not call it gone
            _, err = p.communicate(timeout=30)
            self.assertEqual(p.returncode, 0, err)
            self.assertEqual(state(d), (True, []))

    def test_an_fdctl_command_queued_behind_a_slow_one_is_withdrawn_at_its_deadline(self):
        with Daemon("--dynamic-load-weight", env={"FD_DEBUG_CONTROL_DELAY_MS": str(SLOW_PAUSE_MS)}) as d:
            slow = threading.Thread(target=lambda: d.post("/v1/pause", timeout=30))
            slow.start()
            wait_control_in_flight(d, "pause")  # the pause is running (SLOW_PAUSE_MS), not just sent
            rc, _, err = fdctl(d.port, "--timeout", "0.7", "resume", timeout=30)
            self.assertEqual(rc, EXIT_TIMEOUT, err)
            self.assertIn("withdrawn", err)
            slow.join()
            self.assertTrue(wait_log(d, "dropped resume"), d.output())
            time.sleep(0.3)
            self.assertEqual(state(d), (True, []))  # the pause ran, the withdrawn resume never did

    def test_http_x_request_timeout_withdraws_a_queued_command(self):
        with Daemon("--dynamic-load-weight", env={"FD_DEBUG_CONTROL_DELAY_MS": str(SLOW_PAUSE_MS)}) as d:
            slow = threading.Thread(target=lambda: d.post("/v1/pause", timeout=30))
            slow.start()
            wait_control_in_flight(d, "pause")
            status, j = d.post("/v1/resume", headers={"X-Request-Timeout": "0.5"}, timeout=30)
            self.assertEqual((status, j["error"]["type"]), (504, "timeout"), j)
            self.assertIn("withdrawn", j["error"]["message"])
            slow.join()
            time.sleep(0.3)
            self.assertEqual(state(d), (True, []))
            # A deadline long enough: it runs (after the delay) and says so.
            status, j = d.post("/v1/resume", headers={"X-Request-Timeout": "20"}, timeout=30)
            self.assertEqual(status, 200, j)
            self.assertEqual(state(d), (False, []))

    def test_a_started_command_past_its_bound_names_the_seconds_waited(self):
        # Started before its 1 s deadline, running 3.5 s: the answer comes at the deadline + 2 s,
        # and says so (it said "within 2 s (--control-timeout-s)" after 3 s: a probe).
        with Daemon("--dynamic-load-weight", "--control-timeout-s", "2", env={"FD_DEBUG_CONTROL_DELAY_MS": "3500"}) as d:
            t0 = time.monotonic()
            status, j = d.post("/v1/pause", headers={"X-Request-Timeout": "1"}, timeout=30)
            waited = time.monotonic() - t0
            self.assertEqual((status, j["error"]["type"]), (504, "timeout"), j)
            self.assertIn("within 3.0 s of its receipt", j["error"]["message"])
            self.assertGreaterEqual(waited, 2.9)
            deadline = time.monotonic() + 10  # it had started: it finishes, and takes effect
            while state(d) != (True, []) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(state(d), (True, []))

    def test_http_deadline_header_under_sigstop_and_fdctl_v1(self):
        with Daemon("--dynamic-load-weight") as d:
            out = {}

            def call():
                out["r"] = d.post("/v1/pause", headers={"X-Request-Deadline": f"{time.time() + 1:.3f}"}, timeout=30)

            with Stopped(d):
                t = threading.Thread(target=call)
                t.start()
                p = subprocess.Popen([FDCTL, "--port", str(d.port), "--transport", "v1", "--timeout", "1", "sleep"],
                                     stderr=subprocess.PIPE, text=True)
                time.sleep(2.5)  # both deadlines pass while the daemon is stopped
            t.join(30)
            _, err = p.communicate(timeout=30)
            status, j = out["r"]
            self.assertEqual(status, 504, (j, d.output()[-3000:]))  # the answer and the daemon's log when it is not 504
            self.assertEqual(j["error"]["type"], "timeout", j)
            self.assertEqual(p.returncode, EXIT_TIMEOUT, err)
            self.assertEqual(state(d), (False, []))  # neither the pause nor the sleep ran

    def test_fdctl_v1_wait_and_status_against_a_stopped_daemon_end_at_their_timeout(self):
        """`wait` polls GET /health, answered at once by a live daemon: against a stopped one each
        poll got --timeout + 5 s of grace, so `--timeout 2 wait` took 7.4 s and said "after 2 s" (a
        probe). A stopped daemon's control call says its command is withdrawn (the watchdog's
        "not a healthy fdrollout" fired first before)."""
        with Daemon("--dynamic-load-weight") as d:
            with Stopped(d):
                t0 = time.time()
                rc, _, err = fdctl(d.port, "--transport", "v1", "--timeout", "2", "wait", "--until", "paused", timeout=60)
                self.assertEqual(rc, EXIT_TIMEOUT, err)
                self.assertLess(time.time() - t0, 4.5, err)
                t0 = time.time()
                rc, _, err = fdctl(d.port, "--transport", "v1", "--timeout", "1", "status", timeout=60)
                self.assertEqual(rc, EXIT_TIMEOUT, err)
                self.assertLess(time.time() - t0, 3.5, err)
                rc, _, err = fdctl(d.port, "--transport", "v1", "--timeout", "1", "pause", timeout=60)
                self.assertEqual(rc, EXIT_TIMEOUT, err)
                self.assertIn("withdrawn when it resumes", err)
            self.assertEqual(state(d), (False, []))

    def test_bad_deadline_headers_are_400_and_change_nothing(self):
        with Daemon("--dynamic-load-weight") as d:
            for h in ({"X-Request-Timeout": "soon"}, {"X-Request-Timeout": "-1"}, {"X-Request-Timeout": "nan"},
                      {"X-Request-Deadline": "1e400"}):
                with self.subTest(h):
                    status, j = d.post("/v1/pause", headers=h)
                    self.assertEqual((status, j["error"]["type"]), (400, "invalid_argument"), j)
                    self.assertIn(list(h)[0], j["error"]["message"])
            self.assertEqual(state(d), (False, []))
            # A deadline already past on arrival: 504 at once, nothing done.
            status, j = d.post("/v1/pause", headers={"X-Request-Deadline": f"{time.time() - 5:.3f}"})
            self.assertEqual((status, j["error"]["type"]), (504, "timeout"), j)
            self.assertEqual(state(d), (False, []))


if __name__ == "__main__":
    unittest.main()
