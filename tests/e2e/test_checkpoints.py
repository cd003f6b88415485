"""Checkpoint formats: a Qwen2-shaped (q/k/v biases) and a sharded BF16 untied random checkpoint
load and generate exactly what a plain numpy forward pass predicts; a tied checkpoint without
lm_head.weight loads; broken checkpoints stop start-up naming the file and tensor."""
import json
import os
import shutil
import subprocess
import tempfile
import unittest

import np_llama
from fdtest import BIN, STORIES, Daemon, copy_checkpoint, free_port, make_checkpoint, read_json, write_json


def expect_startup_failure(test, model_dir, *needles):
    port = free_port()
    p = subprocess.run([BIN, "--model", model_dir, "--port", str(port)], capture_output=True, text=True, timeout=60)
    test.assertNotEqual(p.returncode, 0)
    test.assertFalse(os.path.exists(f"/dev/shm/fdrollout.{port}"), "a failed start left its control block behind")
    for n in needles:
        test.assertIn(n, p.stderr)
    return p.stderr


class Checkpoints(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-ckpt-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def check_against_numpy(self, model_dir, n=12):
        cfg, w = np_llama.load(model_dir)
        prompt = [1, 300, 301, 302, 17, 45]
        want, want_top = np_llama.greedy(cfg, w, prompt, n)
        with Daemon(model=model_dir) as d:
            j = d.complete(prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True, logprobs=1)
            got = j["choices"][0]["token_ids"]
            self.assertEqual(got, want)
            # and with a text prompt + streaming the daemon is self-consistent
            k = d.complete(prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True, logprobs=1)
            self.assertEqual(k["choices"][0], j["choices"][0])
        return got

    def test_qwen2_with_qkv_bias(self):
        d = make_checkpoint(os.path.join(self.tmp, "qwen2"), "--preset", "tiny-qwen2", "--seed", "3")
        self.assertEqual(read_json(os.path.join(d, "config.json"))["architectures"], ["Qwen2ForCausalLM"])
        self.check_against_numpy(d)

    def test_sharded_bf16_untied(self):
        d = make_checkpoint(os.path.join(self.tmp, "bf16"), "--preset", "tiny-llama-bf16-sharded", "--seed", "4")
        self.assertTrue(os.path.exists(os.path.join(d, "model.safetensors.index.json")))
        self.check_against_numpy(d)

    def test_f16_tied_without_lm_head(self):
        d = make_checkpoint(os.path.join(self.tmp, "f16"), "--dtype", "F16", "--no-lm-head", "--layers", "2", "--seed", "5")
        self.check_against_numpy(d)

    def test_version_yaml_step_is_the_weight_version(self):
        d = make_checkpoint(os.path.join(self.tmp, "ver"), "--layers", "1", "--step", "17")
        with Daemon(model=d) as dm:
            self.assertEqual(dm.complete(prompt=[1, 5], max_tokens=2)["weight_version"], "17")
            self.assertEqual(dm.get("/health")[1]["weight_version"], "17")

    def test_weight_version_flag_without_version_yaml(self):
        with Daemon("--weight-version", "step-3") as dm:
            self.assertEqual(dm.complete(prompt="Lily", max_tokens=2)["weight_version"], "step-3")
            self.assertEqual(dm.get("/v1/models")[1]["data"][0]["weight_version"], "step-3")

    def test_broken_checkpoints_stop_startup_naming_file_and_tensor(self):
        base = make_checkpoint(os.path.join(self.tmp, "base"), "--layers", "2", "--seed", "6")

        def variant(name):
            d = os.path.join(self.tmp, name)
            shutil.copytree(base, d)
            return d

        # truncated file
        d = variant("truncated")
        f = os.path.join(d, "model.safetensors")
        os.truncate(f, os.path.getsize(f) - 1000)
        expect_startup_failure(self, d, "model.safetensors", "truncated")
        # a tensor with the wrong shape (rewrite the file with numpy)
        import safetensors_np
        import numpy as np
        d = variant("misshaped")
        f = os.path.join(d, "model.safetensors")
        t = safetensors_np.load_file(f)
        t["model.layers.1.mlp.up_proj.weight"] = np.zeros((10, 64), np.float32)
        safetensors_np.save_file(t, f)
        expect_startup_failure(self, d, "model.layers.1.mlp.up_proj.weight", "shape")
        # a missing tensor
        d = variant("missing")
        t = safetensors_np.load_file(f.replace("misshaped", "missing"))
        del t["model.layers.0.self_attn.k_proj.weight"]
        safetensors_np.save_file(t, os.path.join(d, "model.safetensors"))
        expect_startup_failure(self, d, "model.layers.0.self_attn.k_proj.weight", "missing")
        # unsupported architecture
        d = variant("arch")
        cfg = read_json(os.path.join(d, "config.json"))
        cfg["architectures"] = ["MixtralForCausalLM"]
        write_json(os.path.join(d, "config.json"), cfg)
        expect_startup_failure(self, d, "config.json", "MixtralForCausalLM")
        # no checkpoint at all
        expect_startup_failure(self, os.path.join(self.tmp, "does-not-exist"), "does-not-exist", "no such directory")

    def test_config_values_that_break_the_math_or_the_stop_ids_exit_5_naming_the_field(self):
        """rope_theta <= 0 and rms_norm_eps < 0 made every logit NaN (each request a 200 with
        token 0); an eos_token_id of the wrong type gave no stop id, 2^32 + 1 wrapped to 1 (probes)."""
        for name, file, edit, field in [
                ("theta0", "config.json", lambda c: c.update(rope_theta=0), "rope_theta"),
                ("thetaneg", "config.json", lambda c: c.update(rope_theta=-10000), "rope_theta"),
                ("epsneg", "config.json", lambda c: c.update(rms_norm_eps=-1e-5), "rms_norm_eps"),
                ("eosstr", "generation_config.json", lambda c: c.update(eos_token_id=["1", 2]), "eos_token_id"),
                ("eosfloat", "generation_config.json", lambda c: c.update(eos_token_id=1.0), "eos_token_id"),
                ("eosnested", "generation_config.json", lambda c: c.update(eos_token_id=[[2]]), "eos_token_id"),
                ("eoswrap", "generation_config.json", lambda c: c.update(eos_token_id=4294967297), "eos_token_id")]:
            with self.subTest(name):
                d = copy_checkpoint(STORIES, os.path.join(self.tmp, name))
                cfg = read_json(os.path.join(d, file))
                edit(cfg)
                write_json(os.path.join(d, file), cfg)
                p = subprocess.run([BIN, "--model", d, "--port", str(free_port())], capture_output=True, text=True, timeout=60)
                self.assertEqual(p.returncode, 5, p.stderr)
                self.assertIn(f"{file}: field '{field}'", p.stderr)


class Flags(unittest.TestCase):
    def test_help_documents_every_flag_and_env_var(self):
        p = subprocess.run([BIN, "--help"], capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 0)
        for flag, env in [("--model", "FD_MODEL"), ("--port", "FD_PORT"), ("--host", "FD_HOST"),
                          ("--max-num-seqs", "FD_MAX_NUM_SEQS"), ("--max-model-len", "FD_MAX_MODEL_LEN"),
                          ("--block-size", "FD_BLOCK_SIZE"), ("--kv-cache-bytes", "FD_KV_CACHE_BYTES"),
                          ("--enable-prefix-caching", "FD_ENABLE_PREFIX_CACHING"), ("--threads", "FD_THREADS"),
                          ("--weight-version", "FD_WEIGHT_VERSION"), ("--api-key", "FD_API_KEY"),
                          ("--device", "FD_DEVICE"), ("--tensor-parallel-size", "FD_TENSOR_PARALLEL_SIZE")]:
            self.assertIn(flag, p.stdout)
            self.assertIn(env, p.stdout)

    def test_bad_flags_exit_non_zero_with_a_message(self):
        for args, needle in [(["--block-size", "12"], "--block-size"), (["--kv-cache-bytes", "lots"], "--kv-cache-bytes"),
                             (["--device", "tpu"], "--device"), (["--weight-version", "a/b"], "--weight-version"),
                             (["--kv-cache-bytes", "1K"], "--kv-cache-bytes"), (["--max-model-len", "1000"], "max_position_embeddings"),
                             (["--load-strategy", "carrier-pigeon"], "--load-strategy")]:
            p = subprocess.run([BIN, "--port", str(free_port()), *args], capture_output=True, text=True, timeout=30)
            self.assertNotEqual(p.returncode, 0, args)
            self.assertIn(needle, p.stderr, args)

    def test_refused_values_exit_10_naming_the_flag(self):
        """--kv-cache-bytes abc.def / . / 1000T exited 70 (std::stod, an mmap check), 0.5MiB was a
        fraction of memory, 30G on a smaller machine pre-faulted until the OOM killer; --threads
        100000 aborted after ~7000 threads, -1 was 0; --log-level verbose did not name the flag."""
        for args, needle in [(["--kv-cache-bytes", "abc.def"], "--kv-cache-bytes 'abc.def'"),
                             (["--kv-cache-bytes", "."], "--kv-cache-bytes '.'"),
                             (["--kv-cache-bytes", "1.5"], "--kv-cache-bytes '1.5'"),
                             (["--kv-cache-bytes", "1000T"], "exceeds the memory available now"),
                             (["--threads", "-1"], "--threads -1 must be in [0, 1024]"),
                             (["--threads", "100000"], "--threads 100000 must be in [0, 1024]"),
                             (["--log-level", "verbose"], "--log-level 'verbose'")]:
            with self.subTest(args):
                p = subprocess.run([BIN, "--port", str(free_port()), *args], capture_output=True, text=True, timeout=30)
                self.assertEqual(p.returncode, 10, (args, p.stderr))
                self.assertIn(needle, p.stderr)
        with Daemon("--kv-cache-bytes", "1.5MiB") as d:  # a decimal with a unit is bytes
            self.assertEqual(d.get("/health")[1]["kv_cache"]["budget_bytes"], 3 << 19)

    def test_env_vars_set_flags(self):
        with Daemon(env={"FD_WEIGHT_VERSION": "from-env", "FD_MAX_MODEL_LEN": "128"}) as d:
            _, m = d.get("/v1/models")
            self.assertEqual(m["data"][0]["weight_version"], "from-env")
            self.assertEqual(m["data"][0]["max_model_len"], 128)


if __name__ == "__main__":
    unittest.main()
