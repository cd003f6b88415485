"""Delta versions of the rsync store (fdrollout.publish.publish_rsync_delta; docs/weight_sources.md,
"Delta versions") pulled by the real daemon from a real `rsync --daemon` at tp=1 and tp=2. The
references nobody here wrote: fresh daemons started on checkpoints holding the same weights in
full (written with safetensors_np), at the same tensor-parallel size (so bit for bit).
  - v1 published full, v2 as a delta on v1, v3 as a delta on v2: a daemon updated v1 → v2 → v3
    serves what the fresh daemons on the full v2 / v3 serve (token ids and logprobs), also after
    sleep/wakeup (the serving dir it wakes from holds exactly v3's tensors);
  - a delta against a version the daemon does not serve (v0 while v3 serves; v2 on a daemon at
    --model's "0") is a 409 naming the base, and the old version keeps serving;
  - a delta whose base_fingerprint names other bytes, unsorted / out-of-range indices, a tensor
    the model lacks, a damaged weights.fddelta: 4xx naming it, nothing changes;
  - the publisher refuses bad input itself (ValueError naming the tensor) and writes nothing.
"""
import glob
import json
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import STORIES, Daemon, device_args, copy_checkpoint, fresh_daemon, greedy, rewrite_tensors  # noqa: E402
from test_rsync import RsyncDaemon  # noqa: E402
from fdrollout import Client, FdRolloutError, changed_elements  # noqa: E402
from fdrollout import publish, safetensors_np  # noqa: E402
from fdrollout.publish_delta import manifest_fingerprint, read_store_manifest, write_weight_delta  # noqa: E402

from delta_fixtures import NAME, QKV, delta_of, sparse_change  # noqa: E402,F401




class RsyncDeltaTp1(unittest.TestCase):
    TP_ARGS = device_args()  # FD_TEST_DAEMON_ARGS's --device (scripts/gpu_check.sh's extra runs: cuda)

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-rsdelta-")
        cls.v1 = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
        cls.v0 = sparse_change(cls.v1, 0.05, seed=1)
        cls.v2 = sparse_change(cls.v1, 0.01, seed=3)
        cls.v3 = sparse_change(cls.v2, 0.01, seed=5)
        cls.refs = {}
        for v in ("v1", "v2", "v3"):
            tensors = getattr(cls, v)
            d = rewrite_tensors(copy_checkpoint(STORIES, os.path.join(cls.tmp, v)), lambda t, x=tensors: t.update(x))
            with fresh_daemon(d, *cls.TP_ARGS) as ref:
                cls.refs[v] = greedy(ref)[:2]
        assert len({str(r) for r in cls.refs.values()}) == 3, "each version must show in the greedy probe"
        cls.store = os.path.join(cls.tmp, "store")
        publish.publish_rsync(cls.v0, cls.store, "v0", STORIES)
        publish.publish_rsync(cls.v1, cls.store, "v1", STORIES)
        publish.publish_rsync_delta(delta_of(cls.v0, cls.v2), cls.store, "d0", "v0")  # against v0
        cls.rsyncd = RsyncDaemon(cls.tmp, {"store": cls.store})
        cls.staging = os.path.join(cls.tmp, "staging")
        cfg = {"source": cls.rsyncd.url(), "staging_dir": cls.staging, "timeout_s": 60}
        cls.d = Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", json.dumps(cfg),
                       "--control-timeout-s", "60", *cls.TP_ARGS, model=STORIES, extra=False)
        cls.c = Client(f"127.0.0.1:{cls.d.port}", timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()
        cls.rsyncd.stop()
        left = [f for f in os.listdir(cls.staging) if f != ".pull.lock"] if os.path.isdir(cls.staging) else []
        shutil.rmtree(cls.tmp, ignore_errors=True)
        assert not left, f"the daemon left in its staging dir: {left}"

    def update(self, version):
        self.c.pause()
        try:
            return self.c.update_weights(version=version)
        finally:
            self.c.resume()

    def assert_serving(self, v, label=None):
        self.assertEqual(greedy(self.d), (*self.refs[v], label or v))
        self.assertEqual(self.c.health()["state"], "serving")

    def serving_copy(self):
        """The tensors of the daemon's private copy of the store (the serving dir of its deltas)."""
        dirs = glob.glob(os.path.join(self.staging, ".incoming-serving*"))
        self.assertEqual(len(dirs), 1, dirs)
        out = {}
        for f in glob.glob(os.path.join(dirs[0], "*.safetensors")):
            out.update(safetensors_np.load_file(f))
        return out

    def refused(self, status, type_, words, version):
        before = greedy(self.d)
        with self.assertRaises(FdRolloutError) as e:
            self.update(version)
        self.assertEqual((e.exception.status, e.exception.type), (status, type_), e.exception.message)
        for w in words:
            self.assertIn(w, e.exception.message)
        self.assertEqual(greedy(self.d), before, "a refused delta changes nothing, bit for bit")
        return e.exception

    def publish_raw(self, version, base, entries, base_fingerprint=None):
        """A delta version written by hand (bypassing the publisher's checks)."""
        fp = base_fingerprint or manifest_fingerprint(read_store_manifest(self.store, base))
        return publish._publish_version(self.store, version, lambda tmp: write_weight_delta(os.path.join(tmp, "weights.fddelta"), entries),
                                        base_version=base, base_fingerprint=fp)

    def test_1_deltas_serve_what_the_full_versions_serve(self):
        self.update("v1")
        self.assert_serving("v1")
        publish.publish_rsync_delta(delta_of(self.v1, self.v2), self.store, "v2", "v1")
        m = read_store_manifest(self.store, "v2")
        self.assertEqual((m["base_version"], sorted(m["files"])), ("v1", ["weights.fddelta"]))
        self.assertEqual(self.update("v2")["version"], "v2")
        self.assert_serving("v2")
        self.c.sleep()
        self.c.wakeup()
        self.assert_serving("v2")
        # a delta on a delta: some tensors sent in full
        changes = delta_of(self.v2, self.v3)
        changes[QKV] = self.v3[QKV]
        publish.publish_rsync_delta(changes, self.store, "v3", "v2")
        self.assertEqual(self.update("v3")["version"], "v3")
        self.assert_serving("v3")
        self.c.sleep()
        got = self.serving_copy()  # written by the time the weights sleep: what the wakeup loads
        self.assertEqual(sorted(got), sorted(self.v3))
        for n in self.v3:
            self.assertTrue(np.array_equal(got[n].view(np.uint32), self.v3[n].view(np.uint32)), n)
        self.c.wakeup()
        self.assert_serving("v3")

    def test_2_a_delta_on_another_base_is_409(self):
        self.assertEqual(self.c.weight_version(), "v3")
        self.refused(409, "wrong_state", ["'d0'", "'v0'", "serves 'v3'"], "d0")
        self.refused(409, "wrong_state", ["'v2'", "'v1'"], "v2")  # an older delta
        # a daemon that never pulled the base (it serves --model as "0")
        with Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config",
                    json.dumps({"source": self.rsyncd.url(), "staging_dir": os.path.join(self.tmp, "staging2")}),
                    *self.TP_ARGS, model=STORIES, extra=False) as other:
            oc = Client(f"127.0.0.1:{other.port}", timeout=60)
            oc.pause()
            with self.assertRaises(FdRolloutError) as e:
                oc.update_weights(version="v2")
            self.assertEqual((e.exception.status, e.exception.type), (409, "wrong_state"), e.exception.message)
            self.assertIn("'v1'", e.exception.message)
            self.assertEqual(oc.weight_version(), "0")
        self.assert_serving("v3")

    def test_3_bad_deltas_are_4xx_naming_them(self):
        self.assertEqual(self.c.weight_version(), "v3")
        shape = list(self.v3[NAME].shape)
        n = self.v3[NAME].size
        vals = np.ones(3, np.float32)
        # the base's bytes differ from what the delta was made against (its base_fingerprint)
        self.publish_raw("b1", "v3", [(NAME, "F32", shape, np.array([1, 2, 3]), vals)], base_fingerprint="0" * 64)
        self.refused(409, "wrong_state", ["'b1'", "'v3'", "other bytes"], "b1")
        self.publish_raw("b2", "v3", [(NAME, "F32", shape, np.array([5, 2, 9]), vals)])
        self.refused(422, "invalid_checkpoint", [NAME, "out of order"], "b2")
        self.publish_raw("b3", "v3", [(NAME, "F32", shape, np.array([1, 2, n]), vals)])
        self.refused(422, "invalid_checkpoint", [NAME, str(n)], "b3")
        self.publish_raw("b4", "v3", [("model.layers.9.mlp.nope.weight", "F32", shape, np.array([1, 2, 3]), vals)])
        self.refused(422, "invalid_checkpoint", ["model.layers.9.mlp.nope.weight"], "b4")
        self.publish_raw("b5", "v3", [(NAME, "F32", [shape[1], shape[0]], np.array([1, 2, 3]), vals)])
        self.refused(422, "invalid_checkpoint", [NAME], "b5")
        # a damaged weights.fddelta (its SHA-256 no longer the manifest's)
        good = publish.publish_rsync_delta({NAME: (np.array([1, 2, 3]), vals)}, self.store, "b6", "v3")
        path = os.path.join(good, "weights.fddelta")
        with open(path, "rb") as f:
            blob = bytearray(f.read())
        blob[-1] ^= 0x40
        with open(path, "wb") as f:
            f.write(blob)
        e = self.refused(422, "checksum_mismatch", ["weights.fddelta"], "b6")
        self.assertNotIn("b6", self.c.weight_version(), e.message)
        self.c.sleep()
        self.c.wakeup()
        self.assert_serving("v3")

    def test_4_the_publisher_refuses_bad_input(self):
        cases = [({NAME: (np.array([3, 1]), np.ones(2))}, "strictly increasing"),
                 ({NAME: (np.array([1, 1]), np.ones(2))}, "strictly increasing"),
                 ({NAME: (np.array([-1]), np.ones(1))}, "outside"),
                 ({NAME: (np.array([self.v1[NAME].size]), np.ones(1))}, "outside"),
                 ({NAME: (np.array([1]), np.array([np.nan], np.float32))}, "not finite"),
                 ({NAME: (np.array([1, 2]), np.ones(1))}, "2 indices but 1 values"),
                 ({"nope.weight": (np.array([1]), np.ones(1))}, "not a tensor"),
                 ({NAME: np.ones((3, 3), np.float32)}, "shape")]
        for changes, words in cases:
            with self.assertRaises(ValueError) as e:
                publish.publish_rsync_delta(changes, self.store, "p1", "v1")
            self.assertIn(words, str(e.exception))
            self.assertFalse(os.path.exists(os.path.join(self.store, "p1")))
        with self.assertRaises(FileNotFoundError):
            publish.publish_rsync_delta({}, self.store, "p1", "nope")


class RsyncDeltaTp2(RsyncDeltaTp1):
    TP_ARGS = ["--tensor-parallel-size", "2", "--threads", "1", *device_args()]

    # the checks before any rank is involved run once (tp=1)
    test_4_the_publisher_refuses_bad_input = None


if __name__ == "__main__":
    unittest.main()
