"""/v1/completions against the real daemon on the embedded stories260K: reference greedy outputs,
every prompt form, streaming, stop conditions, n, seeds, logprobs, and the read-only endpoints."""
import math
import unittest

from fdtest import REF, Daemon, merge_stream


class Completions(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.d.__exit__(None)

    def test_greedy_matches_llama2c_reference(self):
        for prompt, ref in REF.items():
            j = self.d.complete(prompt=prompt, max_tokens=60, temperature=0)
            c = j["choices"][0]
            self.assertEqual(c["prompt_token_ids"], ref["prompt_ids"])
            self.assertEqual(c["token_ids"], ref["ids"])
            self.assertEqual(prompt + c["text"], ref["text"])
            self.assertEqual(c["finish_reason"], "length")
            self.assertEqual(j["usage"], {"prompt_tokens": 5, "completion_tokens": 60, "total_tokens": 65,
                                          "prompt_tokens_details": {"cached_tokens": 0}})
            self.assertEqual(j["weight_version"], "0")
            self.assertEqual(j["object"], "text_completion")

    def test_streaming_equals_non_streaming(self):
        for prompt, ref in REF.items():
            chunks, done = self.d.stream(prompt=prompt, max_tokens=60, temperature=0)
            self.assertTrue(done)
            m = merge_stream(chunks)[0]
            self.assertEqual(m["token_ids"], ref["ids"])
            self.assertEqual(prompt + m["text"], ref["text"])
            self.assertEqual(m["prompt_token_ids"], ref["prompt_ids"])
            self.assertEqual(m["finish_reason"], "length")
            self.assertTrue(all(c["weight_version"] == "0" for c in chunks))
            self.assertIsNone(chunks[0]["choices"][0]["finish_reason"])

    def test_stream_usage_chunk_when_asked(self):
        chunks, done = self.d.stream(prompt="Lily and Tom", max_tokens=4, temperature=0,
                                     stream_options={"include_usage": True})
        self.assertTrue(done)
        self.assertEqual(chunks[-1]["choices"], [])
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 4)
        self.assertEqual(chunks[-1]["usage"]["prompt_tokens"], 5)
        self.assertEqual(chunks[-1]["weight_version"], "0")  # every response names its version, the usage chunk too

    def test_token_id_prompt_equals_text_prompt(self):
        ref = REF["Once upon a time"]
        a = self.d.complete(prompt=ref["prompt_ids"], max_tokens=20, temperature=0, logprobs=2)
        b = self.d.complete(prompt="Once upon a time", max_tokens=20, temperature=0, logprobs=2)
        self.assertEqual(a["choices"][0]["token_ids"], ref["ids"][:20])
        self.assertEqual(a["choices"][0]["token_ids"], b["choices"][0]["token_ids"])
        self.assertEqual(a["choices"][0]["text"], b["choices"][0]["text"])
        self.assertEqual(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"])

    def test_list_prompts_give_one_choice_per_prompt_and_n(self):
        prompts = list(REF)
        j = self.d.complete(prompt=prompts, max_tokens=10, temperature=0, n=2)
        self.assertEqual([c["index"] for c in j["choices"]], [0, 1, 2, 3])
        for c in j["choices"]:
            ref = REF[prompts[c["index"] // 2]]
            self.assertEqual(c["token_ids"], ref["ids"][:10])
            self.assertEqual(c["prompt_token_ids"], ref["prompt_ids"])
        self.assertEqual(j["usage"]["prompt_tokens"], 10)
        self.assertEqual(j["usage"]["completion_tokens"], 40)
        ids = [REF[p]["prompt_ids"] for p in prompts]
        k = self.d.complete(prompt=ids, max_tokens=10, temperature=0)
        self.assertEqual([c["token_ids"] for c in k["choices"]], [REF[p]["ids"][:10] for p in prompts])

    def test_echo_prepends_the_prompt(self):
        j = self.d.complete(prompt="Lily and Tom", max_tokens=60, temperature=0, echo=True)
        self.assertEqual(j["choices"][0]["text"], REF["Lily and Tom"]["text"])

    def test_echo_of_token_id_prompts_is_their_text(self):
        # token-id prompts are decoded only for echo; the echoed text is the same as before
        ref = REF["Lily and Tom"]
        j = self.d.complete(prompt=ref["prompt_ids"], max_tokens=60, temperature=0, echo=True)
        self.assertEqual(j["choices"][0]["text"], ref["text"])
        chunks, _ = self.d.stream(prompt=[ref["prompt_ids"]], max_tokens=60, temperature=0, echo=True)
        self.assertEqual(merge_stream(chunks)[0]["text"], ref["text"])
        j = self.d.complete(prompt=ref["prompt_ids"], max_tokens=60, temperature=0)
        self.assertEqual("Lily and Tom" + j["choices"][0]["text"], ref["text"])

    def test_stop_string_cuts_the_text(self):
        j = self.d.complete(prompt="Once upon a time", max_tokens=60, temperature=0, stop=["Lily."])
        c = j["choices"][0]
        self.assertEqual(c["finish_reason"], "stop")
        self.assertEqual(c["text"], ", there was a little girl named ")
        chunks, _ = self.d.stream(prompt="Once upon a time", max_tokens=60, temperature=0, stop="Lily.")
        self.assertEqual(merge_stream(chunks)[0]["text"], ", there was a little girl named ")

    def test_stop_token_ids_and_eos(self):
        ref = REF["Once upon a time"]
        j = self.d.complete(prompt="Once upon a time", max_tokens=60, temperature=0, stop_token_ids=[426])
        c = j["choices"][0]
        self.assertEqual(c["finish_reason"], "stop")
        self.assertEqual(c["token_ids"], ref["ids"][:ref["ids"].index(426) + 1])
        # generation_config.json eos_token_id [1, 2]: the story ends with BOS (id 1).
        j = self.d.complete(prompt="Once upon a time", max_tokens=500, temperature=0)
        c = j["choices"][0]
        self.assertEqual(c["finish_reason"], "stop")
        self.assertEqual(c["token_ids"][-1], 1)
        self.assertNotIn(1, c["token_ids"][:-1])
        n_story = len(c["token_ids"])
        j = self.d.complete(prompt="Once upon a time", max_tokens=n_story + 20, temperature=0, ignore_eos=True)
        self.assertEqual(j["choices"][0]["finish_reason"], "length")
        self.assertEqual(len(j["choices"][0]["token_ids"]), n_story + 20)

    def test_max_model_len_ends_with_length(self):
        j = self.d.complete(prompt="Once upon a time", max_tokens=507, temperature=0, ignore_eos=True)
        self.assertEqual(len(j["choices"][0]["token_ids"]), 507)
        self.assertEqual(j["choices"][0]["finish_reason"], "length")

    def test_seeded_sampling_is_reproducible_and_choices_differ(self):
        body = dict(prompt="Once upon a time", max_tokens=30, temperature=1.0, top_p=0.9, top_k=50, seed=1234, n=3)
        a = self.d.complete(**body)
        b = self.d.complete(**body)
        self.assertEqual([c["token_ids"] for c in a["choices"]], [c["token_ids"] for c in b["choices"]])
        self.assertGreater(len({tuple(c["token_ids"]) for c in a["choices"]}), 1)
        c = self.d.complete(**{**body, "seed": 4321})
        self.assertNotEqual([x["token_ids"] for x in a["choices"]], [x["token_ids"] for x in c["choices"]])

    def test_a_seeded_prompt_samples_the_same_wherever_it_sits_in_a_list(self):
        """vLLM runs each prompt of a list as its own request with the request's seed: prompt P's
        samples must not depend on what comes before it (a probe found another continuation for
        P as the second prompt of a list). Unseeded, two equal prompts still sample apart."""
        body = dict(max_tokens=12, temperature=3.0, seed=5, n=2)  # flat enough that two samples never coincide
        alone = [c["token_ids"] for c in self.d.complete(prompt="Once upon a time", **body)["choices"]]
        listed = self.d.complete(prompt=["Lily", "Once upon a time"], **body)["choices"]
        self.assertEqual([c["index"] for c in listed], [0, 1, 2, 3])
        self.assertEqual([c["token_ids"] for c in listed[2:]], alone)
        self.assertNotEqual(alone[0], alone[1])  # the n samples of one prompt still differ
        twice = self.d.complete(prompt=["Once upon a time"] * 2, max_tokens=12, temperature=3.0)["choices"]
        self.assertNotEqual(twice[0]["token_ids"], twice[1]["token_ids"])

    def test_logprobs_are_log_probabilities(self):
        j = self.d.complete(prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=5)
        lp = j["choices"][0]["logprobs"]
        self.assertEqual(len(lp["tokens"]), 8)
        self.assertEqual(len(lp["token_logprobs"]), 8)
        for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
            self.assertEqual(len(top), 5)
            self.assertEqual(chosen, max(top.values()))  # greedy picks the best
            self.assertLessEqual(sum(math.exp(v) for v in top.values()), 1.0 + 1e-5)
            self.assertLess(chosen, 0.0)

    def test_top_logprobs_hold_the_sampled_token(self):
        """OpenAI: the sampled token's logprob is always returned, up to logprobs + 1 entries
        (vLLM: the chosen token plus the top k); logprobs 0 gives the chosen token alone. A probe
        found a sampled token missing from its row, and logprobs 0 giving {}."""
        j = self.d.complete(prompt="Once upon a time", max_tokens=16, temperature=5.0, seed=3, logprobs=2, echo=True)
        lp = j["choices"][0]["logprobs"]
        outside = 0
        for i, (tok, chosen, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])):
            if i == 0:
                self.assertIsNone(top)  # the echoed prompt's first token has none
                continue
            self.assertIn(tok, top, (i, top))
            self.assertEqual(top[tok], chosen)
            self.assertIn(len(top), (2, 3))
            outside += len(top) == 3
        self.assertGreater(outside, 0, "temperature 5 should sample outside the top 2 at least once")
        j = self.d.complete(prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=0)
        lp = j["choices"][0]["logprobs"]
        self.assertEqual(lp["top_logprobs"], [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])])

    def test_models_health_metrics(self):
        status, m = self.d.get("/v1/models")
        self.assertEqual(status, 200)
        self.assertEqual(m["data"][0]["id"], "stories260K")
        self.assertEqual(m["data"][0]["max_model_len"], 512)
        self.assertEqual(m["data"][0]["weight_version"], "0")
        status, h = self.d.get("/health")
        self.assertEqual(status, 200)
        self.assertEqual(h["state"], "serving")
        self.assertEqual(h["weight_version"], "0")
        self.assertFalse(h["is_paused"])
        self.d.complete(prompt="Lily", max_tokens=3, temperature=0)
        status, text = self.d.get("/metrics")
        self.assertEqual(status, 200)
        for name in ["fdrollout_num_requests_running", "fdrollout_num_requests_waiting", "fdrollout_generation_tokens_total",
                     "fdrollout_kv_blocks_used", "fdrollout_kv_blocks_free", "fdrollout_step_latency_seconds_bucket",
                     "fdrollout_step_latency_seconds_count"]:
            self.assertIn(name, text)
        gen = [l for l in text.splitlines() if l.startswith('fdrollout_generation_tokens_total{model_name="stories260K"} ')][0]
        self.assertGreaterEqual(int(gen.split()[1]), 3)
        self.assertIn('le="+Inf"', text)

    def test_model_by_id_and_version(self):
        _, models = self.d.get("/v1/models")
        mid = models["data"][0]["id"]
        status, m = self.d.get(f"/v1/models/{mid}")
        self.assertEqual(status, 200, m)
        self.assertEqual(m, {**models["data"][0], "created": m["created"]})
        self.assertEqual((m["object"], m["id"]), ("model", "stories260K"))
        for bad in ("gpt-5", "stories260K/x", "stories260"):
            status, j = self.d.get(f"/v1/models/{bad}")
            self.assertEqual(status, 404, j)
            self.assertEqual(j["error"]["type"], "not_found")
            self.assertIn(bad, j["error"]["message"])
        status, v = self.d.get("/version")
        self.assertEqual(status, 200)
        self.assertIsInstance(v["version"], str)
        self.assertRegex(v["version"], r"^\d+\.\d+")

    def test_max_tokens_null_is_the_rest_of_the_context(self):
        """vLLM's CompletionRequest: max_tokens absent = 16, an explicit null = max_model_len - the
        prompt (the old daemon gave 16 for both)."""
        ids = REF["Once upon a time"]["prompt_ids"]
        c = self.d.complete(prompt=ids, max_tokens=None, temperature=0, ignore_eos=True)["choices"][0]
        self.assertEqual((len(c["token_ids"]), c["finish_reason"]), (512 - len(ids), "length"))
        c = self.d.complete(prompt=ids, temperature=0, ignore_eos=True)["choices"][0]
        self.assertEqual(len(c["token_ids"]), 16)

    def test_served_model_name_is_accepted(self):
        j = self.d.complete(model="stories260K", prompt="Lily", max_tokens=2, temperature=0)
        self.assertEqual(j["model"], "stories260K")


if __name__ == "__main__":
    unittest.main()
