"""SIGKILL at random points of update_weights / sleep / wakeup, then a clean restart on the same
port (issue 12; CTest label `reliability`): nothing a killed daemon leaves behind — its control
block, the ipc weight record, a half-done update — keeps the next one from starting, and the
restarted daemon serves exactly what a fresh daemon serves on the same checkpoint (ids, logprobs
and weight_version, bit-exact). FD_CRASH_SEED fixes the random kill points (the seed is printed).
"""
import glob
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import unittest

from fdtest import STORIES, Daemon, copy_checkpoint, fdctl, free_port, greedy, perturbed

TRIALS = int(os.environ.get("FD_CRASH_TRIALS", "9"))


class CrashRestart(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-crash-")
        cls.A = copy_checkpoint(STORIES, os.path.join(cls.tmp, "A"))
        cls.B = perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=33)
        cls.ref = {}
        for name, d in (("A", cls.A), ("B", cls.B)):
            with Daemon(model=d) as fresh:  # the reference: a fresh daemon on that checkpoint
                cls.ref[name] = greedy(fresh)
        assert cls.ref["A"][0] != cls.ref["B"][0]
        seed = int(os.environ.get("FD_CRASH_SEED", str(int(time.time()))))
        print(f"FD_CRASH_SEED={seed}", file=sys.stderr)
        cls.rng = random.Random(seed)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def kill_during(self, d, method, path, body=None):
        """Send the request, SIGKILL the daemon 0-40 ms later (before, inside or after the op)."""
        def call():
            try:
                d.request(method, path, body, timeout=10)
            except OSError:
                pass  # the connection dies with the daemon

        t = threading.Thread(target=call)
        t.start()
        time.sleep(self.rng.uniform(0, 0.04))
        d.proc.kill()
        d.proc.wait()
        t.join(15)
        d.__exit__(None)

    def restart(self, port, want, *args, model):
        """A new daemon on the same port must come up at once and serve `want` bit-exactly."""
        d = Daemon("--dynamic-load-weight", *args, model=model, port=port)  # ready within Daemon's 60 s, or it raises
        self.assertEqual(greedy(d), want)
        rc, out, err = fdctl(port, "--timeout", "10", "is-paused")  # its fresh control block works
        self.assertEqual((rc, out.strip()), (0, "false"), err)
        self.assertEqual(os.stat(f"/dev/shm/fdrollout.{port}").st_mode & 0o777, 0o600)
        return d

    def test_sigkill_during_update_sleep_wakeup_then_restart_on_the_same_port(self):
        port = free_port()
        model = copy_checkpoint(self.A, os.path.join(self.tmp, "live"))
        current = "A"
        d = self.restart(port, self.ref["A"], model=model)
        for trial in range(TRIALS):
            op = ("update", "sleep", "wakeup")[trial % 3]
            with self.subTest(trial=trial, op=op):
                if op == "update":
                    self.assertEqual(d.post("/v1/pause")[0], 200)
                    current = "B" if current == "A" else "A"  # the new checkpoint replaces the file atomically
                    src = os.path.join(self.A if current == "A" else self.B, "model.safetensors")
                    shutil.copyfile(src, os.path.join(model, "model.safetensors.x"))
                    os.replace(os.path.join(model, "model.safetensors.x"), os.path.join(model, "model.safetensors"))
                    self.kill_during(d, "POST", "/v1/update_weights", {"version": f"t{trial}"})
                elif op == "sleep":
                    self.kill_during(d, "POST", "/v1/sleep")
                else:
                    self.assertEqual(d.post("/v1/sleep")[0], 200)
                    self.kill_during(d, "POST", "/v1/wakeup")
                self.assertTrue(os.path.exists(f"/dev/shm/fdrollout.{port}"))  # the dead daemon's stale block
                d = self.restart(port, self.ref[current], model=model)
        d.__exit__(None)
        self.assertFalse(os.path.exists(f"/dev/shm/fdrollout.{port}"))  # a clean stop removes it

    def test_sigkill_during_an_ipc_update_then_restart_and_update_again(self):
        port = free_port()
        self.addCleanup(lambda: [os.unlink(p) for p in glob.glob(f"/dev/shm/fdrollout.{port}.weights.*")])
        rc, _, err = fdctl(port, "publish", "--strategy", "ipc", "--from", self.B, "--version", "vb")
        self.assertEqual(rc, 0, err)
        d = self.restart(port, self.ref["A"], "--load-strategy", "ipc", model=self.A)
        for trial in range(max(TRIALS // 3, 1)):
            with self.subTest(trial=trial):
                self.assertEqual(d.post("/v1/pause")[0], 200)
                self.kill_during(d, "POST", "/v1/update_weights", {})
                d = self.restart(port, self.ref["A"], "--load-strategy", "ipc", model=self.A)  # starts from --model
                # The record the trainer published survives and still goes in, bit-exact.
                self.assertEqual(d.post("/v1/pause")[0], 200)
                status, j = d.post("/v1/update_weights", {})
                self.assertEqual(status, 200, j)
                self.assertEqual(d.post("/v1/resume")[0], 200)
                self.assertEqual(greedy(d), (*self.ref["B"][:2], "vb"))
        d.__exit__(None)


if __name__ == "__main__":
    unittest.main()
