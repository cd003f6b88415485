"""The daemon end to end on --device cuda against --device cpu (issue #10; label gpu).

stories260K (F32): greedy tokens equal to a CPU daemon's, token logprobs within 1e-5; sleep of
both tags (weight, kv_cache) hands >= 97% of the device memory the daemon held back (device-wide
cudaMemGetInfo through libcudart, read in this process); wakeup serves the same tokens again; 50
sleep/wakeup cycles leak no device memory (free memory after the last wakeup within 2 MiB of the
first); the sleep result's device_bytes_freed matches. With --use-cudagraph (decode steps replayed from
CUDA graphs captured at start-up): the same greedy tokens and logprobs within 1e-5, concurrent
requests (padded buckets) each equal to their single-request answer, and again after a sleep of
both tags and wakeup (graphs replayed, not recaptured: one capture log line). Exits 77 (CTest: Skipped) where no CUDA device is visible.
"""
import ctypes
import sys
import unittest

from concurrent.futures import ThreadPoolExecutor

from fdtest import GREEDY, Daemon, cuda_device_count, cudart, greedy

KV = ["--kv-cache-bytes", "256MiB", "--dynamic-load-weight"]
RT = cudart()


def device_free():
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    assert RT.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0
    return free.value


class CudaDaemon(unittest.TestCase):
    def test_greedy_logprobs_sleep_and_cycles(self):
        with Daemon(*KV, extra=False) as d:
            ref_tokens, ref_lp, _ = greedy(d)
        free_before = device_free()
        with Daemon("--device", "cuda", *KV, extra=False, timeout=180) as d:
            tokens, lp, _ = greedy(d)
            self.assertEqual(tokens, ref_tokens)
            diff = max(abs(a - b) for a, b in zip(lp, ref_lp))
            print(f"max |logprob cuda - cpu| = {diff:.3g}")
            self.assertLessEqual(diff, 1e-5)
            awake = device_free()
            held = free_before - awake
            self.assertGreater(held, 256 << 20)
            status, body = d.post("/v1/sleep?tags=weight,kv_cache")
            self.assertEqual(status, 200, body)
            freed = device_free() - awake
            res = body.get("result", body)
            self.assertIn("device_bytes_freed", res, body)  # the daemon's own cudaMemGetInfo delta
            self.assertGreaterEqual(res["device_bytes_freed"], 0.97 * freed - (2 << 20))
            # The context, cuBLAS/scratch buffers and index staging stay: >= 97% of what the
            # weights + KV regions held is the bar; held also counts the context, so
            # compare against the regions (256 MiB KV + weights) via the freed fraction of held
            # minus a 600 MiB context allowance.
            print(f"held {held} bytes, sleep freed {freed} bytes")
            self.assertGreaterEqual(freed, 0.97 * (held - (600 << 20)))
            status, body = d.post("/v1/wakeup?tags=weight,kv_cache")
            self.assertEqual(status, 200, body)
            self.assertEqual(greedy(d)[0], ref_tokens)
            first = device_free()
            for _ in range(50):
                self.assertEqual(d.post("/v1/sleep?tags=weight,kv_cache")[0], 200)
                self.assertEqual(d.post("/v1/wakeup?tags=weight,kv_cache")[0], 200)
            last = device_free()
            print(f"50 cycles: free memory {first} -> {last}")
            self.assertGreaterEqual(last, first - (2 << 20))
            self.assertEqual(greedy(d)[0], ref_tokens)

    def test_use_cudagraph_greedy_equal_and_after_wakeup(self):
        with Daemon(*KV, extra=False) as d:
            ref_tokens, ref_lp, _ = greedy(d)
            ref_other = greedy(d, prompt="Once upon a time, a cat")[0]
        with Daemon("--device", "cuda", "--use-cudagraph", "--max-num-seqs", "8", *KV, extra=False, timeout=180) as d:
            tokens, lp, _ = greedy(d)
            self.assertEqual(tokens, ref_tokens)
            self.assertLessEqual(max(abs(a - b) for a, b in zip(lp, ref_lp)), 1e-5)
            # Three requests at once: decode steps of 3 rows, padded to the 4-row bucket.
            with ThreadPoolExecutor(3) as ex:
                outs = list(ex.map(lambda p: greedy(d, prompt=p)[0], [GREEDY["prompt"], "Once upon a time, a cat", GREEDY["prompt"]]))
            self.assertEqual(outs, [ref_tokens, ref_other, ref_tokens])
            self.assertEqual(d.post("/v1/sleep?tags=weight,kv_cache")[0], 200)
            self.assertEqual(d.post("/v1/wakeup?tags=weight,kv_cache")[0], 200)
            self.assertEqual(greedy(d)[0], ref_tokens)
            out = d.output()
            self.assertEqual(out.count("decode buckets captured"), 1, out[-2000:])
            self.assertIn("(1 2 4 8)", out)


if __name__ == "__main__":
    if cuda_device_count() == 0:
        print("no CUDA device visible: skipped")
        sys.exit(77)
    unittest.main()
