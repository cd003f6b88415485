"""Speculative decoding never changes a rollout (--speculative-config, SPEC §11, issue #24).

A daemon with n-gram speculation and one without serve the same requests: greedy tokens, text,
finish reasons, token logprobs, top_logprobs and prompt_logprobs are equal bit for bit (same JSON
floats), alone and batched with plain and sampled requests, at tp=1 and tp=2, across preemption
(swap and recompute) and a pause?mode=keep; a seeded sampled request gives the same tokens with
and without speculation and is reproducible; at a drafted position the sampled tokens follow the
target's probabilities (chi-square over many seeds); the acceptance counters move (/metrics,
/health), and across many weight updates /metrics keeps the per-version series of the last few
versions while vLLM's totals count all. Bad configs are start-up errors naming the field.
"""
import json
import math
import threading
import time
import unittest

from fdtest import Daemon, in_parallel

# disable_by_batch_size 0: speculate at every batch size, so batched steps mix speculating and plain sequences.
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                   "disable_by_batch_size": 0})
# stories260K continues this with the same sentence again: drafts from the prompt are accepted.
REPETITIVE = ("Tom and Lily played with the ball. They were happy. Tom and Lily played with the ball. "
              "They were happy. Tom and Lily played with the")
PROMPTS = ["Once upon a time", "Lily and Tom", REPETITIVE, "The little dog"]


def greedy_bodies():
    """Greedy requests whose every returned field must not change: logprobs with top 5, prompt
    logprobs, a stop string, a stop token id and max_tokens landing inside accepted drafts."""
    out = []
    for i, p in enumerate(PROMPTS):
        out.append({"prompt": p, "max_tokens": 40 + 7 * i, "temperature": 0, "logprobs": 5, "ignore_eos": True})
    out.append({"prompt": REPETITIVE, "max_tokens": 9, "temperature": 0, "logprobs": 2, "prompt_logprobs": 3})
    # "saw a" comes some 15 tokens in (after accepted drafts); "happy" never came: that case did not stop
    out.append({"prompt": REPETITIVE, "max_tokens": 60, "temperature": 0, "logprobs": 1, "stop": ["saw a"]})
    out.append({"prompt": REPETITIVE, "max_tokens": 60, "temperature": 0, "stop_token_ids": [13], "ignore_eos": True})
    out.append({"prompt": "Lily and Tom", "max_tokens": 60, "temperature": 0, "logprobs": 1})  # EOS allowed
    out.append({"prompt": REPETITIVE, "max_tokens": 30, "temperature": 0, "repetition_penalty": 1.3, "logprobs": 1})
    return out


def sampled_bodies():
    return [{"prompt": REPETITIVE, "n": 8, "max_tokens": 30, "temperature": 0.8, "top_p": 0.95, "seed": 11, "logprobs": 1},
            {"prompt": "Once upon a time", "n": 4, "max_tokens": 30, "temperature": 1.1, "top_k": 20, "seed": 5,
             "presence_penalty": 0.5, "logprobs": 1}]


def ngram_reference(tokens, lo, hi, k):
    """vLLM's prompt lookup, written here independently of the C++ proposer: the longest suffix
    n-gram (n from hi down to lo) found earlier in `tokens`, first occurrence; the <= k tokens after it."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == tokens[len(tokens) - n:]:
                return tokens[i + n:i + n + k]
    return []


def choices(d, body):
    """The response's choices (index order), everything they carry."""
    j = d.complete(**body)
    return sorted(j["choices"], key=lambda c: c["index"])


def concurrently(d, reqs):
    return in_parallel(lambda body: choices(d, body), reqs)


def series(m, name):
    """The value of `name` whatever its labels (one series)."""
    return next(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def metrics(d):
    """{series (with labels): value} of /metrics."""
    out = {}
    for line in d.get("/metrics")[1].splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def spec_totals(d):
    m = metrics(d)
    pick = lambda fam: sum(v for k, v in m.items() if k.startswith(fam + "{"))
    return {"drafts": pick("fdrollout_spec_decode_num_drafts_total"),
            "proposed": pick("fdrollout_spec_decode_num_draft_tokens_total"),
            "accepted": pick("fdrollout_spec_decode_num_accepted_tokens_total"),
            "tokens": series(m, "fdrollout_generation_tokens_total"), "forwards": m["fdrollout_sequence_forwards_total"]}


class SpeculativeEqual(unittest.TestCase):
    """Plain and speculating daemons, tp=1 (setUpClass) — the reference is the plain one."""

    @classmethod
    def setUpClass(cls):
        cls.plain = Daemon("--max-logprobs", "512")
        cls.spec = Daemon("--max-logprobs", "512", "--speculative-config", SPEC)

    @classmethod
    def tearDownClass(cls):
        cls.spec.stop()
        cls.plain.stop()

    def test_greedy_alone_equal_and_drafts_accepted(self):
        before = spec_totals(self.spec)
        for body in greedy_bodies():
            with self.subTest(body=body):
                want = choices(self.plain, body)
                self.assertEqual(choices(self.spec, body), want)
                if "stop" in body:
                    self.assertEqual(want[0]["finish_reason"], "stop", want)
        after = spec_totals(self.spec)
        self.assertGreater(after["drafts"], before["drafts"])
        self.assertGreater(after["accepted"], before["accepted"] + 20, (before, after))
        self.assertLessEqual(after["accepted"], after["proposed"])
        # speculation paid: fewer target forwards than tokens
        self.assertGreater((after["tokens"] - before["tokens"]) / (after["forwards"] - before["forwards"]), 1.2, (before, after))
        h = self.spec.get("/health")[1]["speculative"]
        self.assertEqual((h["method"], h["num_speculative_tokens"]), ("ngram", 3))
        self.assertGreater(h["acceptance_rate"], 0.0)
        self.assertLessEqual(h["acceptance_rate"], 1.0)
        self.assertAlmostEqual(h["mean_accepted_length"], 1 + h["num_accepted_tokens"] / h["num_drafts"])
        m = metrics(self.spec)
        self.assertEqual(m['vllm:spec_decode_num_accepted_tokens_total{model_name="stories260K"}'], after["accepted"])
        self.assertEqual(self.plain.get("/health")[1]["speculative"], {"method": "none"})
        self.assertEqual(spec_totals(self.plain)["drafts"], 0)

    def test_batched_with_plain_and_sampled_requests_equal(self):
        reqs = greedy_bodies() + sampled_bodies()
        alone = [choices(self.plain, r) for r in reqs]
        for _ in range(2):
            together = concurrently(self.spec, reqs)
            for i, r in enumerate(reqs):
                self.assertEqual(together[i], alone[i], f"request {i} differs batched under speculation: {r}")

    def test_seeded_sampling_same_tokens_and_reproducible(self):
        body = {"prompt": REPETITIVE, "n": 48, "max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "min_p": 0.02,
                "seed": 1234, "logprobs": 1}
        before = spec_totals(self.spec)
        a, b = choices(self.spec, body), choices(self.spec, body)
        self.assertEqual(a, b)  # reproducible
        self.assertEqual(a, choices(self.plain, body))  # and the very tokens a run without speculation samples
        after = spec_totals(self.spec)
        self.assertGreater(after["accepted"], before["accepted"])
        self.assertGreater(after["proposed"] - after["accepted"], before["proposed"] - before["accepted"])  # rejections too

    def test_drafted_position_follows_target_distribution(self):
        """Choices of 3 tokens at temperature 2: after the first token the step verifies one
        draft (for the first token this prompt makes likely, the n-gram proposer — re-implemented
        below as the reference — drafts the token the story continues with, p ~ 0.7 at this
        temperature). The second token's frequencies in that group match the target's
        probabilities there, softmax(logprob / T) over the whole vocabulary (logprobs 512: the raw
        logits' log-softmax), by chi-square. Skipping the rejection correction (a rejected draft
        resampled from p itself, the draft included) over-weights the draft and fails it."""
        prompt = "Once upon a time, there was a little girl. Once upon a time, there was a little"
        temperature, n, per_request = 2.0, 1000, 125  # n <= 128 per request
        before = spec_totals(self.spec)
        cs = []
        for seed in range(n // per_request):
            cs += choices(self.spec, {"prompt": prompt, "n": per_request, "max_tokens": 3, "temperature": temperature,
                                      "seed": 77 + seed, "logprobs": 512, "return_tokens_as_token_ids": True, "ignore_eos": True})
        after = spec_totals(self.spec)
        groups = {}
        for c in cs:
            groups.setdefault(c["token_ids"][0], []).append(c)
        drafted = {t: g for t, g in groups.items() if ngram_reference(g[0]["prompt_token_ids"] + [t], 1, 3, 1)}
        t1, group = max(drafted.items(), key=lambda kv: len(kv[1]))
        draft = ngram_reference(group[0]["prompt_token_ids"] + [t1], 1, 3, 1)[0]
        self.assertGreaterEqual(after["drafts"] - before["drafts"], sum(len(g) for g in drafted.values()), (before, after))
        self.assertGreater(len(group), 150)
        top = group[0]["logprobs"]["top_logprobs"][1]
        for c in group:  # the target's distribution at position 1 is the same for the whole group
            self.assertEqual(c["logprobs"]["top_logprobs"][1], top)
        self.assertEqual(len(top), 512)
        z = sum(math.exp(v / temperature) for v in top.values())
        probs = {int(k.split(":")[1]): math.exp(v / temperature) / z for k, v in top.items()}
        self.assertTrue(0.2 < probs[draft] < 0.95, probs[draft])  # a draft the correction matters for
        counts = {}
        for c in group:
            counts[c["token_ids"][1]] = counts.get(c["token_ids"][1], 0) + 1
        m = len(group)
        bins, other_p, other_n = [], 0.0, 0
        for tok, p in probs.items():
            if p * m >= 5:
                bins.append((p * m, counts.get(tok, 0)))
            else:
                other_p += p
                other_n += counts.get(tok, 0)
        bins.append((other_p * m, other_n))
        chi2 = sum((o - e) ** 2 / e for e, o in bins if e > 0)
        df = len(bins) - 1
        # chi-square critical value at p = 0.001 (Wilson-Hilferty)
        z = 3.090
        crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
        print(f"drafted position: {m} samples, p(draft) {probs[draft]:.3f}, draft seen {counts.get(draft, 0)}, "
              f"chi2 {chi2:.1f} < {crit:.1f} (df {df})", flush=True)
        self.assertGreaterEqual(df, 1, bins)
        self.assertLess(chi2, crit, f"chi2 {chi2:.1f} >= {crit:.1f} (df {df}): {bins}")

    def test_bad_configs_are_start_up_errors_naming_the_field(self):
        cases = [('{"method": "eagle", "num_speculative_tokens": 2}', "speculative_config.method"),
                 ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
                 ('{"method": "ngram", "num_speculative_tokens": 999}', "speculative_config.num_speculative_tokens"),
                 ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
                  "prompt_lookup_min 5 exceeds prompt_lookup_max 2"),
                 ('{"method": "mtp", "num_speculative_tokens": 1}', "num_nextn_predict_layers"),
                 ('{"method": "ngram", "k": 2}', "speculative_config.k"),
                 ('ngram', "--speculative-config is not valid JSON")]
        for cfg, want in cases:
            with self.subTest(cfg=cfg):
                d = Daemon("--speculative-config", cfg, wait=False, extra=False)
                try:
                    self.assertNotEqual(d.proc.wait(60), 0)
                    self.assertIn(want, d.output())
                finally:
                    d.stop()


class SpeculativeAcrossPreemptionAndKeep(unittest.TestCase):
    def test_preemption_swap_and_recompute_equal(self):
        # 6 KV blocks of 16 tokens: these requests preempt each other over and over.
        tiny = ["--kv-cache-bytes", str(6 * 20480), "--max-model-len", "96"]
        reqs = [{"prompt": p, "n": 2, "max_tokens": 50, "temperature": 0, "logprobs": 2, "ignore_eos": True} for p in PROMPTS]
        with Daemon("--max-model-len", "96", extra=False) as ref:
            want = [choices(ref, r) for r in reqs]
        for extra in (["--swap-space", "0.001"], []):  # swap, then recompute (no pool)
            with self.subTest(extra=extra), Daemon(*tiny, *extra, "--speculative-config", SPEC, extra=False) as d:
                self.assertEqual(concurrently(d, reqs), want)
                m = metrics(d)
                self.assertGreater(m["fdrollout_preemptions_total"], 0)
                kind = "fdrollout_swap_preemptions_total" if extra else "fdrollout_recompute_preemptions_total"
                self.assertGreater(m[kind], 0, m)
                self.assertGreater(spec_totals(d)["accepted"], 0)
                self.assertEqual(d.get("/health")[1]["kv_blocks"]["used"], 0)  # every block given back

    def test_pause_keep_then_resume_equal(self):
        reqs = [{"prompt": p, "max_tokens": 60, "temperature": 0, "logprobs": 1, "ignore_eos": True} for p in PROMPTS]
        with Daemon(extra=False) as ref:
            want = [choices(ref, r) for r in reqs]
        with Daemon("--dynamic-load-weight", "--speculative-config", SPEC, env={"FD_DEBUG_STEP_DELAY_MS": "20"}) as d:
            out = [None] * len(reqs)

            def worker(i):
                out[i] = choices(d, reqs[i])

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
            for t in threads:
                t.start()
            deadline = time.time() + 60
            while d.get("/health")[1]["num_requests_running"] < len(reqs) and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            code, j = d.post("/v1/pause?mode=keep")
            self.assertEqual(code, 200, j)
            self.assertGreater(j["result"]["kept"], 0, j)
            time.sleep(0.2)
            self.assertEqual(d.post("/v1/resume")[0], 200)
            for t in threads:
                t.join(300)
            self.assertEqual(out, want)


    def test_off_above_disable_by_batch_size_still_equal(self):
        """disable_by_batch_size 2 with 8 choices in flight: those steps verify no drafts (counted),
        a lone request speculates again, and every output equals the plain daemon's."""
        cfg = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                          "disable_by_batch_size": 2})
        wide = {"prompt": REPETITIVE, "n": 8, "max_tokens": 30, "temperature": 0, "logprobs": 1, "ignore_eos": True}
        lone = {**wide, "n": 1}
        with Daemon(extra=False) as ref:
            want = [choices(ref, wide), choices(ref, lone)]
        with Daemon("--speculative-config", cfg, extra=False) as d:
            self.assertEqual(choices(d, wide), want[0])
            off = metrics(d)["fdrollout_spec_decode_disabled_steps_total"]
            self.assertGreater(off, 0)
            before = spec_totals(d)
            self.assertEqual(choices(d, lone), want[1])
            self.assertGreater(spec_totals(d)["accepted"], before["accepted"])
            self.assertEqual(d.get("/health")[1]["speculative"]["disabled_steps"], off)


class SpeculativeVersionsBounded(unittest.TestCase):
    def test_per_version_series_bounded_and_totals_count_every_version(self):
        """An RL loop updates the weights every step: /metrics keeps the per-version series of the 4
        versions last drafted under (a probe saw 4 series more per update, without end), while
        vLLM's totals count every version's drafts and never go down."""
        body = {"prompt": REPETITIVE, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        names = {"drafts": "vllm:spec_decode_num_drafts_total", "proposed": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted": "vllm:spec_decode_num_accepted_tokens_total"}
        with Daemon("--dynamic-load-weight", "--speculative-config", SPEC) as d:
            seen = {"drafts": 0, "proposed": 0, "accepted": 0}  # each version's own series while it serves, summed
            for i in range(7):
                v = "0" if i == 0 else f"v{i}"
                if i:
                    for path, b in (("/v1/pause", None), ("/v1/update_weights", {"version": v, "verify_checksum": False}),
                                    ("/v1/resume", None)):
                        code, j = d.post(path, b)
                        self.assertEqual(code, 200, (path, j))
                self.assertEqual(d.complete(**body)["weight_version"], v)
                m = metrics(d)
                own = {k: m[f'{fam}{{weight_version="{v}"}}'] for k, fam in
                       (("drafts", "fdrollout_spec_decode_num_drafts_total"), ("proposed", "fdrollout_spec_decode_num_draft_tokens_total"),
                        ("accepted", "fdrollout_spec_decode_num_accepted_tokens_total"))}
                self.assertGreater(own["accepted"], 0)
                for k in seen:
                    seen[k] += own[k]
                    self.assertEqual(series(m, names[k]), seen[k], (i, k))
            kept = sorted(k.split('weight_version="')[1].split('"')[0] for k in m if k.startswith("fdrollout_spec_decode_num_drafts_total{"))
            self.assertEqual(kept, ["v3", "v4", "v5", "v6"])
            for fam in ("fdrollout_spec_decode_num_draft_tokens_total", "fdrollout_spec_decode_num_accepted_tokens_total",
                        "fdrollout_spec_decode_mean_accepted_length"):
                self.assertEqual(len([k for k in m if k.startswith(fam + "{")]), 4, fam)
            self.assertEqual(d.get("/health")[1]["speculative"]["weight_version"], "v6")


class SpeculativePrefixCache(unittest.TestCase):
    """A speculating sequence leaves the prefix cache and the host KV tier as a plain one does: the
    block its last verify step completes is cached (a probe saw it left out: the next turn's prompt,
    prompt + output, missed it), and its generated blocks are not copied to the host tier at
    eviction (a probe saw verify steps mark them as prompt blocks)."""

    def test_next_turn_caches_the_same_prefix(self):
        ngram6 = json.dumps({"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                             "disable_by_batch_size": 0})
        cached = {}
        for name, extra in (("plain", []), ("spec", ["--speculative-config", ngram6])):
            with Daemon("--enable-prefix-caching", *extra, extra=False) as d:
                got = []
                for n in range(20, 60, 3):  # output lengths whose last verify step completes a block, and others
                    d.post("/v1/flush_cache")
                    c = d.complete(prompt=REPETITIVE, max_tokens=n, temperature=0, ignore_eos=True)["choices"][0]
                    j = d.complete(prompt=c["prompt_token_ids"] + c["token_ids"] + [261], max_tokens=1, temperature=0)
                    got.append(j["usage"]["prompt_tokens_details"]["cached_tokens"])
                cached[name] = got
        self.assertEqual(cached["spec"], cached["plain"])
        self.assertIn(80, cached["plain"])  # the block ending at position 80 is among them

    def test_generated_blocks_stay_off_the_host_tier(self):
        args = ["--enable-prefix-caching", "--swap-space", "0.01", "--kv-cache-bytes", str(20 * 20480), "--max-model-len", "256"]
        offloads = {}
        for name, extra in (("plain", []), ("spec", ["--speculative-config", SPEC])):
            with Daemon(*args, *extra, extra=False) as d:
                for p in [REPETITIVE, "Once upon a time", "Lily and Tom", "The little dog"]:  # the later ones evict the first
                    d.complete(prompt=p, max_tokens=200, temperature=0, ignore_eos=True)
                offloads[name] = metrics(d)["fdrollout_kv_host_tier_offloads_total"]
        self.assertGreater(offloads["plain"], 0)
        self.assertEqual(offloads["spec"], offloads["plain"])


class SpeculativeTp2(unittest.TestCase):
    def test_tp2_greedy_alone_and_batched_equal(self):
        tp2 = ["--tensor-parallel-size", "2", "--threads", "1"]
        reqs = greedy_bodies() + sampled_bodies()
        with Daemon(*tp2, extra=False) as plain:
            want = [choices(plain, r) for r in reqs]
        with Daemon(*tp2, "--speculative-config", SPEC, extra=False) as d:
            self.assertEqual([choices(d, r) for r in reqs], want)
            self.assertEqual(concurrently(d, reqs), want)
            self.assertGreater(spec_totals(d)["accepted"], 0)


if __name__ == "__main__":
    unittest.main()
