"""The `ipc` strategy's GPU form (SPEC §5): a trainer publishes CUDA IPC handles, the rollout
copies the tensors in. Runs where a CUDA build sees a GPU (tests/gpu/cuda_ipc_publisher.cpp
turns a host record into CUDA IPC handles and keeps them alive); skipped elsewhere, where
test_ipc.py checks that such a record is refused with 503 naming the tensor."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from fdtest import Daemon, fdctl, greedy, perturbed, STORIES

PUBLISHER = os.environ.get("FD_CUDA_IPC_PUBLISHER", "")
def gpu_visible():
    if not PUBLISHER or not os.path.exists(PUBLISHER):
        return False
    return subprocess.run([PUBLISHER, "--probe"], capture_output=True, timeout=60).returncode == 0


class CudaIpc(unittest.TestCase):
    def test_update_from_cuda_ipc_handles_equals_a_fresh_daemon(self):
        tmp = tempfile.mkdtemp(prefix="fd-cuda-ipc-")
        try:
            b = perturbed(STORIES, os.path.join(tmp, "B"), seed=5)
            with Daemon(model=b) as fresh:
                b_out = greedy(fresh)[:2]
            with Daemon("--dynamic-load-weight", "--load-strategy", "ipc") as d:
                a_out = greedy(d)[:2]
                self.assertNotEqual(a_out[0], b_out[0])
                rc, out, err = fdctl(d.port, "publish", "--strategy", "ipc", "--from", b, "--version", "gpu-1")
                self.assertEqual(rc, 0, err)
                record = f"/dev/shm/fdrollout.{d.port}.weights.tp0"
                pub = subprocess.Popen([PUBLISHER, record], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                try:
                    self.assertEqual(pub.stdout.readline().strip(), "ready")
                    self.assertEqual(d.post("/v1/pause")[0], 200)
                    status, j = d.post("/v1/update_weights", {})
                    self.assertEqual(status, 200, j)
                    self.assertEqual(j["result"]["version"], "gpu-1")
                    self.assertEqual(d.post("/v1/resume")[0], 200)
                    self.assertEqual(greedy(d), (*b_out, "gpu-1"))
                finally:
                    pub.stdin.close()
                    pub.wait(timeout=60)
                # The exporting process is gone: its handles cannot be opened any more.
                self.assertEqual(d.post("/v1/pause")[0], 200)
                status, j = d.post("/v1/update_weights", {"version": "gpu-2"})
                self.assertEqual(status, 503, j)
                self.assertEqual(j["error"]["type"], "source_unavailable")
                self.assertEqual(d.post("/v1/resume")[0], 200)
                self.assertEqual(greedy(d), (*b_out, "gpu-1"))
                os.remove(record)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if not gpu_visible():
        print("skipped: needs a CUDA build (FD_WITH_CUDA) and a visible GPU")
        sys.exit(77)  # CTest SKIP_RETURN_CODE: reported as Skipped, not Passed
    unittest.main(verbosity=2)
