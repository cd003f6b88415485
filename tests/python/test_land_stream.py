"""Landed weight streams (`weight_stream(..., land=True)`; fd/stream/landing.h): each rank takes
its own shard from the trainer straight into its staging memory. Against the real daemon at tp=1
and tp=2: a landed stream serves exactly as a fresh daemon on the same weights; it mixes with
streams through the daemon and with deltas on landed weights; a missing part, a part at no expected offset, a non-finite value, a
missing version are refused naming what, and change nothing; a trainer killed
mid-landing leaves the old version serving and the next landed stream works; a weight sleep
writes the landed shards and the wakeup serves them again under the same label.
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import PYTHON, STORIES, Daemon, StreamChecks, device_args, fdctl, fresh_daemon, greedy, perturbed, wait_until  # noqa: E402
from fdrollout import Client, FdRolloutError  # noqa: E402
from fdrollout import safetensors_np  # noqa: E402
from fdrollout.weight_stream import changed_elements  # noqa: E402

# A trainer that lands half of the tensors on every rank, says SENT and waits to be killed.
KILLED_LANDER = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
from fdrollout import Client, safetensors_np
c = Client("127.0.0.1:" + sys.argv[1], timeout=60)
t = safetensors_np.load_file(sys.argv[3])
ws = c.weight_stream("killed", land=True).__enter__()
for n in sorted(t)[: len(t) // 2]:
    ws.send(n, t[n])
print("SENT", flush=True)
time.sleep(600)
"""


class LandTp1(StreamChecks, unittest.TestCase):
    TP_ARGS = []

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-pyland-")
        cls.new = os.path.join(cls.tmp, "new")
        perturbed(STORIES, cls.new, seed=3)
        cls.tensors = safetensors_np.load_file(os.path.join(cls.new, "model.safetensors"))
        cls.base = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
        with fresh_daemon(cls.new, *cls.TP_ARGS) as ref:
            cls.ref_new = greedy(ref)[:2]
        with fresh_daemon(STORIES, *cls.TP_ARGS) as ref:
            cls.ref_old = greedy(ref)[:2]
        cls.d = Daemon("--dynamic-load-weight", "--control-timeout-s", "20", *cls.TP_ARGS, model=STORIES, extra=False)
        cls.c = Client(f"127.0.0.1:{cls.d.port}", timeout=20)
        cls.tp = int(cls.TP_ARGS[1]) if cls.TP_ARGS else 1

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def stream(self, version, tensors, land=True, tweak=None, **kw):
        with self.c.weight_stream(version, land=land, **kw) as ws:
            if tweak:
                tweak(ws)
            for name in sorted(tensors):
                ws.send(name, tensors[name])
        return ws.result

    def test_1_landed_stream_equals_a_fresh_daemon_and_mixes_with_daemon_streams(self):
        before = self.d.output().count("the landed stream is complete and staged")
        r = self.stream("l1", self.tensors)
        self.assertEqual(r["weight_version"], "l1")
        self.assertEqual(r["n_tensors"], len(self.tensors))
        landed = sum(a.nbytes for n, a in self.tensors.items() if n != "lm_head.weight")  # tied: no rank reads the head
        norms = sum(a.nbytes for n, a in self.tensors.items() if a.ndim == 1)  # replicated: once per rank
        self.assertEqual(r["bytes"], landed + (self.tp - 1) * norms)
        self.assert_serving(self.ref_new, "l1")
        self.assertEqual(self.d.output().count("the landed stream is complete and staged") - before, self.tp, "every rank landed")
        self.assertEqual(self.d.output().count("staged bucket by bucket"), 0)
        ws = self.c.health()["weight_stream"]
        self.assertEqual((ws["serving_stream_version"], ws["serving_landed"], ws["landing"]), ("l1", True, False))
        r = self.stream("s2", self.base, land=False)  # through the daemon
        self.assertEqual(r["weight_version"], "s2")
        self.assertFalse(self.c.health()["weight_stream"]["serving_landed"])
        self.assert_serving(self.ref_old, "s2")
        self.stream("l3", self.tensors)  # and landed again, over the daemon stream's weights
        self.assert_serving(self.ref_new, "l3")
        self.stream("l4", self.base)
        self.assert_serving(self.ref_old, "l4")

    def test_2_bad_input_is_refused_naming_it_and_changes_nothing(self):
        self.stream("good", self.base)
        name = "model.layers.0.mlp.down_proj.weight"
        missing = {k: v for k, v in self.tensors.items() if k != name}
        self.bad(422, "invalid_checkpoint", [name, "missing"], missing)
        nan = dict(self.tensors)
        nan[name] = nan[name].copy()
        nan[name].reshape(-1)[7] = np.nan
        self.bad(422, "invalid_checkpoint", [name, "non-finite"], nan)

        def shift(ws):  # the first part of rank 0 announced 64 bytes further on
            ws._lander.plan[name][0][1][1] += 64
        self.bad(400, "invalid_argument", ["no part this rank expects"], self.tensors, tweak=shift)
        with self.assertRaises(ValueError):  # refused on this side: a landed update needs a version
            self.c.weight_stream(None, land=True)
        e = self.c.request  # the routes refuse them too
        with self.assertRaises(FdRolloutError) as ex:
            e("POST", "/start_weight_update", body={"land": True})
        self.assertEqual(ex.exception.status, 400)
        self.assertEqual(self.c.weight_version(), "good")
        self.assert_serving(self.ref_old, "good")

    def test_3_a_delta_on_landed_weights_applies_on_the_ranks(self):
        # A delta whose base was landed: written in place on every rank (no dir holds the base),
        # equal to a full update of the same weights; then kept across a sleep by the snapshot.
        self.stream("lb", self.tensors)
        with self.c.weight_stream("ld", base_version="lb") as ws:
            for name in sorted(self.base):
                idx, vals = changed_elements(self.tensors[name], self.base[name])
                ws.send_delta(name, idx, vals)
        self.assertEqual(ws.result["weight_version"], "ld")
        self.assertEqual(ws.result["n_delta"], len(self.base))
        self.assert_serving(self.ref_old, "ld")
        self.c.sleep()
        self.c.wakeup()
        self.assert_serving(self.ref_old, "ld")
        with self.assertRaises(FdRolloutError) as e:  # a delta names the exact base every rank serves
            with self.c.weight_stream("lx", base_version="lb") as ws:
                ws.send_delta("model.norm.weight", np.array([0], np.int64), np.array([1.0], np.float32))
        self.assertEqual(e.exception.status, 409, e.exception.message)
        with self.assertRaises(FdRolloutError) as e:  # and a version: no file holds the bytes to name them by
            with self.c.weight_stream(None, base_version="ld") as ws:
                ws.send_delta("model.norm.weight", np.array([0], np.int64), np.array([1.0], np.float32))
        self.assertEqual(e.exception.status, 400, e.exception.message)
        self.assert_serving(self.ref_old, "ld")

    def test_4_trainer_killed_mid_landing(self):
        self.stream("k0", self.base)
        p = subprocess.Popen([PYTHON, "-c", KILLED_LANDER, str(self.d.port), os.path.join(HERE, "..", "..", "python"),
                              os.path.join(self.new, "model.safetensors")], stdout=subprocess.PIPE, text=True)
        try:
            self.assertEqual(p.stdout.readline().strip(), "SENT")
        finally:
            p.kill()
            p.wait()
            p.stdout.close()
        wait_until(lambda: self.c.health()["weight_stream"]["state"] == "idle", 15, "the update dropped")
        self.assert_serving(self.ref_old, "k0")
        self.stream("k1", self.tensors)
        self.assert_serving(self.ref_new, "k1")

    def test_5_sleep_writes_the_landed_weights_and_wakeup_reads_them_back(self):
        # No file holds landed bytes: a weight sleep writes each rank's shard (0600, a private
        # dir) and the wakeup reloads it, same label, then removes it.
        self.stream("w1", self.tensors)
        before = set(glob.glob("/dev/shm/fdrollout-landed.*"))
        self.c.sleep()
        dirs = set(glob.glob("/dev/shm/fdrollout-landed.*")) - before
        self.assertEqual(len(dirs), 1, "one snapshot dir while asleep")
        d = dirs.pop()
        self.assertEqual(os.stat(d).st_mode & 0o777, 0o700)
        files = sorted(os.listdir(d))
        self.assertEqual(files, [f"model_state.tp{r}.safetensors" for r in range(self.tp)])
        self.assertEqual(os.stat(os.path.join(d, files[0])).st_mode & 0o777, 0o600)
        self.c.wakeup()
        self.assert_serving(self.ref_new, "w1")
        self.assertFalse(os.path.exists(d), "the host copy goes at the wakeup")
        self.c.sleep()  # and again: written anew from the live weights
        self.c.wakeup()
        self.assert_serving(self.ref_new, "w1")
        self.stream("w2", self.base, land=False)  # a stream through the daemon: its dir is the source again
        self.c.sleep()
        self.assertEqual(set(glob.glob("/dev/shm/fdrollout-landed.*")) - before, set())
        self.c.wakeup()
        self.assert_serving(self.ref_old, "w2")

    def test_6_a_landed_label_keeps_no_fingerprint_of_other_bytes(self):
        # The daemon started on STORIES under "0", a label its fingerprint names. Landed bytes
        # (no fingerprint) that reuse "0" take that name over: reloading STORIES afterwards must
        # not come back as "0" as if nothing had changed (it did: landed bytes -> STORIES).
        self.stream("0", self.tensors)
        self.assert_serving(self.ref_new, "0")
        self.c.pause()
        self.c.update_weights()
        self.c.resume()
        ws = self.c.health()["weight_stream"]  # the landed stream serves no more (/health named it still)
        self.assertEqual((ws["serving_stream_version"], ws["serving_landed"]), (None, False))
        rc, out, err = fdctl(self.d.port, "--transport", "shm", "--json", "status")  # the mailbox's status carries the same object
        self.assertEqual(rc, 0, err)
        ws = json.loads(out)["weight_stream"]
        self.assertEqual((ws["serving_stream_version"], ws["serving_landed"]), (None, False))
        ids, lps, label = greedy(self.d)
        self.assertEqual((ids, lps), self.ref_old)
        self.assertNotEqual(label, "0", "other bytes than the ones served under '0' came back under it")
        self.assertEqual(self.c.weight_version(), label)

    def test_7_a_rank_recovered_from_the_source_no_longer_serves_the_landed_stream(self):
        pids = self.d.rank_pids()
        if not pids:
            self.skipTest("no rank processes (uni executor)")
        self.stream("k1", self.tensors)
        self.assert_serving(self.ref_new, "k1")
        os.kill(pids[-1], signal.SIGKILL)  # its landed shard is lost: the recovery loads the source
        wait_until(lambda: self.d.post("/v1/completions", {"prompt": "Once", "max_tokens": 2})[0] == 503, 20, "the rank's death noticed")
        self.assertEqual(self.d.post("/v1/wakeup")[0], 200)
        ids, lps, label = greedy(self.d)
        self.assertEqual((ids, lps), self.ref_old)
        self.assertNotEqual(label, "k1")
        ws = self.c.health()["weight_stream"]  # /health named "k1" still, and the engine kept "landed"
        self.assertEqual((ws["serving_stream_version"], ws["serving_landed"]), (None, False))
        with self.assertRaises(FdRolloutError) as e:
            with self.c.weight_stream("k2", base_version="k1", land=True) as w:
                w.send_delta("model.norm.weight", np.array([0], np.int32), np.array([1.0], np.float32))
        self.assertEqual(e.exception.status, 409, e.exception.message)
        self.stream("k3", self.tensors)  # a full stream lands again
        self.assert_serving(self.ref_new, "k3")
        self.assertEqual(self.c.health()["weight_stream"]["serving_stream_version"], "k3")

    def test_8_an_update_or_a_rank_failing_during_a_landing_is_named_to_the_trainer(self):
        # A full landed stream: the label at its start comes in the start's answer (a probe: an
        # update during it gave "no reason given"); a failed rank's /health is a 503 whose body
        # names it (a probe: "the daemon did not answer /health either").
        other = Client(f"127.0.0.1:{self.d.port}", timeout=20)
        name = "model.layers.0.mlp.down_proj.weight"
        cases = [("m1", lambda: (other.pause(), other.update_weights(version="m9")), "updated to weight_version 'm9'", other.resume)]
        pids = self.d.rank_pids()
        if pids:
            cases.append(("m2", lambda: (os.kill(pids[-1], signal.SIGKILL), wait_until(lambda: self.d.get("/health")[0] == 503, 20,
                                                                                      "the rank's death noticed")),
                          f"rank(s) [{len(pids) - 1}] failed", lambda: self.assertEqual(self.d.post("/v1/wakeup")[0], 200)))
        for version, stop, words, after in cases:
            self.stream("m0", self.base)
            with self.assertRaises(FdRolloutError) as e:
                with self.c.weight_stream(version, land=True) as ws:
                    ws.send(name, self.tensors[name])
                    ws.flush()
                    stop()
                    for _ in range(200):  # bounded: the connection's break shows within a few sends
                        ws.send(name, self.tensors[name])
                        ws.flush()
                        time.sleep(0.01)
            self.assertEqual(e.exception.status, 0, e.exception.message)
            self.assertIn(words, e.exception.message)
            after()
        self.stream("m3", self.tensors)
        self.assert_serving(self.ref_new, "m3")


class LandTp2(LandTp1):
    TP_ARGS = ["--tensor-parallel-size", "2", "--threads", "1"]


@unittest.skipUnless(device_args(), "CUDA ranks: run over FD_TEST_DAEMON_ARGS=--device cuda (scripts/gpu_check.sh)")
class LandOnCuda(unittest.TestCase):
    """Ranks whose weights are device memory cannot land a full update or a delta (409, naming why);
    land="auto" then streams through the daemon and commits."""

    def test_refused_then_auto_streams_through_the_daemon(self):
        tensors = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
        with Daemon("--dynamic-load-weight", *device_args(), model=STORIES, extra=False) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=20)
            with self.assertRaises(FdRolloutError) as e:
                with c.weight_stream("c1", land=True) as ws:
                    for n in sorted(tensors):
                        ws.send(n, tensors[n])
            self.assertEqual(e.exception.status, 409, e.exception.message)
            self.assertIn("device memory", e.exception.message)
            with c.weight_stream("c2", land="auto") as ws:
                for n in sorted(tensors):
                    ws.send(n, tensors[n])
            self.assertEqual(ws.result["weight_version"], "c2")
            self.assertEqual(c.weight_version(), "c2")
            # a landed delta too: 409 naming why, and land="auto" sends it through the daemon
            one = (np.array([0], np.int32), np.array([1.5], np.float32))
            with self.assertRaises(FdRolloutError) as e:
                with c.weight_stream("c3", base_version="c2", land=True) as ws:
                    ws.send_delta("model.norm.weight", *one)
            self.assertEqual(e.exception.status, 409, e.exception.message)
            self.assertIn("device memory", e.exception.message)
            self.assertEqual(c.weight_version(), "c2")
            with c.weight_stream("c4", base_version="c2", land="auto") as ws:
                ws.send_delta("model.norm.weight", *one)
            self.assertEqual((ws.result["weight_version"], ws.result["n_delta"]), ("c4", 1))
            self.assertEqual(c.weight_version(), "c4")


if __name__ == "__main__":
    unittest.main()
