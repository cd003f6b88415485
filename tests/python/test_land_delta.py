"""Landed deltas (`weight_stream(version, base_version=..., land=True)`; fd/stream/landing.h
LandMode::delta): the trainer sends each rank its (indices, values) frames straight, the ranks
check and keep them, and the finish writes them in place on every rank or none. Against the real
daemon at tp=1 and tp=2, with references nobody here wrote: fresh daemons on checkpoints holding
the same weights, and a landed full update of the same weights (its sleep snapshot, byte for byte).
  - a landed delta serves what a fresh daemon on the new weights serves, and its snapshot equals
    a full landed update's byte for byte; sleep/wakeup keeps it; a delta on the delta goes back;
  - a delta straddling the tp=2 split of row- and column-split tensors, sparse and dense (and a
    tensor sent in full with send(): a dense delta);
  - a landed delta on a base streamed through the daemon (a dir) makes the weights landed;
  - unsorted, duplicated, out-of-range and negative indices are a 400 naming the tensor, a
    non-finite value a 422, a base nobody serves a 409: nothing changes, the next delta works;
  - a rank failing half way through the write (FD_TEST_DELTA_FAIL_RANK) puts every rank back;
  - a trainer killed mid-delta: the update is dropped, the base serves, the next delta works;
  - the base's own label as the version is a 400; a base whose label a checkpoint update reused a 409;
    send() of another shape a ValueError;
  - a weight sleep or another update while a delta lands: the trainer's error names it;
  - a rank refusing an early frame of a large delta: the trainer's sends go on and the finish names
    the refusal; a finish without end frames ends within 0.8 of --control-timeout-s, no rank lost.
"""
import glob
import os
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import PYTHON, STORIES, Daemon, StreamChecks, copy_checkpoint, fresh_daemon, greedy, kill_when_sent, make_checkpoint, rewrite_tensors, wait_until  # noqa: E402
from fdrollout import Client, FdRolloutError, changed_elements  # noqa: E402
from fdrollout import safetensors_np  # noqa: E402

from delta_fixtures import NAME, QKV, sparse_delta_class  # noqa: E402
from test_delta_stream import straddling_change  # noqa: E402

# A trainer that lands a base, opens a landed delta on it, sends half of the deltas, says SENT and
# waits to be killed.
KILLED_DELTA_LANDER = r"""
import sys, time
sys.path.insert(0, sys.argv[2]); sys.path.insert(0, sys.argv[3])
from fdrollout import Client, safetensors_np
from delta_fixtures import delta_of, sparse_change
c = Client("127.0.0.1:" + sys.argv[1], timeout=60)
base = safetensors_np.load_file(sys.argv[4])
d = delta_of(base, sparse_change(base, 0.01, seed=3))
ws = c.weight_stream("killed", base_version=sys.argv[5], land=True).__enter__()
for n in sorted(d)[: len(d) // 2]:
    ws.send_delta(n, *d[n])
ws.flush()
print("SENT", flush=True)
time.sleep(600)
"""


def snapshot(c):
    """Sleep (weights) and read the landed snapshot every rank wrote: {file: {name: array}}; then wake up."""
    before = set(glob.glob("/dev/shm/fdrollout-landed.*"))
    c.sleep()
    dirs = set(glob.glob("/dev/shm/fdrollout-landed.*")) - before
    assert len(dirs) == 1, dirs
    d = dirs.pop()
    out = {f: safetensors_np.load_file(os.path.join(d, f)) for f in sorted(os.listdir(d))}
    c.wakeup()
    return out


class LandDeltaTp1(StreamChecks, unittest.TestCase):  # StreamChecks: its tearDownClass
    TP_ARGS = []

    @classmethod
    def setUpClass(cls):
        sparse_delta_class(cls, "fd-pylanddelta-")

    def full(self, version, tensors, land=True, c=None):
        with (c or self.c).weight_stream(version, land=land) as ws:
            for name in sorted(tensors):
                ws.send(name, tensors[name])
        return ws.result

    def delta(self, version, base_version, old, new, int64=(), full=(), dense=(), c=None):
        with (c or self.c).weight_stream(version, base_version=base_version, land=True) as ws:
            for name in sorted(new):
                if name in full:  # send() on a delta landing: the tensor as a dense delta
                    ws.send(name, new[name])
                    continue
                if name in dense:
                    ws.send_delta(name, np.arange(new[name].size, dtype=np.int32), new[name].reshape(-1))
                    continue
                idx, vals = changed_elements(old[name], new[name])
                if idx.size:
                    ws.send_delta(name, idx.astype(np.int64) if name in int64 else idx, vals)
        return ws.result

    def assert_serving(self, ref, version, d=None):
        d = d or self.d
        self.assertEqual(greedy(d), (*ref, version))
        h = Client(f"127.0.0.1:{d.port}").health()
        self.assertEqual((h["state"], h["weight_stream"]["state"]), ("serving", "idle"))

    def test_1_landed_delta_equals_a_full_update(self):
        self.full("b0", self.base)
        before = self.d.output().count("elements were written in place")
        tp = 2 if self.TP_ARGS else 1
        r = self.delta("d1", "b0", self.base, self.new, int64={NAME})  # NAME's indices as int64 on the wire
        self.assertEqual((r["weight_version"], r["base_version"]), ("d1", "b0"))
        self.assertEqual(self.d.output().count("elements were written in place") - before, tp, "every rank wrote its share")
        self.assertGreater(r["n_delta"], 0)
        self.assertIsNone(r["bytes"])
        self.assert_serving(self.ref_new, "d1")
        self.assertTrue(self.c.health()["weight_stream"]["serving_landed"])
        got = snapshot(self.c)  # the landed bytes, written at the sleep; the wakeup serves them again
        self.assert_serving(self.ref_new, "d1")
        self.full("f1", self.new)  # a full landed update of the same weights: the same bytes on every rank
        want = snapshot(self.c)
        self.assertEqual(sorted(got), sorted(want))
        for f in want:
            for n, a in want[f].items():
                self.assertTrue(np.array_equal(got[f][n].view(np.uint8), a.view(np.uint8)), f"{f}: {n}")
        self.delta("d2", "f1", self.new, self.base)  # and back
        self.assert_serving(self.ref_base, "d2")

    def test_2_a_delta_straddling_the_rank_split(self):
        new, changed = straddling_change(self.base)
        new_dir = os.path.join(self.tmp, "straddle")
        rewrite_tensors(copy_checkpoint(STORIES, new_dir), lambda t: t.update({k: v.copy() for k, v in new.items()}))
        with fresh_daemon(new_dir, *self.TP_ARGS) as ref:
            ref_new = greedy(ref)[:2]
        self.assertNotEqual(ref_new, self.ref_base)
        self.full("s0", self.base)
        dense = "model.layers.2.mlp.down_proj.weight"  # every element in the delta (column-split at tp=2)
        self.delta("s1", "s0", self.base, new, int64={"model.layers.1.self_attn.o_proj.weight"}, dense={dense})
        self.assert_serving(ref_new, "s1")
        self.delta("s2", "s1", new, self.base, full={QKV})
        self.assert_serving(self.ref_base, "s2")

    def test_3_a_landed_delta_on_a_base_streamed_through_the_daemon(self):
        self.full("t0", self.base, land=False)
        self.assertFalse(self.c.health()["weight_stream"]["serving_landed"])
        self.delta("t1", "t0", self.base, self.new)
        self.assertTrue(self.c.health()["weight_stream"]["serving_landed"], "no dir holds the bytes now")
        self.assert_serving(self.ref_new, "t1")
        self.c.sleep()  # the snapshot, not the stream's dir, is the wakeup source
        self.c.wakeup()
        self.assert_serving(self.ref_new, "t1")

    def stream_health(self):
        ws = self.c.health()["weight_stream"]
        return ws["serving_stream_version"], ws["serving_landed"]

    def refused(self, status, words, fn):
        before = self.c.weight_version()
        with self.assertRaises(FdRolloutError) as e:
            fn()
        self.assertEqual(e.exception.status, status, e.exception.message)
        for w in words:
            self.assertIn(w, e.exception.message)
        self.assertEqual(self.c.weight_version(), before, "a failed delta changes nothing")
        self.assert_serving(self.ref_base, before)
        return e.exception

    def test_4_bad_input_is_refused_naming_it_and_changes_nothing(self):
        self.full("i0", self.base)
        n = self.base[NAME].size
        vals = np.ones(3, np.float32)

        def one(idx, v=vals, name=NAME, base="i0"):
            def fn():
                with self.c.weight_stream("bad", base_version=base, land=True) as ws:
                    ws.send_delta(QKV, *changed_elements(self.base[QKV], self.new[QKV]))  # a good tensor first
                    ws.send_delta(name, np.asarray(idx, np.int64), v)
            return fn

        self.refused(400, [NAME, "sorted and unique"], one([9, 5, 11]))
        self.refused(400, [NAME, "sorted and unique"], one([1, 5, 5]))
        self.refused(400, [NAME, str(n)], one([0, 1, n]))
        self.refused(400, [NAME], one([-1, 0, 1]))
        nan = vals.copy()
        nan[1] = np.inf
        self.refused(422, [NAME, "non-finite"], one([0, 1, 2], nan))
        self.refused(409, ["'nope'", "i0"], one([0, 1, 2], base="nope"))
        # a row-split tensor (the embedding's vocab rows at tp=2) with its indices out of order across the split
        emb = "model.embed_tokens.weight"
        half = self.base[emb].size // 2
        self.refused(400, [emb], one([half + 1, 0, 2], name=emb))
        # the base's own label for the new bytes (a probe: committed, and "i0" then named other weights), landed or not
        for land in (True, False):
            with self.assertRaises(FdRolloutError) as e:
                with self.c.weight_stream("i0", base_version="i0", land=land) as ws:
                    ws.send_delta(NAME, np.array([0]), np.array([1.0], np.float32))
            self.assertEqual(e.exception.status, 400, e.exception.message)
            self.assertIn("base_version", e.exception.message)
        # send() of a tensor of another shape (a probe: a [64, 100] array was written over a [64, 172] tensor's first 6400)
        with self.assertRaises(ValueError) as ve:
            with self.c.weight_stream("bad", base_version="i0", land=True) as ws:
                ws.send(NAME, np.full((64, 100), 0.5, np.float32))
        self.assertIn("[64, 172]", str(ve.exception))
        self.assert_serving(self.ref_base, "i0")
        self.assertEqual(self.delta("i1", "i0", self.base, self.new)["weight_version"], "i1")  # the next delta works
        self.assert_serving(self.ref_new, "i1")

    def test_4b_a_base_whose_label_a_checkpoint_update_reused_is_refused(self):
        # The label alone is not the base (a probe: a weight_dir update under the base's label took a landed delta).
        self.full("u0", self.base)
        self.assertEqual(self.stream_health(), ("u0", True))
        self.c.pause()
        self.c.update_weights(version="u0")  # --model's bytes (stories260K) under the same label
        self.c.resume()
        # /health no longer names the stream (it did: its fields changed only with streams), and the
        # start refuses the delta before any frame is sent (it was refused at the finish).
        self.assertEqual(self.stream_health(), (None, False))
        e = self.refused(409, ["no longer serves", "u0"], lambda: self.c.weight_stream("u1", base_version="u0", land=True).__enter__())
        self.assertEqual(e.type, "wrong_state", e.message)
        self.refused(409, ["no longer serves"], lambda: self.delta("u1", "u0", self.base, self.new))
        self.full("u2", self.base)
        self.assertEqual(self.delta("u3", "u2", self.base, self.new)["weight_version"], "u3")
        self.assert_serving(self.ref_new, "u3")

    def test_5_a_rank_failing_mid_write_rolls_every_rank_back(self):
        tp = 2 if self.TP_ARGS else 1
        with Daemon("--dynamic-load-weight", "--control-timeout-s", "20", *self.TP_ARGS, model=STORIES, extra=False,
                    env={"FD_TEST_DELTA_FAIL_RANK": str(tp - 1)}) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=20)
            self.full("r0", self.base, c=c)
            with self.assertRaises(FdRolloutError) as e:
                self.delta("r1", "r0", self.base, self.new, c=c)
            self.assertIn("FD_TEST_DELTA_FAIL_RANK", e.exception.message)
            self.assert_serving(self.ref_base, "r0", d)
            self.assertEqual(c.weight_version(), "r0")

    def test_6_trainer_killed_mid_delta(self):
        self.full("k0", self.base)
        p = subprocess.Popen([PYTHON, "-c", KILLED_DELTA_LANDER, str(self.d.port), os.path.join(HERE, "..", "..", "python"), HERE,
                              os.path.join(STORIES, "model.safetensors"), "k0"], stdout=subprocess.PIPE, text=True)
        try:
            kill_when_sent(self, p)
        finally:
            p.stdout.close()
        wait_until(lambda: self.c.health()["weight_stream"]["state"] == "idle", 25, "the update dropped")
        self.assert_serving(self.ref_base, "k0")
        self.delta("k1", "k0", self.base, self.new)
        self.assert_serving(self.ref_new, "k1")

    def test_7_a_sleep_or_update_during_the_delta_is_named_to_the_trainer(self):
        # The ranks close their landings; the trainer saw only "Broken pipe" (its sends go on, a
        # later one or the finish breaks). Its error now names what the daemon did.
        other = Client(f"127.0.0.1:{self.d.port}", timeout=20)
        name, idx = "model.layers.0.mlp.down_proj.weight", np.arange(0, 4000, 7, dtype=np.int32)
        for version, stop, words in (("z1", lambda: other.sleep(), "went to sleep"),
                                     ("z5", lambda: (other.pause(), other.update_weights(version="z0")), "the base 'z0' no longer serves"),
                                     ("z2", lambda: (other.pause(), other.update_weights(version="z9")), "updated to weight_version 'z9'")):
            self.full("z0", self.base)
            with self.assertRaises(FdRolloutError) as e:
                with self.c.weight_stream(version, base_version="z0", land=True) as ws:
                    ws.send_delta(name, idx, np.ones(idx.size, np.float32))
                    ws.flush()
                    stop()
                    for _ in range(200):  # bounded: the connection's break shows within a few sends
                        ws.send_delta(name, idx, np.ones(idx.size, np.float32))
                        ws.flush()
                        time.sleep(0.01)
            self.assertEqual(e.exception.status, 0, e.exception.message)
            self.assertIn(words, e.exception.message)
            self.assertIn("stops an open landing", e.exception.message)
            other.wakeup() if version == "z1" else other.resume()
        self.assertEqual(self.c.weight_version(), "z9")
        self.full("z3", self.base)
        self.assertEqual(self.delta("z4", "z3", self.base, self.new)["weight_version"], "z4")
        self.assert_serving(self.ref_new, "z4")


class LandDeltaBounds(StreamChecks, unittest.TestCase):
    """A rank refusing an early frame of a delta larger than the sockets' buffers (a probe: the trainer
    blocked for its whole timeout and never learnt why), and a finish whose end frames never come on
    a daemon whose control timeout is shorter than the stream's (a probe: a healthy rank was taken
    for dead and the landed weights were lost)."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-pylanddelta-b-")
        cls.ck = make_checkpoint(os.path.join(cls.tmp, "ck"), "--hidden", "512", "--intermediate", "1536", "--layers", "4",
                                 "--heads", "8", "--vocab", "512")
        cls.w = safetensors_np.load_file(os.path.join(cls.ck, "model.safetensors"))
        cls.d = Daemon("--dynamic-load-weight", "--control-timeout-s", "5", "--tensor-parallel-size", "2", "--threads", "1",
                       model=cls.ck, extra=False)
        cls.c = Client(f"127.0.0.1:{cls.d.port}", timeout=60)

    def full(self, version):
        with self.c.weight_stream(version, land=True, timeout=60) as ws:
            for n in sorted(self.w):
                ws.send(n, self.w[n])

    def test_a_refused_early_frame_is_named_at_the_finish_at_once(self):
        self.full("e0")
        before = greedy(self.d)
        t0 = time.monotonic()
        with self.assertRaises(FdRolloutError) as e:
            with self.c.weight_stream("e1", base_version="e0", land=True, timeout=60) as ws:
                ws.send_delta("model.embed_tokens.weight", np.array([5, 3], np.int32), np.ones(2, np.float32))  # unsorted
                for n in sorted(self.w):  # ~50 MB more on the wire, each tensor in full
                    if n != "model.embed_tokens.weight":
                        ws.send(n, self.w[n] * np.float32(1.01))
        self.assertLess(time.monotonic() - t0, 30, "the trainer's sends never blocked on the refusing rank")
        self.assertEqual(e.exception.status, 400, e.exception.message)
        self.assertIn("model.embed_tokens.weight", e.exception.message)
        self.assertIn("not greater than the one before", e.exception.message)
        self.assertEqual(greedy(self.d), before)

    def test_b_a_finish_without_end_frames_ends_within_the_control_timeout(self):
        self.full("f0")
        before = greedy(self.d)
        with self.assertRaises(FdRolloutError) as e:
            with self.c.weight_stream("f1", base_version="f0", land=True, timeout=60) as ws:
                ws.send_delta("model.norm.weight", np.array([0], np.int32), np.ones(1, np.float32))
                ws.flush()  # the frame is out; no end frame: the finish is called by hand
                t0 = time.monotonic()
                self.c.request("POST", "/finish_weight_update", body={"version": "f1"}, timeout=60)
        self.assertLess(time.monotonic() - t0, 4.9, "the ranks' wait ends within 0.8 of --control-timeout-s")
        self.assertEqual(e.exception.status, 504, e.exception.message)
        h = self.c.health()
        self.assertEqual((h["state"], h["degraded_ranks"]), ("serving", []), "no rank was taken for dead")
        self.assertEqual(greedy(self.d), before)
        self.full("f2")  # and the next update works
        self.assertEqual(greedy(self.d)[:2], before[:2])


class LandDeltaTp2(LandDeltaTp1):
    TP_ARGS = ["--tensor-parallel-size", "2", "--threads", "1"]


if __name__ == "__main__":
    unittest.main()
