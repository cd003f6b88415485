"""Tensor-parallel ranks on --device cuda (issues #9/#10; label gpu).

On one GPU, tp=2 puts both ranks on device 0 and --dist-backend auto stages the all-reduce
through host memory (shm; NCCL refuses two ranks on one device); with two or more GPUs auto is
nccl. Either way:
- greedy tokens equal a CPU daemon's and a tp=1 CUDA daemon's, token logprobs within 1e-4;
- /health device_memory lists both ranks with their device, total/free bytes and the bytes
  each holds per tag; /metrics has the per-rank device gauges;
- sleep (both tags): each rank's device_bytes_freed (cudaMemGetInfo in that rank process) is at
  least 97% of the bytes its allocator released; the top-level device_bytes_freed is their sum;
  the group is torn down (comm_group disconnected; every rank reports its group closed) and
  wakeup rebuilds it and serves the same tokens.
- an mp rank on --dist-backend nccl (tp=1: one rank per GPU is all one GPU allows): its NCCL
  communicator is destroyed by sleep and a new one created by wakeup (the rank's own counts).
Exits 77 (CTest: Skipped) where no CUDA device is visible.
"""
import sys
import unittest

from fdtest import Daemon, cuda_device_count, greedy

KV = ["--kv-cache-bytes", "128MiB", "--dynamic-load-weight"]
TP2 = ["--tensor-parallel-size", "2", "--threads", "1"]


N_DEV = cuda_device_count()


def close(testcase, a, b, tol=1e-4):
    testcase.assertEqual(len(a), len(b))
    diff = max(abs(x - y) for x, y in zip(a, b))
    testcase.assertLessEqual(diff, tol)
    return diff


class CudaTensorParallel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with Daemon(*KV, extra=False) as d:
            cls.cpu = greedy(d)
        with Daemon("--device", "cuda", *KV, extra=False, timeout=180) as d:
            cls.cuda1 = greedy(d)

    def test_tp2_equals_tp1_reports_device_memory_and_sleep_frees_per_rank(self):
        with Daemon("--device", "cuda", *TP2, *KV, extra=False, timeout=240) as d:
            tokens, lp, _ = greedy(d)
            self.assertEqual(tokens, self.cpu[0])
            self.assertEqual(tokens, self.cuda1[0])
            print(f"max |logprob tp2 cuda - cpu| = {close(self, lp, self.cpu[1]):.3g}")
            h = d.get("/health")[1]
            self.assertEqual(h["executor"], "mp")
            self.assertEqual(h["comm_group"], {"backend": "nccl" if N_DEV >= 2 else "shm", "state": "connected"})
            ranks = h["device_memory"]["ranks"]
            self.assertEqual([r["rank"] for r in ranks], [0, 1])
            self.assertEqual([r["device"] for r in ranks], [0, 1 % N_DEV])
            for r in ranks:
                self.assertGreater(r["total_bytes"], 1 << 30)
                self.assertGreater(r["free_bytes"], 0)
                self.assertEqual(r["used_bytes"], r["total_bytes"] - r["free_bytes"])
                self.assertGreater(r["held_bytes"]["weight"], 0)
                self.assertGreater(r["held_bytes"]["kv_cache"], 0)
                self.assertLess(r["age_s"], 5.0)
                self.assertTrue(r["comm_connected"])
            m = d.get("/metrics")[1]
            self.assertIn('fdrollout_device_memory_used_bytes{rank="1"', m)
            self.assertIn('fdrollout_device_memory_held_bytes{rank="0",tag="weight"}', m)

            status, body = d.post("/v1/sleep?tags=weight,kv_cache")
            self.assertEqual(status, 200, body)
            res = body["result"]
            total = 0
            for r in res["ranks"]:
                self.assertIn("device_bytes_freed", r, res)
                print(f"rank {r['rank']}: allocator freed {r['freed_bytes']}, device free grew {r['device_bytes_freed']}")
                self.assertGreaterEqual(r["device_bytes_freed"], 0.97 * r["freed_bytes"])
                total += r["device_bytes_freed"]
            self.assertEqual(res["device_bytes_freed"], total)
            h = d.get("/health")[1]
            self.assertEqual(h["comm_group"]["state"], "disconnected")
            self.assertEqual([r["comm_connected"] for r in h["device_memory"]["ranks"]], [False, False])
            for r in h["device_memory"]["ranks"]:
                self.assertEqual((r["held_bytes"]["weight"], r["held_bytes"]["kv_cache"]), (0, 0))
            status, body = d.post("/v1/wakeup?tags=weight,kv_cache")
            self.assertEqual(status, 200, body)
            h = d.get("/health")[1]
            self.assertEqual(h["comm_group"]["state"], "connected")
            self.assertEqual([r["comm_connected"] for r in h["device_memory"]["ranks"]], [True, True])
            self.assertEqual(greedy(d)[0], self.cpu[0])

    def test_nccl_rank_destroys_its_communicator_on_sleep_and_builds_a_new_one_on_wakeup(self):
        args = ("--device", "cuda", "--distributed-executor-backend", "mp", "--dist-backend", "nccl", *KV)
        with Daemon(*args, extra=False, timeout=240) as d:
            tokens, lp, _ = greedy(d)
            self.assertEqual(tokens, self.cpu[0])
            close(self, lp, self.cpu[1], 1e-5)

            def nccl():
                r = d.get("/health")[1]["device_memory"]["ranks"][0]
                return r["nccl_comms"]["live"], r["nccl_comms"]["created"]

            self.assertEqual(d.get("/health")[1]["comm_group"], {"backend": "nccl", "state": "connected"})
            self.assertEqual(nccl(), (1, 1))
            self.assertEqual(d.post("/v1/sleep?tags=weight,kv_cache")[0], 200)
            self.assertEqual(nccl(), (0, 1))
            self.assertEqual(d.post("/v1/wakeup?tags=weight,kv_cache")[0], 200)
            self.assertEqual(nccl(), (1, 2))
            self.assertEqual(greedy(d)[0], self.cpu[0])


if __name__ == "__main__":
    if N_DEV == 0:
        print("no CUDA device visible: skipped")
        sys.exit(77)
    unittest.main()
