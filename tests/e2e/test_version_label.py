"""The version label names the weights served (issue 26; docs/weight_sources.md, "The version
label names the bytes served"). For each of the four sources (normal, rsync, ipc_snapshot, ipc) a
sequence of `fdctl publish`, update_weights, crash + restart (SIGKILL, a new daemon on the same
port) and sleep + wakeup; after every step the greedy ids and logprobs must equal those of a fresh
daemon started on the checkpoint the step left in place, and the reported weight_version (in the
completion and /health) must be the label that checkpoint carries: its published version, or a
fingerprint label "fp-..." when nothing names the new bytes (never the old label).
"""
import json
import os
import shutil
import signal
import tempfile
import unittest

from fdtest import TP, STORIES, Daemon, copy_checkpoint, fdctl, fresh_daemon, greedy, perturbed


class VersionLabel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-label-")
        cls.ckpt = {"A": copy_checkpoint(STORIES, os.path.join(cls.tmp, "A"))}
        for name, seed in (("B", 21), ("C", 22), ("D", 23)):
            cls.ckpt[name] = perturbed(STORIES, os.path.join(cls.tmp, name), seed=seed)
        cls.ref = {}
        for name, path in cls.ckpt.items():
            with fresh_daemon(path) as fresh:  # the reference of each checkpoint
                cls.ref[name] = greedy(fresh)[:2]
        assert len({tuple(v[0]) for v in cls.ref.values()}) == 4, "A, B, C and D must generate differently"

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    # ---- helpers -------------------------------------------------------------------------------

    def start(self, *args, model, port=None):
        d = Daemon("--dynamic-load-weight", *args, model=model, port=port)
        self.addCleanup(d.__exit__)
        return d

    def restart(self, d, *args, model):
        """Crash (SIGKILL) and start a new daemon with the same flags on the same port."""
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        return self.start(*args, model=model, port=d.port)

    def ok(self, d, path, body=None):
        status, j = d.post(path, body)
        self.assertEqual(status, 200, (path, j))
        return j["result"]

    def sleep_wakeup(self, d):
        self.ok(d, "/v1/sleep")  # both tags
        self.ok(d, "/v1/wakeup")

    def update(self, d, body=None):
        self.ok(d, "/v1/pause")
        res = self.ok(d, "/v1/update_weights", body or {})
        self.ok(d, "/v1/resume")
        return res

    def serves(self, d, name, label, step):
        """After `step`: outputs equal checkpoint `name`'s reference and the label is `label`
        ("fp" = some fingerprint label, returned). Checked in the completion and in /health."""
        ids, lps, got = greedy(d)
        self.assertEqual((ids, lps), self.ref[name], f"after {step}: not the weights of {name} (label {got})")
        self.assertEqual(d.get("/health")[1]["weight_version"], got)
        if label == "fp":
            self.assertRegex(got, r"^fp-[0-9a-f]{16}$", f"after {step}: {name}'s bytes are not named by a fingerprint label")
        else:
            self.assertEqual(got, label, f"after {step}: serving {name}")
        return got

    def publish(self, port, *args):
        rc, out, err = fdctl(port, "publish", *args)
        self.assertEqual(rc, 0, err)
        return out

    # ---- ipc_snapshot ----------------------------------------------------------------------------

    def test_ipc_snapshot(self):
        model = copy_checkpoint(self.ckpt["A"], os.path.join(self.tmp, "snap"))
        tp = ("--tp", str(TP))
        snap = lambda name, *v: self.publish(0, "--strategy", "ipc_snapshot", "--from", self.ckpt[name], "--model", model, *tp, *v)
        args = ("--load-strategy", "ipc_snapshot")
        snap("B", "--version", "7")
        # start-up serves the snapshot the label names (main served A labelled "7")
        d = self.start(*args, model=model)
        self.serves(d, "B", "7", "start-up on a published snapshot")
        self.sleep_wakeup(d)
        self.serves(d, "B", "7", "sleep + wakeup")
        snap("C", "--version", "8")
        self.serves(d, "B", "7", "a publish (nothing applied yet)")
        self.update(d)
        self.serves(d, "C", "8", "update_weights {}")
        d = self.restart(d, *args, model=model)
        self.serves(d, "C", "8", "crash + restart")
        # a publish without --version: the snapshot changes under no version; wakeup must not
        # keep claiming "8", and a restart names the snapshot by its fingerprint as well
        self.ok(d, "/v1/sleep")
        snap("D")
        self.ok(d, "/v1/wakeup")
        fp = self.serves(d, "D", "fp", "wakeup after an unversioned publish")
        d = self.restart(d, *args, model=model)
        self.assertEqual(self.serves(d, "D", "fp", "restart on an unversioned snapshot"), fp)
        snap("B", "--version", "9")
        self.update(d)
        self.serves(d, "B", "9", "update_weights {} to a versioned publish")

    # ---- normal --------------------------------------------------------------------------------

    def test_normal(self):
        model = copy_checkpoint(self.ckpt["A"], os.path.join(self.tmp, "normal"))
        with open(os.path.join(model, "version.yaml"), "w") as f:
            f.write("step: 1\n")
        d = self.start(model=model)
        self.serves(d, "A", "1", "start-up")
        self.sleep_wakeup(d)
        self.serves(d, "A", "1", "sleep + wakeup on unchanged files")
        # the trainer overwrites the files while the daemon sleeps, version.yaml unchanged
        self.ok(d, "/v1/sleep?tags=weight")
        shutil.copyfile(os.path.join(self.ckpt["B"], "model.safetensors"), os.path.join(model, "model.safetensors"))
        self.ok(d, "/v1/wakeup?tags=weight")
        fp_b = self.serves(d, "B", "fp", "wakeup on rewritten files (version.yaml still 1)")
        # update_weights {} re-reads the files; version.yaml still says 1, which named A
        self.update(d)
        self.assertEqual(self.serves(d, "B", "fp", "update_weights {} on the same files"), fp_b)
        # a trainer that writes a new step names the files
        shutil.copyfile(os.path.join(self.ckpt["C"], "model.safetensors"), os.path.join(model, "model.safetensors"))
        with open(os.path.join(model, "version.yaml"), "w") as f:
            f.write("step: 2\n")
        self.update(d)
        self.serves(d, "C", "2", "update_weights {} on new files and step 2")
        self.sleep_wakeup(d)
        self.serves(d, "C", "2", "sleep + wakeup")
        d = self.restart(d, model=model)
        self.serves(d, "C", "2", "crash + restart")
        # files rewritten (D) and an explicit version: the caller names them
        shutil.copyfile(os.path.join(self.ckpt["D"], "model.safetensors"), os.path.join(model, "model.safetensors"))
        self.update(d, {"version": 3})  # an integer step: its string
        self.serves(d, "D", "3", "update_weights {version: 3}")
        self.sleep_wakeup(d)
        # version.yaml still says 2 (which named C), the bytes are those labelled 3: kept
        self.serves(d, "D", "3", "sleep + wakeup on the files labelled 3")

    # ---- rsync ---------------------------------------------------------------------------------

    def test_rsync(self):
        store = os.path.join(self.tmp, "store")
        for name, version in (("C", "3"), ("B", "4")):
            self.publish(0, "--strategy", "rsync", "--from", self.ckpt[name], "--store", store, "--version", version)
        model = copy_checkpoint(self.ckpt["A"], os.path.join(self.tmp, "rsync-model"))
        cfg = {"source": store, "staging_dir": os.path.join(self.tmp, "staging"), "timeout_s": 120}
        args = ("--load-strategy", "rsync", "--rsync-config", json.dumps(cfg))
        # no version.yaml: --model serves under --weight-version (the default "0")
        d = self.start(*args, model=model)
        self.serves(d, "A", "0", "start-up without version.yaml")
        self.sleep_wakeup(d)
        self.serves(d, "A", "0", "sleep + wakeup (the store has no '0': --model again)")
        self.update(d, {"version": "4"})
        self.serves(d, "B", "4", "update_weights {version: 4}")
        self.sleep_wakeup(d)
        self.serves(d, "B", "4", "sleep + wakeup (re-pulled)")
        # version.yaml names the version to pull: start-up pulls it (main served A labelled "3")
        with open(os.path.join(model, "version.yaml"), "w") as f:
            f.write("step: 3\n")
        d = self.restart(d, *args, model=model)
        self.serves(d, "C", "3", "restart with version.yaml step 3")
        self.sleep_wakeup(d)
        self.serves(d, "C", "3", "sleep + wakeup")
        self.update(d)
        self.serves(d, "C", "3", "update_weights {} (version.yaml: 3)")
        # the store loses 3: wakeup falls back to --model (A), which "3" never named
        shutil.rmtree(os.path.join(store, "3"))
        self.sleep_wakeup(d)
        self.serves(d, "A", "fp", "wakeup after the store lost the serving version")

    # ---- ipc -----------------------------------------------------------------------------------

    def test_ipc(self):
        model = copy_checkpoint(self.ckpt["A"], os.path.join(self.tmp, "ipc-model"))
        args = ("--load-strategy", "ipc")
        d = self.start(*args, model=model)
        self.addCleanup(lambda: [os.unlink(p) for p in
                                 [f"/dev/shm/fdrollout.{d.port}.weights.tp{r}" for r in range(TP)] if os.path.exists(p)])
        rec = lambda name, v: self.publish(d.port, "--strategy", "ipc", "--from", self.ckpt[name], "--version", v)
        self.serves(d, "A", "0", "start-up (--model)")
        rec("B", "5")  # --tp from the running daemon
        self.serves(d, "A", "0", "a publish (nothing applied yet)")
        self.update(d)
        self.serves(d, "B", "5", "update_weights {} (the record's version)")
        self.sleep_wakeup(d)
        self.serves(d, "B", "5", "sleep + wakeup (the record again)")
        self.ok(d, "/v1/sleep")
        rec("C", "6")
        self.ok(d, "/v1/wakeup")
        self.serves(d, "C", "6", "wakeup after a publish while asleep")
        port = d.port
        d = self.restart(d, *args, model=model)
        self.assertEqual(d.port, port)
        # the record outlives the crash but start-up serves --model, labelled as such
        self.serves(d, "A", "0", "crash + restart")
        self.sleep_wakeup(d)
        self.serves(d, "C", "6", "sleep + wakeup (the record)")
        # Version 6 published again with other bytes: the record's generation moved, so "6" (C's
        # bytes in this process) does not name D's; a wakeup of the unchanged record keeps D's
        # label, and another republish of 6 while asleep gets yet another one.
        rec("D", "6")
        self.update(d)
        fp_d = self.serves(d, "D", "fp", "update_weights {} after version 6 was published again with other bytes")
        self.sleep_wakeup(d)
        self.assertEqual(self.serves(d, "D", "fp", "sleep + wakeup (the same record)"), fp_d)
        self.ok(d, "/v1/sleep")
        rec("B", "6")
        self.ok(d, "/v1/wakeup")
        self.assertNotEqual(self.serves(d, "B", "fp", "wakeup after version 6 was published again while asleep"), fp_d)

    def test_ipc_records_for_another_tp_size(self):
        """fdctl publish --strategy ipc takes the running daemon's tp (above); a --tp that disagrees
        is refused before anything is written, and a record of another tp size (here from the
        Python publisher) is a 422 saying which --tp to pass; the old weights keep serving."""
        import fdpublish
        d = self.start("--load-strategy", "ipc", model=self.ckpt["A"])
        path = f"/dev/shm/fdrollout.{d.port}.weights.tp0"
        self.addCleanup(lambda: [os.unlink(p) for p in
                                 [f"/dev/shm/fdrollout.{d.port}.weights.tp{r}" for r in range(TP + 1)] if os.path.exists(p)])
        rc, out, err = fdctl(d.port, "publish", "--strategy", "ipc", "--from", self.ckpt["B"], "--version", "x", "--tp", str(TP + 1))
        self.assertEqual(rc, 10, err)
        self.assertIn(f"runs tp={TP}", err)
        self.assertIn(f"pass --tp {TP}", err)
        self.assertFalse(os.path.exists(path))
        out = self.publish(d.port, "--strategy", "ipc", "--from", self.ckpt["B"], "--version", "x")
        for r in range(TP):  # every rank's file is listed
            self.assertIn(f"/dev/shm/fdrollout.{d.port}.weights.tp{r}", out)
        hf = fdpublish.load_checkpoint(self.ckpt["C"])
        fdpublish.publish_ipc(fdpublish.to_rollout_names(hf, fdpublish.load_config(self.ckpt["C"])), d.port, "y", tp_size=TP + 1)
        self.ok(d, "/v1/pause")
        status, j = d.post("/v1/update_weights", {})
        self.assertEqual((status, j["error"]["type"]), (422, "invalid_checkpoint"), j)
        self.assertIn(f"published for tp={TP + 1}, the rollout runs tp={TP}: pass --tp {TP}", j["error"]["message"])
        self.ok(d, "/v1/resume")
        self.serves(d, "A", "0", "a refused record of another tp size")


if __name__ == "__main__":
    unittest.main()
