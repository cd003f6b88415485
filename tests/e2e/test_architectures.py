"""Architectures (issue 11): random-weight checkpoints with the real configs' shapes scaled down —
Llama-3.2-1B-like (rope_scaling llama3, tied), Qwen2.5-like (q/k/v biases, tied, an inactive
sliding_window), Qwen3-like (q_norm/k_norm, head_dim 128 != hidden/heads, tied), Mistral-like
(untied) — generate greedily exactly what the numpy forward (np_llama.py, transformers'
conventions) generates, with logprobs within tolerance; rope_scaling linear/dynamic too. The
numpy oracle is shown sensitive to the feature under test (without it, other tokens). Config
fields that change the math and are not implemented stop start-up naming the field; Qwen3's
norms are in `fdctl model-info` and travel through scripts/fdpublish.py to a live update."""
import json
import os
import shutil
import subprocess
import tempfile
import unittest

import numpy as np

import np_llama
from fdtest import (BIN, FDCTL, Daemon, copy_checkpoint, free_port, log_softmax, make_checkpoint, prompt_ids, read_json,
                    rewrite_tensors, write_json)

import fdpublish  # noqa: E402  (scripts/ is on sys.path via fdtest)

N_NEW = 12
LOGPROB_TOL = 1e-4  # measured differences ~5e-6


def numpy_greedy(model_dir, prompt, n=N_NEW, cfg_edit=None, drop=()):
    """(ids, logprob of each) of n greedy steps of the numpy forward; cfg_edit(cfg) may change the
    config and `drop` names weight suffixes to leave out (for the sensitivity checks)."""
    cfg, w = np_llama.load(model_dir)
    if cfg_edit:
        cfg_edit(cfg)
    for k in [k for k in w if k.endswith(tuple(drop))] if drop else []:
        del w[k]
    ids, out, lps = list(prompt), [], []
    for _ in range(n):
        lg = np_llama.logits(cfg, w, ids)[-1]
        t = int(np.argmax(lg))
        out.append(t)
        lps.append(float(log_softmax(lg)[t]))
        ids.append(t)
    return out, lps


def startup_error(model_dir, *args):
    p = subprocess.run([BIN, "--model", model_dir, "--port", str(free_port()), *args], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0, "fdrollout started on a config it must refuse"
    return p.stderr + p.stdout


class Architectures(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-arch-")
        cls.prompt = prompt_ids()
        cls.ck = {}
        for i, preset in enumerate(("llama3.2-like", "qwen2.5-like", "qwen3-like", "mistral-like")):
            cls.ck[preset] = make_checkpoint(os.path.join(cls.tmp, preset), "--preset", preset, "--seed", str(40 + i))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def variant(self, base, name, edit):
        d = os.path.join(self.tmp, name)
        shutil.copytree(self.ck[base], d)
        cfg = read_json(os.path.join(d, "config.json"))
        edit(cfg)
        write_json(os.path.join(d, "config.json"), cfg)
        return d

    def check_against_numpy(self, model_dir, *args):
        want, want_lp = numpy_greedy(model_dir, self.prompt)
        with Daemon(*args, model=model_dir) as d:
            c = d.complete(prompt=self.prompt, max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=1)["choices"][0]
        self.assertEqual(c["token_ids"], want)
        got_lp = c["logprobs"]["token_logprobs"]
        self.assertEqual(len(got_lp), N_NEW)
        for i, (g, w) in enumerate(zip(got_lp, want_lp)):
            self.assertAlmostEqual(g, w, delta=LOGPROB_TOL, msg=f"step {i}")
        return want

    # ---- each architecture against the numpy forward ----

    def test_llama32_like_rope_llama3_tied(self):
        d = self.ck["llama3.2-like"]
        cfg = read_json(os.path.join(d, "config.json"))
        self.assertEqual(cfg["rope_scaling"]["rope_type"], "llama3")
        self.assertTrue(cfg["tie_word_embeddings"])
        got = self.check_against_numpy(d)
        # the oracle sees the scaling: without it the tokens differ
        plain, _ = numpy_greedy(d, self.prompt, cfg_edit=lambda c: c.pop("rope_scaling"))
        self.assertNotEqual(plain, got)

    def test_llama_rope_linear_and_dynamic(self):
        lin = self.variant("llama3.2-like", "linear", lambda c: c.update(rope_scaling={"type": "linear", "factor": 4.0}))
        got = self.check_against_numpy(lin)
        plain, _ = numpy_greedy(lin, self.prompt, cfg_edit=lambda c: c.pop("rope_scaling"))
        self.assertNotEqual(plain, got)
        # dynamic NTK equals plain RoPE below max_position_embeddings (transformers' definition)
        dyn = self.variant("llama3.2-like", "dynamic", lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
        self.assertEqual(self.check_against_numpy(dyn), plain)

    def test_qwen25_like_biases_tied_inactive_window(self):
        d = self.ck["qwen2.5-like"]
        cfg = read_json(os.path.join(d, "config.json"))
        self.assertEqual((cfg["sliding_window"], cfg["use_sliding_window"]), (32768, False))
        self.check_against_numpy(d)

    def test_qwen3_like_qk_norm_head_dim_128(self):
        d = self.ck["qwen3-like"]
        cfg = read_json(os.path.join(d, "config.json"))
        self.assertEqual(cfg["architectures"], ["Qwen3ForCausalLM"])
        self.assertNotEqual(cfg["head_dim"], cfg["hidden_size"] // cfg["num_attention_heads"])
        got = self.check_against_numpy(d)
        # the oracle sees the norms: as a Qwen2-style model (no q/k norm) the tokens differ
        other, _ = numpy_greedy(d, self.prompt, cfg_edit=lambda c: c.update(architectures=["LlamaForCausalLM"]))
        self.assertNotEqual(other, got)

    def test_mistral_like_and_its_sliding_window(self):
        self.check_against_numpy(self.ck["mistral-like"])
        # a window the sequences fit is no window: served, by default up to the window
        win = self.variant("mistral-like", "window", lambda c: c.update(sliding_window=64))
        with Daemon(model=win) as d:
            self.assertEqual(d.get("/v1/models")[1]["data"][0]["max_model_len"], 64)
        self.check_against_numpy(win, "--max-model-len", "64")
        # an active window (max_model_len above it) stops start-up naming the field
        err = startup_error(win, "--max-model-len", "128")
        self.assertIn("sliding_window", err)
        self.assertIn("--max-model-len 64", err)

    # ---- refused at start-up, naming the field ----

    def test_unsupported_fields_stop_startup_naming_the_field(self):
        cases = [
            ("yarn", "llama3.2-like", lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                       "original_max_position_embeddings": 256}),
             ["rope_scaling", "'yarn'"], []),
            ("mlp_bias", "llama3.2-like", lambda c: c.update(mlp_bias=True), ["mlp_bias"], []),
            ("attn_bias", "qwen3-like", lambda c: c.update(attention_bias=True), ["attention_bias"], []),
            ("qwen_window", "qwen2.5-like", lambda c: c.update(use_sliding_window=True, sliding_window=32, max_window_layers=0),
             ["use_sliding_window", "sliding_window = 32", "--max-model-len 32"], ["--max-model-len", "64"]),
            ("moe", "mistral-like", lambda c: c.update(num_local_experts=8, num_experts_per_tok=2), ["num_local_experts"], []),
            ("act", "qwen2.5-like", lambda c: c.update(hidden_act="gelu_pytorch_tanh"), ["hidden_act", "gelu_pytorch_tanh"], []),
        ]
        for name, base, edit, needles, args in cases:
            with self.subTest(name):
                err = startup_error(self.variant(base, "bad-" + name, edit), *args)
                self.assertIn("config.json", err)
                for n in needles:
                    self.assertIn(n, err)

    # ---- Qwen3's norms in model-info and through the publisher ----

    def test_qwen3_norms_in_model_info_and_fdpublish(self):
        d = self.ck["qwen3-like"]
        cfg = fdpublish.load_config(d)
        hf = fdpublish.load_checkpoint(d)
        p = subprocess.run([FDCTL, "model-info", "--model", d, "--tp", "2", "--json"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        info = json.loads(p.stdout)
        self.assertEqual(info["architecture"], "Qwen3ForCausalLM")
        for r in (0, 1):
            sd = {t["name"]: t["shape"] for t in info["ranks"][r]["state_dict"]}
            self.assertEqual(sd["model.layers.1.self_attn.q_norm.weight"], [128])
            self.assertEqual(sd["model.layers.0.self_attn.k_norm.weight"], [128])
            mine = fdpublish.to_rollout_names(hf, cfg, tp=2, rank=r)
            self.assertEqual(sorted(mine), sorted(sd))
            self.assertEqual({k: list(v.shape) for k, v in mine.items()}, sd)
        self.assertEqual(info["name_mappings_to_training"]["model.layers.0.self_attn.q_norm.weight"],
                         ["model.layers.0.self_attn.q_norm.weight"])
        # a live update through ipc_snapshot carries the norms: A's weights with other q/k norms
        # give the numpy forward's tokens for those norms (and not A's)
        model = os.path.join(self.tmp, "q3-live")
        shutil.copytree(d, model)
        rng = np.random.default_rng(5)
        new_norms = {k: (1.0 + rng.normal(0, 0.5, v.shape)).astype(np.float32)
                     for k, v in hf.items() if k.endswith(("q_norm.weight", "k_norm.weight"))}
        self.assertEqual(len(new_norms), 2 * cfg["num_hidden_layers"])
        want_dir = rewrite_tensors(copy_checkpoint(d, os.path.join(self.tmp, "q3-norms")), lambda t: t.update(new_norms))
        want, _ = numpy_greedy(want_dir, self.prompt)
        want_a = numpy_greedy(d, self.prompt)[0]
        self.assertNotEqual(want, want_a)

        def update(dm, version):
            self.assertEqual(dm.post("/v1/pause")[0], 200)
            status, j = dm.post("/v1/update_weights", {"version": version})
            self.assertEqual(status, 200, j)
            self.assertEqual(dm.post("/v1/resume")[0], 200)
            return dm.complete(prompt=self.prompt, max_tokens=N_NEW, temperature=0, ignore_eos=True)["choices"][0]["token_ids"]

        with Daemon("--dynamic-load-weight", "--load-strategy", "ipc_snapshot", model=model) as dm:
            # the Python publisher: A's weights with the other norms
            fdpublish.publish_ipc_snapshot(fdpublish.to_rollout_names({**hf, **new_norms}, cfg), model)
            self.assertEqual(update(dm, "py-norms"), want)
            # the C++ publisher (RolloutModel): back to A's own norms
            p = subprocess.run([FDCTL, "publish", "--strategy", "ipc_snapshot", "--from", d, "--model", model],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(update(dm, "cpp-a"), want_a)


if __name__ == "__main__":
    unittest.main()
