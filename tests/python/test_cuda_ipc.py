"""fdrollout.cuda_ipc through publish_ipc: a torch trainer on the rollout's own GPU (the colocated RL
loop, where NCCL refuses two ranks on one device: test_nccl_sender.py) publishes its CUDA tensors
as CUDA IPC handles in the `ipc` record; the daemon's update_weights copies them device to device
(--device cuda) or to host (--device cpu of a CUDA build); at tp=2 each rank's record holds its
shard, fused and sliced on the device (to_rollout_names on torch tensors). All serve exactly what a
fresh daemon on the same weights (and tp) serves (the reference: its own load of the checkpoint the tensors came from).
Needs torch with CUDA, a visible GPU and a CUDA build; exits 77 (CTest: Skipped) elsewhere.
"""
import json
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from fdtest import STORIES, Daemon, fresh_daemon, greedy, perturbed, torch_and_gpus  # noqa: E402
from fdrollout import safetensors_np  # noqa: E402
from fdrollout.publish import publish_ipc, to_rollout_names  # noqa: E402

torch, N_GPUS = torch_and_gpus()
HAVE_CUDA = N_GPUS > 0


class CudaIpcPublish(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-pycudaipc-")
        cls.new_dir = perturbed(STORIES, os.path.join(cls.tmp, "new"), seed=7)
        new = safetensors_np.load_file(os.path.join(cls.new_dir, "model.safetensors"))
        # separate torch allocations: the caching allocator packs them into shared segments, so
        # most tensors sit at an offset inside the allocation whose handle is published
        cls.tensors = {n: torch.from_numpy(a).cuda() for n, a in sorted(new.items())}
        with open(os.path.join(STORIES, "config.json")) as f:
            cls.cfg = json.load(f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def update_from_cuda_tensors(self, device, tp=1):
        tp_args = ["--tensor-parallel-size", str(tp), "--threads", "1"] if tp > 1 else []
        with fresh_daemon(self.new_dir, "--device", device, *tp_args) as ref:
            want = greedy(ref)[:2]
        with Daemon("--dynamic-load-weight", "--load-strategy", "ipc", "--device", device, *tp_args, extra=False) as d:
            self.assertNotEqual(greedy(d)[0], want[0], "the perturbed weights answer differently")
            version = f"cuda-ipc-{device}-tp{tp}"
            # each rank's record: its shard of the CUDA tensors (fused and sliced on the device),
            # kept alive in `shards` until the update returned
            shards = [to_rollout_names(self.tensors, self.cfg, tp=tp, rank=r) if tp > 1 else self.tensors for r in range(tp)]
            for r in range(tp):
                publish_ipc(shards[r], d.port, version, rank=r, tp_size=tp)
            self.assertEqual(d.post("/v1/pause")[0], 200)
            status, j = d.post("/v1/update_weights", {})
            self.assertEqual(status, 200, j)
            self.assertEqual(j["result"]["version"], version)
            self.assertEqual(d.post("/v1/resume")[0], 200)
            self.assertEqual(greedy(d), (*want, version))
            for r in range(tp):
                os.remove(f"/dev/shm/fdrollout.{d.port}.weights.tp{r}")

    def test_handles_carry_offsets_inside_shared_allocations(self):
        from fdrollout import cuda_ipc
        offsets = [cuda_ipc.ipc_handle(n, t)[1] for n, t in self.tensors.items()]
        self.assertTrue(any(o > 0 for o in offsets), "some tensor sits inside a larger allocation")
        with self.assertRaises(ValueError) as e:
            cuda_ipc.ipc_handle("w.t", self.tensors["model.layers.0.mlp.down_proj.weight"].t())
        self.assertIn("w.t", str(e.exception))

    def test_update_on_a_cuda_daemon_equals_a_fresh_daemon(self):
        self.update_from_cuda_tensors("cuda")

    def test_update_on_a_cpu_daemon_equals_a_fresh_daemon(self):
        self.update_from_cuda_tensors("cpu")

    def test_update_of_a_tp2_cuda_daemon_from_device_shards_equals_a_fresh_one(self):
        self.update_from_cuda_tensors("cuda", tp=2)


if __name__ == "__main__":
    if not HAVE_CUDA:
        print("skipped: needs torch with CUDA and a visible GPU")
        sys.exit(77)  # CTest SKIP_RETURN_CODE: reported as Skipped
    unittest.main(verbosity=2)
