"""Nothing another local user writes is trusted (SPEC §8.6; issue 12, defect 1). A real second
user, created for the test, plants the files the daemon acts on — the `ipc` weight record, the
control block of its port, the rsync staging dir, ipc_snapshot files — and the daemon refuses each
with 403 `forbidden` (fdctl exit 13, start-up exit 13) naming the file and its owner, keeps serving
its old weights, and accepts the same source once it is its own user's again."""
import glob
import json
import os
import shutil
import subprocess
import tempfile
import time
import unittest
import urllib.request

from fdtest import BIN, FDCTL, PYTHON, REPO, STORIES, Daemon, OtherUser, copy_checkpoint, fdctl, free_port, greedy, perturbed

EXIT_FORBIDDEN = 13


class UntrustedFiles(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.user = OtherUser()  # skips the whole class unless root
        cls.addClassCleanup(cls.user.close)  # also when the rest of setUpClass fails
        cls.tmp = tempfile.mkdtemp(prefix="fd-trust-")
        os.chmod(cls.tmp, 0o755)  # the other user reads the checkpoints and runs fdctl from here
        cls.A = copy_checkpoint(STORIES, os.path.join(cls.tmp, "A"))
        cls.B = perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=21)
        for d in (cls.A, cls.B):
            os.chmod(d, 0o755)
        with Daemon(model=cls.B) as fresh:
            cls.out_b = greedy(fresh)[:2]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def forbidden(self, d, path_words, body=None):
        """update_weights must answer 403 forbidden naming the file; the old weights keep serving."""
        before = greedy(d)
        self.assertEqual(d.post("/v1/pause")[0], 200)
        status, j = d.post("/v1/update_weights", body if body is not None else {})
        self.assertEqual((status, j["error"]["type"]), (403, "forbidden"), j)
        for w in path_words:
            self.assertIn(w, j["error"]["message"])
        self.assertEqual(d.post("/v1/resume")[0], 200)
        self.assertEqual(greedy(d), before)
        return j["error"]["message"]

    def test_an_ipc_record_planted_by_another_user_is_refused(self):
        d = Daemon("--dynamic-load-weight", "--load-strategy", "ipc", model=self.A)
        self.addCleanup(d.__exit__)
        record = f"/dev/shm/fdrollout.{d.port}.weights.tp0"
        self.addCleanup(lambda: [os.unlink(p) for p in glob.glob(f"/dev/shm/fdrollout.{d.port}.weights.*")])
        # The other user publishes first (a complete, valid record of other weights, mode 0600).
        p = self.user.run(FDCTL, "--port", str(d.port), "publish", "--strategy", "ipc", "--from", self.B, "--version", "evil")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(os.stat(record).st_uid, self.user.uid)
        msg = self.forbidden(d, [record, f"uid {self.user.uid}"])
        self.assertIn("owned by", msg)
        # fdctl reports it with its own exit code.
        self.assertEqual(fdctl(d.port, "pause")[0], 0)
        rc, _, err = fdctl(d.port, "update-weights")
        self.assertEqual(rc, EXIT_FORBIDDEN, err)
        self.assertIn("forbidden", err)
        # The same weights published by the daemon's own user go in.
        os.unlink(record)
        rc, _, err = fdctl(d.port, "publish", "--strategy", "ipc", "--from", self.B, "--version", "mine")
        self.assertEqual(rc, 0, err)
        status, j = d.post("/v1/update_weights", {})
        self.assertEqual(status, 200, j)
        d.post("/v1/resume")
        self.assertEqual(greedy(d), (*self.out_b, "mine"))
        # A record of this user that others may read or write is refused too.
        os.chmod(record, 0o644)
        self.forbidden(d, [record, "0644"])

    def test_a_control_block_planted_by_another_user_stops_start_up(self):
        port = free_port()
        block = f"/dev/shm/fdrollout.{port}"
        self.addCleanup(lambda: os.path.exists(block) and os.unlink(block))
        code = f"import os; fd = os.open('{block}', os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 33248)"
        p = self.user.run("/usr/bin/python3", "-c", code)
        self.assertEqual(p.returncode, 0, p.stderr)
        r = subprocess.run([BIN, "--model", STORIES, "--port", str(port)], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, EXIT_FORBIDDEN, r.stderr)
        self.assertIn(block, r.stderr)
        self.assertIn(f"uid {self.user.uid}", r.stderr)
        self.assertTrue(os.path.exists(block))  # refused, not removed: its owner (or root) decides
        # The daemon's own stale block (mode 0600) is reclaimed as before; one others can write is not.
        os.unlink(block)
        fd = os.open(block, os.O_CREAT | os.O_RDWR, 0o600)
        os.close(fd)
        os.chmod(block, 0o666)
        r = subprocess.run([BIN, "--model", STORIES, "--port", str(port)], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, EXIT_FORBIDDEN, r.stderr)
        self.assertIn("0666", r.stderr)
        os.chmod(block, 0o600)
        proc = subprocess.Popen([BIN, "--model", STORIES, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.time() + 60
            while time.time() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.05)
            self.assertIsNone(proc.poll(), "the daemon did not reclaim its own stale block")
            self.assertEqual(os.stat(block).st_mode & 0o777, 0o600)
        finally:
            proc.terminate()
            proc.wait(30)

    def test_another_users_staging_dir_is_refused(self):
        store = os.path.join(self.tmp, "store")
        rc, _, err = fdctl(0, "publish", "--strategy", "rsync", "--from", self.B, "--store", store, "--version", "1")
        self.assertEqual(rc, 0, err)
        staging = f"/tmp/fd-staging-other-{os.getpid()}"  # where another user can create it: /tmp
        self.addCleanup(shutil.rmtree, staging, True)
        p = self.user.run("/bin/mkdir", "-m", "0755", staging)
        self.assertEqual(p.returncode, 0, p.stderr)
        cfg = json.dumps({"source": store, "staging_dir": staging, "timeout_s": 60})
        with Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", cfg, model=self.A) as d:
            self.forbidden(d, [staging, f"uid {self.user.uid}"], {"version": "1"})
        own = os.path.join(self.tmp, "staging-own")
        os.mkdir(own, 0o777)
        os.chmod(own, 0o777)  # ours but world-writable: refused as well
        cfg = json.dumps({"source": store, "staging_dir": own, "timeout_s": 60})
        with Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", cfg, model=self.A) as d:
            self.forbidden(d, [own, "0777"], {"version": "1"})
            os.chmod(own, 0o700)
            d.post("/v1/pause")
            status, j = d.post("/v1/update_weights", {"version": "1"})
            self.assertEqual(status, 200, j)

    def test_ipc_snapshot_files_and_dir_of_another_user_are_refused(self):
        model = copy_checkpoint(self.A, os.path.join(self.tmp, "snap"))
        os.chmod(model, 0o755)
        rc, _, err = fdctl(0, "publish", "--strategy", "ipc_snapshot", "--from", self.B, "--model", model)
        self.assertEqual(rc, 0, err)
        snap = glob.glob(os.path.join(model, "model_state.tp0*.safetensors"))
        self.assertTrue(snap)
        with Daemon("--dynamic-load-weight", "--load-strategy", "ipc_snapshot", model=model) as d:
            os.chown(snap[0], self.user.uid, self.user.gid)
            self.forbidden(d, [snap[0], f"uid {self.user.uid}"], {"version": "s"})
            os.chown(snap[0], 0, 0)
            os.chmod(model, 0o777)
            self.forbidden(d, [model, "0777"], {"version": "s"})
            os.chmod(model, 0o755)
            d.post("/v1/pause")
            status, j = d.post("/v1/update_weights", {"version": "s"})
            self.assertEqual(status, 200, j)
            d.post("/v1/resume")
            self.assertEqual(greedy(d), (*self.out_b, "s"))

    def test_another_user_cannot_use_the_control_block(self):
        with Daemon(model=self.A) as d:
            for cmd in (["pause"], ["status"], ["is-paused"]):
                p = self.user.run(FDCTL, "--port", str(d.port), "--transport", "shm", *cmd)
                self.assertEqual(p.returncode, EXIT_FORBIDDEN, p.stderr)  # forbidden, not a generic failure
                self.assertIn("0600", p.stderr)
            self.assertFalse(d.get("/v1/is_paused")[1]["is_paused"])
            # Nor read or map it directly.
            p = self.user.run(PYTHON, "-c", f"open('/dev/shm/fdrollout.{d.port}', 'r+b')")
            self.assertIn("PermissionError", p.stderr)

    def test_fdctl_refuses_a_block_that_is_open_to_others_or_not_its_daemons(self):
        with Daemon(model=self.A) as d:
            path = f"/dev/shm/fdrollout.{d.port}"
            os.chmod(path, 0o666)  # as if someone loosened it: any user could forge answers
            try:
                rc, _, err = fdctl(d.port, "--transport", "shm", "pause")
                self.assertEqual(rc, EXIT_FORBIDDEN, err)
                self.assertIn("mode 0666", err)
                # The other user sees a writable block now, and fdctl refuses it for them too (not theirs).
                p = self.user.run(FDCTL, "--port", str(d.port), "--transport", "shm", "pause")
                self.assertEqual(p.returncode, EXIT_FORBIDDEN, p.stderr)
                self.assertIn(f"not by you (uid {self.user.uid})", p.stderr)
                self.assertFalse(d.get("/v1/is_paused")[1]["is_paused"])
            finally:
                os.chmod(path, 0o600)
            self.assertEqual(fdctl(d.port, "--transport", "shm", "pause")[0], 0)

    def test_another_user_can_neither_read_nor_replace_the_ipc_record(self):
        d = Daemon("--dynamic-load-weight", "--load-strategy", "ipc", model=self.A)
        self.addCleanup(d.__exit__)
        record = f"/dev/shm/fdrollout.{d.port}.weights.tp0"
        self.addCleanup(lambda: [os.unlink(p) for p in glob.glob(f"/dev/shm/fdrollout.{d.port}.weights.*")])
        rc, _, err = fdctl(d.port, "publish", "--strategy", "ipc", "--from", self.B, "--version", "mine")
        self.assertEqual(rc, 0, err)
        self.assertEqual(os.stat(record).st_mode & 0o777, 0o600)
        p = self.user.run(PYTHON, "-c", f"open('{record}', 'rb').read(1)")
        self.assertIn("PermissionError", p.stderr)
        p = self.user.run(FDCTL, "--port", str(d.port), "publish", "--strategy", "ipc", "--from", self.A, "--version", "evil")
        self.assertNotEqual(p.returncode, 0, p.stdout)
        self.assertEqual(os.stat(record).st_uid, 0)
        self.assertEqual(d.post("/v1/pause")[0], 200)
        status, j = d.post("/v1/update_weights", {})
        self.assertEqual(status, 200, j)
        d.post("/v1/resume")
        self.assertEqual(greedy(d), (*self.out_b, "mine"))  # the daemon user's record, bit-exact

    def test_the_publishers_write_no_weights_into_another_users_object_or_link(self):
        """A probe: the other user made the record name first (and kept it open), and root's
        `fdctl publish --strategy ipc` wrote the weights into it, readable by its owner; the
        Python publisher followed a planted symlink and overwrote the root-only file behind it."""
        port = free_port()
        record, delta = f"/dev/shm/fdrollout.{port}.weights.tp0", f"/dev/shm/fdrollout.{port}.weights.delta"
        self.addCleanup(lambda: [os.unlink(p) for p in (record, delta) if os.path.lexists(p)])
        secret = os.path.join(self.tmp, "root-only")
        with open(secret, "w") as f:
            f.write("root's")
        os.chmod(secret, 0o600)
        head = f"import sys; sys.path.insert(0, {os.path.join(REPO, 'python')!r}); from fdrollout import publish, publish_delta\n"
        full_py = head + (f"try:\n    publish.publish_ipc(publish.to_rollout_names(publish.load_checkpoint({self.B!r}), "
                          f"publish.load_config({self.B!r})), {port}, 'v1')\nexcept OSError as e:\n    print(type(e).__name__, e); sys.exit(3)\n")
        delta_py = head + (f"try:\n    publish_delta.write_ipc_delta_record({port}, 'v2', 'v1', b'x' * 64)\n"
                           f"except OSError as e:\n    print(type(e).__name__, e); sys.exit(4)\n")

        def plant(p, kind):
            if kind == "object":
                self.user.run(PYTHON, "-c", f"import os; os.close(os.open({p!r}, os.O_CREAT | os.O_WRONLY, 0o666))")
            else:
                self.user.run(PYTHON, "-c", f"import os; os.symlink({secret!r}, {p!r})")
            self.assertEqual(os.lstat(p).st_uid, self.user.uid)

        for kind in ("object", "symlink"):
            with self.subTest(kind):
                plant(record, kind)
                rc, _, err = fdctl(port, "publish", "--strategy", "ipc", "--from", self.B, "--version", "v1")
                self.assertNotEqual(rc, 0, err)
                if kind == "object":
                    self.assertEqual(rc, EXIT_FORBIDDEN, err)
                    self.assertIn(f"uid {self.user.uid}", err)
                p = subprocess.run([PYTHON, "-c", full_py], capture_output=True, text=True)
                self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
                if kind == "object":
                    self.assertIn("PermissionError", p.stdout)  # (a link: ELOOP, or EACCES where fs.protected_* say so)
                self.assertEqual(os.lstat(record).st_uid, self.user.uid)
                if kind == "object":
                    self.assertEqual(os.stat(record).st_size, 0, "no bytes into the other user's object")
                os.unlink(record)
                plant(delta, kind)
                p = subprocess.run([PYTHON, "-c", delta_py], capture_output=True, text=True)
                self.assertEqual(p.returncode, 4, p.stdout + p.stderr)
                if kind == "object":
                    self.assertEqual(os.stat(delta).st_size, 0, "no bytes into the other user's object")
                os.unlink(delta)
                with open(secret) as f:
                    self.assertEqual(f.read(), "root's", "the file behind the planted link is untouched")

    def test_an_ipc_snapshot_is_never_more_readable_than_its_checkpoint(self):
        """A probe: under umask 022, `fdctl publish --strategy ipc_snapshot` of a 0600 checkpoint
        wrote a 0644 snapshot the other user could read."""
        src = copy_checkpoint(self.B, os.path.join(self.tmp, "private-src"))
        os.chmod(os.path.join(src, "model.safetensors"), 0o600)
        model = copy_checkpoint(STORIES, os.path.join(self.tmp, "snap-target"))
        old = os.umask(0o022)
        try:
            rc, _, err = fdctl(1, "publish", "--strategy", "ipc_snapshot", "--from", src, "--model", model, "--version", "7")
        finally:
            os.umask(old)
        self.assertEqual(rc, 0, err)
        snap = os.path.join(model, "model_state.tp0.safetensors")
        self.assertEqual(os.stat(snap).st_mode & 0o777, 0o600)
        p = self.user.run(PYTHON, "-c", f"open({snap!r}, 'rb').read(1)")
        self.assertIn("PermissionError", p.stderr)

    def test_another_user_is_refused_by_the_control_routes_with_a_control_key(self):
        probe = (
            "import sys, urllib.request, urllib.error\n"
            "for path, key in [('/v1/pause', None), ('/v1/pause', 'gen'), ('/clear_load_weight', 'gen'), ('/v1/sleep', 'guess')]:\n"
            "    h = {'Authorization': 'Bearer ' + key} if key else {}\n"
            "    m = 'GET' if path == '/clear_load_weight' else 'POST'\n"
            "    r = urllib.request.Request('http://127.0.0.1:' + sys.argv[1] + path, data=None if m == 'GET' else b'{}', headers=h, method=m)\n"
            "    try:\n"
            "        print(urllib.request.urlopen(r, timeout=10).status)\n"
            "    except urllib.error.HTTPError as e:\n"
            "        print(e.code)\n")
        with Daemon("--dynamic-load-weight", "--api-key", "gen", "--control-api-key", "ctl", model=self.A) as d:
            p = self.user.run(PYTHON, "-c", probe, str(d.port))
            self.assertEqual(p.stdout.split(), ["401"] * 4, p.stderr)
            status, j = d.get("/v1/is_paused", headers={"Authorization": "Bearer ctl"})
            self.assertEqual((status, j["is_paused"], j["sleeping_tags"]), (200, False, []))


if __name__ == "__main__":
    unittest.main()
