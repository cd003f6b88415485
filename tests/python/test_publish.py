"""fdrollout.publish.to_rollout_names on torch tensors (the colocated trainer's form, before
publish_ipc hands CUDA tensors over by CUDA IPC: tests/python/test_cuda_ipc.py) gives, for every
rank at tp 1 and 2, the same bytes as on numpy arrays, each tensor contiguous. The numpy form is
itself checked against the daemon's own load of the sharded state dict (tests/e2e/test_fdpublish.py,
test_architectures.py). Needs Debian's python3-torch (skipped without it)."""
import json
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import STORIES, torch_and_gpus  # noqa: E402
from fdrollout import publish, safetensors_np  # noqa: E402

torch = torch_and_gpus()[0]


@unittest.skipIf(torch is None, "needs torch (python3-torch)")
class RolloutNamesOnTorch(unittest.TestCase):
    def test_torch_shards_equal_numpy_shards_and_are_contiguous(self):
        with open(os.path.join(STORIES, "config.json")) as f:
            cfg = json.load(f)
        hf = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
        th = {k: torch.from_numpy(v) for k, v in hf.items()}
        n_sliced = 0
        for tp in (1, 2):
            for r in range(tp):
                want = publish.to_rollout_names(hf, cfg, tp=tp, rank=r)
                got = publish.to_rollout_names(th, cfg, tp=tp, rank=r)
                self.assertEqual(sorted(got), sorted(want))
                for k in want:
                    self.assertTrue(got[k].is_contiguous(), k)
                    self.assertEqual(tuple(got[k].shape), want[k].shape, k)
                    self.assertTrue(np.array_equal(got[k].numpy(), want[k]), (tp, r, k))
                    n_sliced += tp > 1 and got[k].shape != th.get(k, got[k]).shape
        self.assertGreater(n_sliced, 0, "tp=2 slices some tensor")


@unittest.skipIf(torch is None, "needs torch (python3-torch)")
class PublishTorchBf16(unittest.TestCase):
    """publish_ipc of CPU torch bfloat16 tensors raised an unnamed "TypeError: Got unsupported
    ScalarType BFloat16" (np.asarray on them; a probe). Now BF16 bits as they are, or widened
    exactly to F32 with dtype="F32" (an F32 model); read back from the record."""

    def entries(self, port):
        with open(publish.ipc_path(port), "rb") as f:
            raw = f.read()
        n = publish._HEADER.unpack_from(raw, 0)[2]
        out = {}
        for i in range(n):
            e = publish._ENTRY.unpack_from(raw, publish._HEADER.size + i * publish._ENTRY.size)
            name, tag, ndim, off, nbytes = e[0].rstrip(b"\0").decode(), e[1], e[3], e[9], e[10]
            out[name] = (tag, list(e[5:5 + ndim]), raw[off:off + nbytes])
        return out

    def test_cpu_bf16_tensors_publish(self):
        port = 59000 + os.getpid() % 900
        self.addCleanup(lambda: os.path.exists(publish.ipc_path(port)) and os.unlink(publish.ipc_path(port)))
        g = torch.Generator().manual_seed(3)
        t = {"a.weight": torch.randn(4, 6, generator=g).bfloat16(), "b.weight": torch.randn(5, generator=g)}
        publish.publish_ipc(t, port, "bf16-1")
        got = self.entries(port)
        bits = t["a.weight"].view(torch.int16).numpy().view(np.uint16)
        self.assertEqual(got["a.weight"], (publish.IPC_DTYPES["BF16"], [4, 6], bits.tobytes()))
        self.assertEqual(got["b.weight"], (publish.IPC_DTYPES["F32"], [5], t["b.weight"].numpy().tobytes()))
        publish.publish_ipc(t, port, "bf16-2", dtype="F32")
        got = self.entries(port)
        self.assertEqual(got["a.weight"], (publish.IPC_DTYPES["F32"], [4, 6], t["a.weight"].float().numpy().tobytes()))
        self.assertEqual(publish._tag_of(t["a.weight"], None), "BF16")


if __name__ == "__main__":
    unittest.main()
