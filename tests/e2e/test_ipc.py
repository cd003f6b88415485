"""The same-host weight sources (SPEC §5, docs/weight_sources.md): `ipc_snapshot` (snapshot files
in inference names in --model) and `ipc` (a POSIX shm record per rank, fd/shm/ipc_weights.h),
both published with `fdctl publish`. After update_weights the outputs equal a fresh daemon on the
published checkpoint; wakeup reloads from the same source; a rewrite by the trainer after the copy
changes nothing until the next update; every fault is refused with the contract's error and the
previous weights keep serving."""
import glob
import mmap
import os
import shutil
import struct
import tempfile
import threading
import time
import unittest

from fdtest import copy_checkpoint, Daemon, fdctl, fresh_daemon, TP, greedy, make_checkpoint, perturbed, STORIES

import safetensors_np  # noqa: E402  (on sys.path via fdtest)

# fd/shm/ipc_weights.h offsets (little-endian).
HDR_GENERATION, HDR_MAGIC, HDR_SIZE = 16, 0, 256
ENTRY_SIZE = 320
E_LOCATION, E_NDIM, E_SHAPE, E_NBYTES = 196, 200, 208, 248


def shm_path(port, rank=0):
    return f"/dev/shm/fdrollout.{port}.weights.tp{rank}"


class Record:
    """Edit a published ipc record in place (the faults a broken or busy trainer would cause)."""

    def __init__(self, port):
        self.f = open(shm_path(port), "r+b")
        self.m = mmap.mmap(self.f.fileno(), 0)

    def close(self):
        self.m.close()
        self.f.close()

    def entry(self, name):
        n = struct.unpack_from("<I", self.m, 12)[0]
        for i in range(n):
            off = HDR_SIZE + i * ENTRY_SIZE
            if self.m[off:off + 192].split(b"\0")[0].decode() == name:
                return off
        raise KeyError(name)

    def set_generation(self, g):
        struct.pack_into("<Q", self.m, HDR_GENERATION, g)

    def generation(self):
        return struct.unpack_from("<Q", self.m, HDR_GENERATION)[0]


class Ipc(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-ipc-")
        cls.A = copy_checkpoint(STORIES, os.path.join(cls.tmp, "A"))
        cls.B = perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=11)
        cls.C = perturbed(STORIES, os.path.join(cls.tmp, "C"), seed=13)
        cls.out = {}
        for name in "ABC":
            with fresh_daemon(getattr(cls, name)) as fresh:
                cls.out[name] = greedy(fresh)[:2]
        assert len({tuple(v[0]) for v in cls.out.values()}) == 3, "A, B and C must generate differently"

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def ok(self, d, method, path, body=None):
        status, j = d.request(method, path, body)
        self.assertEqual(status, 200, j)
        return j["result"]

    def err(self, d, status, etype, body=None):
        got, j = d.request("POST", "/v1/update_weights", body if body is not None else {"version": "broken"})
        self.assertEqual((got, j["error"]["type"]), (status, etype), j)
        self.assertEqual(d.get("/health")[1]["weight_version"], "0")
        return j["error"]["message"]

    def publish(self, *args):
        if "--tp" not in args:
            args = (*args, "--tp", str(TP))  # one state dict per rank of this run's daemons
        rc, out, err = fdctl(self.port, "publish", "--from", *args)
        self.assertEqual(rc, 0, err)
        return out

    def daemon(self, strategy, model):
        d = Daemon("--dynamic-load-weight", "--load-strategy", strategy, model=model)
        self.port = d.port
        self.addCleanup(d.__exit__)
        self.addCleanup(lambda: [os.unlink(p) for p in glob.glob(f"/dev/shm/fdrollout.{d.port}.weights.*")])
        return d

    # ---- ipc_snapshot -------------------------------------------------------------------------

    def test_ipc_snapshot_update_wakeup_and_rewrite(self):
        model = copy_checkpoint(self.A, os.path.join(self.tmp, "snap"))
        d = self.daemon("ipc_snapshot", model)
        self.assertEqual(greedy(d), (*self.out["A"], "0"))
        self.ok(d, "POST", "/v1/pause")
        self.publish(self.B, "--strategy", "ipc_snapshot", "--model", model, "--version", "5")
        self.assertTrue(os.path.exists(os.path.join(model, "model_state.tp0.safetensors")))
        self.assertFalse(glob.glob(os.path.join(model, "*.tmp*")))
        res = self.ok(d, "POST", "/v1/update_weights", {})
        self.assertEqual(res["version"], "5")  # version.yaml step written by the publisher
        self.ok(d, "POST", "/v1/resume")
        self.assertEqual(greedy(d), (*self.out["B"], "5"))
        # wakeup reloads from the snapshot (B), not from model.safetensors (A)
        self.ok(d, "POST", "/v1/sleep?tags=weight")
        self.ok(d, "POST", "/v1/wakeup?tags=weight")
        self.assertEqual(greedy(d), (*self.out["B"], "5"))
        # the trainer rewrites the snapshot after the copy: nothing changes until the next update
        self.publish(self.C, "--strategy", "ipc_snapshot", "--model", model, "--version", "6")
        self.assertEqual(greedy(d), (*self.out["B"], "5"))
        self.ok(d, "POST", "/v1/pause")
        self.assertEqual(self.ok(d, "POST", "/v1/update_weights", {})["version"], "6")
        self.ok(d, "POST", "/v1/resume")
        self.assertEqual(greedy(d), (*self.out["C"], "6"))
        # parts (ascending N) win over the single file: B split over part2 and part10
        snap = os.path.join(model, "model_state.tp0.safetensors")
        os.rename(snap, snap + ".c")
        self.publish(self.B, "--strategy", "ipc_snapshot", "--model", model)
        t = safetensors_np.load_file(snap)
        names = sorted(t)
        safetensors_np.save_file({k: t[k] for k in names[:10]}, os.path.join(model, "model_state.tp0.part2.safetensors"))
        safetensors_np.save_file({k: t[k] for k in names[10:]}, os.path.join(model, "model_state.tp0.part10.safetensors"))
        os.rename(snap + ".c", snap)  # C's single file stays, shadowed by the parts
        self.ok(d, "POST", "/v1/pause")
        self.assertEqual(self.ok(d, "POST", "/v1/update_weights", {"version": "parts"})["version"], "parts")
        self.ok(d, "POST", "/v1/resume")
        self.assertEqual(greedy(d), (*self.out["B"], "parts"))

    def test_ipc_snapshot_faults_keep_the_old_weights(self):
        model = copy_checkpoint(self.A, os.path.join(self.tmp, "snapbad"))
        d = self.daemon("ipc_snapshot", model)
        self.ok(d, "POST", "/v1/pause")
        snap = os.path.join(model, "model_state.tp0.safetensors")
        os.rename(model, model + ".away")  # the model dir is gone (unmounted, moved)
        self.assertIn("not reachable", self.err(d, 503, "source_unavailable"))
        os.rename(model + ".away", model)

        def broken(mutate):
            self.publish(self.B, "--strategy", "ipc_snapshot", "--model", model)
            t = safetensors_np.load_file(snap)
            mutate(t)
            safetensors_np.save_file(t, snap)

        import numpy as np
        broken(lambda t: t.__setitem__("model.norm.weight", np.ones(65, np.float32)))
        self.assertIn("model.norm.weight", self.err(d, 422, "invalid_checkpoint"))
        broken(lambda t: t.__setitem__("model.layers.0.self_attn.qkv_proj.weight", t["model.layers.0.self_attn.qkv_proj.weight"][:32]))
        self.assertIn("qkv_proj", self.err(d, 422, "invalid_checkpoint"))
        broken(lambda t: t.__setitem__("model.layers.1.mlp.gate_up_projX.weight", t.pop("model.layers.1.mlp.gate_up_proj.weight")))
        self.assertIn("gate_up_proj", self.err(d, 422, "invalid_checkpoint"))
        self.publish(self.B, "--strategy", "ipc_snapshot", "--model", model)
        os.truncate(snap, os.path.getsize(snap) - 100)
        self.assertIn("model_state.tp0.safetensors", self.err(d, 422, "invalid_checkpoint"))
        os.unlink(snap)
        self.ok(d, "POST", "/v1/resume")
        self.assertEqual(greedy(d), (*self.out["A"], "0"))

    def test_ipc_snapshot_for_another_tp_names_the_tp_to_publish_for(self):
        """A snapshot published for another --tp gets the ipc strategy's hint, not bare shapes (a
        probe: tp=1 files in a tp=2 daemon's dir: 'tensor ... has shape [128, 64], expected [64, 64]')."""
        model = copy_checkpoint(self.A, os.path.join(self.tmp, "snaptp"))
        d = self.daemon("ipc_snapshot", model)
        self.ok(d, "POST", "/v1/pause")
        self.publish(self.B, "--strategy", "ipc_snapshot", "--model", model, "--tp", str(2 * TP))
        msg = self.err(d, 422, "invalid_checkpoint")
        self.assertIn(f"published for tp={2 * TP}, the rollout runs tp={TP}: pass --tp {TP} to fdctl publish", msg)
        self.publish(self.B, "--strategy", "ipc_snapshot", "--model", model)  # the right tp: it loads
        self.assertEqual(self.ok(d, "POST", "/v1/update_weights", {"version": "b"})["version"], "b")
        self.ok(d, "POST", "/v1/resume")
        self.assertEqual(greedy(d), (*self.out["B"], "b"))

    # ---- ipc ----------------------------------------------------------------------------------

    def test_ipc_update_wakeup_and_trainer_rewrite(self):
        d = self.daemon("ipc", self.A)
        self.ok(d, "POST", "/v1/pause")
        out = self.publish(self.B, "--strategy", "ipc", "--version", "b1")
        self.assertIn(f"rm /dev/shm/fdrollout.{d.port}.weights.tp", out)
        self.assertEqual(os.stat(shm_path(d.port)).st_mode & 0o777, 0o600)
        res = self.ok(d, "POST", "/v1/update_weights", {})
        self.assertEqual(res["version"], "b1")  # the record's version
        self.ok(d, "POST", "/v1/resume")
        self.assertEqual(greedy(d), (*self.out["B"], "b1"))
        # the trainer reuses its memory right after the update returned: outputs do not move
        rec = Record(d.port)
        g = rec.generation()
        self.publish(self.C, "--strategy", "ipc", "--version", "c1", "--json")
        self.assertEqual(rec.generation(), g + 2)
        rec.close()
        self.assertEqual(greedy(d), (*self.out["B"], "b1"))
        # wakeup reloads from the record, which now holds C
        self.ok(d, "POST", "/v1/sleep?tags=weight")
        self.ok(d, "POST", "/v1/wakeup?tags=weight")
        self.assertEqual(greedy(d), (*self.out["C"], "c1"))
        # the request's version wins over the record's
        self.ok(d, "POST", "/v1/pause")
        self.publish(self.B, "--strategy", "ipc", "--version", "b2")
        self.assertEqual(self.ok(d, "POST", "/v1/update_weights", {"version": "mine"})["version"], "mine")
        self.ok(d, "POST", "/v1/resume")
        self.assertEqual(greedy(d), (*self.out["B"], "mine"))

    def test_ipc_a_publisher_racing_the_copy_never_mixes_versions(self):
        """A trainer republishing B and C in a loop while the rollout updates: each update either
        serves exactly one published version (outputs equal a fresh daemon on it) or is refused
        with 503 (the generation moved during the copy, or at tp > 1 the ranks read their records either
        side of a republish); never a mix, and no label ever names both B and C."""
        d = self.daemon("ipc", self.A)
        self.publish(self.B, "--strategy", "ipc", "--version", "B")
        stop = threading.Event()

        def trainer():
            i = 0
            while not stop.is_set():
                name = "BC"[i % 2]
                fdctl(d.port, "publish", "--from", getattr(self, name), "--strategy", "ipc", "--version", name, "--tp", str(TP))
                i += 1

        t = threading.Thread(target=trainer)
        t.start()
        served, refused, labels = set(), 0, {}
        try:
            # 3 s of racing; on a loaded machine (tp=2 copies are slower) keep going, up to 30 s,
            # until one update has been served.
            t0 = time.time()
            while time.time() < t0 + 3 or (not served and time.time() < t0 + 30):
                self.ok(d, "POST", "/v1/pause")
                status, j = d.post("/v1/update_weights", {})
                if status != 200:
                    self.assertEqual((status, j["error"]["type"]), (503, "source_unavailable"), j)
                    refused += 1
                    continue
                v = j["result"]["version"]
                self.ok(d, "POST", "/v1/resume")
                ids, lps, got = greedy(d)
                self.assertEqual(got, v)
                match = [n for n in "BC" if (ids, lps) == self.out[n]]
                self.assertEqual(len(match), 1, f"{v}: the weights of neither B nor C (a mix)")
                # A label names one set of weights: the record's version the first time it is
                # served; a publish of that version again is a new record generation, served
                # under a fingerprint label (docs/weight_sources.md).
                if not v.startswith("fp-"):
                    self.assertEqual(v, match[0])
                self.assertEqual(labels.setdefault(v, match[0]), match[0], f"{v} named both B and C")
                served.add(match[0])
        finally:
            stop.set()
            t.join(30)
        self.assertTrue(served, f"no update succeeded ({refused} refused)")

    def test_ipc_faults_keep_the_old_weights(self):
        d = self.daemon("ipc", self.A)
        self.ok(d, "POST", "/v1/pause")
        self.assertIn(shm_path(d.port), self.err(d, 404, "not_found"))

        def broken(edit):
            self.publish(self.B, "--strategy", "ipc", "--version", "b1")
            rec = Record(d.port)
            try:
                edit(rec)
            finally:
                rec.close()

        broken(lambda r: r.set_generation(r.generation() + 1))  # the publisher is mid-write
        self.assertIn("in progress", self.err(d, 503, "source_unavailable"))
        broken(lambda r: r.set_generation(0))  # created, never published
        self.err(d, 503, "source_unavailable")

        def shape(r):
            e = r.entry("model.norm.weight")
            struct.pack_into("<q", r.m, e + E_SHAPE, 32)
            struct.pack_into("<Q", r.m, e + E_NBYTES, 128)
        broken(shape)
        self.assertIn("model.norm.weight", self.err(d, 422, "invalid_checkpoint"))

        def rename(r):
            e = r.entry("model.layers.2.mlp.down_proj.weight")
            r.m[e:e + 40] = b"model.layers.2.mlp.down_projX.weight\0\0\0\0"
        broken(rename)
        self.assertIn("down_proj", self.err(d, 422, "invalid_checkpoint"))
        broken(lambda r: struct.pack_into("<Q", r.m, HDR_MAGIC, 0x1234))
        self.assertIn("magic", self.err(d, 422, "invalid_checkpoint"))
        broken(lambda r: struct.pack_into("<I", r.m, r.entry("model.norm.weight") + E_LOCATION, 1))
        self.assertIn("model.norm.weight", self.err(d, 503, "source_unavailable"))
        broken(lambda r: struct.pack_into("<Q", r.m, r.entry("model.norm.weight") + E_NBYTES, 1 << 40))
        self.err(d, 422, "invalid_checkpoint")
        self.publish(self.B, "--strategy", "ipc", "--version", "b1")
        os.truncate(shm_path(d.port), os.path.getsize(shm_path(d.port)) - 4096)
        self.err(d, 422, "invalid_checkpoint")
        os.unlink(shm_path(d.port))
        self.ok(d, "POST", "/v1/resume")
        self.assertEqual(greedy(d), (*self.out["A"], "0"))

    def test_bf16_sharded_and_f16_qwen2_checkpoints_through_both_sources(self):
        """BF16 shards with an untied lm_head, and F16 Qwen2 (held as F32, qkv biases): the published
        state dict loads and serves exactly what a fresh daemon on the checkpoint serves."""
        for preset, extra in [("tiny-llama-bf16-sharded", []), ("tiny-qwen2", ["--dtype", "F16"])]:
            with self.subTest(preset):
                x = make_checkpoint(os.path.join(self.tmp, preset + "-x"), "--preset", preset, *extra)
                y = make_checkpoint(os.path.join(self.tmp, preset + "-y"), "--preset", preset, "--seed", "1", *extra)
                with fresh_daemon(y) as fresh:
                    want = greedy(fresh)[:2]
                for strategy in ("ipc", "ipc_snapshot"):
                    model = copy_checkpoint(x, os.path.join(self.tmp, f"{preset}-{strategy}"))
                    with Daemon("--dynamic-load-weight", "--load-strategy", strategy, model=model) as d:
                        self.port = d.port
                        try:
                            ids, lps, _ = greedy(d)  # differs from y bit for bit (plain lists: no tp tolerance)
                            self.assertNotEqual((ids, list(lps)), (want[0], list(want[1])))
                            self.ok(d, "POST", "/v1/pause")
                            self.publish(y, "--strategy", strategy, "--version", "y", "--model", model)
                            self.assertEqual(self.ok(d, "POST", "/v1/update_weights", {})["version"], "y")
                            self.ok(d, "POST", "/v1/resume")
                            self.assertEqual(greedy(d), (*want, "y"))
                        finally:
                            for p in glob.glob(f"/dev/shm/fdrollout.{d.port}.weights.*"):
                                os.unlink(p)

    def test_publish_usage_errors_and_tp(self):
        self.port = 1
        rc, _, err = fdctl(1, "publish", "--from", self.B, "--strategy", "ipc")
        self.assertEqual(rc, 10, err)  # no --version
        rc, _, err = fdctl(1, "publish", "--from", self.B, "--strategy", "ipc", "--version", "a/b")
        self.assertEqual(rc, 10, err)
        rc, _, err = fdctl(1, "publish", "--from", self.B, "--strategy", "ipc_snapshot")
        self.assertEqual(rc, 10, err)  # no --model
        model = copy_checkpoint(self.A, os.path.join(self.tmp, "tp"))
        rc, _, err = fdctl(1, "publish", "--from", self.B, "--strategy", "ipc_snapshot", "--model", model, "--tp", "3")
        self.assertEqual(rc, 10, err)
        self.assertIn("not divisible", err)
        self.publish(self.B, "--strategy", "ipc_snapshot", "--model", model, "--tp", "2")
        for r in range(2):
            h, _ = safetensors_np.read_header(os.path.join(model, f"model_state.tp{r}.safetensors"))
            self.assertEqual(h["model.layers.0.self_attn.qkv_proj.weight"]["shape"], [32 + 16 + 16, 64])
            self.assertEqual(h["model.layers.0.mlp.down_proj.weight"]["shape"], [64, 86])
            self.assertEqual(h["model.embed_tokens.weight"]["shape"], [256, 64])
        b = safetensors_np.load_file(os.path.join(self.B, "model.safetensors"))
        t1 = safetensors_np.load_file(os.path.join(model, "model_state.tp1.safetensors"))
        import numpy as np
        np.testing.assert_array_equal(t1["model.layers.0.self_attn.qkv_proj.weight"][32:48],
                                      b["model.layers.0.self_attn.k_proj.weight"][16:32])
        np.testing.assert_array_equal(t1["model.layers.3.mlp.down_proj.weight"], b["model.layers.3.mlp.down_proj.weight"][:, 86:])
        rc, out, err = fdctl(1, "model-info", "--model", self.B, "--tp", "2", "--json")
        self.assertEqual(rc, 0, err)
        import json
        j = json.loads(out)
        self.assertEqual([len(r["state_dict"]) for r in j["ranks"]], [32, 32])
        self.assertEqual(j["name_mappings_to_training"]["model.layers.0.mlp.gate_up_proj.weight"],
                         ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
