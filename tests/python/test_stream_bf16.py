"""bfloat16 weights through a weight stream (a probe): `changed_elements` of torch bfloat16
tensors gave numpy uint16 values that `send_delta` refused ("cannot send uint16 values"), and with
dtype="BF16" an F32 model answered 422; `send(name, bits, dtype="BF16")` skipped the exact
widening that torch bfloat16 tensors get. Now a delta of bf16 tensors serves, on an F32 model
(stories260K) and on a BF16 copy of it, bit for bit what a full stream of the same weights
serves (the F32 model's: the bf16 values widened exactly)."""
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import STORIES, Daemon, copy_checkpoint, greedy, rewrite_tensors, torch_and_gpus  # noqa: E402
from fdrollout import Client, changed_elements  # noqa: E402
from fdrollout import safetensors_np  # noqa: E402

torch = torch_and_gpus()[0]


def bits(t):
    """The uint16 bf16 bits of torch bfloat16 tensor `t` (numpy)."""
    return t.view(torch.int16).numpy().view(np.uint16)


@unittest.skipIf(torch is None, "needs torch (python3-torch)")
class Bf16Deltas(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-stream-bf16-")
        hf = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
        cls.old = {k: torch.from_numpy(v).bfloat16() for k, v in hf.items()}
        g = torch.Generator().manual_seed(5)
        cls.new = {}
        for i, (k, v) in enumerate(sorted(cls.old.items())):
            n = v.clone()
            if i % 2 == 0:  # every other tensor: a tenth of its elements moved
                flat = n.view(-1)
                idx = torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 10)]
                flat[idx] += (0.1 * torch.randn(idx.numel(), generator=g) * (float(v.float().std()) + 1e-3)).bfloat16()
            cls.new[k] = n

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def stream(self, c, version, tensors, base=None, delta=False, **send_kw):
        with c.weight_stream(version, base_version=base, bucket_bytes=64 << 10) as ws:
            for name in sorted(tensors):
                if delta:
                    idx, vals = tensors[name]
                    if len(idx):
                        ws.send_delta(name, idx, vals, **send_kw)
                else:
                    ws.send(name, tensors[name], **send_kw)
        self.assertEqual(c.weight_version(), version)

    def round_trip(self, model):
        with Daemon("--dynamic-load-weight", model=model) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=60)
            self.stream(c, "old", self.old)
            old = greedy(d)
            torch_delta = {k: changed_elements(self.old[k], self.new[k]) for k in self.old}
            self.assertGreater(sum(len(i) for i, _ in torch_delta.values()), 0)
            self.assertEqual({v.dtype for _, v in torch_delta.values()}, {torch.bfloat16})
            self.stream(c, "delta", torch_delta, base="old", delta=True)
            by_delta = greedy(d)
            # numpy bf16 bits, with dtype="BF16": full and delta
            self.stream(c, "old-bits", {k: bits(v) for k, v in self.old.items()}, dtype="BF16")
            self.assertEqual(greedy(d)[:2], old[:2])
            bits_delta = {k: changed_elements(bits(self.old[k]), bits(self.new[k])) for k in self.old}
            self.stream(c, "delta-bits", bits_delta, base="old-bits", delta=True, dtype="BF16")
            by_bits = greedy(d)
            self.stream(c, "full", self.new)
            full = greedy(d)
        self.assertNotEqual(full[1], old[1], "the change shows in the logprobs")
        self.assertEqual(by_delta[:2], full[:2], "a bf16 delta serves what a full stream of the same weights serves")
        self.assertEqual(by_bits[:2], full[:2])
        return full

    def test_f32_model(self):
        full = self.round_trip(copy_checkpoint(STORIES, os.path.join(self.tmp, "f32")))
        # The F32 model got the bf16 values widened exactly: a full stream of float32 arrays of them serves the same.
        with Daemon("--dynamic-load-weight", model=copy_checkpoint(STORIES, os.path.join(self.tmp, "f32-ref"))) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=60)
            self.stream(c, "widened", {k: v.float().numpy() for k, v in self.new.items()})
            self.assertEqual(greedy(d)[:2], full[:2])

    def test_bf16_model(self):
        model = rewrite_tensors(copy_checkpoint(STORIES, os.path.join(self.tmp, "bf16")), lambda t: None, dtype="BF16")
        self.round_trip(model)


if __name__ == "__main__":
    unittest.main()
