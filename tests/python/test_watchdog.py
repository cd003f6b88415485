"""fdrollout.watchdog (the client's shared deadline thread): an armed action runs once its time has
passed and not before, a disarmed one never runs, deadlines armed out of order run in deadline
order, thousands of disarmed far deadlines do not pile up, and a forked child gets its own thread.
"""
import os
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from fdrollout import watchdog  # noqa: E402


class Watchdog(unittest.TestCase):
    def test_runs_after_its_time_in_deadline_order_and_not_when_disarmed(self):
        got, done = [], threading.Event()
        t0 = time.monotonic()
        watchdog.arm(0.30, lambda: (got.append(("late", time.monotonic() - t0)), done.set()))
        watchdog.arm(0.10, lambda: got.append(("early", time.monotonic() - t0)))
        gone = watchdog.arm(0.05, lambda: got.append(("disarmed", 0)))
        watchdog.disarm(gone)
        self.assertTrue(done.wait(5))
        self.assertEqual([g[0] for g in got], ["early", "late"])
        self.assertGreaterEqual(got[0][1], 0.10)
        self.assertGreaterEqual(got[1][1], 0.30)

    def test_disarmed_far_deadlines_are_dropped(self):
        for _ in range(5000):
            watchdog.disarm(watchdog.arm(900, lambda: None))
        self.assertLess(len(watchdog._heap), 200)
        self.assertEqual(len(watchdog._live), 0)

    def test_an_action_that_raises_does_not_end_the_thread(self):
        done = threading.Event()
        watchdog.arm(0.01, lambda: 1 / 0)
        watchdog.arm(0.05, done.set)
        self.assertTrue(done.wait(5))

    @unittest.skipUnless(hasattr(os, "fork"), "fork")
    def test_a_forked_child_has_its_own_thread(self):
        watchdog.arm(0.01, lambda: None)  # the parent's thread runs
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            ok = threading.Event()
            watchdog.arm(0.05, ok.set)
            os.write(w, b"1" if ok.wait(5) else b"0")
            os._exit(0)
        os.close(w)
        self.assertEqual(os.read(r, 1), b"1")
        os.waitpid(pid, 0)
        os.close(r)


if __name__ == "__main__":
    unittest.main()
