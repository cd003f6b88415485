"""fdrollout.Client (python/fdrollout/client.py) against the real daemon: every control call,
the error types of the daemon's table, deadlines (a stopped daemon raises, never hangs), the
control API key. Reference for weights: a fresh daemon on the new checkpoint."""
import os
import shutil
import signal
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from fdtest import STORIES, Daemon, MisbehavingPeer, copy_checkpoint, free_port, fresh_daemon, greedy, perturbed, stop_process  # noqa: E402
from fdrollout import Client, FdRolloutError  # noqa: E402


class ClientCalls(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-pyclient-")
        cls.model = os.path.join(cls.tmp, "model")
        copy_checkpoint(STORIES, cls.model)
        cls.new = os.path.join(cls.tmp, "new")
        perturbed(STORIES, cls.new)
        with fresh_daemon(cls.new) as ref:
            cls.ref_new = greedy(ref)[:2]
        with fresh_daemon(STORIES) as ref:
            cls.ref_old = greedy(ref)[:2]
        cls.d = Daemon("--dynamic-load-weight", model=cls.model)
        cls.c = Client(f"127.0.0.1:{cls.d.port}", timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def put(self, src):
        """The trainer's step: the daemon's --model dir (its `normal` source) gets src's tensors."""
        shutil.copyfile(os.path.join(src, "model.safetensors"), os.path.join(self.model, "model.safetensors"))

    def setUp(self):
        # Every test starts serving the base weights, with nothing staged.
        h = self.c.health()
        if h["state"] != "serving" or h["weight_version"] != "base" or h["staged_weight_version"]:
            self.c.wakeup() if h["sleeping_tags"] else None
            self.c.pause()
            self.c.drop_staged_weights()
            self.put(STORIES)
            self.c.update_weights(version="base")
            self.c.resume()

    def test_pause_update_resume(self):
        self.assertEqual(self.c.pause()["is_paused"], True)
        self.assertTrue(self.c.is_paused())
        self.put(self.new)
        r = self.c.update_weights(version="b")
        self.assertEqual(r["version"], "b")
        self.assertEqual(self.c.weight_version(), "b")
        self.assertTrue(self.c.is_paused(), "update_weights never resumes")
        self.c.resume()
        ids, lps, version = greedy(self.d)
        self.assertEqual((ids, lps), self.ref_new)
        self.assertEqual(version, "b")

    def test_two_phase(self):
        self.c.pause()
        self.put(self.new)
        r = self.c.stage_weights("c")
        self.assertTrue(r["staged"])
        self.assertEqual(self.c.health()["staged_weight_version"], "c")
        self.assertEqual(self.c.weight_version(), "base", "a staged version does not serve")
        with self.assertRaises(FdRolloutError) as e:
            self.c.commit_weights("not-staged")
        self.assertEqual((e.exception.status, e.exception.type), (409, "wrong_state"))
        self.assertEqual(self.c.commit_weights("c")["version"], "c")
        self.c.resume()
        self.assertEqual(greedy(self.d)[:2], self.ref_new)
        self.c.pause()
        self.assertIsNone(self.c.drop_staged_weights()["dropped_version"])

    def test_drop_keeps_serving(self):
        self.c.pause()
        self.put(self.new)
        self.c.stage_weights("d")
        self.assertEqual(self.c.drop_staged_weights()["dropped_version"], "d")
        self.c.resume()
        self.assertEqual(greedy(self.d), (*self.ref_old, "base"))

    def test_sleep_wakeup_tags(self):
        r = self.c.sleep(["weight", "kv_cache"])
        self.assertGreater(r["freed_bytes"]["weight"], 0)
        self.assertEqual(self.c.health()["state"], "sleeping")
        self.c.wakeup("kv_cache")
        self.assertEqual(self.c.health()["sleeping_tags"], ["weight"])
        self.c.wakeup()
        self.c.wait("serving", timeout=30)
        self.assertEqual(greedy(self.d)[:2], self.ref_old)

    def test_errors_carry_the_daemons_type(self):
        with self.assertRaises(FdRolloutError) as e:
            self.c.update_weights(version="x")  # serving: needs a pause
        self.assertEqual((e.exception.status, e.exception.type), (409, "wrong_state"))
        self.assertIn("pause", e.exception.message)
        with self.assertRaises(FdRolloutError) as e:
            self.c.abort(request_id="cmpl-nobody")
        self.assertEqual((e.exception.status, e.exception.type), (404, "not_found"))
        self.assertEqual(self.c.weight_version(), "base", "a refused call changes nothing")

    def test_bad_arguments_are_refused_before_sending(self):
        for call in (lambda: self.c.sleep("weights"), lambda: self.c.sleep([]), lambda: self.c.pause(mode="later"),
                     lambda: self.c.abort(), lambda: self.c.abort("x", all=True), lambda: self.c.wait("asleep")):
            with self.assertRaises(ValueError):
                call()
        for bad in ("ftp://h:1", "http://"):
            with self.assertRaises(ValueError):
                Client(bad)

    def test_update_from_dir(self):
        r = self.c.update_weights_from_dir(self.new, version="e")
        self.assertEqual(r["weight_version"], "e")
        self.assertEqual(greedy(self.d), (*self.ref_new, "e"))
        with self.assertRaises(FdRolloutError) as e:
            self.c.update_weights_from_dir(os.path.join(self.tmp, "missing"), version="f")
        self.assertEqual((e.exception.status, e.exception.type), (503, "source_unavailable"))
        self.assertEqual(self.c.weight_version(), "e", "a refused load changes nothing")

    def test_abort_all(self):
        self.assertIn("aborted", self.c.abort(all=True))
        self.assertFalse(self.c.is_paused(), "abort never pauses")


class Deadlines(unittest.TestCase):
    def test_unreachable(self):
        c = Client(f"http://127.0.0.1:{free_port()}", timeout=5)
        with self.assertRaises(FdRolloutError) as e:
            c.health()
        self.assertEqual((e.exception.status, e.exception.type), (0, "unreachable"))

    def test_stopped_daemon_raises_within_the_deadline(self):
        with Daemon("--dynamic-load-weight") as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=1)
            stop_process(d.proc.pid)
            try:
                t0 = time.monotonic()
                with self.assertRaises(FdRolloutError) as e:
                    c.pause()
                self.assertLess(time.monotonic() - t0, 1 + 5 + 2)  # timeout + socket grace + slack
                self.assertEqual(e.exception.type, "unreachable")
            finally:
                d.proc.send_signal(signal.SIGCONT)
            self.assertEqual(Client(f"127.0.0.1:{d.port}").health()["state"], "serving")

    def test_wait_on_a_stopped_daemon_ends_near_its_timeout(self):
        """Each poll of Client.wait had the call's grace too: against a stopped daemon wait(timeout=2)
        raised "unreachable" after 2 + 5 s, where its docstring said "timeout" after 2 s (a probe)."""
        with Daemon("--dynamic-load-weight") as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=60)
            self.assertEqual(c.wait("serving", timeout=2)["state"], "serving")
            stop_process(d.proc.pid)
            try:
                t0 = time.monotonic()
                with self.assertRaises(FdRolloutError) as e:
                    c.wait("paused", timeout=2)
                self.assertGreater(time.monotonic() - t0, 1.9)
                self.assertLess(time.monotonic() - t0, 2 + 1)
                self.assertEqual((e.exception.status, e.exception.type), (0, "timeout"))
                self.assertIn("/health", e.exception.message)
            finally:
                d.proc.send_signal(signal.SIGCONT)
            t0 = time.monotonic()
            with self.assertRaises(FdRolloutError) as e:
                c.wait("paused", timeout=1)  # answered, never paused
            self.assertLess(time.monotonic() - t0, 1 + 1)
            self.assertEqual(e.exception.type, "timeout")
            self.assertIn("state is 'serving', not 'paused'", e.exception.message)

    def test_a_peer_that_drips_its_answer_raises_within_the_deadline(self):
        """The socket timeout restarts with every byte: a peer answering one byte a second held
        Client.pause() forever (a probe). The whole call is bounded by timeout + 5 s."""
        with MisbehavingPeer("drip") as peer:
            t0 = time.monotonic()
            with self.assertRaises(FdRolloutError) as e:
                Client(f"127.0.0.1:{peer.port}", timeout=1).pause()
            self.assertLess(time.monotonic() - t0, 1 + 5 + 2)
            self.assertEqual(e.exception.type, "unreachable")
            self.assertIn("no complete answer", e.exception.message)

    def test_a_200_that_is_not_json_is_not_a_success(self):
        """A proxy's page or another service answering 200 is not fdrollout: pause() returned None
        as if it had paused, and a fleet counted the member as staged (a probe)."""
        with MisbehavingPeer("garbage") as peer:
            with self.assertRaises(FdRolloutError) as e:
                Client(f"127.0.0.1:{peer.port}", timeout=5).pause()
            self.assertEqual(e.exception.type, "unreachable")
            self.assertIn("not JSON", e.exception.message)


class ControlKey(unittest.TestCase):
    def test_control_api_key(self):
        with Daemon("--dynamic-load-weight", "--control-api-key", "k-ctl") as d:
            with self.assertRaises(FdRolloutError) as e:
                Client(f"127.0.0.1:{d.port}").pause()
            self.assertEqual((e.exception.status, e.exception.type), (401, "unauthorized"))
            self.assertFalse(Client(f"127.0.0.1:{d.port}", api_key="k-ctl").is_paused())
            self.assertTrue(Client(f"127.0.0.1:{d.port}", api_key="k-ctl").pause()["is_paused"])


if __name__ == "__main__":
    unittest.main()
