"""Architectures with the models' real tokenizers (issue 11): a Qwen3-shaped random checkpoint
(vocab 151936, head_dim 128, q_norm/k_norm, tied) with Qwen3's real tokenizer.json and chat
template, and a Llama-3.2-shaped one (vocab 128256, rope_scaling llama3 with Llama-3.2's real
values, tied) with Llama-3.1's, and a Mistral-shaped one with Llama-2's Metaspace tokenizer.json,
all from the npm fixtures. A chat completion renders the
model's template, and the tokens it generates greedily equal the numpy forward (np_llama.py) on
the prompt ids the daemon reports, with logprobs within tolerance; the text is their decoding."""
import os
import shutil
import tempfile
import unittest

from fdtest import Daemon, make_checkpoint, read_json, write_json
from test_architectures import LOGPROB_TOL, numpy_greedy

NPM = os.environ.get("FD_NPM_FIXTURES", "")
N_NEW = 8

# (npm model dir, make_random_checkpoint args, chat_template_kwargs)
MODELS = {
    "qwen3": ("qwen3", ["--preset", "qwen3-like", "--vocab", "151936", "--max-pos", "40960"], {"enable_thinking": False}),
    "llama3.2": ("llama3_1", ["--preset", "llama3.2-like", "--vocab", "128256", "--hidden", "64", "--intermediate", "256",
                              "--heads", "2", "--kv-heads", "1", "--max-pos", "131072",
                              "--rope-scaling", '{"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, '
                                                '"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}'], {}),
}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Give me a short introduction to large language models, 用中文 too 🙂."}]


@unittest.skipUnless(os.path.isfile(os.path.join(NPM, "models", "qwen3", "tokenizer.json")), "run through ctest (the npm fixture step)")
class RealTokenizerModels(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-realtok-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def check(self, name):
        npm_dir, args, kwargs = MODELS[name]
        d = make_checkpoint(os.path.join(self.tmp, name), *args, "--seed", "7",
                            "--tokenizer-from", os.path.join(NPM, "models", npm_dir))
        cfg = read_json(os.path.join(d, "config.json"))
        with Daemon("--max-model-len", "256", model=d) as dm:
            status, j = dm.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": N_NEW, "temperature": 0,
                                                         "ignore_eos": True, "logprobs": True,
                                                         "chat_template_kwargs": kwargs})
            self.assertEqual(status, 200, j)
            c = j["choices"][0]
            prompt = c["prompt_token_ids"]
            _, rendered = dm.post("/detokenize", {"tokens": prompt})
            _, text = dm.post("/detokenize", {"tokens": c["token_ids"]})
        self.assertIn("用中文 too 🙂", rendered["prompt"])  # the template's rendering, through the real tokenizer
        self.assertGreater(len(prompt), 20)
        want, want_lp = numpy_greedy(d, prompt, n=N_NEW)
        self.assertEqual(c["token_ids"], want)
        got_lp = [x["logprob"] for x in c["logprobs"]["content"]]
        for i, (g, w) in enumerate(zip(got_lp, want_lp)):
            self.assertAlmostEqual(g, w, delta=LOGPROB_TOL, msg=f"step {i}")
        self.assertEqual(c["message"]["content"], text["prompt"])
        return cfg

    def test_mistral_with_the_llama2_metaspace_tokenizer(self):
        # Mistral-7B's tokenizer is Llama-2's Metaspace/byte-fallback form (vocab 32000 here, as
        # Llama-2's); Llama-2's ships no chat template, so a plain completion on text.
        d = make_checkpoint(os.path.join(self.tmp, "mistral"), "--preset", "mistral-like", "--vocab", "32000", "--seed", "8",
                            "--tokenizer-from", os.path.join(NPM, "models", "llama2"))
        with Daemon(model=d) as dm:
            c = dm.complete(prompt="Once upon a time, 用中文 too 🙂", max_tokens=N_NEW, temperature=0, ignore_eos=True,
                            logprobs=1)["choices"][0]
        prompt = c["prompt_token_ids"]
        self.assertGreater(len(prompt), 8)
        want, want_lp = numpy_greedy(d, prompt, n=N_NEW)
        self.assertEqual(c["token_ids"], want)
        for i, (g, w) in enumerate(zip(c["logprobs"]["token_logprobs"], want_lp)):
            self.assertAlmostEqual(g, w, delta=LOGPROB_TOL, msg=f"step {i}")

    def test_qwen3_with_its_tokenizer_and_template(self):
        cfg = self.check("qwen3")
        self.assertEqual((cfg["vocab_size"], cfg["head_dim"]), (151936, 128))

    def test_llama32_with_llama31_tokenizer_and_template(self):
        cfg = self.check("llama3.2")
        self.assertEqual(cfg["rope_scaling"]["original_max_position_embeddings"], 8192)


if __name__ == "__main__":
    unittest.main()
