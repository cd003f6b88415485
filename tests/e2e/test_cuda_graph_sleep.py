"""The `cuda_graph` sleep tag on --device cuda (issue #26; label gpu).

SGLang's release_memory_occupation names three tags (weights, kv_cache, cuda_graph); slime's
staged resume ends with {"tags": ["kv_cache", "cuda_graph"]}. Here the tag is real on CUDA:
`/v1/sleep?tags=cuda_graph` destroys the captured graphs and frees their fixed index buffers and
the activation buffers they replay into (engine::TagSet, Worker::release_graphs), and the next
step captures them again. Checked against the device's own free memory (cudaMemGetInfo through
libcudart, read in this process): it grows after the sleep, by at least half the bytes the
daemon reports (the report also counts the pinned host twin of the index buffers), and the
daemon's device_bytes_freed is positive. Greedy outputs after the wakeup equal the ones before
the sleep (and a CPU daemon's), also three requests at once (other buckets, captured lazily);
after a step the buffers are held again (free memory back within 4 MiB of before the sleep, so
nothing leaks over 20 cycles). SGLang's alias does the same. Exits 77 (CTest: Skipped) where no
CUDA device is visible.
"""
import ctypes
import sys
import unittest

from concurrent.futures import ThreadPoolExecutor

from fdtest import GREEDY, Daemon, cuda_device_count, cudart, greedy

# 8192 tokens reserved: the activation buffers (logits [8192, vocab] f32 among them) are what a
# cuda_graph sleep frees beyond the graphs themselves.
ARGS = ["--kv-cache-bytes", "64MiB", "--dynamic-load-weight", "--max-num-batched-tokens", "8192"]
OTHER = "Once upon a time, a cat"


def device_free():
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    assert cudart().cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0
    return free.value


class CudaGraphSleep(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with Daemon(*ARGS, extra=False) as d:  # the CPU oracle
            cls.ref = greedy(d)[0]
            cls.ref_other = greedy(d, prompt=OTHER)[0]

    def concurrent(self, d):
        with ThreadPoolExecutor(3) as ex:
            return list(ex.map(lambda p: greedy(d, prompt=p)[0], [GREEDY["prompt"], OTHER, GREEDY["prompt"]]))

    def test_sleep_cuda_graph_frees_device_memory_and_recaptures(self):
        with Daemon("--device", "cuda", "--use-cudagraph", "--max-num-seqs", "8", *ARGS, extra=False, timeout=180) as d:
            self.assertEqual(greedy(d)[0], self.ref)
            self.assertEqual(self.concurrent(d), [self.ref, self.ref_other, self.ref])
            awake = device_free()
            status, body = d.post("/v1/sleep?tags=cuda_graph")
            self.assertEqual(status, 200, body)
            res = body["result"]
            self.assertEqual(res["tags"], ["cuda_graph"], res)
            reported = res["freed_bytes"]["cuda_graph"]
            freed = device_free() - awake
            print(f"sleep(cuda_graph): reported {reported} bytes, device free memory grew {freed} bytes, "
                  f"daemon's device_bytes_freed {res.get('device_bytes_freed')}")
            self.assertGreater(reported, 8192 * 4 * 64)  # at least the logits rows of the 8192 tokens reserved
            self.assertGreaterEqual(freed, reported // 2)
            self.assertGreater(res["device_bytes_freed"], 0)
            h = d.get("/health")[1]
            self.assertEqual((h["is_paused"], h["sleeping_tags"]), (True, []), h)  # not a sleeping state
            status, body = d.post("/v1/wakeup?tags=cuda_graph")
            self.assertEqual((status, body["result"]["tags"], body["result"]["is_paused"]), (200, ["cuda_graph"], False), body)
            self.assertEqual(greedy(d)[0], self.ref)  # the buffers reserved again, the bucket captured again
            self.assertEqual(self.concurrent(d), [self.ref, self.ref_other, self.ref])
            back = device_free()
            self.assertLessEqual(abs(back - awake), 4 << 20, (awake, back))
            for _ in range(20):
                self.assertEqual(d.post("/v1/sleep?tags=cuda_graph")[0], 200)
                self.assertEqual(d.post("/v1/wakeup?tags=cuda_graph")[0], 200)
                self.assertEqual(greedy(d)[0], self.ref)
            self.assertGreaterEqual(device_free(), back - (4 << 20))
            # SGLang's staged resume with the tag: release all, weights, then kv_cache + cuda_graph
            self.assertEqual(d.post("/release_memory_occupation", {}), (200, None))
            self.assertEqual(d.post("/resume_memory_occupation", {"tags": ["weights"]}), (200, None))
            self.assertEqual(d.post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}), (200, None))
            self.assertEqual(self.concurrent(d), [self.ref, self.ref_other, self.ref])

    def test_graphs_off_reports_zero(self):
        with Daemon("--device", "cuda", *ARGS, extra=False, timeout=180) as d:
            status, body = d.post("/v1/sleep?tags=cuda_graph")
            self.assertEqual((status, body["result"]["freed_bytes"]), (200, {"cuda_graph": 0}), body)
            self.assertEqual(d.post("/v1/wakeup?tags=cuda_graph")[0], 200)
            self.assertEqual(greedy(d)[0], self.ref)


if __name__ == "__main__":
    if cuda_device_count() == 0:
        print("no CUDA device visible: skipped")
        sys.exit(77)
    unittest.main()
