"""Scoring on the real daemon (stories260K): `echo` + `logprobs` returns the prompt tokens'
logprobs (the first null), `max_tokens: 0` + `echo` scores without generating, vLLM's
`prompt_logprobs` (completions per choice, chat top level), `text_offset` in characters
(continuing across stream chunks), `return_tokens_as_token_ids`.

The references: a prompt token's logprob must equal, bit for bit, the logprob the same daemon
reports when it generates that token greedily after the same prefix; scoring alone, batched with
other prompts, next to running generations, in small prefill chunks and with prefix caching on
must all give the same bits; and each logprob must match the numpy forward (np_llama.py, written
from the HF conventions, not from the engine) to float tolerance."""
import os
import sys
import threading
import unittest

import numpy as np

from fdtest import REF, STORIES, Daemon

sys.path.insert(0, os.path.dirname(__file__))
import np_llama  # noqa: E402

PROMPT = "Once upon a time"


def score(d, prompt, k=2, **kw):
    """Echo-scoring answer's first choice for `prompt` (text or ids), nothing generated."""
    return d.complete(prompt=prompt, max_tokens=0, echo=True, logprobs=k, **kw)["choices"][0]


class Scoring(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon()
        # Prefill in chunks of 16 tokens with prefix caching on: neither may change a bit.
        cls.chunked = Daemon("--max-num-batched-tokens", "16", "--enable-prefix-caching")
        cls.cfg, cls.w = np_llama.load(STORIES)

    @classmethod
    def tearDownClass(cls):
        cls.d.__exit__(None)
        cls.chunked.__exit__(None)

    def test_echo_logprobs_hold_the_prompt_tokens_first_one_null(self):
        ref = REF[PROMPT]
        c = self.d.complete(prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True)["choices"][0]
        lp = c["logprobs"]
        n_p = len(ref["prompt_ids"])
        self.assertEqual(len(lp["tokens"]), n_p + 6)
        self.assertIsNone(lp["token_logprobs"][0])
        self.assertIsNone(lp["top_logprobs"][0])
        self.assertTrue(all(isinstance(v, float) and v < 0 for v in lp["token_logprobs"][1:]))
        self.assertEqual(c["text"], ref["text"][:len(c["text"])])
        self.assertEqual(c["token_ids"], ref["ids"][:6])
        # The prompt part equals a pure scoring request; the generated part the non-echo answer.
        s = score(self.d, PROMPT)
        self.assertEqual(s["logprobs"]["token_logprobs"], lp["token_logprobs"][:n_p])
        self.assertEqual(s["logprobs"]["top_logprobs"], lp["top_logprobs"][:n_p])
        g = self.d.complete(prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)["choices"][0]["logprobs"]
        self.assertEqual(g["token_logprobs"], lp["token_logprobs"][n_p:])

    def test_max_tokens_zero_scores_without_generating(self):
        j = self.d.complete(prompt=[PROMPT, "Lily and Tom"], max_tokens=0, echo=True, logprobs=0)
        for c, p in zip(j["choices"], [PROMPT, "Lily and Tom"]):
            self.assertEqual(c["text"], p)
            self.assertEqual(c["token_ids"], [])
            self.assertEqual(c["finish_reason"], "length")
            self.assertEqual(len(c["logprobs"]["token_logprobs"]), len(REF[p]["prompt_ids"]))
            lp = c["logprobs"]  # logprobs 0: each row holds the token itself (OpenAI, vLLM)
            self.assertEqual(lp["top_logprobs"][1:], [{t: v} for t, v in zip(lp["tokens"][1:], lp["token_logprobs"][1:])])
        self.assertEqual(j["usage"]["completion_tokens"], 0)
        self.assertEqual(j["usage"]["prompt_tokens"], 10)

    def test_prompt_logprob_equals_the_greedy_generation_logprob_bitwise(self):
        for prompt, ref in REF.items():
            g = self.d.complete(prompt=prompt, max_tokens=40, temperature=0, logprobs=3)["choices"][0]
            ids = ref["prompt_ids"] + g["token_ids"]
            s = score(self.d, ids, k=3)
            n_p = len(ref["prompt_ids"])
            self.assertEqual(s["logprobs"]["token_logprobs"][n_p:], g["logprobs"]["token_logprobs"])
            self.assertEqual(s["logprobs"]["top_logprobs"][n_p:], g["logprobs"]["top_logprobs"])

    def test_scores_match_the_numpy_forward(self):
        ids = REF[PROMPT]["prompt_ids"] + REF[PROMPT]["ids"][:30]
        lg = np_llama.logits(self.cfg, self.w, ids).astype(np.float64)
        ref = lg - lg.max(-1, keepdims=True)
        ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
        got = score(self.d, ids, k=0)["logprobs"]["token_logprobs"]
        want = [ref[i - 1, ids[i]] for i in range(1, len(ids))]
        np.testing.assert_allclose(got[1:], want, rtol=0, atol=2e-4)

    def test_batch_invariance_chunking_and_prefix_cache(self):
        ids = REF[PROMPT]["prompt_ids"] + REF[PROMPT]["ids"]  # 65 tokens: 5 chunks of 16 on `chunked`
        alone = score(self.d, ids, k=3)
        others = [REF["Lily and Tom"]["prompt_ids"] + REF["Lily and Tom"]["ids"][:k] for k in (3, 17, 40)]
        batched = self.d.complete(prompt=[others[0], ids, others[1], others[2]], max_tokens=0, echo=True,
                                  logprobs=3)["choices"][1]
        self.assertEqual(batched["logprobs"], alone["logprobs"])
        # Next to running generations (decode rows in the same steps).
        results = []
        gens = [threading.Thread(target=lambda: results.append(self.d.complete(prompt="Lily and Tom", max_tokens=200,
                                                                                   temperature=0, ignore_eos=True)))
                for _ in range(2)]
        for t in gens:
            t.start()
        busy = score(self.d, ids, k=3)
        for t in gens:
            t.join()
        self.assertEqual(busy["logprobs"], alone["logprobs"])
        # Chunked prefill, then the same prompt again with its blocks in the prefix cache: every row
        # is still computed and scored.
        for _ in range(2):
            c = score(self.chunked, ids, k=3)
            self.assertEqual(c["logprobs"], alone["logprobs"])
        g = self.chunked.complete(prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=3)["choices"][0]
        self.assertEqual(g["logprobs"]["token_logprobs"][:len(ids)], alone["logprobs"]["token_logprobs"])
        self.assertEqual(g["token_ids"],
                         self.d.complete(prompt=ids, max_tokens=4, temperature=0)["choices"][0]["token_ids"])

    def test_prompt_logprobs_field(self):
        ids = REF[PROMPT]["prompt_ids"]
        c = self.d.complete(prompt=PROMPT, max_tokens=2, temperature=0, prompt_logprobs=3)["choices"][0]
        pl = c["prompt_logprobs"]
        self.assertIsNone(c["logprobs"])
        self.assertEqual(len(pl), len(ids))
        self.assertIsNone(pl[0])
        echo = score(self.d, PROMPT, k=3)["logprobs"]
        for i in range(1, len(ids)):
            d = pl[i]
            self.assertIn(str(ids[i]), d)
            self.assertEqual(d[str(ids[i])]["logprob"], echo["token_logprobs"][i])
            self.assertEqual(sorted(v["rank"] for v in d.values())[:3], [1, 2, 3])
            self.assertIn(len(d), (3, 4))  # the top 3, plus the prompt token when it is not among them
            pieces = self.pieces([int(k) for k in d])
            for (k, v), piece in zip(d.items(), pieces):
                self.assertIsInstance(v["decoded_token"], str)
                if v["rank"] <= 3:  # the top 3 are those of the echo logprobs
                    self.assertEqual(v["logprob"], echo["top_logprobs"][i][piece])
            # rank = number of tokens at least as likely (vLLM): here all logprobs are distinct.
            mine = d[str(ids[i])]
            self.assertEqual(mine["rank"] <= 3, mine["logprob"] >= min(echo["top_logprobs"][i].values()))
            if mine["rank"] <= 3:
                self.assertEqual(mine["rank"], 1 + sum(v["logprob"] > mine["logprob"] for v in d.values()))
        self.assertEqual(pl[1][str(ids[1])]["decoded_token"], " Once")
        # Without the field: null; echo + logprobs fills it with k = logprobs (vLLM).
        self.assertIsNone(self.d.complete(prompt=PROMPT, max_tokens=1)["choices"][0]["prompt_logprobs"])
        e = score(self.d, PROMPT, k=3)
        self.assertEqual(e["prompt_logprobs"], pl)

    def pieces(self, ids):
        """The vocabulary pieces of ids, as the logprobs name them."""
        c = self.d.complete(prompt=[1] + ids, max_tokens=0, echo=True, logprobs=0)["choices"][0]
        return c["logprobs"]["tokens"][1:]

    def test_text_offset_counts_characters_and_continues_across_chunks(self):
        # "é": one character, two UTF-8 bytes; offsets after it count characters (Python's len).
        prompt = "Once upon a café, the"
        c = self.d.complete(prompt=prompt, max_tokens=12, temperature=0, logprobs=1, echo=True)["choices"][0]
        lp, text = c["logprobs"], c["text"]
        self.assertTrue(text.startswith(prompt))
        offs = lp["text_offset"]
        self.assertEqual(offs, sorted(offs))
        n_p = len(c["prompt_token_ids"])
        self.assertEqual(offs[n_p], len(prompt))  # generated text starts after the prompt's characters
        # Generated tokens: each offset advances by the characters of its piece ("▁" is a space).
        for i in range(n_p, len(offs) - 1):
            self.assertEqual(offs[i + 1] - offs[i], len(lp["tokens"][i].replace("\u2581", " ")), lp["tokens"][i])
        self.assertEqual(text[len(prompt):], "".join(t.replace("\u2581", " ") for t in lp["tokens"][n_p:]))
        # Prompt tokens: "," is at character 16 (byte 17).
        i_comma = lp["tokens"].index(",")
        self.assertEqual(offs[i_comma], prompt.index(","))
        # Streaming: offsets continue from chunk to chunk and equal the non-streamed ones.
        chunks, done = self.d.stream(prompt=prompt, max_tokens=12, temperature=0, logprobs=1, echo=True)
        self.assertTrue(done)
        streamed = [o for ch in chunks for x in ch["choices"] for o in x["logprobs"]["text_offset"]]
        self.assertEqual(streamed, offs)
        plain = self.d.stream(prompt=prompt, max_tokens=12, temperature=0, logprobs=1)[0]
        self.assertEqual([o for ch in plain for x in ch["choices"] for o in x["logprobs"]["text_offset"]],
                         [o - len(prompt) for o in offs[n_p:]])

    def test_return_tokens_as_token_ids(self):
        c = self.d.complete(prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, echo=True,
                            return_tokens_as_token_ids=True)["choices"][0]
        ids = c["prompt_token_ids"] + c["token_ids"]
        self.assertEqual(c["logprobs"]["tokens"], [f"token_id:{i}" for i in ids])
        for top in c["logprobs"]["top_logprobs"][1:]:
            self.assertTrue(all(k.startswith("token_id:") for k in top))
        self.assertIn(f"token_id:{ids[-1]}", c["logprobs"]["top_logprobs"][-1])

    def test_bad_values(self):
        status, j = self.d.post("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "stream": True})
        self.assertEqual(status, 400)
        self.assertEqual(j["error"]["param"], "prompt_logprobs")
        # vLLM refuses only prompt_logprobs > 0 with stream; 0 streams as usual, with no prompt
        # logprobs (the old daemon: 400)
        chunks, done = self.d.stream(prompt=PROMPT, max_tokens=2, temperature=0, prompt_logprobs=0)
        self.assertTrue(done)
        self.assertEqual(sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]), 2)
        self.assertFalse(any(c["choices"][0].get("prompt_logprobs") for c in chunks if c["choices"]))
        status, j = self.d.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
        self.assertEqual(status, 400)
        self.assertEqual(j["error"]["param"], "max_tokens")


if __name__ == "__main__":
    unittest.main()
