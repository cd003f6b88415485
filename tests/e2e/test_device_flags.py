"""The device flags (issue #10) as a CPU-only machine sees them.

--device cuda with no CUDA device visible refuses to start with exit 10 and "no CUDA device
visible" (skipped where a GPU is visible: tests/gpu/test_cuda_worker.cpp runs it there);
--gpu-memory-utilization is CUDA-only and refused on --device cpu with a message naming the
flag; a bad --device value is refused. (--use-cudagraph keeps its SPEC meaning on every backend.) --no-batch-invariant is accepted on
CPU and runs the same kernels: greedy tokens and logprobs bitwise those of a default daemon.
FD_TEST_STAGED_FILL=1 (the Worker's test hook: weights through bounce buffers and
Backend::upload, logits downloaded) serves the same greedy output bitwise, also after a
sleep/wakeup of the weights and a reload through update_weights; at tp=2 the hook also stages the
ranks' shm all-reduce through host buffers (the path of CUDA ranks sharing a device): tokens and
logprobs bitwise those of tp=2 without it, also across a sleep/wakeup that rebuilds the group.
"""
import unittest

from fdtest import Daemon, cuda_device_count, greedy




def refused(testcase, args, needle):
    with Daemon(*args, wait=False, extra=False) as d:
        testcase.assertEqual(d.proc.wait(60), 10, d.output())
        testcase.assertIn(needle, d.output())


class DeviceFlags(unittest.TestCase):
    @unittest.skipIf(cuda_device_count() > 0, "a CUDA device is visible here")
    def test_cuda_without_a_device_exits_10(self):
        refused(self, ["--device", "cuda"], "no CUDA device visible")
        # tp > 1 on cuda is allowed; without a device it stops for that reason alone.
        refused(self, ["--device", "cuda", "--tensor-parallel-size", "2"], "no CUDA device visible")
        refused(self, ["--device", "cuda", "--tensor-parallel-size", "2", "--dist-backend", "nccl"],
                "NCCL refuses two ranks of a group on one device")

    def test_cuda_only_flags_refused_on_cpu(self):
        refused(self, ["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization needs --device cuda")
        refused(self, ["--device", "tpu"], "--device 'tpu': expected cpu or cuda")

    def test_no_batch_invariant_on_cpu_is_the_same_output(self):
        with Daemon(extra=False) as d:
            ref = greedy(d)
        with Daemon("--no-batch-invariant", extra=False) as d:
            self.assertEqual(greedy(d), ref)
            self.assertIn("--no-batch-invariant", d.output())

    def test_staged_fill_hook_serves_bitwise_the_same(self):
        with Daemon("--dynamic-load-weight", extra=False) as d:
            ref = greedy(d)
        with Daemon("--dynamic-load-weight", env={"FD_TEST_STAGED_FILL": "1"}, extra=False) as d:
            self.assertIn("TEST: device-memory paths", d.output())
            self.assertEqual(greedy(d), ref)
            status, _ = d.post("/v1/sleep?tags=weight,kv_cache")
            self.assertEqual(status, 200)
            status, _ = d.post("/v1/wakeup?tags=weight,kv_cache")
            self.assertEqual(status, 200)
            self.assertEqual(greedy(d), ref)

    def test_staged_fill_hook_at_tp2_stages_the_all_reduce_and_serves_bitwise_the_same(self):
        tp2 = ("--dynamic-load-weight", "--tensor-parallel-size", "2", "--threads", "1")
        with Daemon(*tp2, extra=False) as d:
            ref = greedy(d)
            self.assertNotIn("staged through host memory", d.output())
        with Daemon(*tp2, env={"FD_TEST_STAGED_FILL": "1"}, extra=False) as d:
            out = d.output()
            for r in (0, 1):
                self.assertIn(f"rank {r}: shm collectives staged through host memory (TEST: FD_TEST_STAGED_FILL)", out)
            self.assertEqual(greedy(d), ref)
            status, _ = d.post("/v1/sleep?tags=weight,kv_cache")  # closes the group (a new segment on wakeup)
            self.assertEqual(status, 200)
            self.assertEqual(d.get("/health")[1]["comm_group"]["state"], "disconnected")
            status, _ = d.post("/v1/wakeup?tags=weight,kv_cache")
            self.assertEqual(status, 200)
            self.assertEqual(greedy(d), ref)


if __name__ == "__main__":
    unittest.main()
