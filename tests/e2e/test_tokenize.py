"""POST /tokenize and /detokenize (vLLM's shapes) on stories260K's SentencePiece tokenizer and on a
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

    def test_skip_special_tokens_on_completions(self):
        # Token-id prompts ending in EOS-free text; the field is accepted and validated.
        j = self.d.complete(prompt="Once upon a time", max_tokens=5, temperature=0, skip_special_tokens=False,
                            spaces_between_special_tokens=False)
        k = self.d.complete(prompt="Once upon a time", max_tokens=5, temperature=0)
        self.assertEqual(j["choices"][0]["text"], k["choices"][0]["text"])   # no special token generated
        status, e = self.d.post("/v1/completions", {"prompt": "x", "skip_special_tokens": 1})
        self.assertEqual(status, 400, e)


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
