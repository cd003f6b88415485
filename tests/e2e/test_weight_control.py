"""Weight control over HTTP (SPEC §3): pause/resume/is_paused, update_weights all-or-nothing,
sleep/wakeup by tag with memory really returned to the OS, prefix cache across updates."""
import os
import shutil
import tempfile
import threading
import time
import unittest

import numpy as np

from fdtest import copy_checkpoint, Daemon, device_args, fresh_daemon, GREEDY, greedy, Logprobs, make_checkpoint, merge_stream, perturbed, REF, rewrite_tensors, STORIES

import safetensors_np  # noqa: E402  (on sys.path via fdtest)

# Checks of host memory and of a CPU rank's tags: a run over --device cuda (scripts/gpu_check.sh's
# FD_GPU_EXTRA_E2E) skips them; tests/e2e/test_cuda_*.py measure the device's memory instead.
ON_CUDA = "cuda" in " ".join(device_args())
cpu_only = unittest.skipIf(ON_CUDA, "a CPU rank's check (host memory, CPU tags); this run is over --device cuda")

class WeightControl(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-wc-")
        cls.A = copy_checkpoint(STORIES, os.path.join(cls.tmp, "A"))
        cls.B = perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=11)
        with fresh_daemon(cls.B) as fresh:
            cls.b_out = greedy(fresh)[:2]
        with fresh_daemon(cls.A) as fresh:
            cls.a_out = greedy(fresh)[:2]
        assert cls.a_out[0] != cls.b_out[0], "B must generate differently from A"

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def source(self, name):
        """A fresh writable copy of A to serve from, so tests can swap files under the daemon."""
        return copy_checkpoint(self.A, os.path.join(self.tmp, name))

    def ok(self, d, method, path, body=None):
        status, j = d.request(method, path, body)
        self.assertEqual(status, 200, j)
        self.assertEqual(j["status"], "success")
        return j["result"]

    def err(self, d, method, path, status, etype, body=None):
        got, j = d.request(method, path, body)
        self.assertEqual(got, status, j)
        self.assertEqual(j["status"], "error")
        self.assertEqual(j["error"]["type"], etype)
        self.assertGreater(len(j["error"]["message"]), 10)
        return j

    def test_pause_resume_are_idempotent(self):
        with Daemon() as d:
            seen = []
            for method, path in [("GET", "/v1/is_paused"), ("POST", "/v1/pause"), ("POST", "/v1/pause"),
                                 ("GET", "/v1/is_paused"), ("POST", "/v1/resume"), ("POST", "/v1/resume"),
                                 ("GET", "/v1/is_paused")]:
                status, j = d.request(method, path)
                self.assertEqual(status, 200, j)
                if path == "/v1/is_paused":
                    seen.append(j["is_paused"])
            self.assertEqual(seen, [False, True, False])
            self.assertEqual(d.complete(prompt="Lily and Tom", max_tokens=60, temperature=0)["choices"][0]["token_ids"],
                             REF["Lily and Tom"]["ids"])

    def test_pause_aborts_running_and_queued_requests(self):
        with Daemon("--max-num-seqs", "8") as d:
            want = d.complete(prompt="Once upon a time", max_tokens=400, temperature=0, ignore_eos=True)["choices"][0]["token_ids"]
            body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "n": 12}
            out = {}
            t1 = threading.Thread(target=lambda: out.__setitem__("stream", d.stream(**body)))
            t2 = threading.Thread(target=lambda: out.__setitem__("plain", d.post("/v1/completions", body)))
            t1.start(); t2.start()
            deadline = time.time() + 10
            def queued():
                h = d.get("/health")[1]
                return h["num_requests_running"] + h["num_requests_waiting"]

            while time.time() < deadline and queued() < 24:  # both requests admitted: 8 running, 16 waiting
                time.sleep(0.002)
            res = self.ok(d, "POST", "/v1/pause")
            self.assertEqual(res["aborted"], 24)  # 8 running + 16 queued
            t1.join(30); t2.join(30)
            chunks, done = out["stream"]
            self.assertTrue(done)
            status, plain = out["plain"]
            self.assertEqual(status, 200)
            choices = list(merge_stream(chunks).values()) + plain["choices"]
            self.assertEqual(len(choices), 24)
            for c in choices:
                self.assertEqual(c["finish_reason"], "abort")
                self.assertLess(len(c["token_ids"]), 400)
                self.assertEqual(c["token_ids"], want[:len(c["token_ids"])])
            _, h = d.get("/health")
            self.assertEqual(h["kv_blocks"]["used"], 0)
            self.assertEqual(h["state"], "paused")
            t0 = time.time()
            status, j = d.post("/v1/completions", {"prompt": "Lily", "max_tokens": 2})
            self.assertLess(time.time() - t0, 1.0)
            self.assertEqual(status, 503)
            self.assertEqual(j["error"]["type"], "engine_paused")
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(d.complete(prompt="Once upon a time", max_tokens=400, temperature=0, ignore_eos=True)["choices"][0]["token_ids"], want)

    def test_update_weights_equals_a_fresh_daemon_on_the_new_checkpoint(self):
        # persistent: the previous weights' arena is the next staging area (two updates swap
        # it back and forth); transient: staging mapped per update.
        for staging in ("persistent", "transient"):
            with self.subTest(staging):
                self.update_to_b_and_back(staging)

    def update_to_b_and_back(self, staging):
        src = self.source("upd-" + staging)
        with Daemon("--dynamic-load-weight", "--update-staging", staging, model=src) as d:
            self.assertEqual(greedy(d)[:2], self.a_out)
            self.err(d, "POST", "/v1/update_weights", 409, "wrong_state", {"version": "b1"})  # not paused
            self.assertEqual(greedy(d), (*self.a_out, "0"))
            self.ok(d, "POST", "/v1/pause")
            copy_checkpoint(self.B, src)
            res = self.ok(d, "POST", "/v1/update_weights", {"version": "b1", "verify_checksum": False})
            self.assertEqual(res["version"], "b1")
            self.assertTrue(res["is_paused"])  # never resumes by itself
            header, data_start = safetensors_np.read_header(os.path.join(src, "model.safetensors"))
            self.assertEqual(res["bytes"], os.path.getsize(os.path.join(src, "model.safetensors")) - data_start)
            r0 = res["ranks"][0]
            self.assertEqual((r0["rank"], r0["version"]), (0, "b1"))
            self.assertAlmostEqual(r0["total_cost"], r0["sync_cost"] + r0["update_cost"], places=6)
            self.assertEqual(d.post("/v1/completions", GREEDY)[0], 503)
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.b_out, "b1"))
            self.assertEqual(d.get("/v1/models")[1]["data"][0]["weight_version"], "b1")
            self.assertEqual(d.get("/health")[1]["weight_version"], "b1")
            chunks, _ = d.stream(**GREEDY)
            self.assertTrue(all(c["weight_version"] == "b1" for c in chunks))
            # version from version.yaml when the request has none; bad versions are 400
            self.ok(d, "POST", "/v1/pause")
            copy_checkpoint(self.A, src)
            with open(os.path.join(src, "version.yaml"), "w") as f:
                f.write("step: 77\n")
            for bad in ["..", ".", "a/b", "x" * 129, "sp ace", ""]:
                self.err(d, "POST", "/v1/update_weights", 400, "invalid_argument", {"version": bad})
            for bad in [5.5, -5, True, ["7"]]:  # an integer step is its decimal string (issue #26); other values are 400
                self.err(d, "POST", "/v1/update_weights", 400, "invalid_argument", {"version": bad})
            self.assertEqual(self.ok(d, "POST", "/v1/update_weights")["version"], "77")
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.a_out, "77"))

    def test_a_bad_checkpoint_is_rejected_and_the_old_weights_keep_serving(self):
        src = self.source("bad")
        with Daemon("--dynamic-load-weight", model=src) as d:
            self.ok(d, "POST", "/v1/pause")
            variants = {
                "truncated": lambda: os.truncate(os.path.join(src, "model.safetensors"), 600000),
                "wrong shape": lambda: rewrite_tensors(src, lambda t: t.__setitem__("model.norm.weight", np.ones(65, np.float32))),
                "wrong dtype": lambda: rewrite_tensors(src, lambda t: None, dtype="F16"),
                "missing": lambda: rewrite_tensors(src, lambda t: t.pop("model.layers.3.mlp.up_proj.weight")),
                "extra": lambda: rewrite_tensors(src, lambda t: t.__setitem__("model.layers.9.mystery.weight", np.ones(4, np.float32))),
            }
            for name, make in variants.items():
                with self.subTest(name):
                    copy_checkpoint(self.B, src)  # a valid B underneath, then break it
                    make()
                    j = self.err(d, "POST", "/v1/update_weights", 422, "invalid_checkpoint", {"version": "broken"})
                    self.assertIn("model.safetensors", j["error"]["message"])
                    self.assertEqual(d.get("/health")[1]["weight_version"], "0")
            self.ok(d, "POST", "/v1/resume")
            self.assertEqual(greedy(d), (*self.a_out, "0"))

    @cpu_only
    def test_sleep_returns_memory_and_wakeup_restores_outputs(self):
        with Daemon("--dynamic-load-weight", "--kv-cache-bytes", "64MiB") as d:
            before = greedy(d)
            rss_start = d.rss()  # the daemon and its rank processes (mp)
            res = self.ok(d, "POST", "/v1/sleep")
            freed = res["freed_bytes"]["weight"] + res["freed_bytes"]["kv_cache"]
            self.assertEqual(sorted(res["tags"]), ["kv_cache", "weight"])
            self.assertGreaterEqual(freed, 64 << 20)
            drop = rss_start - d.rss()
            self.assertGreaterEqual(drop, 0.9 * freed, (rss_start, drop, freed))
            self.assertGreaterEqual(res["rss_before_bytes"] - res["rss_after_bytes"], 0.9 * freed)
            status, j = d.post("/v1/completions", GREEDY)
            self.assertEqual(status, 503)
            h = d.get("/health")[1]
            self.assertEqual((h["state"], sorted(h["sleeping_tags"]), h["weights_valid"]), ("sleeping", ["kv_cache", "weight"], False))
            self.err(d, "POST", "/v1/resume", 409, "wrong_state")
            self.ok(d, "POST", "/v1/sleep")  # idempotent
            res = self.ok(d, "POST", "/v1/wakeup")
            self.assertFalse(res["is_paused"])  # wakeup resumes
            self.assertEqual(greedy(d), before)
            rss_after_first = d.rss()
            for _ in range(20):
                self.ok(d, "POST", "/v1/sleep?tags=weight,kv_cache")
                self.ok(d, "POST", "/v1/wakeup?tags=kv_cache,weight")
            self.assertEqual(greedy(d), before)
            self.assertLess(d.rss(), rss_after_first + (4 << 20))

    @cpu_only
    def test_sleep_hands_back_the_steps_activations_and_kernel_scratch(self):
        # A long prefill grows the step's activation buffers and the kernels' per-thread scratch
        # (tens of MiB on this 256-wide model at 1,500 tokens). A weight sleep must hand those back
        # too: after it, the daemon that served the long prompt holds no more than one that served
        # a short one (both asleep), and its sleep result counts what it gave back.
        ck = make_checkpoint(os.path.join(self.tmp, "wide"), "--hidden", "256", "--intermediate", "1024", "--layers", "2",
                             "--heads", "4", "--max-pos", "2048", "--seed", "5")
        long_prompt = {"prompt": [int(t) for t in np.random.default_rng(1).integers(3, 500, 1500)], "max_tokens": 2, "temperature": 0}
        after = {}
        for name, body in (("short", {**long_prompt, "prompt": long_prompt["prompt"][:8]}), ("long", long_prompt)):
            with Daemon("--dynamic-load-weight", "--kv-cache-bytes", "32MiB", "--max-model-len", "2048", model=ck) as d:
                status, j = d.post("/v1/completions", body)
                self.assertEqual(status, 200, j)
                rss_served = d.rss()
                res = self.ok(d, "POST", "/v1/sleep")
                after[name] = (rss_served, d.rss(), res["freed_bytes"]["weight"])
                self.ok(d, "POST", "/v1/wakeup")
                status, j2 = d.post("/v1/completions", body)  # the buffers grow again: the same answer
                self.assertEqual((status, j2["choices"][0]["text"]), (200, j["choices"][0]["text"]))
        (short_served, short_asleep, short_freed), (long_served, long_asleep, long_freed) = after["short"], after["long"]
        self.assertGreater(long_served - short_served, 16 << 20, after)  # the long prefill's scratch is there to free
        self.assertLess(long_asleep - short_asleep, 4 << 20, after)
        self.assertGreater(long_freed - short_freed, 0.8 * (long_served - short_served), after)

    def test_sleep_tags(self):
        src = self.source("tags")
        with Daemon("--dynamic-load-weight", model=src) as d:
            for bad in ["weights", "kv", "weight,gpu", "all"]:
                self.err(d, "POST", f"/v1/sleep?tags={bad}", 400, "invalid_argument")
            self.err(d, "POST", "/v1/sleep?level=1", 400, "invalid_argument")  # vLLM's parameter: refused, not guessed
            state = {"is_paused": False, "pause_draining": False, "sleeping_tags": [], "weights_valid": True, "weight_version": "0"}
            got = d.get("/v1/is_paused")[1]
            self.assertTrue(got.pop("request_id").startswith("ctrl-"))
            self.assertEqual(got, {**state, "status": "success", "result": state})
            res = self.ok(d, "POST", "/v1/sleep?tags=%20weight%20")
            self.assertEqual((res["tags"], list(res["freed_bytes"])), (["weight"], ["weight"]))
            res = self.ok(d, "POST", "/v1/sleep?tags=weight,kv_cache")  # weight skipped, kv still processed
            self.assertEqual((res["tags"], res["skipped"]), (["kv_cache"], ["weight"]))
            copy_checkpoint(self.B, src)  # wakeup must really reload from the source
            res = self.ok(d, "POST", "/v1/wakeup?tags=")  # empty = both
            self.assertEqual(sorted(res["tags"]), ["kv_cache", "weight"])
            self.assertEqual(greedy(d)[:2], self.b_out)
            # an update while the weights are released loads them at once: its result says the
            # weight tag is awake (docs/weight_control.md; it had no `tags`)
            self.ok(d, "POST", "/v1/sleep")
            copy_checkpoint(self.A, src)
            res = self.ok(d, "POST", "/v1/update_weights", {"version": "a5"})
            self.assertEqual((res["version"], res["tags"]), ("a5", ["weight"]))
            self.assertEqual(d.get("/health")[1]["sleeping_tags"], ["kv_cache"])
            res = self.ok(d, "POST", "/v1/update_weights", {"version": "a6"})  # awake now: an ordinary update, no tags
            self.assertNotIn("tags", res)

    def test_a_wakeup_that_woke_nothing_keeps_the_pause(self):
        """FastDeploy's wakeup resumes once it succeeds ((pause) -> sleep -> wakeup -> (resume));
        one that woke no tag (a retry: every tag already awake) leaves an explicit pause as it
        was, also through the peers' wakeup routes (a probe: pause?mode=wait, then a wakeup,
        answered is_paused false and generated again on the weights the pause was for)."""
        with Daemon("--dynamic-load-weight") as d:
            for mode in ("wait", "keep", "abort"):
                with self.subTest(mode=mode):
                    self.ok(d, "POST", f"/v1/pause?mode={mode}")
                    res = self.ok(d, "POST", "/v1/wakeup")
                    self.assertEqual((res["tags"], sorted(res["skipped"]), res["is_paused"]), ([], ["kv_cache", "weight"], True))
                    self.assertEqual(d.post("/wake_up")[0], 200)  # vLLM
                    self.assertEqual(d.post("/resume_memory_occupation", {})[0], 200)  # SGLang
                    h = d.get("/health")[1]
                    self.assertEqual((h["state"], h["is_paused"], h["pause_mode"]), ("paused", True, mode), h)
                    self.assertEqual(d.post("/v1/completions", {"prompt": "Lily", "max_tokens": 2})[0], 503)
                    self.ok(d, "POST", "/v1/resume")
            # a wakeup that wakes a tag still resumes when none sleeps after it
            self.ok(d, "POST", "/v1/sleep?tags=kv_cache")
            res = self.ok(d, "POST", "/v1/wakeup")
            self.assertEqual((res["tags"], res["is_paused"]), (["kv_cache"], False))
            self.assertEqual(d.get("/health")[1]["state"], "serving")
            # cuda_graph is no sleeping state, but its wakeup after a sleep(cuda_graph) is that
            # sleep's counterpart and resumes (tests/e2e/test_cuda_graph_sleep.py); a retried one does not
            self.ok(d, "POST", "/v1/sleep?tags=cuda_graph")
            self.assertFalse(self.ok(d, "POST", "/v1/wakeup?tags=cuda_graph")["is_paused"])
            self.ok(d, "POST", "/v1/pause?mode=keep")
            self.assertTrue(self.ok(d, "POST", "/v1/wakeup?tags=cuda_graph")["is_paused"])
            self.assertEqual(d.get("/health")[1]["pause_mode"], "keep")

    def test_kv_cache_wakeup_reports_the_serving_version_per_rank(self):
        """A kv_cache-only wakeup loads no weights: each rank serves the version it served (a probe:
        ranks[].version was "" beside "version": "0")."""
        with Daemon("--dynamic-load-weight") as d:
            self.ok(d, "POST", "/v1/sleep?tags=kv_cache")
            res = self.ok(d, "POST", "/v1/wakeup?tags=kv_cache")
            self.assertEqual((res["tags"], res["version"], res["bytes"]), (["kv_cache"], "0", 0), res)
            self.assertEqual([r["version"] for r in res["ranks"]], ["0"] * len(res["ranks"]), res)
            self.assertTrue(res["ranks"], res)

    def test_use_cudagraph_wakes_the_tags_in_either_order(self):
        """Issue #26: SGLang's staged resume (weights, then kv_cache + cuda_graph) works with
        --use-cudagraph (it was a 409); the engine serves once both tags are back."""
        with Daemon("--dynamic-load-weight", "--use-cudagraph") as d:
            before = greedy(d)
            for first, last in [("weight", "kv_cache"), ("kv_cache", "weight")]:
                with self.subTest(first=first):
                    self.ok(d, "POST", "/v1/sleep")
                    self.assertTrue(self.ok(d, "POST", f"/v1/wakeup?tags={first}")["is_paused"])
                    self.assertEqual(d.get("/health")[1]["sleeping_tags"], [last])
                    self.err(d, "POST", "/v1/resume", 409, "wrong_state")  # one tag still asleep
                    self.assertFalse(self.ok(d, "POST", f"/v1/wakeup?tags={last}")["is_paused"])
                    self.assertEqual(greedy(d), before)

    @cpu_only
    def test_cuda_graph_tag_on_cpu(self):
        """Issue #26: the cuda_graph tag is real (tests/e2e/test_cuda_graph_sleep.py frees the
        graphs on CUDA); a CPU rank has no graphs: 0 bytes, listed as done, not a sleeping state.
        No tags still means weight + kv_cache only."""
        with Daemon("--dynamic-load-weight", "--use-cudagraph") as d:
            before = greedy(d)
            res = self.ok(d, "POST", "/v1/sleep?tags=cuda_graph")
            self.assertEqual((res["tags"], res["skipped"], res["freed_bytes"]), (["cuda_graph"], [], {"cuda_graph": 0}))
            self.assertEqual(d.get("/health")[1]["sleeping_tags"], [])
            self.assertTrue(d.get("/health")[1]["is_paused"])
            self.ok(d, "POST", "/v1/resume")  # nothing asleep: resume is not refused
            self.assertEqual(greedy(d), before)
            res = self.ok(d, "POST", "/v1/sleep")
            self.assertEqual(sorted(res["freed_bytes"]), ["kv_cache", "weight"])
            res = self.ok(d, "POST", "/v1/wakeup?tags=kv_cache,cuda_graph,weight")
            self.assertEqual((res["tags"], res["is_paused"]), (["kv_cache", "weight", "cuda_graph"], False))
            self.assertEqual(greedy(d), before)
            res = self.ok(d, "POST", "/v1/sleep", {"tags": ["weight", "kv_cache", "cuda_graph"]})
            self.assertEqual(res["tags"], ["kv_cache", "weight", "cuda_graph"])
            self.ok(d, "POST", "/v1/wakeup?tags=weight")
            self.ok(d, "POST", "/v1/wakeup?tags=cuda_graph,kv_cache")
            self.assertEqual(greedy(d), before)
            self.err(d, "POST", "/v1/sleep?tags=cuda_graphs", 400, "invalid_argument")

    def test_control_routes_need_dynamic_load_weight(self):
        with Daemon() as d:
            for path in ["/v1/sleep", "/v1/wakeup", "/v1/update_weights"]:
                self.err(d, "POST", path, 404, "not_found")
            self.assertEqual(d.get("/health")[1]["state"], "serving")
            self.ok(d, "POST", "/v1/pause")
            self.ok(d, "POST", "/v1/resume")

    def test_prefix_cache_is_flushed_by_an_update(self):
        src = self.source("prefix")
        prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
        with Daemon("--dynamic-load-weight", "--enable-prefix-caching", model=src) as d, fresh_daemon(self.B) as fresh_b:
            d.complete(prompt=prompt, max_tokens=5, temperature=0)
            j = d.complete(prompt=prompt, max_tokens=5, temperature=0)
            self.assertGreater(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            self.ok(d, "POST", "/v1/pause")
            copy_checkpoint(self.B, src)
            self.ok(d, "POST", "/v1/update_weights", {"version": "b"})
            self.ok(d, "POST", "/v1/resume")
            j = d.complete(prompt=prompt, max_tokens=20, temperature=0, logprobs=1)
            self.assertEqual(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            want = fresh_b.complete(prompt=prompt, max_tokens=20, temperature=0, logprobs=1)
            self.assertEqual(j["choices"][0]["token_ids"], want["choices"][0]["token_ids"])
            self.assertEqual(Logprobs(j["choices"][0]["logprobs"]["token_logprobs"]), want["choices"][0]["logprobs"]["token_logprobs"])
            self.assertEqual(j["choices"][0]["logprobs"]["tokens"], want["choices"][0]["logprobs"]["tokens"])
            self.assertEqual([sorted(t) for t in j["choices"][0]["logprobs"]["top_logprobs"]],
                             [sorted(t) for t in want["choices"][0]["logprobs"]["top_logprobs"]])

    def test_metrics_show_state_and_control_counters(self):
        with Daemon("--dynamic-load-weight") as d:
            self.ok(d, "POST", "/v1/pause")
            self.ok(d, "POST", "/v1/sleep?tags=kv_cache")
            _, m = d.get("/metrics")
            for line in ["fdrollout_paused 1", 'fdrollout_sleeping{tag="kv_cache"} 1', 'fdrollout_sleeping{tag="weight"} 0',
                         'fdrollout_control_ops_total{op="pause"} 1', 'fdrollout_control_ops_total{op="sleep"} 1',
                         'fdrollout_weight_version_info{weight_version="0"} 1', "fdrollout_model_weights_status -2"]:
                self.assertIn(line, m)
            self.err(d, "POST", "/v1/resume", 409, "wrong_state")
            self.assertIn('fdrollout_control_errors_total{op="resume"} 1', d.get("/metrics")[1])


if __name__ == "__main__":
    unittest.main()
