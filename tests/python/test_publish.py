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


if __name__ == "__main__":
    unittest.main()
