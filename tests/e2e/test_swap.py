"""The host KV swap tier (--swap-space, FD_ENABLE_SWAP_SPACE_CLEARING; issue #10).

A KV pool of 6 blocks cannot hold 12 concurrent 65-token sequences, so the scheduler must
preempt over and over. With a host swap pool the victims' KV is copied out and back instead of
being recomputed: every choice's tokens and logprobs must equal, bitwise, those of a daemon with
a pool big enough that nothing is ever preempted (the reference), at the uni and mp executors
(tp 1 and 2). /metrics must show the swaps (and no recompute while the host pool has room; both
kinds when it is tiny). sleep(kv_cache) keeps the swap pool's memory by default and releases it
with FD_ENABLE_SWAP_SPACE_CLEARING=1 (RSS shows it), and wakeup maps it again.
"""
import re
import unittest

from fdtest import REF, Daemon, run_concurrently

PROMPTS = ["Once upon a time", "Lily and Tom", "The little dog", "One day, a girl named Sue",
           "Tom had a red ball. He", "The sun was"]
# 6 blocks x 16 tokens of stories260K's KV (2 x 5 layers x 16 tokens x 32 floats x 4 bytes).
BLOCK_BYTES = 20480
TINY_POOL = ["--kv-cache-bytes", str(6 * BLOCK_BYTES), "--max-model-len", "80"]
GIB = 1 << 30


def bodies():
    return [{"prompt": p, "n": 2, "max_tokens": 60, "temperature": 0, "logprobs": 2, "ignore_eos": True} for p in PROMPTS]


def metrics(d):
    _, text = d.get("/metrics")
    out = {}
    for line in text.splitlines():
        if line.startswith("fdrollout_") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


class SwapTier(unittest.TestCase):
    def check_equal_to_reference(self, backend_args, swap_gib, expect_recompute):
        reqs = bodies()
        with Daemon(*backend_args, "--max-model-len", "80", extra=False) as ref:
            want = run_concurrently(ref, reqs)
            self.assertEqual(metrics(ref)["fdrollout_preemptions_total"], 0)
        with Daemon(*backend_args, *TINY_POOL, "--swap-space", str(swap_gib), extra=False) as d:
            got = run_concurrently(d, reqs)
            for i, (g, w) in enumerate(zip(got, want)):
                self.assertEqual(g, w, f"request {i} ({reqs[i]['prompt']!r}) differs with swapping")
            m = metrics(d)
            self.assertGreater(m["fdrollout_swap_preemptions_total"], 0, m)
            self.assertEqual(m["fdrollout_preemptions_total"],
                             m["fdrollout_swap_preemptions_total"] + m["fdrollout_recompute_preemptions_total"])
            if expect_recompute:
                self.assertGreater(m["fdrollout_recompute_preemptions_total"], 0, m)
            else:
                self.assertEqual(m["fdrollout_recompute_preemptions_total"], 0, m)
            # Every block swapped out came back in (all sequences finished); bytes are whole blocks.
            self.assertGreater(m["fdrollout_kv_swap_out_bytes_total"], 0)
            self.assertEqual(m["fdrollout_kv_swap_in_bytes_total"], m["fdrollout_kv_swap_out_bytes_total"])
            self.assertEqual(m["fdrollout_kv_swap_out_bytes_total"] % BLOCK_BYTES, 0)
            self.assertEqual(m["fdrollout_kv_swap_blocks_used"], 0)
            self.assertEqual(m["fdrollout_num_requests_swapped"], 0)
            h = d.get("/health")[1]
            tp = 2 if "2" in backend_args else 1
            self.assertEqual(h["kv_swap_blocks"]["total"], int(swap_gib * GIB) // (BLOCK_BYTES // tp))
            self.assertEqual(h["kv_blocks"]["used"], 0)
            self.assertIn("swapped out to the host pool", d.output())

    def test_swapping_equals_no_preemption_uni(self):
        self.check_equal_to_reference(["--distributed-executor-backend", "uni"], 0.01, expect_recompute=False)

    def test_swapping_equals_no_preemption_mp(self):
        self.check_equal_to_reference(["--distributed-executor-backend", "mp"], 0.01, expect_recompute=False)

    def test_swapping_equals_no_preemption_mp_tp2(self):
        self.check_equal_to_reference(["--tensor-parallel-size", "2", "--threads", "1"], 0.01, expect_recompute=False)

    def test_full_host_pool_falls_back_to_recompute(self):
        # Room for 2 blocks: some victims are swapped, the rest recomputed; outputs are the same.
        self.check_equal_to_reference(["--distributed-executor-backend", "uni"], 2.5 * BLOCK_BYTES / GIB, expect_recompute=True)

    def test_bad_swap_space_is_refused(self):
        for bad in ["-1", "0.000000001"]:
            with Daemon(f"--swap-space={bad}", wait=False, extra=False) as d:
                self.assertEqual(d.proc.wait(30), 10, d.output())
                self.assertIn("--swap-space", d.output())

    def sleep_cycle(self, backend_args, clearing):
        pool = 128 << 20
        env = {"FD_ENABLE_SWAP_SPACE_CLEARING": "1"} if clearing else {"FD_ENABLE_SWAP_SPACE_CLEARING": "0"}
        with Daemon(*backend_args, "--dynamic-load-weight", *TINY_POOL, "--swap-space", str(pool / GIB), env=env,
                    extra=False) as d:
            body = {"prompt": "Once upon a time", "n": 4, "max_tokens": 60, "temperature": 0}
            rss0 = d.rss()
            status, res = d.post("/v1/sleep?tags=kv_cache")
            self.assertEqual(status, 200, res)
            res = res["result"]
            rss1 = d.rss()
            if clearing:
                self.assertGreaterEqual(res["freed_bytes"]["kv_swap"], pool)
                self.assertGreaterEqual(rss0 - rss1, 0.9 * pool, (rss0, rss1))
                self.assertGreaterEqual(res["rss_before_bytes"] - res["rss_after_bytes"], 0.9 * pool)
            else:
                self.assertNotIn("kv_swap", res["freed_bytes"])
                self.assertLess(rss0 - rss1, pool / 4, (rss0, rss1))  # only the 120 KiB KV pool went
            status, res = d.post("/v1/wakeup?tags=kv_cache")
            self.assertEqual(status, 200, res)
            if clearing:
                self.assertGreaterEqual(d.rss() - rss1, 0.9 * pool)  # mapped (and pre-faulted) again
            # The pool works after wakeup: forced swapping, reference outputs.
            j = d.complete(**body)
            for c in j["choices"]:
                self.assertEqual(c["token_ids"], REF["Once upon a time"]["ids"])
            self.assertGreater(metrics(d)["fdrollout_swap_preemptions_total"], 0)

    def test_startup_log_states_the_pool_bytes_health_reports(self):
        """A probe: the log said "524 blocks = 12.0 MiB" (the mapping, whole huge pages) while /health
        kv_host_tier.capacity_bytes said 10.2 MiB (blocks x block bytes)."""
        with Daemon("--swap-space", "0.01", extra=False) as d:
            cap = d.get("/health")[1]["kv_host_tier"]["capacity_bytes"]
            line = next(x for x in d.output().splitlines() if "host KV swap pool" in x)
            n, b, mib = re.search(r"host KV swap pool (\d+) blocks x (\d+) bytes = ([\d.]+) MiB", line).groups()
            self.assertEqual((int(n) * int(b), int(b), mib), (cap, BLOCK_BYTES, f"{cap / (1 << 20):.1f}"), line)

    def test_sleep_keeps_swap_pool_by_default(self):
        self.sleep_cycle(["--distributed-executor-backend", "uni"], clearing=False)

    def test_sleep_releases_swap_pool_with_clearing_uni(self):
        self.sleep_cycle(["--distributed-executor-backend", "uni"], clearing=True)

    def test_sleep_releases_swap_pool_with_clearing_mp(self):
        self.sleep_cycle(["--distributed-executor-backend", "mp"], clearing=True)


if __name__ == "__main__":
    unittest.main()
