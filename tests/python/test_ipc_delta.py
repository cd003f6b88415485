"""Delta updates over an ipc publish (fdrollout.publish.publish_ipc_delta; docs/weight_streams.md,
"Over ipc publishes") applied by the real daemon (--load-strategy ipc) at tp=1 and tp=2. The
references nobody here wrote: fresh daemons started on checkpoints holding the same weights in
full (written with safetensors_np), at the same tensor-parallel size (so bit for bit).
  - v1 published full into the weights records, v2 as an ipc delta on v1, v3 as a delta on v2
    (one tensor sent in full): the daemon serves what the fresh daemons on the full v2 / v3 serve
    (token ids and logprobs), also after sleep/wakeup (the records are reloaded and the deltas
    applied again);
  - a delta against a version the daemon does not serve (v0 while v3 serves) is a 409 naming both,
    and v3 keeps serving; so is one on weights that did not come from the records (a checkpoint dir);
  - bad records (an index out of range, unsorted indices, a tensor the model lacks, a wrong shape,
    a truncated payload, a bad magic, a publish in progress, a record others may access): 4xx /
    503 naming it, nothing changes;
  - records republished under the deltas (fdctl publish --strategy ipc): a wakeup serves what the
    records hold, labelled by them; then a delta from `fdctl publish --strategy ipc_delta` (the
    elements that differ between two checkpoint dirs) serves the full v3.
"""
import glob
import json
import os
import shutil
import sys
import tempfile
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import STORIES, Daemon, device_args, copy_checkpoint, fdctl, fresh_daemon, greedy, rewrite_tensors, wait_until  # noqa: E402
from fdrollout import Client, FdRolloutError, changed_elements  # noqa: E402
from fdrollout import publish, safetensors_np  # noqa: E402
from fdrollout.publish_delta import ipc_delta_path, weight_delta_bytes, write_ipc_delta_record  # noqa: E402

from delta_fixtures import NAME, QKV, delta_of, sparse_change  # noqa: E402,F401




class IpcDeltaTp1(unittest.TestCase):
    TP = 1
    TP_ARGS = device_args()  # FD_TEST_DAEMON_ARGS's --device (scripts/gpu_check.sh's extra runs: cuda)
    ENV = {}

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-ipcdelta-")
        cls.cfg = publish.load_config(STORIES)
        cls.v1 = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
        cls.v0 = sparse_change(cls.v1, 0.05, seed=1)
        cls.v2 = sparse_change(cls.v1, 0.01, seed=3)
        cls.v3 = sparse_change(cls.v2, 0.01, seed=5)
        cls.refs, cls.dirs = {}, {}
        for v in ("v1", "v2", "v3"):
            tensors = getattr(cls, v)
            cls.dirs[v] = rewrite_tensors(copy_checkpoint(STORIES, os.path.join(cls.tmp, v)), lambda t, x=tensors: t.update(x))
            with fresh_daemon(cls.dirs[v], *cls.TP_ARGS) as ref:
                cls.refs[v] = greedy(ref)[:2]
        assert len({str(r) for r in cls.refs.values()}) == 3, "each version must show in the greedy probe"
        cls.d = Daemon("--dynamic-load-weight", "--load-strategy", "ipc", "--control-timeout-s", "60", *cls.TP_ARGS,
                       model=STORIES, extra=False, env=cls.ENV)
        cls.port = cls.d.port
        cls.c = Client(f"127.0.0.1:{cls.port}", timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)
        left = [f for f in os.listdir("/dev/shm") if f.startswith((f"fdrollout.{cls.port}.weights", f"fdrollout-stream.{cls.port}."))]
        for f in left:
            p = os.path.join("/dev/shm", f)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        assert not [f for f in left if f.startswith("fdrollout-stream.")], f"the daemon left its dirs: {left}"

    def publish_full(self, tensors, version):
        for r in range(self.TP):
            publish.publish_ipc(publish.to_rollout_names(tensors, self.cfg, tp=self.TP, rank=r), self.port, version, rank=r,
                                tp_size=self.TP)

    def update(self, version=None):
        self.c.pause()
        try:
            return self.c.update_weights(version=version)
        finally:
            self.c.resume()

    def assert_serving(self, v, label=None):
        self.assertEqual(greedy(self.d), (*self.refs[v], label or v))
        self.assertEqual(self.c.health()["state"], "serving")

    def refused(self, status, type_, words, version):
        before = greedy(self.d)
        with self.assertRaises(FdRolloutError) as e:
            self.update(version)
        self.assertEqual((e.exception.status, e.exception.type), (status, type_), e.exception.message)
        for w in words:
            self.assertIn(w, e.exception.message)
        self.assertEqual(greedy(self.d), before, "a refused delta changes nothing, bit for bit")
        return e.exception

    def test_1_deltas_serve_what_the_full_versions_serve(self):
        self.publish_full(self.v1, "v1")
        self.assertEqual(self.update("v1")["version"], "v1")
        self.assert_serving("v1")
        publish.publish_ipc_delta(delta_of(self.v1, self.v2), self.port, "v2", "v1", STORIES)
        self.assertEqual(self.update("v2")["version"], "v2")
        self.assert_serving("v2")
        self.c.sleep()
        self.c.wakeup()
        self.assert_serving("v2")
        # a delta on a delta: one tensor sent in full
        changes = delta_of(self.v2, self.v3)
        changes[QKV] = self.v3[QKV]
        publish.publish_ipc_delta(changes, self.port, "v3", "v2", STORIES)
        self.assertEqual(self.update("v3")["version"], "v3")
        self.assert_serving("v3")
        (ipc_dir,) = glob.glob(os.path.join("/dev/shm", f"fdrollout-stream.{self.port}.{self.d.proc.pid}.ipcdelta.*"))
        kept = os.listdir(ipc_dir)
        self.assertEqual(len(kept), 1 if self.ENV else 2, kept)  # merged into one / the two deltas
        self.c.sleep()
        self.c.wakeup()
        self.assert_serving("v3")

    def test_2_a_delta_on_another_base_is_409(self):
        self.assertEqual(self.c.weight_version(), "v3")
        publish.publish_ipc_delta(delta_of(self.v0, self.v2), self.port, "d0", "v0", STORIES)
        self.refused(409, "wrong_state", ["'d0'", "'v0'", "serves 'v3'"], "d0")
        # the weights served as v3 from a checkpoint dir, not the records: same label, other source
        self.assertEqual(self.c.update_weights_from_dir(self.dirs["v3"], version="v3")["weight_version"], "v3")
        self.assert_serving("v3")
        publish.publish_ipc_delta({NAME: (np.array([1, 2]), np.ones(2, np.float32))}, self.port, "d1", "v3", STORIES)
        self.refused(409, "wrong_state", ["'d1'", "did not come from this port's ipc weights records"], "d1")
        # back on the records, at v3 (full) for the next tests
        self.publish_full(self.v3, "v3")
        self.assertFalse(os.path.exists(ipc_delta_path(self.port)), "a full publish removes the delta record")
        self.assertEqual(self.update("v3")["version"], "v3")
        self.assert_serving("v3")

    def test_3_bad_records_are_4xx_naming_them(self):
        self.assertEqual(self.c.weight_version(), "v3")
        shape = list(self.v3[NAME].shape)
        n = self.v3[NAME].size
        vals = np.ones(3, np.float32)

        def raw(version, entries, **kw):
            write_ipc_delta_record(self.port, version, "v3", weight_delta_bytes(entries), **kw)

        raw("b1", [(NAME, "F32", shape, np.array([5, 2, 9]), vals)])
        self.refused(422, "invalid_checkpoint", [NAME, "out of order"], "b1")
        raw("b2", [(NAME, "F32", shape, np.array([1, 2, n]), vals)])
        self.refused(422, "invalid_checkpoint", [NAME, str(n)], "b2")
        raw("b3", [("model.layers.9.mlp.nope.weight", "F32", shape, np.array([1, 2, 3]), vals)])
        self.refused(422, "invalid_checkpoint", ["model.layers.9.mlp.nope.weight"], "b3")
        raw("b4", [(NAME, "F32", [shape[1], shape[0]], np.array([1, 2, 3]), vals)])
        self.refused(422, "invalid_checkpoint", [NAME], "b4")
        write_ipc_delta_record(self.port, "b5", "v3", weight_delta_bytes([(NAME, "F32", shape, np.array([1, 2, 3]), vals)])[:-5])
        self.refused(422, "invalid_checkpoint", ["weights.fddelta"], "b5")
        raw("b6", [(NAME, "F32", shape, np.array([1, 2, 3]), vals)], magic=0x1234)
        self.refused(422, "invalid_checkpoint", [ipc_delta_path(self.port), "magic"], "b6")
        # a publish in progress (odd generation): 503, retry later
        raw("b7", [(NAME, "F32", shape, np.array([1, 2, 3]), vals)])
        with open(ipc_delta_path(self.port), "r+b") as f:
            f.seek(16)
            gen = int.from_bytes(f.read(8), "little")
            f.seek(16)
            f.write((gen + 1).to_bytes(8, "little"))
        self.refused(503, "source_unavailable", ["in progress"], "b7")
        # a record others may read or write is not trusted
        raw("b8", [(NAME, "F32", shape, np.array([1, 2, 3]), vals)])
        os.chmod(ipc_delta_path(self.port), 0o644)
        self.refused(403, "forbidden", [ipc_delta_path(self.port)], "b8")
        os.remove(ipc_delta_path(self.port))
        self.c.sleep()
        self.c.wakeup()
        self.assert_serving("v3")

    def test_4_records_republished_under_the_deltas(self):
        publish.publish_ipc_delta({NAME: (np.array([0]), self.v1[NAME].reshape(-1)[:1] + 1)}, self.port, "v4", "v3", STORIES)
        self.assertEqual(self.update("v4")["version"], "v4")
        self.assertNotEqual(greedy(self.d)[:2], self.refs["v3"])
        self.c.sleep()
        # the trainer rewrote the records (fdctl, from a checkpoint dir): the deltas were made on other bytes
        rc, out, err = fdctl(self.port, "publish", "--strategy", "ipc", "--from", self.dirs["v2"], "--version", "w2", "--tp", str(self.TP))
        self.assertEqual(rc, 0, err)
        self.assertFalse(os.path.exists(ipc_delta_path(self.port)), "a full publish removes the delta record")
        self.c.wakeup()
        self.assert_serving("v2", "w2")  # what the records hold, named by them
        # a delta from fdctl: what differs between two checkpoint dirs
        rc, out, err = fdctl(self.port, "publish", "--strategy", "ipc_delta", "--from", self.dirs["v3"], "--base-from",
                             self.dirs["v2"], "--version", "v3b", "--base-version", "w2", "--json")
        self.assertEqual(rc, 0, err)
        j = json.loads(out)
        self.assertEqual(j["changed"], sum(int(np.sum(self.v2[n].view(np.uint32) != self.v3[n].view(np.uint32))) for n in self.v3))
        self.assertEqual(self.update("v3b")["version"], "v3b")
        self.assert_serving("v3", "v3b")
        self.c.sleep()
        self.c.wakeup()
        self.assert_serving("v3", "v3b")
        # v3b names the delta's result here: a full record published later as v3b with other
        # weights (v1's) is served under a fingerprint label, never as v3b a second time
        self.publish_full(self.v1, "v3b")
        label = self.update()["version"]
        self.assertRegex(label, r"^fp-[0-9a-f]{16}$")
        self.assert_serving("v1", label)

    def test_5_the_publisher_refuses_bad_input(self):
        cases = [({NAME: (np.array([3, 1]), np.ones(2))}, "strictly increasing"),
                 ({NAME: (np.array([self.v1[NAME].size]), np.ones(1))}, "outside"),
                 ({NAME: (np.array([1]), np.array([np.nan], np.float32))}, "not finite"),
                 ({"nope.weight": (np.array([1]), np.ones(1))}, "not a tensor")]
        path = ipc_delta_path(self.port)
        before = self.read(path)
        for changes, words in cases:
            with self.assertRaises(ValueError) as e:
                publish.publish_ipc_delta(changes, self.port, "p1", "v1", STORIES)
            self.assertIn(words, str(e.exception))
            self.assertEqual(self.read(path), before, "nothing was written")

    @staticmethod
    def read(path):
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            return f.read()


class IpcDeltaTornCopy(unittest.TestCase):
    """A publisher that rewrites the delta record while the daemon copies it: 503, nothing applied
    (FD_TEST_IPC_DELTA_COPY_DELAY_MS holds the daemon between its copy and its check)."""

    def test_a_record_rewritten_during_the_copy_is_503(self):
        v1 = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
        cfg = publish.load_config(STORIES)
        with Daemon("--dynamic-load-weight", "--load-strategy", "ipc", "--control-timeout-s", "60", model=STORIES, extra=False,
                    env={"FD_TEST_IPC_DELTA_COPY_DELAY_MS": "600"}) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=60)
            try:
                publish.publish_ipc(publish.to_rollout_names(v1, cfg), d.port, "v1")
                c.pause()
                self.assertEqual(c.update_weights(version="v1")["version"], "v1")
                c.resume()
                before = greedy(d, max_tokens=8)[:2]
                c.pause()
                change = {NAME: (np.array([0, 5]), np.array([3.0, -3.0], np.float32))}
                publish.publish_ipc_delta(change, d.port, "v2", "v1", STORIES)
                result = {}

                def update():
                    try:
                        result["answer"] = c.update_weights(version="v2")
                    except FdRolloutError as e:
                        result["error"] = e

                t = threading.Thread(target=update)
                t.start()
                copied = os.path.join("/dev/shm", f"fdrollout-stream.{d.port}.{d.proc.pid}.ipcdelta.*", "*", "weights.fddelta")
                wait_until(lambda: glob.glob(copied), 30, "the daemon's copy of the delta record")
                publish.publish_ipc_delta(change, d.port, "v2", "v1", STORIES)  # same bytes, new generation
                t.join(60)
                self.assertFalse(t.is_alive())
                e = result.get("error")
                self.assertIsNotNone(e, result)
                self.assertEqual((e.status, e.type), (503, "source_unavailable"), e.message)
                self.assertIn("rewrote the delta record during the copy", e.message)
                self.assertEqual(c.weight_version(), "v1")
                c.resume()
                self.assertEqual(greedy(d, max_tokens=8)[:2], before)
                c.pause()  # the retry applies it
                self.assertEqual(c.update_weights(version="v2")["version"], "v2")
                c.resume()
                self.assertNotEqual(greedy(d, max_tokens=8)[:2], before)
            finally:
                for f in (publish.ipc_path(d.port), ipc_delta_path(d.port)):
                    if os.path.exists(f):
                        os.remove(f)


class IpcDeltaMergedTp1(IpcDeltaTp1):
    """The kept deltas merged into one at every commit (FD_IPC_DELTA_MERGE_BYTES=1): the wakeups
    replay the merged delta."""
    ENV = {"FD_IPC_DELTA_MERGE_BYTES": "1"}

    test_5_the_publisher_refuses_bad_input = None


class IpcDeltaTp2(IpcDeltaTp1):
    TP = 2
    TP_ARGS = ["--tensor-parallel-size", "2", "--threads", "1", *device_args()]

    test_5_the_publisher_refuses_bad_input = None  # no rank involved: once (tp=1)


if __name__ == "__main__":
    unittest.main()
