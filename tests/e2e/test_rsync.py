"""--load-strategy rsync against a real `rsync --daemon` on loopback (docs/weight_sources.md,
section `rsync`): fdctl publish writes the store atomically; update_weights pulls, checks sizes
always and SHA-256 with verify_checksum, and equals a fresh daemon on the published files;
wakeup re-pulls the serving version; every fault (unknown version, daemon down or hung, a
flipped byte, a truncated file, a missing manifest, bad version strings) is the documented
error, the old weights keep serving bit-exactly and the staging dir is left empty; a killed
publisher leaves the store consistent; a local-path store works without a daemon."""
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest

from fdtest import copy_checkpoint, Daemon, FDCTL, fdctl, free_port, fresh_daemon, TP, greedy, perturbed, STORIES

def read(path):
    with open(path) as f:
        return f.read()


class RsyncDaemon:
    """`rsync --daemon` serving each {module: dir} of `modules` on 127.0.0.1:<free port>."""

    def __init__(self, workdir, modules, port=None):
        self.port = port or free_port()
        self.workdir = workdir
        self.conf = os.path.join(workdir, f"rsyncd-{self.port}.conf")
        with open(self.conf, "w") as f:
            f.write(f"use chroot = no\npid file = {workdir}/rsyncd-{self.port}.pid\n")
            for name, path in modules.items():
                f.write(f"[{name}]\npath = {path}\nread only = yes\n")
        self.log = open(os.path.join(workdir, f"rsyncd-{self.port}.log"), "w")
        self.proc = subprocess.Popen(["rsync", "--daemon", "--no-detach", f"--config={self.conf}", f"--port={self.port}",
                                      "--address=127.0.0.1"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 10
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"rsync --daemon did not start on port {self.port}")

    def url(self, module="store"):
        return f"rsync://127.0.0.1:{self.port}/{module}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Rsync(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-rsync-")
        cls.A = copy_checkpoint(STORIES, os.path.join(cls.tmp, "A"))
        cls.B = perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=11)
        cls.store = os.path.join(cls.tmp, "store")
        cls.publish(cls.B, cls.store, "B")
        with fresh_daemon(cls.B) as fresh:
            cls.b_out = greedy(fresh)[:2]
        with fresh_daemon(cls.A) as fresh:
            cls.a_out = greedy(fresh)[:2]
        assert cls.a_out[0] != cls.b_out[0], "B must generate differently from A"
        cls.faulty = os.path.join(cls.tmp, "store-faulty")  # versions the fault tests break
        cls.publish(cls.B, cls.faulty, "B")
        cls.rsyncd = RsyncDaemon(cls.tmp, {"store": cls.store, "faulty": cls.faulty})

    @classmethod
    def tearDownClass(cls):
        cls.rsyncd.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @staticmethod
    def publish(src, store, version, *extra):
        rc, out, err = fdctl(0, "publish", "--strategy", "rsync", "--from", src, "--store", store, "--version", version, *extra)
        assert rc == 0, (rc, out, err)
        return out

    # timeout_s of a daemon whose pulls must complete: far above a pull's time on a loaded 2-core
    # box (an rsync took over 2 s at load 17); the short timeouts are only where the timeout is
    # what a test checks (a refused or hung rsync daemon).
    PULL_TIMEOUT_S = 60

    def daemon(self, source, staging, timeout_s=PULL_TIMEOUT_S, model=None):
        cfg = {"source": source, "staging_dir": staging, "timeout_s": timeout_s}
        return Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", json.dumps(cfg), model=model or self.A)

    def ok(self, d, method, path, body=None):
        status, j = d.request(method, path, body)
        self.assertEqual(status, 200, j)
        return j["result"]

    def err(self, d, status, etype, body):
        got, j = d.request("POST", "/v1/update_weights", body)
        self.assertEqual((got, j["error"]["type"]), (status, etype), j)
        self.assertGreater(len(j["error"]["message"]), 10)
        return j["error"]["message"]

    def assert_clean(self, staging):
        """Nothing staged is left: the staging dir holds at most its pull lock (.pull.lock, the
        flock rank processes take around a pull; an empty file kept for the next pull)."""
        left = os.listdir(staging) if os.path.isdir(staging) else []
        self.assertEqual([f for f in left if f != ".pull.lock"], [])

    def test_ranks_share_one_pull_per_version(self):
        """Every rank process stages from the same pulled dir: one rsync run per update and per
        wakeup, whatever the tensor-parallel size (an rsync wrapper counts its runs)."""
        staging = os.path.join(self.tmp, "staging-shared")
        count = os.path.join(self.tmp, "rsync-runs")
        wrapper = os.path.join(self.tmp, "rsync-counting")
        with open(wrapper, "w") as f:
            f.write(f"#!/bin/sh\necho \"$$\" >> {count}\nexec rsync \"$@\"\n")
        os.chmod(wrapper, 0o755)
        cfg = {"source": self.rsyncd.url(), "staging_dir": staging, "timeout_s": self.PULL_TIMEOUT_S, "rsync": wrapper}

        def runs():
            return len(read(count).split()) if os.path.exists(count) else 0
        with Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", json.dumps(cfg), model=self.A) as d:
            if TP > 1:
                self.assertEqual(len(d.rank_pids()), TP)
            self.ok(d, "POST", "/v1/pause")
            res = self.ok(d, "POST", "/v1/update_weights", {"version": "B", "verify_checksum": True})
            self.assertEqual([r["version"] for r in res["ranks"]], ["B"] * TP)
            self.assertEqual(runs(), 1)
            self.assert_clean(staging)
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.b_out, "B"))
            self.ok(d, "POST", "/v1/sleep?tags=weight")
            self.ok(d, "POST", "/v1/wakeup?tags=weight")
            self.assertEqual(runs(), 2)  # wakeup re-pulls B once
            self.assert_clean(staging)
            self.assertEqual(greedy(d), (*self.b_out, "B"))

    def test_publish_writes_a_complete_version_with_its_manifest(self):
        store = os.path.join(self.tmp, "store-pub")
        out = json.loads(self.publish(self.B, store, "v1", "--json"))
        # the checkpoint's files only: not the model card, licence or reference outputs of the dir
        files = sorted(f for f in os.listdir(self.B) if f not in ("README.md", "LICENSE", "reference_logits.json")
                       and os.path.isfile(os.path.join(self.B, f)))
        self.assertIn("tokenizer.model", files)
        self.assertEqual(sorted(os.listdir(os.path.join(store, "v1"))), sorted(files + ["manifest.json"]))
        self.assertEqual((out["version"], out["files"]), ("v1", len(files)))
        self.assertEqual(out["bytes"], sum(os.path.getsize(os.path.join(self.B, f)) for f in files))
        m = json.loads(read(os.path.join(store, "v1", "manifest.json")))
        self.assertEqual((m["format"], m["version"]), ("fdrollout-store/1", "v1"))
        self.assertEqual(m["files"]["model.safetensors"]["size"], os.path.getsize(os.path.join(self.B, "model.safetensors")))
        self.assertIn("model.embed_tokens.weight", m["tensors"])
        self.assertEqual(read(os.path.join(store, "latest")), "v1\n")
        rc, _, err = fdctl(0, "publish", "--strategy", "rsync", "--from", self.B, "--store", store, "--version", "v1")
        self.assertEqual(rc, 10, err)  # a version is never overwritten
        # dot-names are the store's and the staging dir's own (a version ".pull.lock" blocked every later pull)
        for bad in ["..", "a/b", ".pull.lock", ".hold-v1", ".incoming-v1-1", "v1\n"]:
            rc, _, err = fdctl(0, "publish", "--strategy", "rsync", "--from", self.B, "--store", store, "--version", bad)
            self.assertEqual(rc, 10, err)
        # a checkpoint no rollout could load never becomes latest: config.json missing or not a JSON object
        for name, text in [("noconfig", None), ("badconfig", "{not json"), ("listconfig", "[]")]:
            ck = copy_checkpoint(self.B, os.path.join(self.tmp, name))
            if text is None:
                os.remove(os.path.join(ck, "config.json"))
            else:
                with open(os.path.join(ck, "config.json"), "w") as f:
                    f.write(text)
            rc, _, err = fdctl(0, "publish", "--strategy", "rsync", "--from", ck, "--store", store, "--version", name)
            self.assertEqual(rc, 5, (name, err))
            self.assertIn("config.json", err)
        self.assertEqual(sorted(os.listdir(store)), ["latest", "v1"])
        os.chmod(store, 0o777)  # writable by every user: anyone could forge a version there
        rc, _, err = fdctl(0, "publish", "--strategy", "rsync", "--from", self.B, "--store", store, "--version", "v2")
        self.assertEqual(rc, 13, err)
        self.assertIn("writable by every user", err)
        os.chmod(store, 0o755)
        self.assertEqual(sorted(os.listdir(store)), ["latest", "v1"])

    def test_update_and_wakeup_from_an_rsync_daemon(self):
        staging = os.path.join(self.tmp, "staging-ok")
        with self.daemon(self.rsyncd.url(), staging) as d:
            self.assertEqual(greedy(d), (*self.a_out, "0"))
            self.ok(d, "POST", "/v1/pause")
            res = self.ok(d, "POST", "/v1/update_weights", {"version": "B", "verify_checksum": True})
            self.assertEqual((res["version"], res["checksum_verified"], res["is_paused"]), ("B", True, True))
            self.assert_clean(staging)
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.b_out, "B"))
            self.assertEqual(d.get("/health")[1]["weight_version"], "B")
            # --model is A: outputs equal to B after wakeup prove the weights came from the store
            self.ok(d, "POST", "/v1/sleep?tags=weight")
            res = self.ok(d, "POST", "/v1/wakeup?tags=weight")
            self.assertFalse(res["is_paused"])
            self.assertEqual(greedy(d), (*self.b_out, "B"))
            self.assert_clean(staging)
            # version omitted: --model has no version.yaml, so the store's latest (B)
            self.ok(d, "POST", "/v1/pause")
            self.assertEqual(self.ok(d, "POST", "/v1/update_weights")["version"], "B")
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.b_out, "B"))
            self.assert_clean(staging)

    def test_after_a_pull_the_staging_dir_holds_only_its_lock(self):
        """Issue #26: after every pull, whatever its end (applied, staged, staged then committed,
        staged then dropped, failed), the staging dir holds exactly `.pull.lock` and nothing else
        (a staged version is held in the staging arena, not in the staging dir)."""
        staging = os.path.join(self.tmp, "staging-only-lock")
        with self.daemon(self.rsyncd.url(), staging) as d:
            self.ok(d, "POST", "/v1/pause")
            self.ok(d, "POST", "/v1/update_weights", {"version": "B"})
            self.assertEqual(sorted(os.listdir(staging)), [".pull.lock"])
            res = self.ok(d, "POST", "/v1/update_weights", {"version": "B", "commit": False})
            self.assertTrue(res["staged"])
            self.assertEqual(sorted(os.listdir(staging)), [".pull.lock"])  # staged: the copy lives in memory, not here
            self.ok(d, "POST", "/v1/commit_weights", {"version": "B"})
            self.assertEqual(sorted(os.listdir(staging)), [".pull.lock"])
            self.ok(d, "POST", "/v1/update_weights", {"version": "B", "commit": False})
            self.assertEqual(self.ok(d, "POST", "/v1/drop_staged_weights")["dropped_version"], "B")
            self.assertEqual(sorted(os.listdir(staging)), [".pull.lock"])
            self.err(d, 404, "not_found", {"version": "nope"})
            self.assertEqual(sorted(os.listdir(staging)), [".pull.lock"])
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.b_out, "B"))

    def test_faults_leave_the_old_weights_serving_and_staging_empty(self):
        store = self.faulty
        for v in ["flip", "trunc", "grown", "nomanifest"]:
            self.publish(self.B, store, v)
        st = os.path.join(store, "flip", "model.safetensors")
        with open(st, "r+b") as f:  # one flipped bit in the last tensor's data
            f.seek(-3, os.SEEK_END)
            b = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([b[0] ^ 1]))
        os.truncate(os.path.join(store, "trunc", "model.safetensors"), os.path.getsize(st) - 4)
        with open(os.path.join(store, "grown", "config.json"), "a") as f:
            f.write("\n")
        os.unlink(os.path.join(store, "nomanifest", "manifest.json"))
        hung = socket.socket()  # accepts connections, never speaks rsync
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        staging = os.path.join(self.tmp, "staging-faults")
        timeout_s = 2
        try:
            with self.daemon(self.rsyncd.url("faulty"), staging) as d:  # real pulls: the generous timeout
                self.ok(d, "POST", "/v1/pause")
                self.assertIn("nope", self.err(d, 404, "not_found", {"version": "nope"}))
                self.err(d, 404, "not_found", {"version": "latest"})  # a file of the store, not a version
                self.assertIn("model.safetensors", self.err(d, 422, "checksum_mismatch", {"version": "flip", "verify_checksum": True}))
                self.assertIn("model.safetensors", self.err(d, 422, "invalid_checkpoint", {"version": "trunc"}))
                self.assertIn("config.json", self.err(d, 422, "invalid_checkpoint", {"version": "grown"}))
                self.assertIn("manifest.json", self.err(d, 422, "invalid_checkpoint", {"version": "nomanifest"}))
                for bad in ["..", "a/b", ".", ".pull.lock", ".hold-B"]:
                    self.err(d, 400, "invalid_argument", {"version": bad})
                self.assert_clean(staging)
                self.assertEqual(d.get("/health")[1]["weight_version"], "0")
                self.ok(d, "POST", "/v1/resume")
                self.assertEqual(greedy(d), (*self.a_out, "0"))
            # the rsync daemon down (refused) and hung (accepts, never answers): 503 within timeout_s
            for name, url in [("refused", f"rsync://127.0.0.1:{free_port()}/store"),
                              ("hung", f"rsync://127.0.0.1:{hung.getsockname()[1]}/store")]:
                with self.subTest(name), self.daemon(url, staging, timeout_s=timeout_s) as d:
                    self.ok(d, "POST", "/v1/pause")
                    t0 = time.time()
                    self.err(d, 503, "source_unavailable", {"version": "B"})
                    self.assertLess(time.time() - t0, timeout_s + 1.5)
                    self.assert_clean(staging)
                    self.ok(d, "POST", "/v1/resume")
                    self.assertEqual(greedy(d), (*self.a_out, "0"))
            # a daemon that was serving stops: 503 (refused: at once, whatever timeout_s), then works
            # again once it is back (a real pull: the generous timeout)
            rs = RsyncDaemon(self.tmp, {"store": store})
            with self.daemon(rs.url(), staging) as d:
                self.ok(d, "POST", "/v1/pause")
                rs.stop()
                self.err(d, 503, "source_unavailable", {"version": "B"})
                self.assert_clean(staging)
                rs = RsyncDaemon(self.tmp, {"store": store}, port=rs.port)
                self.ok(d, "POST", "/v1/update_weights", {"version": "B"})
                self.ok(d, "POST", "/v1/resume")
                self.assertEqual(greedy(d), (*self.b_out, "B"))
            rs.stop()
        finally:
            hung.close()

    def test_staging_dir_not_writable_is_503(self):
        staging = os.path.join(self.tmp, "staging-blocked")
        with open(staging, "w") as f:  # a file where the dir should be
            f.write("x")
        with self.daemon(self.rsyncd.url(), staging) as d:
            self.ok(d, "POST", "/v1/pause")
            self.err(d, 503, "source_unavailable", {"version": "B"})
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.a_out, "0"))

    def test_a_killed_publisher_leaves_the_store_consistent(self):
        store = os.path.join(self.tmp, "store-kill")
        self.publish(self.B, store, "v1")
        big = copy_checkpoint(self.B, os.path.join(self.tmp, "B-big"))
        with open(os.path.join(big, "vocab.txt"), "wb") as f:  # a checkpoint file, copied without parsing
            f.truncate(256 << 20)  # sparse: slow enough to copy that the kill lands mid-way
        p = subprocess.Popen([FDCTL, "publish", "--strategy", "rsync", "--from", big,
                              "--store", store, "--version", "v2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tmpdir = os.path.join(store, f".tmp-v2-{p.pid}")
        deadline = time.time() + 10
        while time.time() < deadline and not os.path.exists(os.path.join(tmpdir, "vocab.txt")):
            time.sleep(0.001)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        self.assertTrue(os.path.isdir(tmpdir), "the kill should land mid-copy")
        self.assertFalse(os.path.exists(os.path.join(store, "v2")))
        self.assertEqual(read(os.path.join(store, "latest")), "v1\n")
        self.publish(self.B, store, "v3")  # removes the dead publisher's temp dir
        self.assertEqual(sorted(os.listdir(store)), ["latest", "v1", "v3"])
        self.assertEqual(read(os.path.join(store, "latest")), "v3\n")

    def test_a_local_path_store_needs_no_daemon(self):
        store = os.path.join(self.tmp, "store-local")
        self.publish(self.B, store, "b7")
        staging = os.path.join(self.tmp, "staging-local")
        with self.daemon(store, staging) as d:
            # wakeup of a version the store lacks ("0") reloads --model (A)
            self.ok(d, "POST", "/v1/sleep?tags=weight")
            self.ok(d, "POST", "/v1/wakeup?tags=weight")
            self.assertEqual(greedy(d), (*self.a_out, "0"))
            self.ok(d, "POST", "/v1/pause")
            self.err(d, 404, "not_found", {"version": "b8"})
            res = self.ok(d, "POST", "/v1/update_weights", {"version": "b7", "verify_checksum": True})
            self.assertTrue(res["checksum_verified"])
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.b_out, "b7"))
            self.assert_clean(staging)
            os.rename(store, store + ".gone")  # the store disappears: 503, old weights keep serving
            self.ok(d, "POST", "/v1/pause")
            self.err(d, 503, "source_unavailable", {"version": "b7"})
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.b_out, "b7"))
            os.rename(store + ".gone", store)
            # b7 was verified at its update: a wakeup checks it again. A probe damaged the store
            # copy in place (same size) and the wakeup served those bytes as "b7".
            st = os.path.join(store, "b7", "model.safetensors")
            with open(st, "r+b") as f:
                f.seek(-3, os.SEEK_END)
                good = f.read(1)
                f.seek(-3, os.SEEK_END)
                f.write(bytes([good[0] ^ 1]))
            self.ok(d, "POST", "/v1/sleep?tags=weight")
            code, j = d.post("/v1/wakeup?tags=weight")
            self.assertEqual((code, j["error"]["type"]), (422, "checksum_mismatch"), j)
            self.assertEqual(d.get("/health")[1]["sleeping_tags"], ["weight"])
            with open(st, "r+b") as f:  # repaired: the wakeup brings b7 back
                f.seek(-3, os.SEEK_END)
                f.write(good)
            self.ok(d, "POST", "/v1/wakeup?tags=weight")
            self.assertEqual(greedy(d), (*self.b_out, "b7"))

    def test_a_wakeup_pulls_the_store_version_served_under_a_fingerprint_label(self):
        """A probe: store version 5 republished with other bytes (C) after it had been served
        (B) is served under an fp- label (5 named other bytes); a sleep + wakeup then re-pulled
        by that label, which the store lacks, and silently served --model (A). The wakeup pulls
        the store version the bytes came from: C again, same label."""
        store = os.path.join(self.tmp, "store-relabel")
        C = perturbed(STORIES, os.path.join(self.tmp, "C"), seed=12)
        with fresh_daemon(C) as fresh:
            c_out = greedy(fresh)[:2]
        self.publish(self.B, store, "5")
        with self.daemon(store, os.path.join(self.tmp, "staging-relabel")) as d:
            self.ok(d, "POST", "/v1/pause")
            self.ok(d, "POST", "/v1/update_weights", {})  # the store's latest: 5 (B)
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.b_out, "5"))
            shutil.rmtree(os.path.join(store, "5"))
            self.publish(C, store, "5")
            self.ok(d, "POST", "/v1/pause")
            label = self.ok(d, "POST", "/v1/update_weights", {})["version"]
            self.assertTrue(label.startswith("fp-"), label)  # "5" named B: C gets its fingerprint label
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*c_out, label))
            self.ok(d, "POST", "/v1/sleep?tags=weight")
            self.ok(d, "POST", "/v1/wakeup?tags=weight")
            self.assertEqual(greedy(d), (*c_out, label))

    def test_a_trusted_local_store_is_hard_linked_else_copied(self):
        """A local store's version is pulled by hard links (rsync --link-dest) when all its files are
        ours and writable by nobody else; a group-writable file, or "link": false, makes it a copy.
        Either way the daemon serves the version's tokens and leaves the store as it was."""
        store = os.path.join(self.tmp, "store-link")
        self.publish(self.B, store, "l1")
        self.publish(self.A, store, "l2")
        staging = os.path.join(self.tmp, "staging-link")
        weights = [os.path.join(store, "l1", f) for f in os.listdir(os.path.join(store, "l1")) if f.endswith(".safetensors")]
        with self.daemon(store, staging) as d:
            self.ok(d, "POST", "/v1/pause")
            self.ok(d, "POST", "/v1/update_weights", {"version": "l1", "verify_checksum": True})
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.b_out, "l1"))
            self.assertRegex(d.output(), r"pulled l1 \(\d+ bytes, hard-linked from the local store\)")
            self.assert_clean(staging)
            self.assertEqual({os.stat(w).st_nlink for w in weights}, {1})  # the staged links are gone with the staged dir
            os.chmod(os.path.join(store, "l2", "config.json"), 0o664)  # group-writable: not trusted for sharing
            self.ok(d, "POST", "/v1/pause")
            self.ok(d, "POST", "/v1/update_weights", {"version": "l2"})
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.a_out, "l2"))
            self.assertRegex(d.output(), r"pulled l2 \(\d+ bytes, copied\)")
        cfg = {"source": store, "staging_dir": staging, "link": False}
        with Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", json.dumps(cfg), model=self.A) as d:
            self.ok(d, "POST", "/v1/pause")
            self.ok(d, "POST", "/v1/update_weights", {"version": "l1"})
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.b_out, "l1"))
            self.assertRegex(d.output(), r"pulled l1 \(\d+ bytes, copied\)")

    def test_a_bad_rsync_config_stops_start_up_naming_the_field(self):
        for cfg, field in [('{"staging_dir": "/tmp/x"}', "source"), ('{"source": "/s", "timeout_s": -1}', "timeout_s"),
                           ('{"source": "/s", "args": "-z"}', "args"), ('{"source": "/s", "colour": 1}', "colour"),
                           ("not json", "JSON")]:
            with self.subTest(field):
                d = Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", cfg, wait=False)
                try:
                    d.proc.wait(20)
                    self.assertNotEqual(d.proc.returncode, 0)
                    self.assertIn(field, d.output())
                finally:
                    d.stop()


if __name__ == "__main__":
    unittest.main()
