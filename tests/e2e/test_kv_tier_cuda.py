"""The host KV tier on --device cuda (issue #27; label gpu): the tier's pool is pinned host memory
and its block copies go through the CUDA backend's download/upload (the Worker's swap path).
A prefix evicted from the device pool comes back from the host and the completion equals,
bitwise, the same CUDA daemon computing it from scratch (no prefix cache); /metrics counts the
host hits. Exits 77 (CTest: Skipped) where no CUDA device is visible.
"""
import sys
import unittest

from fdtest import Daemon, cuda_device_count
from test_kv_tier import A, BLOCK_BYTES, SMALL_POOL, TIER, body, evict_a, metrics, out


class CudaKvTier(unittest.TestCase):
    def test_host_hit_equals_recompute_on_cuda(self):
        with Daemon("--device", "cuda", *SMALL_POOL, extra=False, timeout=180) as ref:
            want = out(ref.complete(**body(A)))
        with Daemon("--device", "cuda", *TIER, extra=False, timeout=180) as d:
            evict_a(self, d)
            j = d.complete(**body(A))
            u = j["usage"]["prompt_tokens_details"]
            self.assertGreater(u["host_cached_tokens"], 0, u)
            self.assertEqual(out(j), want)
            m = metrics(d)
            self.assertEqual(m["fdrollout_kv_host_tier_in_bytes_total"], m["fdrollout_kv_host_tier_hits_total"] * BLOCK_BYTES)
            self.assertGreater(m["fdrollout_kv_host_tier_hits_total"], 0)


if __name__ == "__main__":
    if cuda_device_count() == 0:
        print("no CUDA device visible: skipped")
        sys.exit(77)
    unittest.main()
