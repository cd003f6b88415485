"""fdrollout.nccl_sender (Client.weight_stream(..., backend="nccl")): the trainer as rank 0 of an
NCCL group with the daemon's receiver. Where no GPU is visible (or torch lacks CUDA), only the
refusal is checked: the stream raises before any request reaches the daemon, which keeps serving.
With one GPU, the trainer and the daemon would both be on it, which NCCL refuses ("Duplicate GPU
detected", ncclInvalidUsage, after both sides met through the unique id): the stream must raise
within its timeout on the trainer's side and the daemon keep serving, its next TCP stream working.
With two GPUs (trainer on device 1, daemon on device 0) and a CUDA build of the daemon, a full
stream and a delta stream over NCCL serve what a fresh daemon on the same weights serves (the
reference nobody here wrote: its own load).
"""
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import STORIES, Daemon, fresh_daemon, greedy, perturbed, torch_and_gpus  # noqa: E402
from fdrollout import Client, FdRolloutError, changed_elements, safetensors_np  # noqa: E402

torch, N_GPUS = torch_and_gpus()
HAVE_CUDA = N_GPUS > 0


class NcclRefusedWithoutGpu(unittest.TestCase):
    @unittest.skipIf(torch is None, "needs torch (python3-torch)")
    @unittest.skipIf(HAVE_CUDA, "a GPU is visible: NcclStream runs instead")
    def test_nccl_backend_without_a_gpu_raises_and_changes_nothing(self):
        with Daemon("--dynamic-load-weight", extra=False) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=20)
            before = c.weight_version()
            with self.assertRaises(RuntimeError) as e:
                with c.weight_stream("n1", backend="nccl") as ws:
                    ws.send("model.norm.weight", np.ones(64, np.float32))
            self.assertIn("needs torch with CUDA", str(e.exception))
            self.assertEqual(c.weight_version(), before)
            self.assertEqual(c.health()["weight_stream"]["transport"], None, "no init reached the daemon")
        with self.assertRaises(ValueError):
            Client("127.0.0.1:1").weight_stream("x", backend="gloo")


@unittest.skipUnless(N_GPUS == 1, "needs exactly one visible GPU and torch with CUDA")
class NcclOneGpu(unittest.TestCase):
    def test_nccl_on_the_daemons_own_gpu_raises_in_time_and_changes_nothing(self):
        import time
        with Daemon("--dynamic-load-weight", "--device", "cuda", "--control-timeout-s", "30", extra=False) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=30)
            before, out = c.weight_version(), greedy(d)
            t0 = time.monotonic()
            with self.assertRaises((RuntimeError, TimeoutError, FdRolloutError)) as e:
                with c.weight_stream("n1", backend="nccl", device=0) as ws:
                    ws.send("model.norm.weight", np.ones(64, np.float32))
            took = time.monotonic() - t0
            print(f"one GPU: the NCCL stream raised after {took:.1f} s: {type(e.exception).__name__}: {e.exception}", flush=True)
            self.assertLess(took, 45, "bounded by the stream timeout")
            self.assertEqual(c.weight_version(), before)
            self.assertEqual(greedy(d), out, "the daemon serves exactly as before")
            # the next stream (TCP) works and commits
            base = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
            with c.weight_stream("t1") as ws:
                for n in sorted(base):
                    ws.send(n, base[n])
            self.assertEqual(greedy(d), (*out[:2], "t1"))


@unittest.skipUnless(N_GPUS >= 2, "needs two visible GPUs (NCCL refuses two ranks on one) and torch with CUDA")
class NcclStream(unittest.TestCase):
    def test_full_then_delta_over_nccl_equal_a_fresh_daemon(self):
        tmp = tempfile.mkdtemp(prefix="fd-pynccl-")
        try:
            new_dir = perturbed(STORIES, os.path.join(tmp, "new"))
            new = safetensors_np.load_file(os.path.join(new_dir, "model.safetensors"))
            base = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
            with fresh_daemon(new_dir, "--device", "cuda") as ref:
                ref_new = greedy(ref)[:2]
            with fresh_daemon(STORIES, "--device", "cuda") as ref:
                ref_base = greedy(ref)[:2]
            with Daemon("--dynamic-load-weight", "--device", "cuda", extra=False) as d:
                c = Client(f"127.0.0.1:{d.port}", timeout=60)
                with c.weight_stream("g1", backend="nccl", device=1) as ws:
                    for n in sorted(base):
                        ws.send(n, torch.from_numpy(base[n]).cuda(1))
                self.assertEqual(greedy(d), (*ref_base, "g1"))
                with c.weight_stream("g2", base_version="g1", backend="nccl", device=1) as ws:
                    for n in sorted(new):
                        idx, vals = changed_elements(base[n], new[n])
                        ws.send_delta(n, idx, vals)
                self.assertEqual(ws.result["n_delta"], len(new))
                self.assertEqual(greedy(d), (*ref_new, "g2"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
