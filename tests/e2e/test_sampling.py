"""vLLM's sampling fields on the real daemon (stories260K): min_tokens, repetition_penalty,
presence_penalty, frequency_penalty, logit_bias, include_stop_str_in_output, stop_reason.

The reference is a numpy transcription of vLLM's documented formulas (v1 sampler: min_tokens and
logit_bias, then repetition, frequency, presence penalties, in float32) applied to raw logits the
engine did not compute: np_llama.py's forward. Greedy choices must be its argmax at every step;
seeded sampling with the fields must stay reproducible and batch-invariant."""
import json
import os
import shutil
import sys
import tempfile
import unittest

import numpy as np

from fdtest import REF, STORIES, Daemon, copy_checkpoint, merge_stream

sys.path.insert(0, os.path.dirname(__file__))
import np_llama  # noqa: E402

PROMPT = "Once upon a time"
EOS_IDS = [1, 2]  # generation_config.json; the tokenizer's EOS is 2


def vllm_process(logits, prompt, out, p):
    """vLLM v1's logits processors on one float32 row (sampler.py / ops/penalties.py order)."""
    x = logits.astype(np.float32).copy()
    if len(out) < p.get("min_tokens", 0):
        x[list(p.get("stop_token_ids", [])) + EOS_IDS] = -np.inf
    for k, b in p.get("logit_bias", {}).items():
        x[int(k)] += np.float32(b)
    r = np.float32(p.get("repetition_penalty", 1.0))
    seen = np.zeros(x.shape, bool)
    seen[list(prompt) + list(out)] = True
    pen = np.where(seen, r, np.float32(1.0)).astype(np.float32)
    x = np.where(x > 0, x / pen, x * pen).astype(np.float32)
    counts = np.bincount(np.array(out, dtype=np.int64), minlength=x.shape[0]).astype(np.float32)
    x = x - np.float32(p.get("frequency_penalty", 0.0)) * counts
    x = x - np.float32(p.get("presence_penalty", 0.0)) * (counts > 0).astype(np.float32)
    return x


class Sampling(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon()
        cls.cfg, cls.w = np_llama.load(STORIES)

    @classmethod
    def tearDownClass(cls):
        cls.d.__exit__(None)

    def check_greedy_against_numpy(self, fields, n=24, prompt=PROMPT):
        c = self.d.complete(prompt=prompt, max_tokens=n, temperature=0, **fields)["choices"][0]
        ids, out = c["prompt_token_ids"], c["token_ids"]
        lg = np_llama.logits(self.cfg, self.w, ids + out)
        n_checked = 0
        for i, t in enumerate(out):
            x = vllm_process(lg[len(ids) + i - 1], ids, out[:i], fields)
            best = np.sort(x)[::-1]
            if best[0] - best[1] < 1e-3:  # a near-tie the two forwards may round differently
                continue
            self.assertEqual(t, int(np.argmax(x)), f"step {i} of {fields}")
            n_checked += 1
        self.assertGreater(n_checked, len(out) // 2)
        return c

    def test_penalties_and_logit_bias_match_vllms_formulas(self):
        # stories260K is confident (top-1 logprobs near 0): each case below changes its first 40
        # greedy tokens, some only after ~25 tokens.
        plain = self.d.complete(prompt=PROMPT, max_tokens=40, temperature=0)["choices"][0]["token_ids"]
        cases = [
            {"repetition_penalty": 1.3},
            {"repetition_penalty": 2.0},
            {"repetition_penalty": 0.5},
            {"frequency_penalty": 1.2},
            {"presence_penalty": 2.0},
            {"presence_penalty": -2.0, "frequency_penalty": 0.4},
            {"logit_bias": {"432": -100, "286": 3.5}},
            {"repetition_penalty": 1.2, "frequency_penalty": 0.3, "presence_penalty": 0.3, "logit_bias": {"261": -4}},
        ]
        for fields in cases:
            with self.subTest(fields):
                c = self.check_greedy_against_numpy(fields, n=40)
                self.assertNotEqual(c["token_ids"], plain)  # each case changes this story
        # A +100 bias wins every step; -100 on the greedy first token removes it.
        c = self.d.complete(prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={"300": 100})["choices"][0]
        self.assertEqual(c["token_ids"], [300] * 5)
        c = self.d.complete(prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={str(plain[0]): -100})["choices"][0]
        self.assertNotIn(plain[0], c["token_ids"])

    def test_logprobs_stay_the_raw_models(self):
        # vLLM's default logprobs mode (raw_logprobs): the penalties change the choice, not the logprobs.
        c = self.d.complete(prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1, frequency_penalty=2.0)["choices"][0]
        s = self.d.complete(prompt=c["prompt_token_ids"] + c["token_ids"], max_tokens=0, echo=True, logprobs=1)
        n_p = len(c["prompt_token_ids"])
        self.assertEqual(s["choices"][0]["logprobs"]["token_logprobs"][n_p:], c["logprobs"]["token_logprobs"])

    def test_min_tokens_masks_eos_and_defers_stops(self):
        story = self.d.complete(prompt=PROMPT, max_tokens=500, temperature=0)["choices"][0]
        n = len(story["token_ids"])
        self.assertEqual(story["token_ids"][-1], 1)  # the story ends with EOS id 1
        fields = {"min_tokens": n + 10}
        c = self.check_greedy_against_numpy(fields, n=n + 10)
        self.assertEqual(c["finish_reason"], "length")
        self.assertNotIn(1, c["token_ids"])
        self.assertNotIn(2, c["token_ids"])
        self.assertEqual(c["token_ids"][:n - 1], story["token_ids"][:n - 1])
        # stop_token_ids and stop strings count only from min_tokens on.
        ids = REF[PROMPT]["ids"]
        c = self.d.complete(prompt=PROMPT, max_tokens=60, temperature=0, stop_token_ids=[426], min_tokens=12)["choices"][0]
        i426 = ids.index(426)  # the 11th token: masked while fewer than 12 tokens exist
        self.assertEqual(c["token_ids"][:i426], ids[:i426])
        self.assertNotIn(426, c["token_ids"][:12])
        self.assertEqual((c["finish_reason"], c["stop_reason"], c["token_ids"][-1]), ("stop", 426, 426))
        c = self.d.complete(prompt=PROMPT, max_tokens=60, temperature=0, stop=["Lily"], min_tokens=8)["choices"][0]
        self.assertEqual(c["stop_reason"], "Lily")
        self.assertEqual(c["text"], ", there was a little girl named ")
        # "little" completes at token 5, before min_tokens: it never stops the story (vLLM looks for
        # stop strings only in text new since the last check); "play" later does.
        c = self.d.complete(prompt=PROMPT, max_tokens=60, temperature=0, stop=["little", "play"], min_tokens=8)["choices"][0]
        self.assertEqual((c["finish_reason"], c["stop_reason"]), ("stop", "play"))
        self.assertEqual(c["text"], ", there was a little girl named Lily. She loved to ")

    def test_stop_reason(self):
        c = self.d.complete(prompt=PROMPT, max_tokens=60, temperature=0, stop=["park", "Lily"])["choices"][0]
        self.assertEqual((c["finish_reason"], c["stop_reason"]), ("stop", "Lily"))  # the first in the text
        # "irl" and "girl" complete with the same token ("irl" after "▁g"): vLLM takes the list order.
        c = self.d.complete(prompt=PROMPT, max_tokens=60, temperature=0, stop=["girl", "irl"])["choices"][0]
        self.assertEqual((c["stop_reason"], c["text"]), ("girl", ", there was a little "))
        c = self.d.complete(prompt=PROMPT, max_tokens=60, temperature=0, stop=["irl", "girl"])["choices"][0]
        self.assertEqual((c["stop_reason"], c["text"]), ("irl", ", there was a little g"))
        c = self.d.complete(prompt=PROMPT, max_tokens=60, temperature=0, stop_token_ids=[426])["choices"][0]
        self.assertEqual((c["finish_reason"], c["stop_reason"]), ("stop", 426))
        c = self.d.complete(prompt=PROMPT, max_tokens=5, temperature=0)["choices"][0]
        self.assertEqual((c["finish_reason"], c["stop_reason"]), ("length", None))
        # EOS: the tokenizer's own EOS (2) gives null; generation_config's other EOS (1) is a stop
        # token id to vLLM, so it is the reason.
        c = self.d.complete(prompt=PROMPT, max_tokens=500, temperature=0)["choices"][0]
        self.assertEqual((c["finish_reason"], c["stop_reason"]), ("stop", 1))
        c = self.d.complete(prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={"2": 100})["choices"][0]
        self.assertEqual((c["finish_reason"], c["stop_reason"], c["token_ids"]), ("stop", None, [2]))
        chunks, _ = self.d.stream(prompt=PROMPT, max_tokens=60, temperature=0, stop="Lily")
        reasons = [x.get("stop_reason") for ch in chunks for x in ch["choices"]]
        self.assertEqual(reasons, [None] * (len(reasons) - 1) + ["Lily"])

    def test_include_stop_str_in_output(self):
        c = self.d.complete(prompt=PROMPT, max_tokens=60, temperature=0, stop=["Lily."],
                            include_stop_str_in_output=True)["choices"][0]
        self.assertEqual(c["text"], ", there was a little girl named Lily.")
        self.assertEqual(c["stop_reason"], "Lily.")
        chunks, _ = self.d.stream(prompt=PROMPT, max_tokens=60, temperature=0, stop=["Lily."], include_stop_str_in_output=True)
        self.assertEqual(merge_stream(chunks)[0]["text"], c["text"])
        # A stop token's text is kept too (vLLM: the detokenizer keeps the stopping token).
        ids = REF[PROMPT]["ids"]
        c = self.d.complete(prompt=PROMPT, max_tokens=60, temperature=0, stop_token_ids=[426], include_stop_str_in_output=True)
        plain = self.d.complete(prompt=PROMPT, max_tokens=ids.index(426) + 1, temperature=0)["choices"][0]
        self.assertEqual(c["choices"][0]["text"], plain["text"])
        c2 = self.d.complete(prompt=PROMPT, max_tokens=60, temperature=0, stop_token_ids=[426])["choices"][0]
        self.assertLess(len(c2["text"]), len(plain["text"]))

    def test_seeded_sampling_with_penalties_is_reproducible_and_batch_invariant(self):
        body = dict(prompt=PROMPT, max_tokens=30, temperature=0.9, top_k=40, seed=77, n=2, repetition_penalty=1.2,
                    presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"261": -2}, min_tokens=10)
        a = self.d.complete(**body)
        b = self.d.complete(**body)
        self.assertEqual([c["token_ids"] for c in a["choices"]], [c["token_ids"] for c in b["choices"]])
        batched = self.d.complete(**{**body, "prompt": [PROMPT, "Lily and Tom"]})  # choices 0, 1: same streams
        self.assertEqual([c["token_ids"] for c in batched["choices"][:2]], [c["token_ids"] for c in a["choices"]])
        plain = self.d.complete(**{k: v for k, v in body.items() if k not in
                                   ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens")})
        self.assertNotEqual([c["token_ids"] for c in plain["choices"]], [c["token_ids"] for c in a["choices"]])


class GenerationConfigDefaults(unittest.TestCase):
    """vLLM's --generation-config auto (its default): the sampling fields of the model's
    generation_config.json are the defaults of every field a request leaves out, and its
    max_new_tokens caps every request (vllm/config/model.py get_diff_sampling_param,
    entrypoints get_max_tokens); --generation-config vllm ignores them. The old daemon ignored
    the file: 16 tokens, sampled at top_k off."""
    GEN = {"bos_token_id": 1, "eos_token_id": [1, 2], "do_sample": True, "temperature": 0.6, "top_k": 1, "top_p": 0.9,
           "repetition_penalty": 1.0, "max_new_tokens": 5}

    @classmethod
    def setUpClass(cls):  # class cleanups run even when a later start fails
        cls.tmp = tempfile.mkdtemp(prefix="fd-genconfig-")
        cls.addClassCleanup(shutil.rmtree, cls.tmp, True)
        cls.model = copy_checkpoint(STORIES, os.path.join(cls.tmp, "m"))
        with open(os.path.join(cls.model, "generation_config.json"), "w") as f:
            json.dump(cls.GEN, f)
        cls.auto = Daemon(model=cls.model)
        cls.addClassCleanup(cls.auto.__exit__, None)
        cls.vllm = Daemon("--generation-config", "vllm", model=cls.model)
        cls.addClassCleanup(cls.vllm.__exit__, None)

    def test_the_models_defaults_fill_what_a_request_leaves_out(self):
        greedy = REF[PROMPT]["ids"][:5]
        for seed in range(3):  # top_k 1 from the file: greedy whatever the seed; max_new_tokens 5
            c = self.auto.complete(prompt=PROMPT, seed=seed, ignore_eos=True)["choices"][0]
            self.assertEqual(c["token_ids"], greedy)
            status, j = self.auto.post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "seed": seed,
                                                                 "ignore_eos": True})
            self.assertEqual((status, len(j["choices"][0]["token_ids"])), (200, 5), j)
        # max_new_tokens caps an explicit max_tokens too (vLLM: the smallest of the request's, the
        # rest of the context and the model's); one past the context is still the request's 400
        self.assertEqual(self.auto.complete(prompt=PROMPT, max_tokens=40, temperature=0)["choices"][0]["token_ids"], greedy)
        self.assertEqual(self.auto.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 600})[0], 400)
        # a request's own fields win: top_k 0 and top_p 1 sample as the daemon that ignores the file
        for seed in range(3):
            body = dict(prompt=PROMPT, max_tokens=5, seed=seed, temperature=1.0, ignore_eos=True)
            a = self.auto.complete(**body, top_k=0, top_p=1.0)["choices"][0]["token_ids"]
            self.assertEqual(a, self.vllm.complete(**body)["choices"][0]["token_ids"])
        self.assertIn("temperature=0.6, top_k=1, top_p=0.9, max_tokens=5", self.auto.output())

    def test_generation_config_vllm_keeps_the_neutral_defaults(self):
        c = self.vllm.complete(prompt=PROMPT, seed=1, ignore_eos=True)["choices"][0]
        self.assertEqual(len(c["token_ids"]), 16)  # OpenAI's and vLLM's completions default
        outs = {tuple(self.vllm.complete(prompt=PROMPT, seed=s, max_tokens=8)["choices"][0]["token_ids"]) for s in range(4)}
        self.assertGreater(len(outs), 1)  # temperature 1, top_k off: sampled
        self.assertNotIn("generation config", self.vllm.output())

    def test_a_default_out_of_range_stops_start_up_naming_the_field(self):
        bad = copy_checkpoint(STORIES, os.path.join(self.tmp, "bad"))
        with open(os.path.join(bad, "generation_config.json"), "w") as f:
            json.dump({**self.GEN, "top_p": 0}, f)
        d = None
        try:
            d = Daemon(model=bad, timeout=30)
        except RuntimeError as e:
            self.assertRegex(str(e), r"generation_config\.json: field 'top_p' must be in \(0, 1\]")
        else:
            d.__exit__(None)
            self.fail("started with top_p 0 as its default")
        with Daemon("--generation-config", "vllm", model=bad) as d:  # not read at all
            self.assertEqual(len(d.complete(prompt=PROMPT, ignore_eos=True)["choices"][0]["token_ids"]), 16)

    def test_override_generation_config_replaces_the_fields_it_names(self):
        # vLLM's --override-generation-config: the file's fields updated by the override's (null
        # clears one, 1.0 is taken as given); over --generation-config vllm, the override alone.
        # It was not implemented: an unknown flag stopped start-up.
        over = json.dumps({"temperature": 1.0, "top_k": None, "top_p": 1.0, "max_new_tokens": 7})
        with Daemon("--override-generation-config", over, model=self.model) as d:
            for seed in range(3):  # the file's top_k 1 cleared: sampled as the daemon without defaults, 7 tokens
                body = dict(prompt=PROMPT, seed=seed, ignore_eos=True)
                self.assertEqual(d.complete(**body)["choices"][0]["token_ids"], self.vllm.complete(**body, max_tokens=7)["choices"][0]["token_ids"])
            self.assertIn("temperature=1, top_p=1, max_tokens=7", d.output())
        with Daemon("--generation-config", "vllm", "--override-generation-config", '{"top_k": 1, "max_new_tokens": 3}', model=self.model) as d:
            c = d.complete(prompt=PROMPT, seed=5, max_tokens=10, ignore_eos=True)["choices"][0]
            self.assertEqual(c["token_ids"], REF[PROMPT]["ids"][:3])  # top_k 1: greedy; capped at 3
            self.assertIn("overridden by --override-generation-config: top_k=1, max_tokens=3", d.output())  # no model config read
        for bad, words in (('{"top_p": 0}', "field 'top_p' must be in (0, 1]"), ('{"temprature": 0.5}', "temprature not a sampling field"),
                           ("temperature=0", "not JSON")):
            d = None
            try:
                d = Daemon("--override-generation-config", bad, model=self.model, timeout=30)
            except RuntimeError as e:
                self.assertIn("--override-generation-config", str(e))
                self.assertIn(words, str(e))
            else:
                d.__exit__(None)
                self.fail(f"started with --override-generation-config {bad}")


if __name__ == "__main__":
    unittest.main()
