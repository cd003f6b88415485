"""The multi-level KV cache (issue #27): with --enable-prefix-caching and --swap-space, prefix
blocks the device pool evicts live on in the host tier and come back instead of being recomputed.

A device pool of 8 blocks (16 tokens each) holds one 80-token prompt and its completion, not two:
asking A, then B and C, evicts A's prefix blocks to the host; asking A again copies them back.
Every completion whose prefix came from the host must equal, bitwise (tokens and logprobs), the
same completion from a daemon without prefix caching (computed from scratch). usage reports the
host-tier tokens apart (prompt_tokens_details.host_cached_tokens, part of cached_tokens), and
/metrics and /health show the tier. Host entries serve only the weight version that computed
them: after an update (one- or two-phase) with the host tier full of old blocks, outputs equal a
fresh daemon on the new version. Sleep keeps the tier (cleared with FD_ENABLE_SWAP_SPACE_CLEARING=1),
vLLM's /reset_prefix_cache and SGLang's /flush_cache clear both tiers unless keep_host_tier=true,
and pause stops tier transfers (/health says so) until resume.

Transfers run in the background (a reused prefix block about to be evicted is copied ahead,
while a step computes): a pause during such a copy (slowed by FD_TEST_KV_COPY_DELAY_MS) answers
only after it landed, and never hangs: past the control timeout it answers 504 and changes
nothing. fdctl flush-cache [--keep-host-tier] flushes over either transport.
"""
import os
import random
import shutil
import tempfile
import time
import unittest

from fdtest import copy_checkpoint, Daemon, fdctl, fresh_daemon, Logprobs, perturbed, STORIES

BLOCK_BYTES = 20480  # stories260K: 2 x 5 layers x 16 tokens x 32 floats x 4 bytes
SMALL_POOL = ["--kv-cache-bytes", str(8 * BLOCK_BYTES), "--max-model-len", "128"]
TIER = ["--enable-prefix-caching", *SMALL_POOL, "--swap-space", str(64 * BLOCK_BYTES / (1 << 30))]


def prompt(seed, n=80):
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 500) for _ in range(n - 1)]


A, B, C = prompt(1), prompt(2), prompt(3)


def body(p):
    return {"prompt": p, "max_tokens": 16, "temperature": 0, "logprobs": 2}


def out(j):
    c = j["choices"][0]
    return c["token_ids"], Logprobs(c["logprobs"]["token_logprobs"]), c["logprobs"]["top_logprobs"]


def metrics(d):
    _, text = d.get("/metrics")
    m = {}
    for line in text.splitlines():
        if line.startswith("fdrollout_") and "{" not in line:
            name, value = line.split()
            m[name] = float(value)
    return m


def evict_a(test, d):
    """A, then B and C: A's prefix blocks leave the device for the host tier."""
    for p in (A, B, C):
        d.complete(**body(p))
    test.assertGreater(d.get("/health")[1]["kv_host_tier"]["cached_blocks"], 0)


class KvTier(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-kvtier-")
        cls.Bw = perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=11)
        with fresh_daemon(STORIES, *SMALL_POOL) as ref:
            cls.ref_a = out(ref.complete(**body(A)))
        with fresh_daemon(cls.Bw, *SMALL_POOL) as ref:
            cls.ref_a_new = out(ref.complete(**body(A)))
        assert cls.ref_a[0] != cls.ref_a_new[0], "the new weights must generate differently"

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def host_hit(self, d):
        """A again: its prefix comes (at least partly) from the host tier; returns the usage details."""
        j = d.complete(**body(A))
        u = j["usage"]["prompt_tokens_details"]
        self.assertEqual(out(j), self.ref_a, "a completion with its prefix from the host tier differs from recompute")
        return u

    def check_exact(self, *args):
        with Daemon(*TIER, *args, extra=False) as d:
            evict_a(self, d)
            m0 = metrics(d)
            u = self.host_hit(d)
            self.assertGreater(u["host_cached_tokens"], 0, u)
            self.assertEqual(u["cached_tokens"], 64, u)  # (80 - 1) // 16 full blocks, device + host
            self.assertEqual(u["cached_tokens"] % 16, 0)
            self.assertEqual(u["host_cached_tokens"] % 16, 0)
            m = metrics(d)
            n_blocks = u["host_cached_tokens"] // 16
            self.assertEqual(m["fdrollout_kv_host_tier_hits_total"] - m0["fdrollout_kv_host_tier_hits_total"], n_blocks)
            self.assertEqual(m["fdrollout_kv_host_tier_in_bytes_total"] - m0["fdrollout_kv_host_tier_in_bytes_total"],
                             n_blocks * BLOCK_BYTES)
            self.assertEqual(m["fdrollout_prompt_tokens_host_cached_total"], u["host_cached_tokens"])
            self.assertGreater(m["fdrollout_kv_host_tier_offloads_total"], 0)
            self.assertEqual(m["fdrollout_kv_host_tier_out_bytes_total"], m["fdrollout_kv_host_tier_offloads_total"] * BLOCK_BYTES)
            # The tier's copies are not preemption swaps.
            self.assertEqual(m["fdrollout_kv_swap_in_bytes_total"], 0)
            h = d.get("/health")[1]["kv_host_tier"]
            self.assertTrue(h["enabled"])
            self.assertEqual(h["cached_bytes"], h["cached_blocks"] * BLOCK_BYTES)
            self.assertFalse(h["transfers_paused"])

    def test_host_hit_equals_recompute_uni(self):
        self.check_exact("--distributed-executor-backend", "uni")

    def test_host_hit_equals_recompute_mp(self):
        self.check_exact("--distributed-executor-backend", "mp")

    def test_preemption_swaps_and_tier_copies_together(self):
        # test_swap's load (12 concurrent requests, n = 2, 60 generated tokens, over 6 device
        # blocks) with prefix caching on: preemption swaps and the tier's copies share the host
        # pool and the steps. Its prompts are 20 tokens here (one full prompt block each): the
        # tier keeps only blocks likely to be reused (prompt blocks, or blocks a lookup hit), and
        # test_swap's short text prompts have no full prompt block, so nothing of theirs would go.
        from test_swap import TINY_POOL, bodies, run_concurrently
        reqs = [{**b, "prompt": prompt(200 + i, 20)} for i, b in enumerate(bodies())]
        with Daemon("--max-model-len", "80", extra=False) as ref:
            want = run_concurrently(ref, reqs)
        with Daemon(*TINY_POOL, "--enable-prefix-caching", "--swap-space", str(24 * BLOCK_BYTES / (1 << 30)), extra=False) as d:
            got = run_concurrently(d, reqs)
            for i, (g, w) in enumerate(zip(got, want)):
                self.assertEqual(g, w, f"request {i} differs")
            m = metrics(d)
            self.assertGreater(m["fdrollout_swap_preemptions_total"], 0, m)
            self.assertGreater(m["fdrollout_kv_host_tier_offloads_total"], 0, m)
            self.assertEqual(m["fdrollout_kv_swap_blocks_used"], 0)
            # hits count first admissions, as usage's host_cached_tokens does; loads every copy back.
            self.assertEqual(m["fdrollout_kv_host_tier_hits_total"] * 16, m["fdrollout_prompt_tokens_host_cached_total"], m)
            self.assertGreaterEqual(m["fdrollout_kv_host_tier_loads_total"], m["fdrollout_kv_host_tier_hits_total"], m)
            self.assertEqual(m["fdrollout_kv_host_tier_in_bytes_total"], m["fdrollout_kv_host_tier_loads_total"] * BLOCK_BYTES, m)

    def test_no_host_field_without_tier(self):
        with Daemon("--enable-prefix-caching", *SMALL_POOL, extra=False) as d:
            j = d.complete(**body(A))
            self.assertNotIn("host_cached_tokens", j["usage"]["prompt_tokens_details"])
            self.assertFalse(d.get("/health")[1]["kv_host_tier"]["enabled"])

    def updated_daemon(self, two_phase):
        src = copy_checkpoint(STORIES, os.path.join(self.tmp, f"src{int(two_phase)}"))
        with Daemon("--dynamic-load-weight", *TIER, model=src, extra=False) as d:
            evict_a(self, d)
            self.assertEqual(out(d.complete(**body(A))), self.ref_a)
            evict_a(self, d)  # the host tier holds A's old-version blocks
            self.assertEqual(d.post("/v1/pause")[0], 200)
            copy_checkpoint(self.Bw, src)
            if two_phase:
                self.assertEqual(d.post("/v1/update_weights", {"version": "b", "commit": False})[0], 200)
                self.assertEqual(d.post("/v1/resume")[0], 200)
                # Still serving the old version: its host entries stay valid and are used.
                u = self.host_hit(d)
                self.assertGreater(u["host_cached_tokens"], 0, u)
                evict_a(self, d)
                self.assertEqual(d.post("/v1/pause")[0], 200)
                self.assertEqual(d.post("/v1/commit_weights", {"version": "b"})[0], 200)
            else:
                self.assertEqual(d.post("/v1/update_weights", {"version": "b"})[0], 200)
            self.assertEqual(d.post("/v1/resume")[0], 200)
            j = d.complete(**body(A))
            self.assertEqual(j["weight_version"], "b")
            self.assertEqual(out(j), self.ref_a_new, "old-version KV served after the update")
            self.assertEqual(j["usage"]["prompt_tokens_details"]["host_cached_tokens"], 0)
            self.assertGreater(metrics(d)["fdrollout_kv_host_tier_invalidated_total"], 0)

    def test_update_never_reuses_old_version_blocks(self):
        self.updated_daemon(two_phase=False)

    def test_two_phase_commit_never_reuses_old_version_blocks(self):
        self.updated_daemon(two_phase=True)

    def test_sleep_keeps_the_tier_unless_clearing(self):
        for clearing in (False, True):
            env = {"FD_ENABLE_SWAP_SPACE_CLEARING": "1" if clearing else "0"}
            with Daemon("--dynamic-load-weight", *TIER, env=env, extra=False) as d:
                evict_a(self, d)
                st, res = d.post("/v1/sleep?tags=kv_cache")
                self.assertEqual(st, 200, res)
                self.assertEqual("kv_swap" in res["result"]["freed_bytes"], clearing)
                self.assertEqual(d.get("/health")[1]["kv_host_tier"]["cached_blocks"] == 0, clearing)
                self.assertEqual(d.post("/v1/wakeup?tags=kv_cache")[0], 200)
                u = self.host_hit(d)
                if clearing:
                    self.assertEqual(u["host_cached_tokens"], 0, u)
                else:
                    self.assertEqual(u["host_cached_tokens"], 64, u)  # the device pool came back empty

    def test_flush_routes_clear_both_tiers_unless_kept(self):
        for route in ("/reset_prefix_cache", "/flush_cache"):
            for keep in (False, True):
                with Daemon(*TIER, extra=False) as d:
                    evict_a(self, d)
                    st, _ = d.post(route + ("?keep_host_tier=true" if keep else ""))
                    self.assertEqual(st, 200)
                    self.assertEqual(d.get("/health")[1]["kv_host_tier"]["cached_blocks"] > 0, keep)
                    u = self.host_hit(d)
                    self.assertEqual(u["cached_tokens"], 64 if keep else 0, (route, keep, u))
                    self.assertEqual(u["host_cached_tokens"], 64 if keep else 0, (route, keep, u))
        with Daemon(*TIER, extra=False) as d:
            st, res = d.post("/reset_prefix_cache?keep_host_tier=maybe")
            self.assertEqual(st, 400, res)

    def test_pause_stops_transfers_resume_restarts(self):
        with Daemon(*TIER, extra=False) as d:
            evict_a(self, d)
            self.assertEqual(d.post("/v1/pause")[0], 200)
            h = d.get("/health")[1]["kv_host_tier"]
            self.assertTrue(h["transfers_paused"])
            self.assertEqual(metrics(d)["fdrollout_kv_host_tier_transfers_paused"], 1)
            self.assertGreater(h["cached_blocks"], 0)  # a pause keeps the tier (same weights)
            self.assertEqual(d.post("/v1/resume")[0], 200)
            self.assertFalse(d.get("/health")[1]["kv_host_tier"]["transfers_paused"])
            u = self.host_hit(d)
            self.assertEqual(u["host_cached_tokens"], 64, u)  # pause flushed the device cache, not the host tier

    def background_copy_in_flight(self, d):
        """A, then B with max_tokens 1: B's one step evicts two of A's five prompt blocks (copied
        at once) and writes the other three ahead in the background; then the engine is idle with
        that copy in flight. Returns when B answered (time.monotonic() before B was sent)."""
        d.complete(**body(A))
        t0 = time.monotonic()
        d.complete(prompt=B, max_tokens=1, temperature=0)
        return t0

    def check_pause_waits(self, *args):
        with Daemon(*TIER, *args, env={"FD_TEST_KV_COPY_DELAY_MS": "3000"}, extra=False) as d:
            t0 = self.background_copy_in_flight(d)
            st, j = d.post("/v1/pause")
            dt = time.monotonic() - t0
            self.assertEqual(st, 200, j)
            self.assertEqual(j["result"]["tier_copies_waited"], 3, j)
            self.assertGreaterEqual(dt, 3.0, "the pause answered before the background copy landed")
            self.assertEqual(d.get("/health")[1]["kv_host_tier"]["transfers_in_flight_blocks"], 0)
            m = metrics(d)
            self.assertEqual(m["fdrollout_kv_host_tier_offloads_background_total"], 3, m)
            self.assertEqual(m["fdrollout_kv_host_tier_offloads_total"], 5, m)
            self.assertEqual(m["fdrollout_kv_host_tier_transfers_in_flight"], 0, m)
            self.assertEqual(d.post("/v1/resume")[0], 200)
            for p in (B, C):  # A leaves the device: all five blocks come from the host, bitwise as recomputed
                d.complete(**body(p))
            u = self.host_hit(d)
            self.assertEqual(u["host_cached_tokens"], 64, u)

    def test_pause_waits_for_background_copies_uni(self):
        self.check_pause_waits("--distributed-executor-backend", "uni")

    def test_pause_waits_for_background_copies_mp(self):
        self.check_pause_waits("--distributed-executor-backend", "mp")

    def test_pause_during_a_transfer_never_hangs(self):
        with Daemon(*TIER, "--control-timeout-s", "2", env={"FD_TEST_KV_COPY_DELAY_MS": "8000"}, extra=False) as d:
            t0 = self.background_copy_in_flight(d)
            st, j = d.post("/v1/pause", timeout=30)
            self.assertEqual(st, 504, j)  # the copy outlasts the control timeout: refused, not hung
            self.assertEqual(j["error"]["type"], "timeout", j)
            self.assertLess(time.monotonic() - t0, 7.5)
            self.assertFalse(d.get("/v1/is_paused")[1]["is_paused"])  # nothing changed
            time.sleep(max(0.0, 8.2 - (time.monotonic() - t0)))
            st, j = d.post("/v1/pause")
            self.assertEqual(st, 200, j)
            self.assertEqual(j["result"]["tier_copies_waited"], 3, j)

    def test_fdctl_flush_cache_keeps_the_host_tier_when_asked(self):
        for transport in ("shm", "v1"):
            for keep in (False, True):
                with Daemon(*TIER, extra=False) as d:
                    evict_a(self, d)
                    held = d.get("/health")[1]["kv_host_tier"]["cached_blocks"]
                    rc, so, se = fdctl(d.port, "--transport", transport, "flush-cache", *(["--keep-host-tier"] if keep else []))
                    self.assertEqual(rc, 0, (transport, keep, so, se))
                    # a probe: --keep-host-tier printed "(0 host KV tier block(s) forgotten)"
                    self.assertEqual(so.strip(), "device prefix cache flushed (host KV tier kept)" if keep else
                                     f"prefix cache flushed ({held} host KV tier block(s) forgotten)")
                    self.assertEqual(d.get("/health")[1]["kv_host_tier"]["cached_blocks"] > 0, keep, (transport, keep))
                    u = self.host_hit(d)
                    self.assertEqual(u["host_cached_tokens"], 64 if keep else 0, (transport, keep, u))
        with Daemon(*TIER, extra=False) as d:
            st, res = d.post("/v1/flush_cache?keep_host_tier=maybe")
            self.assertEqual(st, 400, res)
            st, res = d.post("/v1/flush_cache?keep_host_tier=true")
            self.assertEqual(st, 200, res)
            self.assertEqual(res["result"]["host_blocks_flushed"], 0)

    def test_absurd_swap_space_is_refused_naming_the_numbers(self):
        with Daemon("--swap-space", "100000", wait=False, extra=False) as d:
            self.assertEqual(d.proc.wait(30), 10, d.output())
            self.assertIn("--swap-space 100000", d.output())
            self.assertIn("GiB", d.output())


if __name__ == "__main__":
    unittest.main()
