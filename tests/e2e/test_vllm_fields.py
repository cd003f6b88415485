"""vLLM's request fields that RL stacks send through the OpenAI client's extra_body (issue #26):
min_p, add_special_tokens, truncate_prompt_tokens, return_token_ids, detokenize, priority,
cache_salt, response_format, stream_options.continuous_usage_stats; detokenize false (token ids,
no text); logprob tokens as decoded text; the embedded model's chat template, --chat-template and the request's chat_template.
A value fdrollout cannot honour is a 400 naming the field. References: REF (llama2.c's greedy
outputs, models/stories260K/README.md) and the tokenizer's own ids."""
import math
import os
import re
import shutil
import subprocess
import tempfile
import unittest

from fdtest import BIN, Daemon, free_port, REF, REPO, STORIES

PROMPT = "Once upon a time"
IDS = REF[PROMPT]["prompt_ids"]  # [BOS, ...]


class VllmFields(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon("--enable-prefix-caching", "--block-size", "4")

    @classmethod
    def tearDownClass(cls):
        cls.d.__exit__(None)

    def bad(self, body, field, route="/v1/completions"):
        code, j = self.d.post(route, body)
        self.assertEqual((code, j["error"]["param"]), (400, field), j)
        return j["error"]["message"]

    def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely(self):
        # At temperature 1 the logprobs are the sampling distribution's: every sampled token must
        # have p >= min_p * p_max, i.e. logprob >= log(min_p) + the top logprob.
        for min_p in (0.2, 0.5):
            j = self.d.complete(prompt=PROMPT, max_tokens=48, temperature=1.0, seed=11, min_p=min_p, logprobs=1)
            lp = j["choices"][0]["logprobs"]
            for tok_lp, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
                self.assertGreaterEqual(tok_lp, math.log(min_p) + max(top.values()) - 1e-5)
        # Without min_p the same seed draws at least one token below that bound (the check above can fail).
        j = self.d.complete(prompt=PROMPT, max_tokens=48, temperature=1.0, seed=11, logprobs=1)
        lp = j["choices"][0]["logprobs"]
        self.assertTrue(any(t < math.log(0.5) + max(top.values()) for t, top in zip(lp["token_logprobs"], lp["top_logprobs"])))
        # min_p 1 keeps only the most likely token: greedy
        j = self.d.complete(prompt=PROMPT, max_tokens=20, temperature=1.0, seed=3, min_p=1.0)
        self.assertEqual(j["choices"][0]["token_ids"], REF[PROMPT]["ids"][:20])
        for v in (-0.1, 1.5, "0.1"):
            self.bad({"prompt": PROMPT, "min_p": v}, "min_p")

    def test_add_special_tokens_and_truncate_prompt_tokens(self):
        c = self.d.complete(prompt=PROMPT, max_tokens=1, add_special_tokens=False)["choices"][0]
        self.assertEqual(c["prompt_token_ids"], IDS[1:])
        self.assertEqual(self.d.complete(prompt=PROMPT, max_tokens=1, add_special_tokens=True)["choices"][0]["prompt_token_ids"], IDS)
        c = self.d.complete(prompt=PROMPT, max_tokens=1, truncate_prompt_tokens=3, echo=True)["choices"][0]
        self.assertEqual(c["prompt_token_ids"], IDS[-3:])  # the last 3 (left truncation, as vLLM)
        self.assertTrue(c["text"].startswith("upon a time"), c["text"])
        self.assertEqual(self.d.complete(prompt=IDS, max_tokens=1, truncate_prompt_tokens=-1)["choices"][0]["prompt_token_ids"], IDS)
        self.assertEqual(self.d.complete(prompt=IDS, max_tokens=1, truncate_prompt_tokens=50)["choices"][0]["prompt_token_ids"], IDS)
        for v in (0, -2, 10 ** 6, "3"):
            self.bad({"prompt": PROMPT, "truncate_prompt_tokens": v}, "truncate_prompt_tokens")
        self.bad({"prompt": PROMPT, "add_special_tokens": "no"}, "add_special_tokens")

    def test_accepted_values_and_refused_ones(self):
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True, "detokenize": True,
                "priority": 0, "response_format": {"type": "text"}, "cache_salt": "run-7"}
        c = self.d.complete(**body)["choices"][0]
        self.assertEqual(c["token_ids"], REF[PROMPT]["ids"][:4])
        self.assertEqual(self.d.complete(**{**body, "return_token_ids": False})["choices"][0]["token_ids"], REF[PROMPT]["ids"][:4])
        self.assertIn("priority", self.bad({"prompt": PROMPT, "priority": 1}, "priority"))
        self.bad({"prompt": PROMPT, "detokenize": "no"}, "detokenize")
        self.bad({"prompt": PROMPT, "response_format": {"type": "json_object"}}, "response_format")
        self.bad({"prompt": PROMPT, "response_format": "text"}, "response_format")
        self.bad({"prompt": PROMPT, "cache_salt": ""}, "cache_salt")
        self.bad({"prompt": PROMPT, "return_token_ids": 1}, "return_token_ids")
        self.bad({"messages": [{"role": "user", "content": PROMPT}], "priority": -1}, "priority", "/v1/chat/completions")

    def test_integers_beyond_their_range_are_refused_not_wrapped(self):
        """Probes: chat top_logprobs 4294967299 was read as 3, truncate_prompt_tokens 2^64 - 1 as -1
        (the whole context), and seed 2^64 - 1 drew exactly what seed -1 draws (vLLM's seed is an
        int64). Each is now a 400 naming the field; int64's own bounds still work."""
        chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "logprobs": True}
        for v in (4294967299, 4294967296, -4294967294):
            self.bad({**chat, "top_logprobs": v}, "top_logprobs", "/v1/chat/completions")
        self.bad({"prompt": PROMPT, "truncate_prompt_tokens": 2 ** 64 - 1}, "truncate_prompt_tokens")
        self.bad({"prompt": PROMPT, "seed": 2 ** 64 - 1}, "seed")
        self.bad({"prompt": PROMPT, "seed": 2 ** 63}, "seed")
        a = self.d.complete(prompt=PROMPT, max_tokens=6, temperature=1.0, seed=-1)["choices"][0]["token_ids"]
        b = self.d.complete(prompt=PROMPT, max_tokens=6, temperature=1.0, seed=2 ** 63 - 1)["choices"][0]["token_ids"]
        self.assertEqual(len(a), 6)
        self.assertEqual(len(b), 6)

    def test_openai_fields_at_their_neutral_values_pass(self):
        """A probe: modalities ["text"], audio/prediction/functions null and the like were 400
        "unknown field" though docs/coming_from_vllm.md lets such fields pass at neutral values."""
        chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
        for key, v in (("modalities", ["text"]), ("audio", None), ("prediction", None), ("web_search_options", None),
                       ("function_call", None), ("functions", None), ("mm_processor_kwargs", None), ("prompt_cache_key", None),
                       ("safety_identifier", None)):
            code, j = self.d.post("/v1/chat/completions", {**chat, key: v})
            self.assertEqual(code, 200, (key, j))
        code, j = self.d.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_embeds": None})
        self.assertEqual(code, 200, j)
        self.bad({**chat, "modalities": ["text", "audio"]}, "modalities", "/v1/chat/completions")
        self.bad({**chat, "functions": [{"name": "f"}]}, "functions", "/v1/chat/completions")

    def test_echo_keeps_an_explicit_prompt_logprobs_count(self):
        """A probe: echo + logprobs 3 + prompt_logprobs 1 gave prompt rows of 3 alternatives; vLLM
        uses logprobs only when prompt_logprobs is not given."""
        c = self.d.complete(prompt=PROMPT, max_tokens=1, echo=True, logprobs=3, prompt_logprobs=1)["choices"][0]
        rows = c["prompt_logprobs"][1:]
        self.assertTrue(rows)
        for row in rows:  # the prompt token, plus at most 1 alternative
            self.assertLessEqual(len(row), 2, row)
            self.assertTrue(all(e["rank"] <= 1 or str(tid) in row for tid, e in row.items()))
        for top in c["logprobs"]["top_logprobs"][1:]:  # the echoed tokens keep logprobs' 3 (+ the token itself)
            self.assertGreaterEqual(len(top), 3)
        c = self.d.complete(prompt=PROMPT, max_tokens=1, echo=True, logprobs=3)["choices"][0]
        self.assertTrue(any(len(row) >= 3 for row in c["prompt_logprobs"][1:]))  # without prompt_logprobs: logprobs' 3

    def test_detokenize_false_returns_token_ids_and_no_text(self):
        """vLLM's SamplingParams.detokenize=False (vllm/sampling_params.py; its tokens-only
        serving, vllm/entrypoints/serve/disagg/serving.py): no text is decoded, the token ids are
        the answer, logprob tokens read "token_id:N" (as _create_tokens_logprobs writes them), and
        stop strings are refused ("stop strings are only supported when detokenize is True").
        The ids and logprobs equal those of the same request with text (and REF's greedy ids)."""
        n = 12
        body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "logprobs": 2, "return_token_ids": True}
        ref = self.d.complete(**body)["choices"][0]
        c = self.d.complete(**body, detokenize=False)["choices"][0]
        self.assertEqual(c["token_ids"], REF[PROMPT]["ids"][:n])
        self.assertEqual(c["token_ids"], ref["token_ids"])
        self.assertNotEqual(ref["text"], "")
        self.assertEqual(c["text"], "")
        lp = c["logprobs"]
        self.assertEqual(lp["tokens"], [f"token_id:{i}" for i in c["token_ids"]])
        self.assertEqual(lp["token_logprobs"], ref["logprobs"]["token_logprobs"])
        ref_tok = self.d.complete(**body, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
        self.assertEqual(lp["top_logprobs"], ref_tok["top_logprobs"])  # the same ids and values as "token_id:N" keys
        self.assertEqual(lp["text_offset"], [0] * n)
        self.assertEqual(c["finish_reason"], "length")
        # a stop token id still stops it (stop_token_ids need no text)
        stop_id = REF[PROMPT]["ids"][3]
        c = self.d.complete(prompt=PROMPT, max_tokens=n, temperature=0, detokenize=False, stop_token_ids=[stop_id])["choices"][0]
        self.assertEqual((c["token_ids"], c["finish_reason"], c["stop_reason"], c["text"]),
                         (REF[PROMPT]["ids"][:4], "stop", stop_id, ""))
        # echo: no text either; the prompt's logprobs are as token ids, prompt_logprobs undecoded
        c = self.d.complete(prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, prompt_logprobs=1, detokenize=False)["choices"][0]
        self.assertEqual(c["text"], "")
        self.assertEqual(c["logprobs"]["tokens"], [f"token_id:{i}" for i in IDS])
        self.assertEqual({e["decoded_token"] for d in c["prompt_logprobs"][1:] for e in d.values()}, {None})
        # chat: empty content, ids and token-id logprobs
        chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": n, "temperature": 0, "logprobs": True,
                "top_logprobs": 1}
        code, j = self.d.post("/v1/chat/completions", {**chat, "detokenize": False})
        self.assertEqual(code, 200, j)
        ch = j["choices"][0]
        self.assertEqual((ch["message"]["content"], ch["token_ids"]), ("", REF[PROMPT]["ids"][:n]))
        self.assertEqual([e["token"] for e in ch["logprobs"]["content"]], [f"token_id:{i}" for i in ch["token_ids"]])
        # streamed: every chunk's text is empty, the ids add up to the same tokens
        chunks, done = self.d.stream(prompt=PROMPT, max_tokens=n, temperature=0, detokenize=False)
        self.assertTrue(done)
        self.assertEqual({c["choices"][0]["text"] for c in chunks if c["choices"]}, {""})
        self.assertEqual([t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]], REF[PROMPT]["ids"][:n])
        # stop strings need text: 400 naming stop (vLLM's rule), on both routes
        self.assertIn("detokenize", self.bad({"prompt": PROMPT, "detokenize": False, "stop": ["Lily"]}, "stop"))
        self.bad({**chat, "detokenize": False, "stop": "x"}, "stop", "/v1/chat/completions")

    def test_cache_salt_separates_the_prefix_cache(self):
        prompt = PROMPT + " there was a little girl named Lily who liked to"

        def cached(**kw):
            return self.d.complete(prompt=prompt, max_tokens=1, temperature=0, **kw)["usage"]["prompt_tokens_details"]["cached_tokens"]

        self.d.post("/reset_prefix_cache")
        self.assertEqual(cached(cache_salt="alice"), 0)
        self.assertGreater(cached(cache_salt="alice"), 0)  # same salt: hit
        self.assertEqual(cached(cache_salt="bob"), 0)       # another salt: miss
        self.assertEqual(cached(), 0)                       # unsalted: miss
        self.assertGreater(cached(), 0)

    def test_continuous_usage_stats(self):
        chunks, done = self.d.stream(prompt=PROMPT, max_tokens=6, temperature=0,
                                     stream_options={"include_usage": True, "continuous_usage_stats": True})
        self.assertTrue(done)
        token_chunks = [c for c in chunks if c["choices"]]
        self.assertTrue(all("usage" in c for c in token_chunks), token_chunks)
        seen = 0
        for c in token_chunks:
            seen += len(c["choices"][0]["token_ids"])
            self.assertEqual(c["usage"]["completion_tokens"], seen)
            self.assertEqual(c["usage"]["prompt_tokens"], len(IDS))
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 6)
        # with include_usage false it adds nothing (vLLM needs both; include_usage left out is true:
        # test_stream_options_defaults_as_vllm)
        chunks, _ = self.d.stream(prompt=PROMPT, max_tokens=3, stream_options={"include_usage": False, "continuous_usage_stats": True})
        self.assertFalse(any("usage" in c for c in chunks))
        self.bad({"prompt": PROMPT, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
                 "stream_options.continuous_usage_stats")
        # n 2: each chunk counts its own choice's tokens (vLLM's previous_num_tokens[i]); the old
        # daemon summed every choice's (1, 2, 3, 4)
        chunks, _ = self.d.stream(prompt=PROMPT, max_tokens=3, n=2, temperature=0, ignore_eos=True,
                                  stream_options={"include_usage": True, "continuous_usage_stats": True})
        seen = {}
        for c in chunks:
            if c["choices"]:
                i = c["choices"][0]["index"]
                seen[i] = seen.get(i, 0) + len(c["choices"][0]["token_ids"])
                self.assertEqual((c["usage"]["completion_tokens"], c["usage"]["prompt_tokens"]), (seen[i], len(IDS)), c)
        self.assertEqual(seen, {0: 3, 1: 3})
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 6)  # the final chunk: every choice

    def test_stream_options_defaults_as_vllm(self):
        """vLLM's StreamOptions.include_usage defaults to true, and only a non-empty stream_options
        without stream is refused (the old daemon: no usage chunk for {}, and {} without stream a 400)."""
        chunks, done = self.d.stream(prompt=PROMPT, max_tokens=3, temperature=0, stream_options={})
        self.assertTrue(done)
        self.assertEqual((chunks[-1]["choices"], chunks[-1]["usage"]["completion_tokens"]), ([], 3))
        chunks, _ = self.d.stream(prompt=PROMPT, max_tokens=3, stream_options={"continuous_usage_stats": True})
        self.assertTrue(all("usage" in c for c in chunks))  # include_usage true by default: both on
        chunks, _ = self.d.stream(prompt=PROMPT, max_tokens=3, stream_options={"include_usage": None})
        self.assertFalse(any("usage" in c for c in chunks))  # an explicit null is false (pydantic: None)
        j = self.d.complete(prompt=PROMPT, max_tokens=3, stream_options={})
        self.assertEqual(j["usage"]["completion_tokens"], 3)
        self.bad({"prompt": PROMPT, "stream_options": {"include_usage": False}}, "stream_options")

    def test_logprob_tokens_are_decoded_text(self):
        c = self.d.complete(prompt=PROMPT, max_tokens=40, temperature=0, logprobs=2)["choices"][0]
        lp = c["logprobs"]
        self.assertEqual("".join(lp["tokens"]), c["text"])  # decoded text, as OpenAI and vLLM return it
        self.assertFalse(any("\u2581" in t for t in lp["tokens"]), lp["tokens"])
        self.assertEqual(lp["tokens"][:3], [",", " there", " was"])
        self.assertIn(" there", lp["top_logprobs"][1])
        ch = self.d.post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40,
                                                  "temperature": 0, "logprobs": True, "top_logprobs": 2})[1]["choices"][0]
        self.assertEqual([e["token"] for e in ch["logprobs"]["content"]], lp["tokens"])
        self.assertEqual([e["bytes"] for e in ch["logprobs"]["content"]], [list(t.encode()) for t in lp["tokens"]])
        # the exact tokens stay available
        c = self.d.complete(prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, return_tokens_as_token_ids=True)["choices"][0]
        self.assertEqual(c["logprobs"]["tokens"], [f"token_id:{i}" for i in c["token_ids"]])

    def test_embedded_chat_template(self):
        """stories260K ships a chat template: BOS, then the messages' text joined by spaces."""
        code, j = self.d.post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 30,
                                                       "temperature": 0})
        self.assertEqual(code, 200, j)
        c = j["choices"][0]
        self.assertEqual(c["prompt_token_ids"], IDS)
        self.assertEqual(c["token_ids"], REF[PROMPT]["ids"][:30])
        j = self.d.post("/v1/chat/completions", {"messages": [{"role": "system", "content": "Lily"},
                                                              {"role": "user", "content": "and Tom"}], "max_tokens": 10,
                                                 "temperature": 0})[1]
        self.assertEqual(j["choices"][0]["token_ids"], REF["Lily and Tom"]["ids"][:10])
        # a request's own template needs --trust-request-chat-template (vLLM's rule)
        self.assertIn("--trust-request-chat-template",
                      self.bad({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ bos_token }}Lily and Tom"},
                               "chat_template", "/v1/chat/completions"))


    def test_completion_ids_carry_128_random_bits(self):
        ids = {self.d.complete(prompt=PROMPT, max_tokens=1)["id"] for _ in range(20)}
        self.assertEqual(len(ids), 20)
        self.assertTrue(all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids), ids)
        j = self.d.post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1})[1]
        self.assertRegex(j["id"], r"^chatcmpl-[0-9a-f]{32}$")


class VllmHabitFlags(unittest.TestCase):
    """vLLM's flags typed by habit: accepted with vLLM's meaning, or refused naming ours."""

    def test_serve_model_and_accepted_flags(self):
        tmp = tempfile.mkdtemp(prefix="fd-vf-")
        try:
            wrapper = os.path.join(tmp, "vllm-style")
            with open(wrapper, "w") as f:
                f.write(f'#!/bin/sh\nexec "{BIN}" serve "{STORIES}" "$@"\n')
            os.chmod(wrapper, 0o755)
            with Daemon("--enable-sleep-mode", "--dtype", "auto", "--max-logprobs", "2", model=None, bin=wrapper) as d:
                self.assertEqual(d.get("/v1/models")[1]["data"][0]["id"], "stories260K")
                self.assertEqual(d.complete(model="stories260K", prompt=PROMPT, max_tokens=1)["model"], "stories260K")
                self.assertEqual(d.post("/sleep?level=1")[0], 200)  # --enable-sleep-mode = --dynamic-load-weight
                self.assertEqual(d.post("/wake_up")[0], 200)
                code, j = d.post("/v1/completions", {"prompt": PROMPT, "logprobs": 3})
                self.assertEqual((code, j["error"]["param"]), (400, "logprobs"), j)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_several_served_model_names(self):
        """vLLM's --served-model-name takes several names: a request may give any, /v1/models lists
        each, responses report the first (the old daemon exited 2)."""
        with Daemon("--served-model-name", "policy", "policy-alias") as d:
            self.assertEqual([m["id"] for m in d.get("/v1/models")[1]["data"]], ["policy", "policy-alias"])
            for name in ("policy", "policy-alias"):
                self.assertEqual(d.complete(model=name, prompt=PROMPT, max_tokens=1)["model"], "policy")
                self.assertEqual(d.get(f"/v1/models/{name}")[1]["id"], name)
            code, j = d.post("/v1/completions", {"model": "stories260K", "prompt": PROMPT, "max_tokens": 1})
            self.assertEqual((code, j["error"]["param"]), (404, "model"), j)

    def test_help_states_the_defaults_of_negatable_flags(self):
        out = subprocess.run([BIN, "--help"], capture_output=True, text=True, timeout=60).stdout
        lines = out.splitlines()
        # a flag's line and the next (CLI11 puts the description there after a long name)
        line = {n: " ".join(lines[i:i + 2]) for n in ("--enable-prefix-caching,", "--no-batch-invariant")
                for i in [next(k for k, x in enumerate(lines) if x.startswith("  -") and n in x)]}  # option lines, not the header
        self.assertIn("[default: off]", line["--enable-prefix-caching,"])  # CLI11's "{false}" is the value --no-… sets
        self.assertIn("[default: batch-invariant kernels", line["--no-batch-invariant"])

    def test_usage_md_names_every_flag_help_lists(self):
        """docs/usage.md's flag list against --help (a probe: --kv-cache-dtype, --dist-backend,
        --enable-expert-parallel and --enable-return-routed-experts were missing, and
        --speculative-config's help showed only n-gram fields though "mtp" exists)."""
        out = subprocess.run([BIN, "--help"], capture_output=True, text=True, timeout=60).stdout
        flags = {f for line in out.splitlines() if line.startswith("  -")
                 for f in re.findall(r"--[a-z0-9_-]+", line.split()[0].split("{")[0]) if f != "--help"}
        with open(os.path.join(REPO, "docs", "usage.md")) as f:
            usage = f.read()
        self.assertGreater(len(flags), 50)
        self.assertEqual(sorted(f for f in flags if not re.search(rf"`{re.escape(f)}[` ]", usage)), [])
        spec = next(i for i, x in enumerate(out.splitlines()) if x.startswith("  --speculative-config"))
        self.assertIn('"mtp"', " ".join(out.splitlines()[spec:spec + 2]))

    def test_refused_flags_name_the_equivalent(self):
        for args, says in [(["--dtype", "float16"], "checkpoint's own dtype"), (["--seed", "1"], "in each request"),
                           (["--dtype", "bfloat16"], "pass --compute-dtype bfloat16"),  # the flag that gives bf16 arithmetic
                           (["--dtype", "float16"], "F16 is widened to F32")]:  # README: weights stay F32 or BF16
            p = subprocess.run([BIN, "--model", STORIES, "--port", str(free_port()), *args], capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(says, p.stdout + p.stderr)


class ChatTemplateFlags(unittest.TestCase):
    def test_chat_template_flag_and_trusted_request_template(self):
        tmp = tempfile.mkdtemp(prefix="fd-ct-")
        try:
            path = os.path.join(tmp, "t.jinja")
            with open(path, "w") as f:
                f.write("{{ bos_token }}{{ messages[-1]['content'] }} and Tom")
            with Daemon("--chat-template", path, "--trust-request-chat-template") as d:
                j = d.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Lily"}], "max_tokens": 10,
                                                    "temperature": 0})[1]
                self.assertEqual(j["choices"][0]["prompt_token_ids"], REF["Lily and Tom"]["prompt_ids"])
                self.assertEqual(j["choices"][0]["token_ids"], REF["Lily and Tom"]["ids"][:10])
                j = d.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "ignored"}], "max_tokens": 10,
                                                    "temperature": 0, "chat_template": "{{ bos_token }}Once upon a time"})[1]
                self.assertEqual(j["choices"][0]["token_ids"], REF[PROMPT]["ids"][:10])
                code, j = d.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "chat_template": "{% for m in messages %}"})
                self.assertEqual((code, j["error"]["param"]), (400, "chat_template"), j)
            d = Daemon("--chat-template", os.path.join(tmp, "missing.jinja"), wait=False)
            try:
                d.proc.wait(60)
                self.assertNotEqual(d.proc.returncode, 0)
                self.assertIn("neither a readable file nor a Jinja template", d.output())
            finally:
                d.__exit__(None)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class TokenizerBeyondVocab(unittest.TestCase):
    def test_a_prompt_encoding_past_vocab_size_is_a_400_and_harms_no_other_request(self):
        """A probe: a tokenizer.json with an added token (id 600) past config.json's vocab_size (512)
        started, and a prompt holding it failed with 500 — and so did other clients' requests in
        the same batch. Now that prompt is a 400 naming it, the others run, and start-up warns."""
        import json, threading
        tmp = tempfile.mkdtemp(prefix="fd_vocab_")
        try:
            ck = os.path.join(tmp, "ck")
            shutil.copytree(STORIES, ck)
            os.unlink(os.path.join(ck, "tokenizer.model"))
            with open(os.path.join(ck, "tokenizer.json")) as f:
                tj = json.load(f)
            tj["added_tokens"].append({"id": 600, "content": "<extra>", "single_word": False, "lstrip": False, "rstrip": False,
                                       "normalized": False, "special": True})
            with open(os.path.join(ck, "tokenizer.json"), "w") as f:
                json.dump(tj, f)
            with Daemon(model=ck) as d:
                results = []
                long_run = threading.Thread(target=lambda: results.append(d.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 60, "n": 8, "temperature": 0})))
                long_run.start()
                for _ in range(5):
                    code, j = d.post("/v1/completions", {"prompt": "Hello <extra> world", "max_tokens": 4})
                    self.assertEqual(code, 400, j)
                    self.assertEqual(j["error"]["param"], "prompt")
                    self.assertIn("600", j["error"]["message"])
                code, j = d.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi <extra>"}], "max_tokens": 2})
                self.assertEqual(code, 400, j)
                long_run.join(60)
                code, j = results[0]
                self.assertEqual(code, 200, j)
                self.assertEqual(j["choices"][0]["token_ids"], REF[PROMPT]["ids"][:60])
                self.assertIn("vocab_size is 512", d.output())
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()

