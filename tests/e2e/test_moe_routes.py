"""Rollout routing replay (R3, issue 23, SPEC §10): with --enable-return-routed-experts a request
with "return_routed_experts": true gets, on each choice, `routed_experts` — one row per token the
model ran a forward on (the prompt, then every generated token but the last), each row one list
per sparse MoE layer of the top_k expert ids in the router's order: vLLM's and SGLang's
[seq_len, num_layers, top_k] (vllm/model_executor/layers/fused_moe/routed_experts_capturer.py,
sglang/srt/layers/moe/routed_experts_capturer.py; vLLM sizes `num_layers` by every hidden layer,
fdrollout by the sparse ones, as the SPEC says).

The reference is np_moe.py, the numpy forward written from transformers' Qwen3MoeSparseMoeBlock
(softmax → torch.topk order), run once over prompt + generated[:-1]. The qwen3-moe-like
checkpoint has 3 layers of which layer 1 is dense (mlp_only_layers), so each row holds 2 lists
of 4. Checked: alone, in a batch of other prompts, after another request cached the prompt's
blocks (a routes request recomputes its prefix: cached_tokens 0), streamed (final chunk), in a
chat completion, under recompute and swap preemption, and at tp=2. Bad input: no flag, a dense model, a
non-boolean value → 400 naming why; the daemon keeps serving."""
import os
import shutil
import tempfile
import threading
import time
import unittest

import numpy as np

import np_llama
import np_moe
from fdtest import Daemon, copy_checkpoint, make_checkpoint, perturbed

N_NEW = 8
R3 = ("--enable-return-routed-experts",)
TP2 = ("--tensor-parallel-size", "2", "--threads", "1")
BLOCK_BYTES = 2 * 3 * 16 * 64 * 4  # qwen3-moe-like: K and V x 3 layers x 16 tokens x kv_dim 64 x f32


def prompt_ids(n, seed):
    rng = np.random.default_rng(seed)
    return [1] + [int(x) for x in rng.integers(3, 512, n - 1)]


def routes_of(cfg, w, ids):
    """numpy's routes of a forward over `ids`: [len(ids), n_sparse_layers, top_k] (list form)."""
    per_layer = []
    np_moe.logits(cfg, w, ids, routes=per_layer)
    return np.stack(per_layer, axis=1).tolist()


def body(prompt, **kw):
    return {"prompt": prompt, "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True, "return_routed_experts": True, **kw}


class RoutedExperts(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-moe-r3-")
        cls.ck = make_checkpoint(os.path.join(cls.tmp, "q3"), "--preset", "qwen3-moe-like", "--seed", "20")
        cls.cfg, cls.w = np_llama.load(cls.ck)
        cls.prompts = [prompt_ids(24, 3), prompt_ids(9, 5), prompt_ids(37, 6)]
        cls.want = {}  # prompt index -> (generated ids, routes)
        for i, p in enumerate(cls.prompts):
            gen, _ = np_moe.greedy(cls.cfg, cls.w, p, N_NEW)
            cls.want[i] = (gen, routes_of(cls.cfg, cls.w, p + gen[:-1]))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def check_choice(self, choice, i):
        gen, routes = self.want[i]
        self.assertEqual(choice["token_ids"], gen)
        got = choice["routed_experts"]
        self.assertEqual(len(got), len(self.prompts[i]) + N_NEW - 1)  # prompt rows, then generated but the last
        self.assertEqual([len(r) for r in got], [2] * len(got))      # the 2 sparse layers (layer 1 is dense)
        for t, (g, r) in enumerate(zip(got, routes)):
            self.assertEqual(g, r, f"prompt {i} row {t}")

    def test_routes_equal_numpy_alone_batched_streamed_and_after_a_prefix_cache_hit(self):
        with Daemon(*R3, "--enable-prefix-caching", "--max-num-seqs", "8", model=self.ck) as d:
            alone = d.complete(**body(self.prompts[0]))
            self.check_choice(alone["choices"][0], 0)
            # without the field: no routed_experts at all
            plain = d.complete(**{k: v for k, v in body(self.prompts[0]).items() if k != "return_routed_experts"})
            self.assertNotIn("routed_experts", plain["choices"][0])
            self.assertEqual(plain["usage"]["prompt_tokens_details"]["cached_tokens"], 16)  # the prompt's blocks are cached
            # batched with other prompts (each choice its own routes), n=2, the first prompt's blocks cached:
            # a routes request recomputes its prefix (cached_tokens 0), so its routes are its own forward's
            j = d.complete(**body([self.prompts[1], self.prompts[0], self.prompts[2]], n=2))
            self.assertEqual(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            self.assertEqual(len(j["choices"]), 6)
            for c in j["choices"]:
                self.check_choice(c, [1, 0, 2][c["index"] // 2])
            # streamed: on the finishing chunk only, equal to the whole answer's
            chunks, done = d.stream(**body(self.prompts[2]))
            self.assertTrue(done)
            with_routes = [ch for c in chunks for ch in c.get("choices", []) if "routed_experts" in ch]
            self.assertEqual(len(with_routes), 1)
            self.assertIsNotNone(with_routes[0]["finish_reason"])
            self.assertEqual(with_routes[0]["routed_experts"], self.want[2][1])

    def test_chat_completion_routes_cover_the_rendered_prompt(self):
        tmpl = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        with Daemon(*R3, "--chat-template", tmpl, model=self.ck) as d:
            status, j = d.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Once upon a time"}],
                                                         "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True,
                                                         "return_routed_experts": True})
            self.assertEqual(status, 200, j)
            c = j["choices"][0]
            status, tok = d.post("/tokenize", {"messages": [{"role": "user", "content": "Once upon a time"}]})
            self.assertEqual(status, 200, tok)
        ids = tok["tokens"]
        gen = c["token_ids"]
        self.assertEqual(len(gen), N_NEW)
        self.assertEqual(c["routed_experts"], routes_of(self.cfg, self.w, ids + gen[:-1]))

    def test_routes_survive_recompute_and_swap_preemption(self):
        # 6 blocks cannot hold 4 choices of 24 + 40 tokens (4 blocks each) at once: some are preempted
        # and recomputed, or (with --swap-space) swapped out and back; their routes are those of one
        # uninterrupted forward.
        n_new = 40
        gen, _ = np_moe.greedy(self.cfg, self.w, self.prompts[0], n_new)
        want = routes_of(self.cfg, self.w, self.prompts[0] + gen[:-1])
        swap = ("--swap-space", str(32 * BLOCK_BYTES / (1 << 30)))
        for kind, extra in (("recompute", ()), ("swap", swap)):
            with Daemon(*R3, "--kv-cache-bytes", str(6 * BLOCK_BYTES), "--max-model-len", "80", *extra, model=self.ck) as d:
                j = d.complete(**body(self.prompts[0], max_tokens=n_new, n=4))
                _, metrics = d.get("/metrics")
            pre = [l for l in metrics.splitlines() if l.startswith(f"fdrollout_{kind}_preemptions_total ")][0]
            self.assertGreater(float(pre.split()[1]), 0, kind)
            for c in j["choices"]:
                self.assertEqual(c["token_ids"], gen, kind)
                self.assertEqual(c["routed_experts"], want, kind)

    def test_speculation_leaves_the_routes_unchanged(self):
        """n-gram drafts (repetitive prompts, so drafts are accepted) must not change a rollout,
        routes included: a probe saw a choice that finished inside a verify step with accepted
        drafts return fewer rows (33 for 36) than without speculation."""
        ng = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
        rng = np.random.default_rng(1)
        motif = [int(x) for x in rng.integers(3, 512, 6)]
        prompts = [[1] + motif * 4, [1] + motif[:3] * 5 + [7, 8]]
        with Daemon(*R3, model=self.ck) as plain, Daemon(*R3, "--speculative-config", ng, model=self.ck) as spec:
            for n in (24, 25, 26, 27):
                for p in prompts:
                    a = plain.complete(**body(p, max_tokens=n))["choices"][0]
                    b = spec.complete(**body(p, max_tokens=n))["choices"][0]
                    self.assertEqual(len(b["routed_experts"]), len(p) + n - 1, (n, p[:4]))
                    self.assertEqual((b["token_ids"], b["routed_experts"]), (a["token_ids"], a["routed_experts"]), (n, p[:4]))
            _, h = spec.get("/health")
            self.assertGreater(h["speculative"]["num_accepted_tokens"], 0, h["speculative"])  # drafts were accepted

    def test_rows_before_an_update_under_keep_stay_those_of_the_old_weights(self):
        """pause?mode=keep, update, resume: the kept choice's KV is recomputed with the new
        weights, but each routed_experts row names the weights that computed its step
        (docs/architectures.md): the rows before the switch are the old weights' (a probe saw
        the recompute prefill overwrite them with the new weights' routes)."""
        new = perturbed(self.ck, os.path.join(self.tmp, "new"), seed=9, scale=0.3)
        model = copy_checkpoint(self.ck, os.path.join(self.tmp, "kept"))
        p, m, res = self.prompts[0], 60, {}
        with Daemon(*R3, "--dynamic-load-weight", model=model, env={"FD_DEBUG_STEP_DELAY_MS": "30"}) as d:
            t = threading.Thread(target=lambda: res.update(r=d.post("/v1/completions", body(p, max_tokens=m))))
            t.start()
            time.sleep(0.8)
            self.assertEqual(d.post("/v1/pause?mode=keep")[1]["result"]["kept"], 1)
            copy_checkpoint(new, model)
            self.assertEqual(d.post("/v1/update_weights", {"version": "v2"})[0], 200)
            self.assertEqual(d.post("/v1/resume")[0], 200)
            t.join(120)
        c = res["r"][1]["choices"][0]
        k = c["weight_versions"][1]["first_token"]  # the first token of v2
        rows, n_old = c["routed_experts"], len(p) + k - 1  # rows computed before the switch
        self.assertEqual(len(rows), len(p) + m - 1)
        seq = p + c["token_ids"][:k]
        with Daemon(*R3, model=self.ck) as f:
            old = f.complete(**body(seq, max_tokens=1))["choices"][0]["routed_experts"]
        with Daemon(*R3, model=new) as f:
            nw = f.complete(**body(seq, max_tokens=1))["choices"][0]["routed_experts"]
        self.assertNotEqual(old[:n_old], nw[:n_old], "the perturbation must change the routes")
        self.assertEqual(rows[:n_old], old[:n_old])
        self.assertEqual(rows[n_old], nw[n_old])  # the first row the new weights computed

    def test_tp2_routes_equal_numpy(self):
        with Daemon(*R3, *TP2, model=self.ck) as d:
            j = d.complete(**body([self.prompts[0], self.prompts[1]]))
        for c in j["choices"]:
            self.check_choice(c, c["index"])

    def test_bad_requests_are_400_naming_why_and_the_daemon_keeps_serving(self):
        with Daemon(model=self.ck) as d:  # no flag
            status, j = d.post("/v1/completions", body(self.prompts[1]))
            self.assertEqual(status, 400, j)
            self.assertIn("--enable-return-routed-experts", j["error"]["message"])
            self.assertEqual(j["error"]["param"], "return_routed_experts")
            # false is fine without the flag
            self.assertNotIn("routed_experts", d.complete(**body(self.prompts[1], return_routed_experts=False))["choices"][0])
        with Daemon(*R3, model=self.ck) as d:
            for v in ("yes", 1, [True], {"a": 1}):
                status, j = d.post("/v1/completions", body(self.prompts[1], return_routed_experts=v))
                self.assertEqual(status, 400, (v, j))
                self.assertIn("must be a boolean", j["error"]["message"])
            self.check_choice(d.complete(**body(self.prompts[1]))["choices"][0], 1)
        with Daemon(*R3) as d:  # the default dense model (stories260K)
            status, j = d.post("/v1/completions", {"prompt": "Once", "max_tokens": 2, "return_routed_experts": True})
            self.assertEqual(status, 400, j)
            self.assertIn("mixture-of-experts", j["error"]["message"])
            self.assertEqual(d.complete(prompt="Once", max_tokens=2)["usage"]["completion_tokens"], 2)


if __name__ == "__main__":
    unittest.main()
