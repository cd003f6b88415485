"""What the publishers (fdrollout.publish and `fdctl publish`) refuse or keep, found by a probe:

- one publisher per ipc record at a time: a second one (Python or fdctl) is refused while the
  first holds the record (two at once interleaved their bytes under one even generation, which
  the daemon served under one label);
- an ipc record is grown, never shrunk (the Python writer shrank it: a reader of the previous
  generation would read past its end);
- a symbolic link at the record's path is refused as a trust failure: fdctl exit 13, Python
  PermissionError, the daemon 403 (were exit 10, OSError ELOOP, 503 "retry");
- "latest" is not a version of an rsync store (the Python publisher made it a dir, after which
  every publish failed to rename `latest`);
- a snapshot or checkpoint file written under umask 002, or from a group-writable source, is not
  writable by other users (it published with exit 0 and the daemon refused it with 403).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import FDCTL, STORIES, Daemon, copy_checkpoint, free_port  # noqa: E402
from fdrollout import publish, safetensors_np  # noqa: E402

EXIT_FORBIDDEN, EXIT_WRONG_STATE = 13, 4


def fdctl_publish(port, *args):
    return subprocess.run([FDCTL, "--port", str(port), "publish", *args], capture_output=True, text=True, timeout=120)


class IpcRecords(unittest.TestCase):
    def setUp(self):
        self.port = free_port()
        self.path = publish.ipc_path(self.port)
        self.addCleanup(lambda: [os.unlink(p) for p in (self.path, publish.ipc_delta_path(self.port)) if os.path.lexists(p)])

    def test_a_second_publisher_is_refused_while_one_writes(self):
        fd = publish.open_record(self.path)  # a publisher in the middle of its write holds the record
        try:
            with self.assertRaises(BlockingIOError) as e:
                publish.publish_ipc({"a": np.zeros(4, np.float32)}, self.port, "p2")
            self.assertIn("another publisher is writing", str(e.exception))
            p = fdctl_publish(self.port, "--strategy", "ipc", "--from", STORIES, "--version", "c2")
            self.assertEqual(p.returncode, EXIT_WRONG_STATE, p.stderr)
            self.assertIn("another publisher is writing", p.stderr)
        finally:
            os.close(fd)
        self.assertEqual(publish.publish_ipc({"a": np.zeros(4, np.float32)}, self.port, "p3") % 2, 0)  # free again

    def test_a_record_is_never_shrunk(self):
        publish.publish_ipc({"a": np.zeros((256, 1024), np.float32)}, self.port, "big")
        big = os.stat(self.path).st_size
        publish.publish_ipc({"a": np.zeros(16, np.float32)}, self.port, "small")
        self.assertEqual(os.stat(self.path).st_size, big)
        payload = b"x" * 100000
        from fdrollout.publish_delta import write_ipc_delta_record
        write_ipc_delta_record(self.port, "d1", "small", payload)
        delta = os.stat(publish.ipc_delta_path(self.port)).st_size
        write_ipc_delta_record(self.port, "d2", "small", b"y" * 10)
        self.assertEqual(os.stat(publish.ipc_delta_path(self.port)).st_size, delta)

    def test_a_symlink_at_the_record_is_a_trust_failure_everywhere(self):
        tmp = tempfile.mkdtemp(prefix="fd-pubguard-")
        self.addCleanup(shutil.rmtree, tmp, True)
        target = os.path.join(tmp, "real")
        with open(target, "wb") as f:
            f.write(b"\0" * 4096)
        os.chmod(target, 0o600)
        os.symlink(target, self.path)
        with self.assertRaises(PermissionError) as e:
            publish.publish_ipc({"a": np.zeros(4, np.float32)}, self.port, "s1")
        self.assertIn("symbolic link", str(e.exception))
        p = fdctl_publish(self.port, "--strategy", "ipc", "--from", STORIES, "--version", "s2")
        self.assertEqual(p.returncode, EXIT_FORBIDDEN, p.stderr)
        self.assertIn("symbolic link", p.stderr)
        with Daemon("--dynamic-load-weight", "--load-strategy", "ipc", port=self.port, extra=False) as d:
            self.assertEqual(d.post("/v1/pause")[0], 200)
            status, j = d.post("/v1/update_weights", {})
            self.assertEqual((status, j["error"]["type"]), (403, "forbidden"), j)
            self.assertIn("symbolic link", j["error"]["message"])


class StoreAndFiles(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="fd-pubguard-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.tensors = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))

    def test_latest_is_not_a_version(self):
        store = os.path.join(self.tmp, "store")
        for name in ("latest", "latest.tmp-1"):
            with self.assertRaises(ValueError) as e:
                publish.publish_rsync(self.tensors, store, name, template_dir=STORIES)
            self.assertIn("reserved", str(e.exception))
        self.assertFalse(os.path.exists(os.path.join(store, "latest")))
        publish.publish_rsync(self.tensors, store, "v1", template_dir=STORIES)
        with open(os.path.join(store, "latest")) as f:
            self.assertEqual(f.read().strip(), "v1")
        self.assertEqual(sorted(os.listdir(store)), ["latest", "v1"])

    def test_files_are_never_writable_by_other_users(self):
        snap = copy_checkpoint(STORIES, os.path.join(self.tmp, "model"))
        src = copy_checkpoint(STORIES, os.path.join(self.tmp, "src"))
        out = copy_checkpoint(STORIES, os.path.join(self.tmp, "out"))  # the dirs: made before the umask
        old = os.umask(0o002)
        try:
            path = publish.publish_ipc_snapshot(self.tensors, snap)
            self.assertEqual(os.stat(path).st_mode & 0o022, 0, oct(os.stat(path).st_mode))
            os.chmod(os.path.join(src, "model.safetensors"), 0o664)
            p = fdctl_publish(0, "--strategy", "ipc_snapshot", "--from", src, "--model", out, "--version", "s3")
            self.assertEqual(p.returncode, 0, p.stderr)
            mode = os.stat(os.path.join(out, "model_state.tp0.safetensors")).st_mode
            self.assertEqual(mode & 0o022, 0, oct(mode))
        finally:
            os.umask(old)
        with Daemon("--dynamic-load-weight", "--load-strategy", "ipc_snapshot", model=out, extra=False) as d:
            self.assertEqual(d.get("/health")[1]["weight_version"], "s3")


if __name__ == "__main__":
    unittest.main()
