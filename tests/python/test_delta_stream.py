"""Delta weight streams (Client.weight_stream(version, base_version=...), send_delta) against the
real daemon at tp=1 and tp=2. References nobody here wrote: a fresh daemon started on a
checkpoint holding the same weights (written with safetensors_np), and a full stream of them.
  - a delta update serves exactly what a full update of the same weights serves (ids and
    logprobs), and stages byte for byte the same tensors;
  - a wrong base (not the serving version, or the serving version changed under an open delta)
    is a 409 and the old version keeps serving;
  - bad indices (unsorted, duplicated, out of range, negative) are a 400 naming the tensor, a
    non-finite value a 422; nothing staged survives a failed stream;
  - a rank failing half way through writing a delta in place (FD_TEST_DELTA_FAIL_RANK) puts
    every rank and the serving dir back: the base serves bit for bit, before and after a wakeup;
    a rank process killed there degrades the engine and the wakeup's recovery serves the base;
  - deltas on deltas, with sleep/wakeup between, serve what the fresh reference daemons serve;
    a weight sleep frees the ranks' delta undo buffers too (in its freed_bytes);
  - a delta whose indices straddle the rank split of column-split (o_proj, down_proj) and
    row-split (q|k|v, gate|up, the vocab rows of the tied embedding) tensors, sparse and dense,
    serves bit for bit what a fresh daemon on a checkpoint of the same weights serves;
  - a trainer killed in the middle of a delta update's second bucket (its first bucket already
    appended to the update's delta file): the update is dropped with its staging dir, the base
    serves bit for bit, and the next delta works;
  - the serving stream dir removed behind the daemon's back while deltas are pending: the sleep
    and the wakeup still work, the wakeup serves --model's bytes under a label that is not the
    delta's, a delta on the lost base is a 409 and the next full stream and delta work.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import PYTHON, STORIES, Daemon, device_args, copy_checkpoint, fresh_daemon, greedy, kill_when_sent, rewrite_tensors, wait_until  # noqa: E402
from fdrollout import Client, FdRolloutError, changed_elements  # noqa: E402
from fdrollout import safetensors_np  # noqa: E402

from delta_fixtures import NAME, QKV, sparse_delta_class  # noqa: E402


# The killed delta trainer: opens a delta update on argv[2], sends one delta bucket whole (answered:
# appended to the update's delta file), then announces a second and sends its frame and a few of
# its bytes, says SENT and waits to be killed.
KILLED_DELTA_TRAINER = r"""
import json, socket, struct, sys, threading, time, http.client
port, base = int(sys.argv[1]), sys.argv[2]
def post(path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse(); return r.status, json.loads(r.read() or b"null")
def frame(h):
    h = json.dumps(h).encode(); return b"FDW1" + struct.pack("<I", len(h)) + h
_, info = post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})
shapes = {t["name"]: t["shape"] for t in info["tensors"]}
s = socket.create_connection(("127.0.0.1", info["port"]))
s.sendall(frame({"token": info["token"]}))
assert post("/start_weight_update", {"version": "killed", "base_version": base})[0] == 200
def bucket(name, idx, vals, whole):
    d = {"n_indices": len(idx), "index_dtype": "I32"}
    ui = {"names": [name], "dtype_names": ["F32"], "shapes": [shapes[name]], "deltas": [d]}
    th = threading.Thread(target=post, args=("/update_weights", {"update_info": ui}), daemon=True)
    th.start()
    payload = struct.pack(f"<{len(idx)}i", *idx) + struct.pack(f"<{len(vals)}f", *vals)
    s.sendall(frame({"name": name, "dtype": "F32", "shape": shapes[name], "nbytes": len(payload), **d}))
    s.sendall(payload if whole else payload[:12])
    return th
bucket("model.norm.weight", [0, 5], [1.0, 2.0], True).join()
bucket("model.layers.0.mlp.down_proj.weight", list(range(0, 2000, 2)), [0.5] * 1000, False)
print("SENT", flush=True)
time.sleep(600)
"""


def stream_dirs(port):
    return sorted(glob.glob(f"/dev/shm/fdrollout-stream.{port}.*")) + \
        sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"fdrollout-stream.{port}.*")))



def straddling_change(base):
    """`base` with elements changed around the tp=2 split of every kind of sharded tensor
    (stories260K: hidden 64, 8 q / 4 kv heads of 8, ff 172, vocab 512, tied embedding), and the
    names changed. Values move by half the tensor's std so that the greedy probe sees them."""
    out = {k: v.copy() for k, v in base.items()}
    rng = np.random.default_rng(11)

    def bump(name, rows, cols):
        a = out[name]
        sel = a[np.ix_(rows, cols)]
        a[np.ix_(rows, cols)] = (sel + 0.5 * float(a.std()) * (1 + rng.random(sel.shape))).astype(a.dtype)

    bump("model.layers.0.mlp.down_proj.weight", [0, 1, 31, 63], list(range(83, 90)))     # cols split at 86
    bump("model.layers.2.mlp.down_proj.weight", [10], list(range(0, 172)))             # one whole row across it
    bump("model.layers.1.self_attn.o_proj.weight", list(range(64)), [30, 31, 32, 33])  # cols split at 32
    bump("model.layers.3.mlp.gate_proj.weight", [84, 85, 86, 87], list(range(64)))     # rows split at 86 (gate | up)
    bump("model.layers.3.mlp.up_proj.weight", [85, 86], [0, 63])
    bump("model.layers.0.self_attn.q_proj.weight", [31, 32], [5, 6, 7])                 # q rows split at 32 (q | k | v)
    bump("model.layers.0.self_attn.k_proj.weight", [15, 16], [0, 1])                    # kv rows split at 16
    bump("model.layers.0.self_attn.v_proj.weight", [0, 15, 16, 31], [63])
    bump("model.embed_tokens.weight", list(range(254, 259)), list(range(64)))          # vocab rows split at 256
    n = out["model.norm.weight"]
    n[[0, 31, 32, 63]] = (n[[0, 31, 32, 63]] * 1.5).astype(n.dtype)                     # replicated
    changed = sorted(k for k in out if not np.array_equal(out[k], base[k]))
    return out, changed


def read_staged(d):
    """The tensors of the daemon's serving stream dir (its kept staging dir)."""
    dirs = stream_dirs(d.port)
    assert len(dirs) == 1, dirs
    out = {}
    for f in glob.glob(os.path.join(dirs[0], "*.safetensors")):
        out.update(safetensors_np.load_file(f))
    return out


class DeltaTp1(unittest.TestCase):
    TP_ARGS = device_args()  # FD_TEST_DAEMON_ARGS's --device (scripts/gpu_check.sh's extra runs: cuda)

    @classmethod
    def setUpClass(cls):
        sparse_delta_class(cls, "fd-pydelta-")

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)
        assert not stream_dirs(cls.d.port), f"the daemon left staging dirs: {stream_dirs(cls.d.port)}"

    def full(self, version, tensors):
        with self.c.weight_stream(version) as ws:
            for name in sorted(tensors):
                ws.send(name, tensors[name])
        return ws.result

    def delta(self, version, base_version, old, new, int32=(), full=(), wide=()):
        with self.c.weight_stream(version, base_version=base_version) as ws:
            for name in sorted(new):
                if name in full:
                    ws.send(name, new[name])
                    continue
                idx, vals = changed_elements(old[name], new[name])
                if idx.size:
                    ws.send_delta(name, idx.astype(np.int32 if name in int32 else np.int64), vals, narrow=name not in wide)  # int64 as before changed_elements gave int32
        return ws.result

    def assert_serving(self, ref, version):
        self.assertEqual(greedy(self.d), (*ref, version))
        h = self.c.health()
        self.assertEqual(h["state"], "serving")
        self.assertEqual(h["weight_stream"]["state"], "idle")

    def test_1_delta_equals_a_full_update(self):
        self.assertEqual(self.full("b0", self.base)["weight_version"], "b0")
        self.assert_serving(self.ref_base, "b0")
        n_changed = sum(1 for n in self.new if changed_elements(self.base[n], self.new[n])[0].size)
        # one tensor's indices go as int64 on the wire (narrow=False), NAME's as int32 given, the rest narrowed by the client
        wide = next(n for n in sorted(self.new) if n not in (NAME, QKV) and changed_elements(self.base[n], self.new[n])[0].size)
        r = self.delta("d1", "b0", self.base, self.new, int32={NAME}, full={QKV}, wide={wide})
        self.assertEqual((r["weight_version"], r["base_version"]), ("d1", "b0"))
        self.assertEqual(r["n_delta"], n_changed - 1)            # QKV went in full
        self.assertEqual(r["n_from_base"], len(self.base) - n_changed)
        sent = sum(self.new[QKV].nbytes if n == QKV else changed_elements(self.base[n], self.new[n])[0].size * (8 + 4 if n == wide else 4 + 4)
                   for n in self.new)
        self.assertEqual(r["bytes"], sent, "the wire carries the deltas only")
        self.assert_serving(self.ref_new, "d1")
        # the serving dir (the wakeup source) follows lazily: written by the time the weights sleep
        self.c.sleep()
        staged = read_staged(self.d)
        self.assertEqual(sorted(staged), sorted(self.new))
        for n in self.new:
            self.assertTrue(np.array_equal(staged[n].view(np.uint32), self.new[n].view(np.uint32)), n)
        self.c.wakeup()
        self.assert_serving(self.ref_new, "d1")
        # a full update of the same weights serves the same, bit for bit; then a delta back
        self.full("f1", self.new)
        self.assert_serving(self.ref_new, "f1")
        r = self.delta("d2", "f1", self.new, self.base)
        self.assertEqual(r["weight_version"], "d2")
        self.assert_serving(self.ref_base, "d2")
        # sleep / wakeup reloads the delta's staged weights
        self.c.sleep()
        self.c.wakeup()
        self.assert_serving(self.ref_base, "d2")
        self.assertEqual(len(stream_dirs(self.d.port)), 1)

    def refused(self, status, type_, words, fn):
        before = self.c.weight_version()
        with self.assertRaises(FdRolloutError) as e:
            fn()
        self.assertEqual((e.exception.status, e.exception.type), (status, type_), e.exception.message)
        for w in words:
            self.assertIn(w, e.exception.message)
        self.assertEqual(self.c.weight_version(), before, "a failed delta changes nothing")
        self.assertEqual(self.c.health()["state"], "serving")
        self.assertEqual(len(stream_dirs(self.d.port)), 1, "no staging dir of a failed stream survives")
        return e.exception

    def test_2_wrong_base_is_409_and_the_old_version_serves(self):
        self.full("w0", self.base)
        # a base nobody serves; an older stream's version
        self.refused(409, "wrong_state", ["'nope'", "w0"], lambda: self.delta("w1", "nope", self.base, self.new))
        self.full("w1", self.new)
        self.refused(409, "wrong_state", ["'w0'", "w1"], lambda: self.delta("w2", "w0", self.base, self.new))
        self.assert_serving(self.ref_new, "w1")

        # the serving version changes while the delta is open: the finish refuses it
        def changed_under():
            with self.c.weight_stream("w3", base_version="w1") as ws:
                idx, vals = changed_elements(self.new[NAME], self.base[NAME])
                ws.send_delta(NAME, idx, vals)
                ws.flush()
                self.c.pause()
                self.c.update_weights(version="other")  # --model from the load-strategy source
                self.c.resume()

        with self.assertRaises(FdRolloutError) as e:
            changed_under()
        self.assertEqual((e.exception.status, e.exception.type), (409, "wrong_state"), e.exception.message)
        self.assertIn("'w1'", e.exception.message)
        self.assert_serving(self.ref_base, "other")
        # 'other' came from --model, not from a stream: no delta applies to it
        self.refused(409, "wrong_state", ["'other'", "stream the full weights first"],
                     lambda: self.delta("w4", "other", self.base, self.new))

    def test_2b_the_streams_own_dir_reloaded_is_not_the_stream(self):
        # A probe: a delta left pending in the stream's dir, then that dir loaded by a checkpoint
        # update under the delta's label. The load drops the pending delta, so other bytes serve
        # under that label; /health named the stream still and a delta on it committed (the dir
        # and the label matched). The serving bytes changed: the stream serves no more.
        self.full("p0", self.new)
        self.delta("p1", "p0", self.new, self.base)  # pending in p0's dir
        self.assertEqual(self.c.health()["weight_stream"]["serving_stream_version"], "p1")
        dirs = [d for d in stream_dirs(self.d.port) if glob.glob(os.path.join(d, ".fdrollout-pending-*"))]
        self.assertEqual(len(dirs), 1, stream_dirs(self.d.port))
        self.c.pause()
        self.c.update_weights_from_dir(dirs[0], version="p1")
        self.c.resume()
        self.assertIsNone(self.c.health()["weight_stream"]["serving_stream_version"])
        self.refused(409, "wrong_state", ["'p1'", "no longer serves"], lambda: self.delta("p2", "p1", self.new, self.base))
        self.full("p3", self.base)  # a full stream serves again
        self.assertEqual(self.delta("p4", "p3", self.base, self.new)["weight_version"], "p4")
        self.assert_serving(self.ref_new, "p4")

    def test_3_bad_indices_are_4xx_naming_the_tensor(self):
        self.full("i0", self.base)
        n = self.base[NAME].size
        vals = np.ones(3, np.float32)

        def one(idx, v=vals, name=NAME):
            def fn():
                with self.c.weight_stream("bad", base_version="i0") as ws:
                    ws.send(QKV, self.new[QKV])  # a full tensor before it in the same bucket
                    ws.send_delta(name, np.asarray(idx, np.int64), v)
            return fn

        e = self.refused(400, "invalid_argument", [NAME, "sorted and unique", "index 5 at position 1 follows 9"], one([9, 5, 11]))
        self.refused(400, "invalid_argument", [NAME, "sorted and unique", "index 5 at position 2 follows 5"], one([1, 5, 5]))
        self.refused(400, "invalid_argument", [NAME, f"index {n} (at position 2) is outside [0, {n})"], one([0, 1, n]))
        self.refused(400, "invalid_argument", [NAME, "index -1 (at position 0)"], one([-1, 0, 1]))
        self.refused(400, "invalid_argument", [NAME, f"a delta of {n + 1} elements"],
                     one(np.arange(n + 1), np.zeros(n + 1, np.float32)))
        nan = vals.copy()
        nan[1] = np.inf
        self.refused(422, "invalid_checkpoint", [NAME, "delta value 1 (of 3) is non-finite"], one([0, 1, 2], nan))
        self.assertIn("nothing was applied", e.message)
        # a delta frame in an update without base_version (the client refuses before sending)
        with self.assertRaises(ValueError):
            with self.c.weight_stream("bad") as ws:
                ws.send_delta(NAME, np.arange(3), vals)
        st, body = self.d.post("/start_weight_update", {"base_version": "i0!"})
        self.assertEqual(st, 400, body)
        self.assert_serving(self.ref_base, "i0")
        # the next delta works
        self.assertEqual(self.delta("i1", "i0", self.base, self.new)["weight_version"], "i1")
        self.assert_serving(self.ref_new, "i1")

    def test_4_health_shows_an_open_stream(self):
        self.full("h0", self.base)

        class Stop(Exception):
            pass

        with self.assertRaises(Stop):
            with self.c.weight_stream("h1", base_version="h0", timeout=20) as ws:
                idx, vals = changed_elements(self.base[NAME], self.new[NAME])
                ws.send_delta(NAME, idx, vals)
                ws.flush()
                s = self.c.health()["weight_stream"]
                self.assertEqual((s["state"], s["transport"], s["version"], s["base_version"]), ("open", "tcp", "h1", "h0"))
                self.assertEqual((s["n_received"], s["n_delta"], s["bytes_received"]), (1, 1, idx.size * 8))
                self.assertTrue(0 < s["deadline_in_s"] <= 20, s)
                raise Stop()  # leaving with an exception aborts the update
        s = self.c.health()["weight_stream"]
        self.assertEqual((s["state"], s["version"], s["n_received"], s["deadline_in_s"], s["serving_stream_version"]),
                         ("idle", None, 0, None, "h0"))
        self.assert_serving(self.ref_base, "h0")

    def test_5_a_rank_failing_mid_apply_rolls_every_rank_back(self):
        # A second daemon whose last rank fails half way through writing a delta in place
        # (FD_TEST_DELTA_FAIL_RANK, TEST ONLY): at tp=2 rank 0 has applied all of it by then, at
        # tp=1 the one rank some of it. Every rank and the serving dir go back; the base serves.
        tp = 2 if "--tensor-parallel-size" in self.TP_ARGS else 1
        with Daemon("--dynamic-load-weight", "--control-timeout-s", "20", *self.TP_ARGS, model=STORIES, extra=False,
                    env={"FD_TEST_DELTA_FAIL_RANK": str(tp - 1)}) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=20)
            with c.weight_stream("r0") as ws:
                for name in sorted(self.base):
                    ws.send(name, self.base[name])
            with self.assertRaises(FdRolloutError) as e:
                with c.weight_stream("r1", base_version="r0") as ws:
                    for name in sorted(self.new):
                        idx, vals = changed_elements(self.base[name], self.new[name])
                        if idx.size:
                            ws.send_delta(name, idx, vals)
            self.assertIn("FD_TEST_DELTA_FAIL_RANK", e.exception.message)
            self.assertIn(f"rank {tp - 1}" if tp > 1 else "half way", e.exception.message)
            self.assertEqual(greedy(d), (*self.ref_base, "r0"), "every rank serves the base again, bit for bit")
            self.assertEqual(c.health()["state"], "serving")
            staged = read_staged(d)
            for n in self.base:
                self.assertTrue(np.array_equal(staged[n].view(np.uint32), self.base[n].view(np.uint32)), n)
            c.sleep()
            c.wakeup()
            self.assertEqual(greedy(d), (*self.ref_base, "r0"), "the wakeup reloads the base, under its label")

    def test_5b_a_rank_killed_mid_apply_recovers_to_the_base(self):
        # tp=2 only: rank 1's process exits half way through the delta (rank 0 applied it all).
        # The engine degrades; the wakeup's recovery reloads every rank from the serving dir,
        # which the delta never reached: the base serves, under its label.
        if "--tensor-parallel-size" not in self.TP_ARGS:
            self.skipTest("a rank process is killed: tp=2 only")
        with Daemon("--dynamic-load-weight", "--control-timeout-s", "20", *self.TP_ARGS, model=STORIES, extra=False,
                    env={"FD_TEST_DELTA_FAIL_RANK": "1:exit"}) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=20)
            with c.weight_stream("k0") as ws:
                for name in sorted(self.base):
                    ws.send(name, self.base[name])
            with self.assertRaises(FdRolloutError):
                with c.weight_stream("k1", base_version="k0") as ws:
                    for name in sorted(self.new):
                        idx, vals = changed_elements(self.base[name], self.new[name])
                        if idx.size:
                            ws.send_delta(name, idx, vals)
            st, h = d.get("/health")
            self.assertEqual((st, h["state"], h["degraded_ranks"], h["weight_version"]), (503, "degraded", [1], "k0"))
            c.wakeup()
            self.assertEqual(greedy(d), (*self.ref_base, "k0"))

    def test_6_delta_on_delta_then_sleep_wakeup(self):
        self.full("e0", self.base)
        self.delta("e1", "e0", self.base, self.new)
        self.assert_serving(self.ref_new, "e1")
        self.assertEqual(self.delta("e2", "e1", self.new, self.base)["weight_version"], "e2")  # based on the dir e1 updated
        self.assert_serving(self.ref_base, "e2")
        self.c.sleep()
        self.c.wakeup()
        self.assert_serving(self.ref_base, "e2")
        self.assertEqual(self.delta("e3", "e2", self.base, self.new)["weight_version"], "e3")  # after a wakeup too
        self.assert_serving(self.ref_new, "e3")
        freed_after_delta = self.c.sleep()["freed_bytes"]["weight"]
        self.c.wakeup()
        self.assert_serving(self.ref_new, "e3")
        freed_after_load = self.c.sleep()["freed_bytes"]["weight"]
        # The first sleep also freed the ranks' undo buffers: the old value of every element e3
        # wrote (a replicated 1-D tensor's on every rank), each piece's values 8-byte aligned (at
        # most one f32 of padding per piece, and a piece holds at least one element). The tied
        # lm_head.weight is not a tensor the ranks hold.
        tp = 2 if "--tensor-parallel-size" in self.TP_ARGS else 1
        with open(os.path.join(STORIES, "config.json")) as f:
            tied = json.load(f).get("tie_word_embeddings", False)
        undo = sum(changed_elements(self.base[n], self.new[n])[0].size * self.new[n].itemsize * (tp if self.new[n].ndim == 1 else 1)
                   for n in self.new if not (tied and n == "lm_head.weight"))
        self.assertGreater(undo, 0)
        # ... and every rank's copy of e3's delta file (read_weight_delta_into): its payload (int32
        # indices and the values of every changed element, as sent), the 16-byte framing and the
        # header room the stream reserves (1 KiB + 512 B per tensor of the model), in whole 4 KiB pages.
        payload = sum(changed_elements(self.base[n], self.new[n])[0].size * (4 + self.new[n].itemsize) for n in self.new)
        file_most = -(-(payload + 16 + 1024 + 512 * len(self.base)) // 4096) * 4096
        freed_undo = freed_after_delta - freed_after_load
        self.assertGreaterEqual(freed_undo, undo + tp * payload, "a weight sleep frees the delta undo buffer and the delta file's copy")
        self.assertLessEqual(freed_undo, 2 * undo + tp * file_most)
        staged = read_staged(self.d)
        for n in self.new:
            self.assertTrue(np.array_equal(staged[n].view(np.uint32), self.new[n].view(np.uint32)), n)
        self.c.wakeup()
        self.assert_serving(self.ref_new, "e3")

    def test_6b_a_delta_file_near_a_full_update_is_mapped_not_kept(self):
        # Every tensor sent in full: the delta file is about the model's size, over a quarter of any
        # rank's weights, so each rank maps it (Worker::read_hf_delta) instead of keeping a copy;
        # the bytes served are the same. A weight sleep then frees the undo buffer (the old value of
        # every element the ranks hold, a replicated 1-D tensor's on every rank) and no copy: a
        # copy would add about tp times the model's bytes.
        self.full("m0", self.base)
        self.c.sleep()  # what the full update left staged goes here, not in the difference below
        self.c.wakeup()
        r = self.delta("m1", "m0", self.base, self.new, full=set(self.new))
        self.assertEqual((r["weight_version"], r["n_delta"]), ("m1", 0))
        self.assert_serving(self.ref_new, "m1")
        freed_after_delta = self.c.sleep()["freed_bytes"]["weight"]
        self.c.wakeup()
        self.assert_serving(self.ref_new, "m1")
        freed_after_load = self.c.sleep()["freed_bytes"]["weight"]
        self.c.wakeup()
        tp = 2 if "--tensor-parallel-size" in self.TP_ARGS else 1
        with open(os.path.join(STORIES, "config.json")) as f:
            tied = json.load(f).get("tie_word_embeddings", False)
        undo = sum(self.new[n].nbytes * (tp if self.new[n].ndim == 1 else 1) for n in self.new if not (tied and n == "lm_head.weight"))
        freed_undo = freed_after_delta - freed_after_load
        self.assertGreaterEqual(freed_undo, undo, "a weight sleep frees the delta undo buffer")
        self.assertLess(freed_undo, undo * 3 // 2, "no rank kept a copy of a delta file this large")
        self.assert_serving(self.ref_new, "m1")

    def test_7_deltas_without_a_version_are_named_by_the_dir(self):
        # No version: the commit writes the dir at once and the fingerprint names the bytes (fp-...),
        # which a wakeup keeps.
        self.full("g0", self.base)
        with self.c.weight_stream(None, base_version="g0") as ws:
            idx, vals = changed_elements(self.base[NAME], self.new[NAME])
            ws.send_delta(NAME, idx, vals)
        label = ws.result["weight_version"]
        self.assertTrue(label.startswith("fp-"), label)
        self.c.sleep()
        self.c.wakeup()
        self.assertEqual(self.c.weight_version(), label)

    def test_8_delta_straddling_the_rank_split_equals_a_full_update(self):
        # Reference: a fresh daemon (this run's tp) on a checkpoint holding the changed weights.
        new, changed = straddling_change(self.base)
        self.assertEqual(len(changed), 10)
        new_dir = os.path.join(self.tmp, "straddle")
        rewrite_tensors(copy_checkpoint(STORIES, new_dir), lambda t: t.update({k: v.copy() for k, v in new.items()}))
        with fresh_daemon(new_dir, *self.TP_ARGS) as ref:
            ref_new = greedy(ref)[:2]
        self.assertNotEqual(ref_new, self.ref_base, "the change must show in the greedy probe")
        self.full("s0", self.base)
        dense = "model.layers.2.mlp.down_proj.weight"  # sent in full: one run per row and rank
        r = self.delta("s1", "s0", self.base, new, int32={"model.layers.1.self_attn.o_proj.weight"}, full={dense})
        self.assertEqual((r["n_delta"], r["n_from_base"]), (len(changed) - 1, len(self.base) - len(changed)))
        self.assert_serving(ref_new, "s1")
        self.c.sleep()  # the serving dir follows: the wakeup source holds the same bytes
        staged = read_staged(self.d)
        for n in new:
            self.assertTrue(np.array_equal(staged[n].view(np.uint32), new[n].view(np.uint32)), n)
        self.c.wakeup()
        self.assert_serving(ref_new, "s1")
        # and back, as a delta on the delta: the base again, bit for bit
        self.delta("s2", "s1", new, self.base)
        self.assert_serving(self.ref_base, "s2")

    def test_9_serving_dir_removed_under_pending_deltas(self):
        # The stream dir the deltas are pending for is removed behind the daemon's back (tmpfs
        # cleanup, an operator). Nothing can write it or reload from it any more: the sleep drops
        # the pending deltas, the wakeup loads --model (stories260K = the base's bytes) and the
        # label follows those bytes, never the delta's version.
        self.full("x0", self.base)
        self.delta("x1", "x0", self.base, self.new)
        self.assert_serving(self.ref_new, "x1")
        dirs = stream_dirs(self.d.port)
        self.assertEqual(len(dirs), 1)
        self.assertTrue(glob.glob(os.path.join(dirs[0], ".fdrollout-pending-*.fddelta")), "the delta is pending for the dir")
        shutil.rmtree(dirs[0])
        self.c.sleep()
        self.c.wakeup()
        ids, lps, label = greedy(self.d)
        self.assertEqual((ids, lps), self.ref_base, "the wakeup serves --model's bytes")
        self.assertNotIn(label, ("x1", "x0"), "the label names the bytes served")
        self.assertEqual(self.c.health()["state"], "serving")
        # the lost base cannot take a delta; a full stream, then deltas, work again
        with self.assertRaises(FdRolloutError) as e:
            self.delta("x2", "x1", self.new, self.base)
        self.assertEqual((e.exception.status, e.exception.type), (409, "wrong_state"), e.exception.message)
        self.assertIn("'x1'", e.exception.message)
        self.assertEqual(self.c.weight_version(), label)
        self.assertEqual(stream_dirs(self.d.port), [], "nothing staged survives the refusal")
        self.full("x3", self.new)
        self.assert_serving(self.ref_new, "x3")
        self.delta("x4", "x3", self.new, self.base)
        self.assert_serving(self.ref_base, "x4")

    def test_11_trainer_killed_mid_delta_drops_it(self):
        self.full("k0", self.base)
        p = subprocess.Popen([PYTHON, "-c", KILLED_DELTA_TRAINER, str(self.d.port), "k0"], stdout=subprocess.PIPE, text=True)
        kill_when_sent(self, p, lambda: self.assertEqual(len(stream_dirs(self.d.port)), 2,
                                                         "the open delta update has its staging dir beside the serving one"))
        t0 = time.monotonic()

        def reinit():  # a new init is accepted once the update was dropped
            st, _ = self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})
            return st == 200

        wait_until(reinit, 10, "the killed trainer's delta update dropped")
        self.assertLess(time.monotonic() - t0, 10, "dropped well before the 20 s stream timeout")
        self.assert_serving(self.ref_base, "k0")
        self.assertEqual(len(stream_dirs(self.d.port)), 1, "the dropped delta's staging dir (and its delta file) is removed")
        self.delta("k1", "k0", self.base, self.new)
        self.assert_serving(self.ref_new, "k1")

    def test_10_the_dir_takes_the_delta_file_the_ranks_read(self):
        # The finish writes one delta file (weights.fddelta, HF names) that every rank maps and
        # splits itself; after the commit it goes into the serving dir as a pending delta. A sleep
        # right after the commit writes it into the dir (which the wakeup reloads): the dir then
        # holds the delta's bytes, bit for bit, and the wakeup serves them under the delta's
        # label. A finish refused after the seal (the base changed under it) drops the update and
        # its file; the next delta works.
        with Daemon("--dynamic-load-weight", "--control-timeout-s", "20", *self.TP_ARGS, model=STORIES, extra=False) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=20)
            with c.weight_stream("w0") as ws:
                for name in sorted(self.base):
                    ws.send(name, self.base[name])
            with c.weight_stream("w1", base_version="w0") as ws:
                for name in sorted(self.new):
                    idx, vals = changed_elements(self.base[name], self.new[name])
                    if idx.size:
                        ws.send_delta(name, idx, vals)
            self.assertEqual(ws.result["weight_version"], "w1")
            c.sleep()
            staged = read_staged(d)
            for n in self.new:
                self.assertTrue(np.array_equal(staged[n].view(np.uint32), self.new[n].view(np.uint32)), n)
            c.wakeup()
            self.assertEqual(greedy(d), (*self.ref_new, "w1"))
            # a delta whose base changes between its split and its commit: dropped with its file
            with self.assertRaises(FdRolloutError) as e:
                with c.weight_stream("w2", base_version="w1") as ws:
                    idx, vals = changed_elements(self.new[NAME], self.base[NAME])
                    ws.send_delta(NAME, idx, vals)
                    ws.flush()
                    c.pause()
                    c.update_weights(version="other")  # --model from the load-strategy source
                    c.resume()
            self.assertEqual(e.exception.status, 409, e.exception.message)
            self.assertEqual(greedy(d), (*self.ref_base, "other"))
            self.assertEqual(len(stream_dirs(d.port)), 1, "only the serving stream dir is left")
            self.full_on(c, "w3", self.new)
            with c.weight_stream("w4", base_version="w3") as ws:
                idx, vals = changed_elements(self.new[NAME], self.base[NAME])
                ws.send_delta(NAME, idx, vals)
            self.assertEqual(ws.result["weight_version"], "w4")

    @staticmethod
    def full_on(c, version, tensors):
        with c.weight_stream(version) as ws:
            for name in sorted(tensors):
                ws.send(name, tensors[name])


class DeltaTp2(DeltaTp1):
    TP_ARGS = ["--tensor-parallel-size", "2", "--threads", "1", *device_args()]

    # tp=2 repeats the paths that reach the ranks; the input checks run before any rank is involved.
    test_3_bad_indices_are_4xx_naming_the_tensor = None
    test_4_health_shows_an_open_stream = None


if __name__ == "__main__":
    unittest.main()
