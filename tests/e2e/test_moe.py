"""Mixture-of-experts models (issue 23): random checkpoints with the real configs' shapes scaled
down — Qwen3-30B-A3B-like (128 → 16 experts top-4, norm_topk_prob, q/k norms, one dense layer
from mlp_only_layers), Qwen1.5-MoE-A2.7B-like (shared expert behind sigmoid(shared_expert_gate),
q/k/v biases, norm_topk_prob false), Mixtral-8x7B-like (block_sparse_moe w1/w3/w2, top-2
always renormalised) — generate greedily exactly what the numpy forward written from
transformers' definitions (np_moe.py) generates, logprobs within tolerance, at tp=1 and tp=2
(TP-MoE: each expert's intermediate dim split). The stacked export layout serves the same model
and refits a per-expert one; an incomplete expert set is refused naming layer and expert, at
start-up and at update (the old weights keep serving). With the npm fixtures, the models' real
tokenizer.json files (Qwen3's, Llama-2's for Mixtral) drive a chat completion."""
import os
import shutil
import subprocess
import tempfile
import unittest

import numpy as np

import np_llama
import np_moe
from fdtest import BIN, FDCTL, Daemon, copy_checkpoint, free_port, make_checkpoint, read_json, rewrite_tensors, write_json

N_NEW = 10
LOGPROB_TOL = 1e-4
PRESETS = ("qwen3-moe-like", "qwen2-moe-like", "mixtral-like")
TP2 = ("--tensor-parallel-size", "2", "--threads", "1")
NPM = os.environ.get("FD_NPM_FIXTURES", "")


def prompt_ids(n=24, seed=3):
    rng = np.random.default_rng(seed)
    return [1] + [int(x) for x in rng.integers(3, 512, n - 1)]


def numpy_greedy(model_dir, prompt, n=N_NEW, cfg_edit=None, w_edit=None):
    cfg, w = np_llama.load(model_dir)
    if cfg_edit:
        cfg_edit(cfg)
    if w_edit:
        w_edit(w)
    return np_moe.greedy(cfg, w, prompt, n)


def startup_error(model_dir, *args):
    p = subprocess.run([BIN, "--model", model_dir, "--port", str(free_port()), *args], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0, "fdrollout started on a checkpoint it must refuse"
    return p.stderr + p.stdout


class MoeModels(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-moe-")
        cls.prompt = prompt_ids()
        cls.ck = {p: make_checkpoint(os.path.join(cls.tmp, p), "--preset", p, "--seed", str(20 + i))
                  for i, p in enumerate(PRESETS)}
        cls.want = {p: numpy_greedy(d, cls.prompt) for p, d in cls.ck.items()}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def generate(self, model_dir, *args, prompt=None):
        with Daemon(*args, model=model_dir) as d:
            c = d.complete(prompt=prompt or self.prompt, max_tokens=N_NEW, temperature=0, ignore_eos=True,
                           logprobs=1)["choices"][0]
        return c["token_ids"], c["logprobs"]["token_logprobs"]

    def check(self, preset, *args, model_dir=None, want=None):
        want, want_lp = want or self.want[preset]
        got, got_lp = self.generate(model_dir or self.ck[preset], *args)
        self.assertEqual(got, want)
        self.assertEqual(len(got_lp), N_NEW)
        for i, (g, w) in enumerate(zip(got_lp, want_lp)):
            self.assertAlmostEqual(g, w, delta=LOGPROB_TOL, msg=f"{preset} step {i}")

    # ---- each architecture against the numpy forward, tp=1 and tp=2 ----

    def test_qwen3_moe_like(self):
        d = self.ck["qwen3-moe-like"]
        cfg = read_json(os.path.join(d, "config.json"))
        self.assertEqual((cfg["architectures"], cfg["mlp_only_layers"], cfg["norm_topk_prob"]),
                         (["Qwen3MoeForCausalLM"], [1], True))
        self.check("qwen3-moe-like")
        self.check("qwen3-moe-like", *TP2)
        # the oracle sees the renormalisation: without it the tokens differ
        other, _ = numpy_greedy(d, self.prompt, cfg_edit=lambda c: c.update(norm_topk_prob=False))
        self.assertNotEqual(other, self.want["qwen3-moe-like"][0])

    def test_qwen2_moe_like_shared_expert(self):
        d = self.ck["qwen2-moe-like"]
        self.check("qwen2-moe-like")
        self.check("qwen2-moe-like", *TP2)
        # the oracle sees the shared expert: without it (down_proj zeroed) the tokens differ
        other, _ = numpy_greedy(d, self.prompt, w_edit=lambda w: [w.__setitem__(k, w[k] * 0) for k in list(w)
                                                                  if k.endswith("shared_expert.down_proj.weight")])
        self.assertNotEqual(other, self.want["qwen2-moe-like"][0])

    def test_mixtral_like(self):
        d = self.ck["mixtral-like"]
        cfg = read_json(os.path.join(d, "config.json"))
        self.assertNotIn("norm_topk_prob", cfg)  # Mixtral renormalises without being told
        self.check("mixtral-like")
        self.check("mixtral-like", *TP2)
        # the oracle sees Mixtral's unconditional renormalisation: without it the tokens differ
        keep = np_moe.renormalises
        np_moe.renormalises = lambda c: False
        try:
            other, _ = numpy_greedy(d, self.prompt)
        finally:
            np_moe.renormalises = keep
        self.assertNotEqual(other, self.want["mixtral-like"][0])

    # ---- batch invariance through the daemon ----

    def test_a_sequence_logprobs_do_not_depend_on_the_batch(self):
        d = self.ck["qwen3-moe-like"]
        others = [prompt_ids(n, seed) for n, seed in ((9, 5), (31, 6), (17, 8))]
        with Daemon("--max-num-seqs", "8", model=d) as dm:
            alone = dm.complete(prompt=self.prompt, max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=1)
            batch = dm.complete(prompt=[others[0], self.prompt, *others[1:]], max_tokens=N_NEW, temperature=0,
                                ignore_eos=True, logprobs=1)
        a = alone["choices"][0]
        b = [c for c in batch["choices"] if c["index"] == 1][0]
        self.assertEqual(a["token_ids"], b["token_ids"])
        self.assertEqual(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"])  # bitwise (JSON floats)

    # ---- the stacked layout ----

    def stacked(self, name, preset, seed):
        return make_checkpoint(os.path.join(self.tmp, name), "--preset", preset, "--seed", str(seed), "--stacked-experts")

    def test_stacked_experts_serve_the_same_model_and_refit_a_per_expert_one(self):
        st = self.stacked("q3-stacked", "qwen3-moe-like", 20)  # qwen3-moe-like's seed: the same values, stacked
        names = set(read_json(os.path.join(st, "config.json")))  # (config is identical)
        self.assertIn("moe_intermediate_size", names)
        import safetensors_np
        t = safetensors_np.load_file(os.path.join(st, "model.safetensors"))
        self.assertEqual(t["model.layers.0.mlp.experts.gate_up_proj"].shape, (16, 64, 64))
        self.assertEqual(t["model.layers.0.mlp.experts.down_proj"].shape, (16, 64, 32))
        self.assertNotIn("model.layers.0.mlp.experts.0.gate_proj.weight", t)
        self.check("qwen3-moe-like", model_dir=st)  # the numpy forward reads the stacked tensors itself
        # a per-expert daemon refitted from a stacked checkpoint of other weights serves those
        model = copy_checkpoint(self.ck["qwen3-moe-like"], os.path.join(self.tmp, "q3-live"))
        other = self.stacked("q3-other", "qwen3-moe-like", 99)
        want_other = numpy_greedy(other, self.prompt)[0]
        self.assertNotEqual(want_other, self.want["qwen3-moe-like"][0])
        with Daemon("--dynamic-load-weight", model=model) as dm:
            for f in ("model.safetensors",):
                shutil.copyfile(os.path.join(other, f), os.path.join(model, f))
            self.assertEqual(dm.post("/v1/pause")[0], 200)
            status, j = dm.post("/v1/update_weights", {"version": "stacked"})
            self.assertEqual(status, 200, j)
            self.assertEqual(dm.post("/v1/resume")[0], 200)
            got = dm.complete(prompt=self.prompt, max_tokens=N_NEW, temperature=0, ignore_eos=True)["choices"][0]
            self.assertEqual(got["token_ids"], want_other)

    # ---- the state dict per rank, and the Python publisher ----

    def test_model_info_lists_experts_per_rank_and_fdpublish_refits_tp2(self):
        import json as json_
        import fdpublish
        d = self.ck["qwen2-moe-like"]
        cfg = fdpublish.load_config(d)
        p = subprocess.run([FDCTL, "model-info", "--model", d, "--tp", "2", "--json"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        info = json_.loads(p.stdout)
        for r in (0, 1):
            sd = {t["name"]: t["shape"] for t in info["ranks"][r]["state_dict"]}
            self.assertEqual(sd["model.layers.0.mlp.gate.weight"], [12, 64])
            self.assertEqual(sd["model.layers.1.mlp.experts.11.gate_up_proj.weight"], [32, 64])  # 2 * 32 / 2
            self.assertEqual(sd["model.layers.1.mlp.experts.11.down_proj.weight"], [64, 16])
            self.assertEqual(sd["model.layers.0.mlp.shared_expert.gate_up_proj.weight"], [128, 64])
            self.assertEqual(sd["model.layers.0.mlp.shared_expert_gate.weight"], [1, 64])
            mine = fdpublish.to_rollout_names(fdpublish.load_checkpoint(d), cfg, tp=2, rank=r)
            self.assertEqual({k: list(v.shape) for k, v in mine.items()}, sd)
        self.assertEqual(info["name_mappings_to_training"]["model.layers.1.mlp.experts.3.gate_up_proj.weight"],
                         ["model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"])
        # a tp=2 daemon refitted through ipc_snapshot from a STACKED checkpoint of other weights
        other = self.stacked("q2-other", "qwen2-moe-like", 77)
        want = numpy_greedy(other, self.prompt)[0]
        self.assertNotEqual(want, self.want["qwen2-moe-like"][0])
        model = copy_checkpoint(d, os.path.join(self.tmp, "q2-live"))
        hf = fdpublish.load_checkpoint(other)
        self.assertIn("model.layers.0.mlp.experts.gate_up_proj", hf)
        with Daemon("--dynamic-load-weight", "--load-strategy", "ipc_snapshot", *TP2, model=model) as dm:
            for r in (0, 1):
                fdpublish.publish_ipc_snapshot(fdpublish.to_rollout_names(hf, cfg, tp=2, rank=r), model, rank=r)
            self.assertEqual(dm.post("/v1/pause")[0], 200)
            status, j = dm.post("/v1/update_weights", {"version": "py-stacked"})
            self.assertEqual(status, 200, j)
            self.assertEqual(dm.post("/v1/resume")[0], 200)
            got = dm.complete(prompt=self.prompt, max_tokens=N_NEW, temperature=0, ignore_eos=True)["choices"][0]
        self.assertEqual(got["token_ids"], want)

    # ---- an incomplete expert set ----

    def test_missing_duplicated_or_misshapen_expert_is_refused_naming_layer_and_expert(self):
        base = self.ck["mixtral-like"]
        miss = rewrite_tensors(copy_checkpoint(base, os.path.join(self.tmp, "mx-miss")),
                               lambda t: t.pop("model.layers.1.block_sparse_moe.experts.5.w3.weight"))
        err = startup_error(miss)
        self.assertIn("model.layers.1.block_sparse_moe.experts.5.w3.weight", err)
        self.assertIn("layer 1, expert 5", err)
        bad = rewrite_tensors(copy_checkpoint(base, os.path.join(self.tmp, "mx-shape")),
                              lambda t: t.update({"model.layers.0.block_sparse_moe.experts.2.w2.weight":
                                                  np.zeros((64, 95), np.float32)}))
        err = startup_error(bad)
        self.assertIn("layer 0, expert 2", err)
        self.assertIn("[64, 95]", err)
        # a stacked tensor beside the per-expert ones: every expert given twice
        st = self.stacked("q3-dup-src", "qwen3-moe-like", 20)
        import safetensors_np
        stacked = safetensors_np.load_file(os.path.join(st, "model.safetensors"))
        dup = rewrite_tensors(copy_checkpoint(self.ck["qwen3-moe-like"], os.path.join(self.tmp, "q3-dup")),
                              lambda t: t.update({"model.layers.2.mlp.experts.down_proj":
                                                  stacked["model.layers.2.mlp.experts.down_proj"]}))
        err = startup_error(dup)
        self.assertIn("layer 2 expert 0", err)
        self.assertIn("given twice", err)
        # at update: 4xx naming the expert; the old weights keep serving bit-exactly
        model = copy_checkpoint(base, os.path.join(self.tmp, "mx-live"))
        with Daemon("--dynamic-load-weight", model=model) as dm:
            before = dm.complete(prompt=self.prompt, max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=1)
            shutil.copyfile(os.path.join(miss, "model.safetensors"), os.path.join(model, "model.safetensors"))
            self.assertEqual(dm.post("/v1/pause")[0], 200)
            status, j = dm.post("/v1/update_weights", {"version": "broken"})
            self.assertEqual(status, 422, j)
            self.assertIn("layer 1, expert 5", j["error"]["message"])
            self.assertEqual(dm.post("/v1/resume")[0], 200)
            after = dm.complete(prompt=self.prompt, max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=1)
        self.assertEqual(after["choices"][0]["token_ids"], before["choices"][0]["token_ids"])
        self.assertEqual(after["choices"][0]["logprobs"], before["choices"][0]["logprobs"])

    def test_bad_moe_configs_stop_startup_naming_the_field(self):
        cases = [("topk0", "qwen3-moe-like", {"num_experts_per_tok": 0}, ["num_experts_per_tok"]),
                 ("topk_big", "mixtral-like", {"num_experts_per_tok": 9}, ["num_experts_per_tok", "8"]),
                 ("counts", "qwen2-moe-like", {"num_local_experts": 60}, ["inconsistent", "num_experts"]),
                 ("sigmoid", "qwen3-moe-like", {"scoring_func": "sigmoid"}, ["scoring_func"]),
                 ("router_shape", "qwen3-moe-like", {"num_experts": 15}, ["model.layers.0.mlp.gate.weight", "[15, 64]"])]
        for name, base, edit, needles in cases:
            with self.subTest(name):
                d = os.path.join(self.tmp, "bad-" + name)
                shutil.copytree(self.ck[base], d)
                cfg = read_json(os.path.join(d, "config.json"))
                cfg.update(edit)
                write_json(os.path.join(d, "config.json"), cfg)
                err = startup_error(d)
                for n in needles:
                    self.assertIn(n, err)


@unittest.skipUnless(os.path.isfile(os.path.join(NPM, "models", "qwen3", "tokenizer.json")), "run through ctest (the npm fixture step)")
class MoeRealTokenizers(unittest.TestCase):
    """Qwen3-MoE with Qwen3's tokenizer.json (vocab 151936) and Mixtral with Llama-2's (32000)."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-moe-real-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def check(self, preset, npm_dir, vocab):
        d = make_checkpoint(os.path.join(self.tmp, preset), "--preset", preset, "--vocab", str(vocab), "--seed", "4",
                            "--tokenizer-from", os.path.join(NPM, "models", npm_dir))
        with Daemon("--max-model-len", "256", model=d) as dm:
            j = dm.complete(prompt="Mixture of experts route each token to a few experts.", max_tokens=6,
                            temperature=0, ignore_eos=True, logprobs=1)
        c = j["choices"][0]
        self.assertGreater(len(c["prompt_token_ids"]), 8)
        want, want_lp = numpy_greedy(d, c["prompt_token_ids"], n=6)
        self.assertEqual(c["token_ids"], want)
        for g, w in zip(c["logprobs"]["token_logprobs"], want_lp):
            self.assertAlmostEqual(g, w, delta=LOGPROB_TOL)

    def test_qwen3_moe_with_qwen3_tokenizer(self):
        self.check("qwen3-moe-like", "qwen3", 151936)

    def test_mixtral_with_llama2_tokenizer(self):
        self.check("mixtral-like", "llama2", 32000)


if __name__ == "__main__":
    unittest.main()
