"""POST /tokenize and /detokenize (vLLM's shapes) on stories260K, on its copy holding only the
SentencePiece tokenizer.model (special-token text, decoding, as the tokenizer.json path) and on a
model directory holding only a Hugging Face tokenizer.json (Llama-3.1's, from the npm fixtures):
that directory starts, and its token ids equal @lenml/tokenizers' (tokenizer_reference.json, made
by the CTest fixture step). A malformed tokenizer.json stops start-up naming the file and position;
tokenizer.json and tokenizer.model that disagree stop it naming both."""
import json
import os
import shutil
import tempfile
import unittest

from fdtest import Daemon, STORIES, make_checkpoint, read_json
from test_checkpoints import expect_startup_failure

NPM = os.environ.get("FD_NPM_FIXTURES", "")
REFERENCE = os.environ.get("FD_TOKENIZER_REFERENCE", "")


class StoriesTokenize(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()

    def test_tokenize_matches_the_reference_ids(self):
        # models/stories260K/README.md: "Once upon a time" → [1, 403, 407, 261, 378]
        status, j = self.d.post("/tokenize", {"prompt": "Once upon a time"})
        self.assertEqual(status, 200, j)
        self.assertEqual(j["tokens"], [1, 403, 407, 261, 378])
        self.assertEqual(j["count"], 5)
        _, models = self.d.get("/v1/models")
        self.assertEqual(j["max_model_len"], models["data"][0]["max_model_len"])
        self.assertIsNone(j["token_strs"])
        _, j = self.d.post("/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False,
                                         "return_token_strs": True})
        self.assertEqual(j["tokens"], [403, 407, 261, 378])
        self.assertEqual(j["token_strs"], ["\u2581Once", "\u2581upon", "\u2581a", "\u2581time"])

    def test_detokenize_keeps_special_tokens(self):
        status, j = self.d.post("/detokenize", {"tokens": [1, 403, 407, 261, 378]})
        self.assertEqual(status, 200, j)
        self.assertEqual(j, {"prompt": "<s> Once upon a time"})
        _, j = self.d.post("/detokenize", {"tokens": [403, 407, 261, 378]})
        self.assertEqual(j["prompt"], "Once upon a time")

    def test_bad_requests_are_400_naming_the_field(self):
        for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 3}, "prompt"),
                                  ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
                                  ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
                                  ("/tokenize", {"messages": []}, "messages"),
                                  ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
                                  ("/detokenize", {"tokens": "1 2"}, "tokens"), ("/detokenize", {}, "tokens")]:
            status, j = self.d.post(path, body)
            self.assertEqual(status, 400, (path, body, j))
            self.assertEqual(j["error"]["param"], param, (path, body, j))
        status, j = self.d.post("/tokenize", {"prompt": "x", "model": "other"})
        self.assertEqual(status, 404, j)

    def test_decode_fields_on_completions_are_validated(self):
        for key in ("skip_special_tokens", "spaces_between_special_tokens"):
            status, e = self.d.post("/v1/completions", {"prompt": "x", key: 1})
            self.assertEqual(status, 400, e)
            self.assertEqual(e["error"]["param"], key)


class SentencePieceOnly(unittest.TestCase):
    """stories260K without its tokenizer.json (the SentencePiece tokenizer.model path) against the
    full copy (tokenizer.json, LlamaConverter form): special-token text in a prompt is one token
    there as in HF (slow LlamaTokenizer with split_special_tokens=False, the fast tokenizer
    converted from it, vLLM), so a multi-turn Llama-2 prompt gets ids 2 and 1, not the characters
    < / s > (a probe); ids with specials decode alike."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-sp-only-")
        cls.model = os.path.join(cls.tmp, "sp")
        os.makedirs(cls.model)
        for f in os.listdir(STORIES):
            if f != "tokenizer.json":
                os.symlink(os.path.join(STORIES, f), os.path.join(cls.model, f))
        cls.sp = Daemon(model=cls.model)
        cls.json = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.sp.stop()
        cls.json.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_special_token_text_is_one_token(self):
        self.assertIn("tokenizer: sentencepiece", self.sp.output())
        tok = lambda d, text, special=False: d.post("/tokenize", {"prompt": text, "add_special_tokens": special})[1]["tokens"]
        hi, there = tok(self.sp, "hi"), tok(self.sp, "there")
        self.assertEqual(tok(self.sp, "hi </s> there <s>"), hi + [2] + there + [1])
        self.assertEqual(tok(self.sp, "<unk>"), [0])
        for text in ("hi </s> there <s>", "[INST] hi [/INST] yo </s><s>[INST] ok [/INST]", "a</s>b<s>c", " <s> ", "<s>hello</s>",
                     "x <unk>  y", "</", "<s", "\n<s>\n"):
            for special in (False, True):
                self.assertEqual(tok(self.sp, text, special), tok(self.json, text, special), (text, special))

    def test_ids_with_special_tokens_decode_as_the_tokenizer_json_path(self):
        for ids in ([2, 133, 378, 485, 67, 0], [1, 403, 407, 2], [403, 2, 407, 1, 13, 378], [0, 0, 2]):
            _, a = self.sp.post("/detokenize", {"tokens": ids})
            _, b = self.json.post("/detokenize", {"tokens": ids})
            self.assertEqual(a, b, ids)
        self.assertEqual(self.sp.post("/detokenize", {"tokens": [2, 133, 378, 485, 67, 0]})[1]["prompt"], "</s>\ufffd time\u00e9@<unk>")
        body = dict(prompt="Once upon", max_tokens=24, temperature=2.0, seed=3, ignore_eos=True, skip_special_tokens=False)
        for sb in (True, False):
            a = self.sp.complete(**body, spaces_between_special_tokens=sb)["choices"][0]
            b = self.json.complete(**body, spaces_between_special_tokens=sb)["choices"][0]
            self.assertEqual(a["token_ids"], b["token_ids"])
            self.assertEqual(a["text"], b["text"])


def byte_level_tokenizer_json(n_special):
    """A byte-level tokenizer.json: the 256 GPT-2 byte characters, no merges, and `n_special`
    special added tokens <|sK|> after them."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): b for b, c in zip(bs, cs)}
    return {"added_tokens": [{"id": 256 + k, "content": f"<|s{k}|>", "special": True} for k in range(n_special)],
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
            "post_processor": None, "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "vocab": vocab, "merges": []}}


class SkipSpecialTokens(unittest.TestCase):
    """A random 512-id model whose upper half are special tokens, so sampling emits many."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-special-")
        cls.model = make_checkpoint(os.path.join(cls.tmp, "m"), "--vocab", "512", "--tokenizer-from", cls.tmp)
        with open(os.path.join(cls.model, "tokenizer.json"), "w") as f:
            json.dump(byte_level_tokenizer_json(256), f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_generated_special_tokens_are_skipped_or_kept(self):
        with Daemon(model=self.model) as d:
            # A hot temperature mixes bytes (some lone UTF-8 lead/continuation bytes) and specials.
            body = dict(prompt="a<|s5|>b<|s9|>", max_tokens=24, temperature=10.0, seed=1, ignore_eos=True)
            skipped = d.complete(**body)["choices"][0]
            kept = d.complete(**body, skip_special_tokens=False)["choices"][0]
            ids = skipped["token_ids"]
            self.assertEqual(kept["token_ids"], ids)
            self.assertGreater(sum(t >= 256 for t in ids), 0)
            _, full = d.post("/detokenize", {"tokens": ids})
            _, plain = d.post("/detokenize", {"tokens": [t for t in ids if t < 256]})
            self.assertEqual(kept["text"], full["prompt"])
            self.assertEqual(skipped["text"], plain["prompt"])
            self.assertIn("<|s", kept["text"])
            self.assertNotIn("<|s", skipped["text"])
            # Streaming gives the same text, chunk by chunk.
            chunks, done = d.stream(**body, skip_special_tokens=False)
            self.assertTrue(done)
            self.assertEqual("".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), kept["text"])


@unittest.skipUnless(os.path.isfile(os.path.join(NPM, "models", "llama3_1", "tokenizer.json")) and
                     os.path.isfile(REFERENCE), "run through ctest (the npm fixture steps)")
class TokenizerJsonOnly(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-tokjson-")
        cls.model = make_checkpoint(os.path.join(cls.tmp, "llama3"), "--vocab", "128256", "--hidden", "32",
                                    "--intermediate", "64", "--layers", "1", "--heads", "2",
                                    "--tokenizer-from", os.path.join(NPM, "models", "llama3_1"))
        assert not os.path.exists(os.path.join(cls.model, "tokenizer.model"))
        cls.ref = read_json(REFERENCE)["models"]["llama3_1"]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_starts_and_tokenizes_like_the_reference(self):
        with Daemon(model=self.model) as d:
            self.assertIn("tokenizer: tokenizer.json", d.output())
            for case in self.ref["cases"][::7]:
                status, j = d.post("/tokenize", {"prompt": case["text"]})
                self.assertEqual(status, 200, j)
                self.assertEqual(j["tokens"], case["ids"], case["text"])
                _, j = d.post("/detokenize", {"tokens": case["ids"]})
                self.assertEqual(j["prompt"], case["decoded"])
            case = self.ref["cases"][0]
            j = d.complete(prompt=case["text"], max_tokens=8, temperature=0, ignore_eos=True)
            self.assertEqual(j["choices"][0]["prompt_token_ids"], case["ids"])
            gen = j["choices"][0]["token_ids"]
            if all(t < 128000 for t in gen):
                _, t = d.post("/detokenize", {"tokens": gen})
                self.assertEqual(j["choices"][0]["text"], t["prompt"])

    def test_streamed_text_with_stop_strings_is_whole_characters(self):
        """A stop string's held-back bytes never cut a UTF-8 character: the deltas join to the
        non-streamed text and none carries U+FFFD (a probe saw ' ت\ufffd' streamed for ' تن')."""
        with Daemon(model=self.model) as d:
            n_non_ascii = 0
            for seed in range(12):
                body = {"prompt": "Hello", "max_tokens": 24, "temperature": 3.0, "seed": seed, "ignore_eos": True,
                        "stop": ["ET", "\n\n"]}
                want = d.complete(**body)["choices"][0]["text"]
                chunks, done = d.stream(**body)
                self.assertTrue(done)
                got = [c["choices"][0]["text"] for c in chunks if c.get("choices")]
                self.assertEqual("".join(got), want, (seed, got))
                self.assertFalse(any("\ufffd" in g for g in got) and "\ufffd" not in want, (seed, got))
                n_non_ascii += any(ord(ch) > 127 for ch in want)
            self.assertGreater(n_non_ascii, 3)  # the case is exercised

    def test_malformed_tokenizer_json_names_file_and_position(self):
        bad = os.path.join(self.tmp, "bad")
        shutil.copytree(self.model, bad)
        path = os.path.join(bad, "tokenizer.json")
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[:5000])
        err = expect_startup_failure(self, bad, "tokenizer.json", "not valid JSON")
        self.assertRegex(err, r"byte \d+")
        # A well-formed file with a wrong field names the field.
        j = json.loads(data)
        j["model"]["merges"][3] = 17
        with open(path, "w") as f:
            json.dump(j, f)
        expect_startup_failure(self, bad, "tokenizer.json", "model.merges[3]")
        shutil.rmtree(bad)

    def test_disagreeing_tokenizer_files_name_both(self):
        both = os.path.join(self.tmp, "both")
        shutil.copytree(self.model, both)
        shutil.copyfile(os.path.join(STORIES, "tokenizer.model"), os.path.join(both, "tokenizer.model"))
        expect_startup_failure(self, both, "tokenizer.json", "tokenizer.model", "disagree")
        shutil.rmtree(both)


if __name__ == "__main__":
    unittest.main()
