"""scripts/fdpublish.py, the numpy-only trainer-side publisher (SPEC §5): each of its three
layouts is accepted by a real daemon with that --load-strategy, and the update equals a fresh
daemon started on the published weights; the store it writes is atomic and hash-exact."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import unittest

from fdtest import copy_checkpoint, Daemon, greedy, perturbed, PYTHON, REPO, STORIES

import fdpublish  # noqa: E402  (scripts/ is on sys.path via fdtest)

class FdPublish(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-pub-")
        cls.B = perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=23)
        cls.cfg = fdpublish.load_config(STORIES)
        cls.hf_b = fdpublish.load_checkpoint(cls.B)
        with Daemon(model=cls.B) as fresh:
            cls.b_out = greedy(fresh)[:2]
        with Daemon(model=STORIES) as fresh:
            cls.a_out = greedy(fresh)[:2]
        assert cls.a_out[0] != cls.b_out[0]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @staticmethod
    def latest(store):
        with open(os.path.join(store, "latest")) as f:
            return f.read().strip()

    def update(self, d, body):
        self.assertEqual(d.post("/v1/pause")[0], 200)
        status, j = d.post("/v1/update_weights", body)
        self.assertEqual(status, 200, j)
        self.assertEqual(d.post("/v1/resume")[0], 200)
        return j["result"]

    def test_rollout_names_cover_the_state_dict(self):
        r = fdpublish.to_rollout_names(self.hf_b, self.cfg)
        self.assertEqual(r["model.layers.0.self_attn.qkv_proj.weight"].shape, (64 + 32 + 32, 64))
        self.assertEqual(r["model.layers.0.mlp.gate_up_proj.weight"].shape, (2 * 172, 64))
        self.assertNotIn("lm_head.weight", r)  # tied
        r2 = fdpublish.to_rollout_names(self.hf_b, self.cfg, tp=2, rank=1)
        self.assertEqual(r2["model.layers.0.self_attn.o_proj.weight"].shape, (64, 32))
        with self.assertRaises(ValueError):
            fdpublish.to_rollout_names(self.hf_b, self.cfg, tp=3)

    def test_rsync_store_is_hash_exact_and_atomic(self):
        store = os.path.join(self.tmp, "store-atomic")
        d = fdpublish.publish_rsync(self.hf_b, store, "7", STORIES)
        with open(os.path.join(d, "manifest.json")) as f:
            m = json.load(f)
        self.assertEqual(m["version"], "7")
        for name, entry in m["files"].items():
            with open(os.path.join(d, name), "rb") as f:
                data = f.read()
            self.assertEqual(entry["size"], len(data))
            self.assertEqual(entry["sha256"], hashlib.sha256(data).hexdigest())
        self.assertEqual(len(m["tensors"]), len(self.hf_b))
        self.assertEqual(self.latest(store), "7")
        with self.assertRaises(FileExistsError):
            fdpublish.publish_rsync(self.hf_b, store, "7", STORIES)
        os.chmod(store, 0o777)
        with self.assertRaisesRegex(PermissionError, "writable by every user"):
            fdpublish.publish_rsync(self.hf_b, store, "8", STORIES)
        os.chmod(store, 0o755)
        for bad in ("..", "a/b", "", ".pull.lock", "7\n"):
            with self.assertRaises(ValueError):
                fdpublish.publish_rsync(self.hf_b, store, bad, STORIES)
        # stories260K is F32: BF16 would be refused by the rollout, so nothing is published.
        with self.assertRaisesRegex(ValueError, "holds F32"):
            fdpublish.publish_rsync(self.hf_b, store, "bf16", STORIES, dtype="BF16")
        self.assertFalse(os.path.exists(os.path.join(store, "bf16")))
        self.assertEqual(self.latest(store), "7")
        # A publisher killed mid-way leaves neither the version nor `latest` changed.
        code = ("import sys, os, time; sys.path.insert(0, %r); import fdpublish, safetensors_np\n"
                "orig = safetensors_np.save_file\n"
                "def slow(*a, **k):\n    r = orig(*a, **k); print('written', flush=True); time.sleep(60); return r\n"
                "safetensors_np.save_file = slow\n"
                "fdpublish.publish_rsync(fdpublish.load_checkpoint(%r), %r, '8', %r)\n"
                % (os.path.join(REPO, "scripts"), self.B, store, STORIES))
        p = subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE, text=True)
        self.assertEqual(p.stdout.readline().strip(), "written")
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
        self.assertFalse(os.path.exists(os.path.join(store, "8")))
        self.assertEqual(self.latest(store), "7")
        # The next publish sweeps the dead publisher's temporary dir.
        fdpublish.publish_rsync(self.hf_b, store, "9", STORIES)
        self.assertEqual([n for n in os.listdir(store) if n.startswith(".tmp-")], [])

    def test_template_files_must_be_regular_and_keep_their_read_bits(self):
        # as fdctl publish (checkpoint/src/store.cpp): a dangling link under a checkpoint name is an
        # error naming it (it was left out); a copy is never more readable than its source
        import stat as st
        tmpl = copy_checkpoint(STORIES, os.path.join(self.tmp, "tmpl-dangling"))
        os.remove(os.path.join(tmpl, "generation_config.json"))
        os.symlink(os.path.join(self.tmp, "nothing-here"), os.path.join(tmpl, "generation_config.json"))
        store = os.path.join(self.tmp, "store-dangling")
        with self.assertRaisesRegex(ValueError, "generation_config.json"):
            fdpublish.publish_rsync(self.hf_b, store, "1", tmpl)
        self.assertFalse(os.path.exists(os.path.join(store, "1")))
        tmpl = copy_checkpoint(STORIES, os.path.join(self.tmp, "tmpl-private"))
        secret = os.path.join(self.tmp, "private.json")
        with open(secret, "w") as f:
            f.write("{}")
        os.chmod(secret, 0o600)
        if os.path.lexists(os.path.join(tmpl, "special_tokens_map.json")):
            os.remove(os.path.join(tmpl, "special_tokens_map.json"))
        os.symlink(secret, os.path.join(tmpl, "special_tokens_map.json"))
        out = fdpublish.publish_rsync(self.hf_b, os.path.join(self.tmp, "store-private"), "1", tmpl)
        self.assertEqual(st.S_IMODE(os.stat(os.path.join(out, "special_tokens_map.json")).st_mode), 0o600)
        self.assertEqual(st.S_IMODE(os.stat(os.path.join(out, "config.json")).st_mode) & 0o077, 0o044)

    def test_rsync_strategy_accepts_the_store(self):
        store = os.path.join(self.tmp, "store")
        fdpublish.publish_rsync(self.hf_b, store, "42", STORIES)
        staging = os.path.join(self.tmp, "staging")
        cfg = json.dumps({"source": store, "staging_dir": staging, "timeout_s": 60})
        with Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", cfg) as d:
            r = self.update(d, {"version": "42", "verify_checksum": True})
            self.assertEqual(r["version"], "42")
            self.assertEqual(greedy(d), (*self.b_out, "42"))

    def test_ipc_snapshot_strategy_accepts_the_files(self):
        model = copy_checkpoint(STORIES, os.path.join(self.tmp, "snap-model"))
        with Daemon("--dynamic-load-weight", "--load-strategy", "ipc_snapshot", model=model) as d:
            fdpublish.publish_ipc_snapshot(fdpublish.to_rollout_names(self.hf_b, self.cfg), model)
            self.update(d, {"version": "snap-1"})
            self.assertEqual(greedy(d), (*self.b_out, "snap-1"))

    def test_ipc_strategy_accepts_the_record_and_copies_it(self):
        shm = None
        try:
            with Daemon("--dynamic-load-weight", "--load-strategy", "ipc") as d:
                port, shm = d.port, fdpublish.ipc_path(d.port)
                rollout = fdpublish.to_rollout_names(self.hf_b, self.cfg)
                fdpublish.publish_ipc(rollout, port, "ipc-1")
                r = self.update(d, {})
                self.assertEqual(r["version"], "ipc-1")  # the record's version
                self.assertEqual(greedy(d), (*self.b_out, "ipc-1"))
                # The trainer reuses its memory: the rollout already copied, nothing changes.
                fdpublish.publish_ipc(fdpublish.to_rollout_names(fdpublish.load_checkpoint(STORIES), self.cfg), port, "ipc-2")
                self.assertEqual(greedy(d), (*self.b_out, "ipc-1"))
        finally:
            if shm and os.path.exists(shm):
                os.remove(shm)


if __name__ == "__main__":
    unittest.main(verbosity=2)
