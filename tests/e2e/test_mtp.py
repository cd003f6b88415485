"""MTP speculation (--speculative-config method "mtp", SPEC §11, issue #24) on random MiMo checkpoints.

MiMoForCausalLM = Qwen2 + model.mtp_layers.N.* (scripts/make_random_checkpoint.py --preset
tiny-mimo). A daemon drafting with the MTP layer and one without serve the same requests:
greedy tokens, text, finish reasons and every logprob equal bit for bit, alone and batched.
--mtp-mimic makes the MTP layer a copy of layer 0 fed the token, so its drafts are often
accepted (acceptance is really exercised); the plain random MTP layer rarely is; the "mixed"
fixture (1-layer untied target, input_proj reading the hidden state too) accepts about half. The drafts themselves are checked against a numpy MTP layer (np_llama.mtp_drafts). The MTP cache
is freed by sleep?tags=kv_cache (its bytes in freed_bytes) and rebuilt by wakeup; it is paid from
--kv-cache-bytes (blocks = (budget - scratch) / (target + MTP bytes per block), /health
kv_cache.budget_bytes); preemption by swap and by recompute keeps outputs equal and drafts
accepted; --use-cudagraph is accepted with mtp; update_weights
replaces the draft layer with the target (acceptance per weight version moves, and its collapse
is logged and shown in /health); a checkpoint
without the MTP tensors is refused (422 naming them) and the old weights keep serving; mtp on a
model without MTP layers is a start-up error naming the field. tp 2: tests/e2e/test_mtp_tp2.py.
"""
import itertools
import json
import os
import subprocess
import tempfile
import time
import unittest

from fdtest import BIN, STORIES, Daemon, copy_checkpoint, make_checkpoint, rewrite_tensors, spec_by_version, in_parallel

MTP = lambda k: json.dumps({"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": 0})
PROMPTS = ["Once upon a time", "Lily and Tom", "The little dog", "Tom and Lily played with the ball."]


def bodies():
    out = [{"prompt": p, "max_tokens": 30 + 5 * i, "temperature": 0, "logprobs": 3, "ignore_eos": True} for i, p in enumerate(PROMPTS)]
    out.append({"prompt": PROMPTS[0], "max_tokens": 7, "temperature": 0, "logprobs": 2, "prompt_logprobs": 2})
    out.append({"prompt": PROMPTS[1], "max_tokens": 25, "temperature": 0, "logprobs": 1, "repetition_penalty": 1.3})
    return out


def choices(d, body):
    return sorted(d.complete(**body)["choices"], key=lambda c: c["index"])


def concurrently(d, reqs):
    return in_parallel(lambda body: choices(d, body), reqs)



def metric(d, name):
    """The value of an unlabelled series of /metrics."""
    for line in d.get("/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


class Mtp(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="fd-mtp-")
        cls.mimic = make_checkpoint(os.path.join(cls.tmp.name, "mimic"), "--preset", "tiny-mimo", "--mtp-mimic", "--seed", "3")
        cls.random = make_checkpoint(os.path.join(cls.tmp.name, "random"), "--preset", "tiny-mimo", "--seed", "3")
        # a 1-layer target with varied tokens (untied head) and a layer-0 copy as the draft that
        # also reads the hidden state (input_proj's hidden half 0.1 x random, random norms):
        # about half the drafts accepted, so most of them change what the counters show
        cls.mixed = make_checkpoint(os.path.join(cls.tmp.name, "mixed"), "--preset", "tiny-mimo", "--mtp-mimic",
                                    "--mtp-hidden-scale", "0.1", "--no-tie", "--layers", "1", "--seed", "3")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def ok(self, d, path, body=None):
        code, j = d.post(path, body)
        self.assertEqual(code, 200, j)
        return j["result"]

    def test_greedy_and_logprobs_equal_alone_and_batched(self):
        for ck, k in ((self.mimic, 1), (self.mimic, 3), (self.mixed, 2), (self.random, 2)):
            with self.subTest(ck=os.path.basename(ck), k=k), Daemon("--max-logprobs", "64", model=ck) as plain, \
                    Daemon("--max-logprobs", "64", "--speculative-config", MTP(k), model=ck) as spec:
                want = [choices(plain, b) for b in bodies()]
                self.assertEqual([choices(spec, b) for b in bodies()], want)
                self.assertEqual(concurrently(spec, bodies() * 2), want * 2)
                drafts, proposed, accepted = spec_by_version(spec)["0"]
                self.assertGreater(drafts, 0)
                self.assertLessEqual(accepted, proposed)
                if ck == self.mimic:  # the copied layer predicts the target often
                    self.assertGreater(accepted, 0.2 * proposed, (drafts, proposed, accepted))
                h = spec.get("/health")[1]["speculative"]
                self.assertEqual((h["method"], h["num_speculative_tokens"]), ("mtp", k))

    def test_drafts_equal_a_numpy_mtp_reference(self):
        # The draft layer's own arithmetic, checked through what it changes: with a greedy request
        # alone, the proposed and accepted counts follow from the drafts the numpy MTP layer
        # (np_llama.mtp_drafts, from vLLM's mimo_mtp.py) makes at each step boundary.
        import np_llama
        loaded = {ck: np_llama.load(ck) for ck in (self.mimic, self.mixed, self.random)}
        # a 2-token prompt too: position 0's row weighs more there
        for ck, k, prompt in itertools.product(loaded, (1, 3), ([1, 45, 99, 301, 7], [1, 200])):
            cfg, w = loaded[ck]
            with self.subTest(ck=os.path.basename(ck), k=k, prompt=prompt), \
                    Daemon("--speculative-config", MTP(k), "--no-enable-prefix-caching", model=ck) as d:
                m = 40
                out = d.complete(prompt=prompt, max_tokens=m, temperature=0, ignore_eos=True)["choices"][0]["token_ids"]
                seq = prompt + out
                proposed, accepted = np_llama.mtp_draft_counts(cfg, w, seq, len(prompt), m, k)
                _, got_proposed, got_accepted = spec_by_version(d)["0"]
                self.assertEqual((got_proposed, got_accepted), (proposed, accepted))
                if ck == self.mixed:  # both outcomes occur: the comparison sees every draft
                    self.assertTrue(0 < accepted < proposed, (proposed, accepted))

    def test_sleep_kv_cache_frees_the_mtp_cache_and_wakeup_rebuilds_it(self):
        args = ("--dynamic-load-weight", "--kv-cache-bytes", "8MiB", "--max-num-seqs", "8")
        with Daemon(*args, model=self.mimic) as plain, Daemon(*args, "--speculative-config", MTP(2), model=self.mimic) as spec:
            want = choices(plain, bodies()[0])
            self.assertEqual(choices(spec, bodies()[0]), want)
            mtp = spec.get("/health")[1]["speculative"]["mtp_cache_bytes"]
            target = spec.get("/health")[1]["kv_cache"]["bytes"]
            self.assertGreater(mtp, 0)
            freed_plain = self.ok(plain, "/v1/sleep?tags=kv_cache")["freed_bytes"]["kv_cache"]
            freed_spec = self.ok(spec, "/v1/sleep?tags=kv_cache")["freed_bytes"]["kv_cache"]
            # the MTP cache (one layer's K and V over the same blocks + scratch) is freed with the
            # target's pool, which is smaller than the plain daemon's: both share --kv-cache-bytes
            self.assertGreaterEqual(freed_spec, mtp + target)
            self.assertLess(freed_spec - mtp, freed_plain, (freed_spec, mtp, freed_plain))
            self.assertEqual(spec.get("/health")[1]["speculative"]["mtp_cache_bytes"], 0)
            self.ok(spec, "/v1/wakeup?tags=kv_cache")
            self.assertGreater(spec.get("/health")[1]["speculative"]["mtp_cache_bytes"], 0)
            self.assertEqual(choices(spec, bodies()[0]), want)
            self.assertGreater(spec_by_version(spec)["0"][2], 0)

    def test_kv_budget_pays_for_the_mtp_cache(self):
        # tiny-mimo: 2 layers, 2 KV heads x head_dim 16, f32, 16-token blocks. A block of the
        # target's KV: 2 layers x (K, V) x 16 x 32 x 4 B; of the MTP cache: (K, V) x 16 x 32 x 4 B
        # (one layer, always f32), and k = 2 drafts take max_num_seqs x (ceil(2 / 16) + 1) scratch
        # blocks. The budget pays both: (8 MiB - scratch) // (target + MTP) blocks.
        budget, seqs = 8 << 20, 8
        target_block, mtp_block, scratch = 2 * 2 * 16 * 32 * 4, 2 * 16 * 32 * 4, seqs * 2
        args = ("--dynamic-load-weight", "--kv-cache-bytes", str(budget), "--max-num-seqs", str(seqs))
        with Daemon(*args, model=self.mimic) as plain, Daemon(*args, "--speculative-config", MTP(2), model=self.mimic) as spec:
            hp, hs = plain.get("/health")[1], spec.get("/health")[1]
            self.assertEqual(hp["kv_cache"]["blocks"], budget // target_block)
            blocks = (budget - scratch * mtp_block) // (target_block + mtp_block)
            self.assertEqual(hs["kv_cache"]["blocks"], blocks)
            self.assertEqual((hs["kv_cache"]["budget_bytes"], hp["kv_cache"]["budget_bytes"]), (budget, budget))
            # held bytes: what the pools ask for, rounded up by the host allocator (2 MiB pages)
            mtp_want, mib2 = (blocks + scratch) * mtp_block, 2 << 20
            mtp_bytes = hs["speculative"]["mtp_cache_bytes"]
            self.assertTrue(mtp_want <= mtp_bytes < mtp_want + mib2, (mtp_bytes, mtp_want))
            self.assertEqual(hs["kv_cache"]["bytes"], blocks * target_block)
            self.assertLessEqual(hs["kv_cache"]["bytes"] + mtp_want, budget)
            self.assertIn(f"MTP cache {blocks} + {scratch} scratch blocks", spec.output())
            freed = self.ok(spec, "/v1/sleep?tags=kv_cache")["freed_bytes"]["kv_cache"]
            self.assertTrue(blocks * target_block + mtp_want <= freed < blocks * target_block + mtp_want + 2 * mib2, freed)
        # a budget that holds the scratch blocks but not one max_model_len sequence besides: refused, named
        r = subprocess.run([BIN, "--model", self.mimic, "--port", "0", "--speculative-config", MTP(2), "--max-model-len", "96",
                            "--max-num-seqs", "4", "--kv-cache-bytes", str(6 * target_block + 8 * mtp_block)],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0, r.stderr)
        self.assertIn("MTP cache", r.stdout + r.stderr)

    def test_preemption_by_swap_and_recompute_keeps_the_draft_kv(self):
        # 6 KV blocks of 16 tokens (and the MTP cache's share of the budget): these requests
        # preempt each other over and over. Greedy outputs equal a plain daemon's and the drafts
        # are still accepted as often as without preemption. (Which steps draft depends on when
        # sequences are swapped, so the counts are not compared; that a swapped sequence drafts
        # exactly as one never swapped is tests/model/test_worker_mtp_swap.cpp's.)
        seqs, target_block, mtp_block = 4, 2 * 2 * 16 * 32 * 4, 2 * 16 * 32 * 4
        tiny = ["--kv-cache-bytes", str(6 * (target_block + mtp_block) + seqs * 2 * mtp_block)]
        common = ["--max-model-len", "96", "--max-num-seqs", str(seqs), "--max-logprobs", "8"]
        reqs = [{"prompt": p, "n": 2, "max_tokens": 50, "temperature": 0, "logprobs": 2, "ignore_eos": True} for p in PROMPTS]
        with Daemon(*common, model=self.mimic) as plain:
            want = [choices(plain, r) for r in reqs]
        with Daemon(*common, "--speculative-config", MTP(3), model=self.mimic) as ref:
            self.assertEqual(concurrently(ref, reqs), want)
            ref_counts = spec_by_version(ref)["0"]
            self.assertEqual(metric(ref, "fdrollout_preemptions_total"), 0)
        self.assertGreater(ref_counts[2], 0.2 * ref_counts[1], ref_counts)
        for extra in (["--swap-space", "0.001"], []):  # swap, then recompute (no pool)
            with self.subTest(extra=extra), Daemon(*common, *tiny, *extra, "--speculative-config", MTP(3), model=self.mimic) as d:
                self.assertEqual(d.get("/health")[1]["kv_cache"]["blocks"], 6)
                if extra:  # a host block holds the block's MTP K/V too (so it comes back with the sequence)
                    self.assertEqual(d.get("/health")[1]["kv_swap_blocks"]["total"], int(0.001 * 2**30) // (target_block + mtp_block))
                self.assertEqual(concurrently(d, reqs), want)
                kind = "fdrollout_swap_preemptions_total" if extra else "fdrollout_recompute_preemptions_total"
                self.assertGreater(metric(d, kind), 0)
                counts = spec_by_version(d)["0"]
                self.assertGreater(counts[2] / counts[1], ref_counts[2] / ref_counts[1] - 0.05, (counts, ref_counts))
                # every block given back (the engine frees the last ones just after the responses)
                deadline = time.monotonic() + 10
                while d.get("/health")[1]["kv_blocks"]["used"] != 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.assertEqual(d.get("/health")[1]["kv_blocks"]["used"], 0)

    def test_use_cudagraph_with_mtp_is_accepted(self):
        # --use-cudagraph with mtp: accepted (on cuda every step then runs eagerly, logged; on cpu
        # the flag captures nothing), same tokens and logprobs, drafts accepted
        with Daemon(model=self.mimic) as plain, Daemon("--use-cudagraph", "--speculative-config", MTP(2), model=self.mimic) as d:
            self.assertEqual(choices(d, bodies()[0]), choices(plain, bodies()[0]))
            self.assertGreater(spec_by_version(d)["0"][2], 0)

    def test_update_replaces_the_draft_layer_with_the_target(self):
        with tempfile.TemporaryDirectory(prefix="fd-mtp-upd-") as src:
            copy_checkpoint(self.mimic, src)
            # v1: the same target, the MTP layer replaced by random weights (the random checkpoint's)
            import safetensors_np
            rnd = safetensors_np.load_file(os.path.join(self.random, "model.safetensors"))
            with Daemon("--dynamic-load-weight", "--speculative-config", MTP(2), model=src) as d, Daemon(model=self.mimic) as plain:
                want = [choices(plain, b) for b in bodies()[:3]]
                self.assertEqual([choices(d, b) for b in bodies()[:3]], want)
                self.ok(d, "/v1/pause")
                rewrite_tensors(src, lambda t: t.update({k: v for k, v in rnd.items() if k.startswith("model.mtp_layers.")}))
                self.ok(d, "/v1/update_weights", {"version": "v1", "verify_checksum": False})
                self.ok(d, "/v1/resume")
                for b, w in zip(bodies()[:3], want):  # same target: same tokens and logprobs, the new label
                    j = d.complete(**b)
                    self.assertEqual(j["weight_version"], "v1")
                    self.assertEqual(sorted(j["choices"], key=lambda c: c["index"]), w)
                per = spec_by_version(d)
                rate = {v: acc / prop for v, (_, prop, acc) in per.items()}
                self.assertGreater(rate["0"], 0.2, per)
                self.assertLess(rate["v1"], rate["0"] / 3, per)  # the random draft layer is much worse
                # ... which is the acceptance collapse the daemon reports, naming both versions
                col = d.get("/health")[1]["speculative"]["acceptance_collapse"]
                self.assertEqual((col["weight_version"], col["previous_weight_version"]), ("v1", "0"), col)
                self.assertAlmostEqual(col["acceptance_rate"], rate["v1"])
                self.assertIn("acceptance collapsed after the weight update from version '0' to 'v1'", d.output())

    def test_checkpoint_without_mtp_tensors_is_refused_and_nothing_changes(self):
        with tempfile.TemporaryDirectory(prefix="fd-mtp-miss-") as src:
            copy_checkpoint(self.mimic, src)
            with Daemon("--dynamic-load-weight", "--speculative-config", MTP(2), model=src) as d:
                want = choices(d, bodies()[0])
                self.ok(d, "/v1/pause")
                rewrite_tensors(src, lambda t: t.pop("model.mtp_layers.0.input_proj.weight"))
                code, j = d.post("/v1/update_weights", {"version": "broken", "verify_checksum": False})
                self.assertEqual((code, j["error"]["type"]), (422, "invalid_checkpoint"), j)
                self.assertIn("model.mtp_layers.0.input_proj.weight", j["error"]["message"])
                self.ok(d, "/v1/resume")
                self.assertEqual(d.get("/health")[1]["weight_version"], "0")
                self.assertEqual(choices(d, bodies()[0]), want)

    def test_start_up_errors_name_the_field(self):
        r = subprocess.run([BIN, "--model", STORIES, "--port", "0", "--speculative-config", MTP(2)],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0, r.stderr)
        self.assertIn("num_nextn_predict_layers", r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
