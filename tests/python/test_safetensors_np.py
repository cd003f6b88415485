"""fdrollout.safetensors_np's f32 -> bf16 rounding against torch's (python3-torch: `.to(torch.bfloat16)`,
round-to-nearest-even, the reference nobody here wrote): every finite value and +-Inf give torch's
bits, a NaN stays a NaN; and a BF16 file written by save_file reads back as those bits."""
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import torch_and_gpus  # noqa: E402
from fdrollout import safetensors_np  # noqa: E402

torch = torch_and_gpus()[0]


def values():
    rng = np.random.default_rng(3)
    normal = rng.standard_normal(1 << 20, dtype=np.float32) * np.float32(3)
    bits = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001,
                      0x80000001, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7F8000, 0x00008000],
                     dtype=np.uint32)
    x = np.concatenate([normal, bits.view(np.float32), edges.view(np.float32)])
    return x[~np.isnan(x)], x[np.isnan(x)]


@unittest.skipIf(torch is None, "needs torch (python3-torch)")
class Bf16Rounding(unittest.TestCase):
    def test_bits_equal_torch_and_nan_stays_nan(self):
        finite, nans = values()
        want = torch.from_numpy(finite).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        got = safetensors_np._f32_to_bf16_bits(finite)
        bad = np.flatnonzero(got != want)
        self.assertEqual(bad.size, 0, [(hex(finite.view(np.uint32)[i]), hex(got[i]), hex(want[i])) for i in bad[:5]])
        self.assertGreater(nans.size, 1000)
        back = safetensors_np._bf16_bits_to_f32(safetensors_np._f32_to_bf16_bits(nans))
        self.assertTrue(np.isnan(back).all())

    def test_saved_bf16_reads_back_as_torch_rounds(self):
        x = np.random.default_rng(4).standard_normal((37, 129), dtype=np.float32)
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "t.safetensors")
            safetensors_np.save_file({"w": (x, "BF16")}, p)
            got = safetensors_np.load_file(p)["w"]
        want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
        self.assertTrue(np.array_equal(got, want))


if __name__ == "__main__":
    unittest.main()
