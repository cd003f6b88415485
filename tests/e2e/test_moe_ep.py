"""Expert parallelism (issue 23, SPEC §10): `--enable-expert-parallel --tensor-parallel-size 2`
on the three MoE architectures' random fixtures (Qwen3-MoE-like, Qwen2-MoE-like with its shared
expert, Mixtral-like), with real rank processes (mp executor, shm and gloo comms).

- Each rank holds E/2 experts whole; attention stays tensor-parallel. Greedy tokens equal those of
  a tp=1 daemon and of the numpy forward written from transformers' definitions (np_moe.py);
  logprobs within 1e-4 of tp=1's. They cannot be bitwise tp=1's as a whole: attention's o_proj
  is summed over the two ranks' heads (the same holds for plain tp=2). The MoE block itself is
  bitwise tp=1's (tests/unit/model/test_moe_ep.cpp); here: EP=2 over shm and over gloo give
  bitwise the same logprobs, and one sequence's logprobs do not depend on what it is batched with.
- /health says the expert-parallel size and that the comm group is kept on weight sleep; sleep
  (weight) reports the ep_buffer bytes it freed beside the weights', the group stays connected,
  wakeup brings both back and serves bitwise what it served before; update_weights to other
  weights serves what a fresh EP daemon on those weights serves (bitwise) and tp=1's tokens.
  --shutdown-comm-group-if-worker-idle given explicitly destroys the group on sleep as before.
- A rank SIGKILLed mid-dispatch (FD_TEST_PAUSE_AT=ep_dispatch: rank 1 stops before a MoE
  layer's dispatch while rank 0 waits in the combine's all-gather) fails the request with 503
  rank_failed within the control timeout, /health degraded; wakeup respawns the ranks and serves
  bitwise what it served before.
- Start-up errors: num_experts not divisible by the size names both numbers; a dense model is
  refused naming the flag."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import unittest

import numpy as np

import np_llama
import np_moe
from fdtest import BIN, STORIES, Daemon, copy_checkpoint, free_port, make_checkpoint, perturbed, read_json, write_json

N_NEW = 8
LOGPROB_TOL = 1e-4
PRESETS = ("qwen3-moe-like", "qwen2-moe-like", "mixtral-like")
EP2 = ("--tensor-parallel-size", "2", "--enable-expert-parallel", "--threads", "1")


def prompt_ids(n=20, seed=3):
    rng = np.random.default_rng(seed)
    return [1] + [int(x) for x in rng.integers(3, 512, n - 1)]


def startup_error(model_dir, *args):
    p = subprocess.run([BIN, "--model", model_dir, "--port", str(free_port()), *args], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0, "fdrollout started with a configuration it must refuse"
    return p.stderr + p.stdout


class MoeExpertParallel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-moe-ep-")
        cls.prompt = prompt_ids()
        cls.ck = {p: make_checkpoint(os.path.join(cls.tmp, p), "--preset", p, "--seed", str(20 + i))
                  for i, p in enumerate(PRESETS)}
        cls.tp1 = {p: cls.generate(d) for p, d in cls.ck.items()}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def generate(cls, model_dir, *args, d=None):
        if d is not None:
            c = d.complete(prompt=cls.prompt, max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=1)["choices"][0]
            return c["token_ids"], c["logprobs"]["token_logprobs"]
        with Daemon(*args, model=model_dir) as dm:
            return cls.generate(model_dir, d=dm)

    def ok(self, d, path, body=None):
        status, j = d.post(path, body)
        self.assertEqual(status, 200, j)
        return j["result"]

    def assert_close(self, got, want, what):
        self.assertEqual(got[0], want[0], what)
        self.assertEqual(len(got[1]), N_NEW)
        for i, (g, w) in enumerate(zip(got[1], want[1])):
            self.assertAlmostEqual(g, w, delta=LOGPROB_TOL, msg=f"{what} step {i}")

    # ---- EP=2 against tp=1 and the numpy forward, each architecture ----

    def test_ep2_equals_tp1_on_each_architecture(self):
        for preset, d in self.ck.items():
            with self.subTest(preset):
                cfg, w = np_llama.load(d)
                self.assertEqual(self.tp1[preset][0], np_moe.greedy(cfg, w, self.prompt, N_NEW)[0])
                with Daemon(*EP2, model=d) as dm:
                    h = dm.get("/health")[1]
                    self.assertEqual((h["tensor_parallel_size"], h["expert_parallel_size"]), (2, 2), h)
                    self.assertEqual(h["comm_group_on_weight_sleep"], "kept", h)
                    shm = self.generate(d, d=dm)
                    log = dm.output()
                self.assert_close(shm, self.tp1[preset], f"{preset} EP=2 vs tp=1")
                # each rank loaded only its experts: half the expert bytes of a TP-MoE rank is not
                # asserted here (sizes are the checkpoint tests'); the comms must agree bitwise
                with Daemon(*EP2, "--dist-backend", "gloo", model=d) as dg:
                    self.assertEqual(self.generate(d, d=dg), shm, f"{preset}: EP=2 over gloo vs shm")
                self.assertNotIn("ERROR", log)

    def test_a_sequence_does_not_depend_on_its_batch_under_ep(self):
        d = self.ck["qwen3-moe-like"]
        others = [prompt_ids(n, seed) for n, seed in ((9, 5), (31, 6), (17, 8))]
        with Daemon(*EP2, "--max-num-seqs", "8", model=d) as dm:
            alone = dm.complete(prompt=self.prompt, max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=1)
            batch = dm.complete(prompt=[others[0], self.prompt, *others[1:]], max_tokens=N_NEW, temperature=0,
                                ignore_eos=True, logprobs=1)
        a = alone["choices"][0]
        b = [c for c in batch["choices"] if c["index"] == 1][0]
        self.assertEqual(a["token_ids"], b["token_ids"])
        self.assertEqual(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"])  # bitwise

    # ---- sleep / wakeup / update under EP ----

    def test_sleep_wakeup_update_keep_the_group_and_free_the_ep_buffer(self):
        model = copy_checkpoint(self.ck["qwen2-moe-like"], os.path.join(self.tmp, "q2-live"))
        other = perturbed(self.ck["qwen2-moe-like"], os.path.join(self.tmp, "q2-other"), seed=7, scale=0.3)
        want_other_tp1 = self.generate(other)
        want_other_ep = self.generate(other, *EP2)
        self.assertNotEqual(want_other_ep[0], self.tp1["qwen2-moe-like"][0], "the perturbation must change the tokens")
        with Daemon(*EP2, "--dynamic-load-weight", model=model) as d:
            before = self.generate(model, d=d)
            self.assert_close(before, self.tp1["qwen2-moe-like"], "EP=2 before sleep")
            res = self.ok(d, "/v1/sleep?tags=weight")
            freed = res["freed_bytes"]
            print(f"EP=2 sleep(weight) freed per tag: {freed}")
            self.assertGreater(freed["weight"], 0)
            self.assertGreater(freed["ep_buffer"], 0)
            h = d.get("/health")[1]
            self.assertEqual((h["comm_group"]["state"], h["comm_group_on_weight_sleep"]), ("connected", "kept"), h)
            again = self.ok(d, "/v1/sleep?tags=weight")
            self.assertEqual(again["skipped"], ["weight"])
            self.ok(d, "/v1/wakeup")
            self.assertEqual(self.generate(model, d=d), before)  # bitwise
            # update_weights to other bytes: all-or-nothing over both ranks' experts
            for f in os.listdir(other):
                if f.endswith(".safetensors"):
                    shutil.copyfile(os.path.join(other, f), os.path.join(model, f))
            self.ok(d, "/v1/pause")
            res = self.ok(d, "/v1/update_weights", {"version": "other"})
            self.assertEqual([r["version"] for r in res["ranks"]], ["other", "other"])
            self.ok(d, "/v1/resume")
            got = self.generate(model, d=d)
            self.assertEqual(got, want_other_ep)  # bitwise a fresh EP daemon on those weights
            self.assert_close(got, want_other_tp1, "EP=2 after update vs tp=1")
        # the explicit flag still destroys the group on weight sleep (and wakeup rebuilds it)
        with Daemon(*EP2, "--dynamic-load-weight", "--shutdown-comm-group-if-worker-idle", model=other) as d:
            self.assertEqual(d.get("/health")[1]["comm_group_on_weight_sleep"], "destroyed")
            self.generate(other, d=d)
            self.ok(d, "/v1/sleep?tags=weight")
            self.assertEqual(d.get("/health")[1]["comm_group"]["state"], "disconnected")
            self.ok(d, "/v1/wakeup")
            self.assertEqual(self.generate(other, d=d), want_other_ep)

    # ---- a rank killed mid-dispatch ----

    def test_a_rank_killed_mid_dispatch_fails_within_the_timeout_and_wakeup_recovers(self):
        model = self.ck["mixtral-like"]
        marker = os.path.join(self.tmp, "ep-dispatch")
        open(marker, "w").close()  # armed: the hook trips once this file is gone
        with Daemon(*EP2, "--dynamic-load-weight", "--control-timeout-s", "10", model=model, extra=False,
                    env={"FD_TEST_PAUSE_AT": f"ep_dispatch:1:{marker}"}) as d:
            before = self.generate(model, d=d)
            os.unlink(marker)
            answer = {}
            t0 = time.time()
            t = threading.Thread(target=lambda: answer.update(r=d.post(
                "/v1/completions", {"prompt": self.prompt, "max_tokens": 4, "temperature": 0}, timeout=60)))
            t.start()
            deadline = time.time() + 30
            while time.time() < deadline and not (os.path.exists(marker) and os.path.getsize(marker) > 0):
                time.sleep(0.01)
            with open(marker) as f:
                victim = int(f.read())
            self.assertIn(victim, d.rank_pids())
            os.kill(victim, signal.SIGKILL)
            t.join(30)
            self.assertFalse(t.is_alive(), "the completion did not answer after rank 1 died mid-dispatch")
            took = time.time() - t0
            status, j = answer["r"]
            print(f"rank 1 killed mid-dispatch: {status} after {took:.2f} s: {json.dumps(j)[:200]}")
            self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
            self.assertLess(took, 10 + 5)
            h = d.get("/health")[1]
            self.assertEqual((h["state"], h["degraded_ranks"]), ("degraded", [1]), h)
            self.ok(d, "/v1/wakeup")
            h = d.get("/health")[1]
            self.assertEqual((h["state"], h["degraded_ranks"], h["expert_parallel_size"]), ("serving", [], 2), h)
            self.assertNotIn(victim, d.rank_pids())
            self.assertEqual(self.generate(model, d=d), before)

    # ---- start-up errors ----

    def test_startup_errors_name_the_numbers(self):
        bad = copy_checkpoint(self.ck["qwen3-moe-like"], os.path.join(self.tmp, "q3-15"))
        cfg = read_json(os.path.join(bad, "config.json"))
        cfg["num_experts"] = 15
        write_json(os.path.join(bad, "config.json"), cfg)
        err = startup_error(bad, *EP2)
        self.assertIn("num_experts = 15", err)
        self.assertIn("--tensor-parallel-size 2", err)
        err = startup_error(STORIES, *EP2)
        self.assertIn("--enable-expert-parallel needs a mixture-of-experts model", err)
        self.assertIn("dense", err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
