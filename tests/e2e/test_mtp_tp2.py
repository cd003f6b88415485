"""MTP speculation at --tensor-parallel-size 2 (issue #24, SPEC §11): the same guarantees as tp 1.

Each rank runs its shard of the MTP layer (heads and intermediate split as a target block, the
embedding and the shared head vocab parallel, the all-reduces where a target block has them);
the ranks all-gather their per-shard (max logit, id) so every rank drafts the same tokens; the
daemon sends the draft batch to the ranks over the step link (LinkOp::draft_mtp) and reads rank
0's drafts back. The reference is a tp 2 daemon without speculation (tp 2's own arithmetic).

Checked here:
- greedy tokens, text, every logprob, top_logprobs and prompt_logprobs, and a seeded sampled
  request equal a tp 2 daemon without speculation bit for bit, alone and batched; the drafts are
  accepted (the mimic layer, > 0.2) and, on the "mixed" fixture, the proposed / accepted counts
  equal the numpy MTP reference (np_llama.mtp_draft_counts): the sharded layer and the agreed
  argmax compute the layer's drafts;
- --nnodes 2: the remote rank gets the draft batch inline on its TCP link (outputs equal, drafts
  accepted);
- the MTP cache is per rank (kv_dim / 2 each: /health's mtp_cache_bytes, the ranks' sum, is what
  the budget formula of tp 1 gives), sleep?tags=kv_cache frees it on both ranks (in freed_bytes,
  mtp_cache_bytes 0) and wakeup rebuilds it (outputs as before, drafts accepted);
- preemption by swap and by recompute (a 6-block pool) keeps outputs equal and acceptance as
  without preemption: each rank's host blocks carry its half of the MTP K/V;
- update_weights at tp 2 replaces the MTP layer on both ranks with the target (trained fixture of
  scripts/make_mtp_fixture.py --quick, CTest's mtp_fixture): from the untrained layer, a one-phase
  update to the trained (fresh) one lifts acceptance above 0.35 (a layer mixed across ranks would
  not), a two-phase (stage, commit) update back to the untrained one gives version 0's draft
  counts exactly; outputs equal a plain tp 2 daemon's throughout.
"""
import json
import os
import shutil
import sys
import tempfile
import unittest

from fdtest import BIN, REPO, Daemon, copy_checkpoint, free_port, in_parallel, make_checkpoint, rewrite_tensors, spec_by_version

sys.path.insert(0, os.path.join(REPO, "scripts"))
import make_mtp_fixture  # noqa: E402

MTP = lambda k: json.dumps({"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": 0})
TP2 = ("--tensor-parallel-size", "2", "--threads", "1")
PROMPTS = ["Once upon a time", "Lily and Tom", "The little dog", "Tom and Lily played with the ball."]


def bodies():
    out = [{"prompt": p, "max_tokens": 24 + 4 * i, "temperature": 0, "logprobs": 3, "ignore_eos": True} for i, p in enumerate(PROMPTS)]
    out.append({"prompt": PROMPTS[0], "max_tokens": 7, "temperature": 0, "logprobs": 2, "prompt_logprobs": 2})
    out.append({"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0, "logprobs": 1, "repetition_penalty": 1.3})
    out.append({"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0.8, "seed": 11, "logprobs": 2, "ignore_eos": True})
    return out


def choices(d, body):
    return sorted(d.complete(**body)["choices"], key=lambda c: c["index"])


class MtpTp2(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="fd-mtp-tp2-")
        cls.mimic = make_checkpoint(os.path.join(cls.tmp.name, "mimic"), "--preset", "tiny-mimo", "--mtp-mimic", "--seed", "3")
        cls.mixed = make_checkpoint(os.path.join(cls.tmp.name, "mixed"), "--preset", "tiny-mimo", "--mtp-mimic",
                                    "--mtp-hidden-scale", "0.1", "--no-tie", "--layers", "1", "--seed", "3")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def ok(self, d, path, body=None):
        code, j = d.post(path, body)
        self.assertEqual(code, 200, j)
        return j["result"]

    def test_outputs_equal_a_tp2_plain_daemon_alone_and_batched(self):
        with Daemon(*TP2, "--max-logprobs", "64", model=self.mimic) as plain, \
                Daemon(*TP2, "--max-logprobs", "64", "--speculative-config", MTP(3), model=self.mimic) as spec:
            want = [choices(plain, b) for b in bodies()]
            self.assertEqual([choices(spec, b) for b in bodies()], want)
            self.assertEqual(in_parallel(lambda b: choices(spec, b), bodies() * 2), want * 2)
            drafts, proposed, accepted = spec_by_version(spec)["0"]
            self.assertGreater(accepted, 0.2 * proposed, (drafts, proposed, accepted))  # the copied layer predicts the target

    def test_two_nodes_send_the_draft_batch_inline(self):
        # --nnodes 2 (two "hosts" on one machine, test_nnodes.py): rank 1 gets each draft batch
        # inline on its TCP link; outputs equal the one-node tp 2 plain daemon's, drafts accepted
        from test_nnodes import Node, node0
        token = os.path.join(self.tmp.name, "token")
        with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        with Daemon(*TP2, model=self.mimic) as plain:
            want = [choices(plain, b) for b in bodies()[:3]]
        port = free_port()
        with node0(port, token, "--speculative-config", MTP(2), model=self.mimic) as d, Node(port, token, model=self.mimic):
            d.wait_ready(60)
            self.assertEqual([choices(d, b) for b in bodies()[:3]], want)
            drafts, proposed, accepted = spec_by_version(d)["0"]
            self.assertGreater(accepted, 0.2 * proposed, (drafts, proposed, accepted))

    def test_draft_counts_equal_the_numpy_mtp_reference(self):
        import np_llama
        cfg, w = np_llama.load(self.mixed)
        prompt, m, k = [1, 45, 99, 301, 7], 40, 2
        with Daemon(*TP2, "--speculative-config", MTP(k), "--no-enable-prefix-caching", model=self.mixed) as d:
            seq = prompt + d.complete(prompt=prompt, max_tokens=m, temperature=0, ignore_eos=True)["choices"][0]["token_ids"]
            proposed, accepted = np_llama.mtp_draft_counts(cfg, w, seq, len(prompt), m, k)
            self.assertEqual(spec_by_version(d)["0"][1:], [proposed, accepted])
            self.assertTrue(0 < accepted < proposed, (proposed, accepted))  # both outcomes: every draft is compared

    def test_mtp_cache_per_rank_sleep_frees_it_and_wakeup_rebuilds_it(self):
        seqs, budget = 4, 64 << 20
        args = ("--dynamic-load-weight", "--kv-cache-bytes", str(budget), "--max-num-seqs", str(seqs), "--block-size", "16")
        # tiny-mimo: kv_dim 32, 2 layers; per block, all ranks together: target 2*2*16*32*4, MTP 2*16*32*4
        target_block, mtp_block, scratch = 2 * 2 * 16 * 32 * 4, 2 * 16 * 32 * 4, seqs * 2
        blocks = (budget - scratch * mtp_block) // (target_block + mtp_block)
        mtp_want, mib2 = (blocks + scratch) * mtp_block, 2 << 20  # 22 MB: a rank holding all kv heads would double it
        with Daemon(*TP2, *args, "--speculative-config", MTP(2), model=self.mimic) as spec:
            want = choices(spec, bodies()[0])
            mtp = spec.get("/health")[1]["speculative"]["mtp_cache_bytes"]
            self.assertTrue(mtp_want <= mtp < mtp_want + 2 * mib2, (mtp, mtp_want))  # the two ranks' halves, each rounded up
            freed = self.ok(spec, "/v1/sleep?tags=kv_cache")["freed_bytes"]["kv_cache"]
            self.assertTrue(blocks * target_block + mtp_want <= freed < blocks * target_block + mtp_want + 4 * mib2, freed)
            self.assertEqual(spec.get("/health")[1]["speculative"]["mtp_cache_bytes"], 0)
            self.ok(spec, "/v1/wakeup?tags=kv_cache")
            self.assertEqual(spec.get("/health")[1]["speculative"]["mtp_cache_bytes"], mtp)
            self.assertEqual(choices(spec, bodies()[0]), want)
            self.assertGreater(spec_by_version(spec)["0"][2], 0)

    def test_preemption_by_swap_and_recompute_keeps_each_ranks_draft_kv(self):
        # As test_mtp.py's at tp 1: 6 KV blocks of 16 tokens, the requests preempt each other over
        # and over; each rank's host blocks hold its half of the block's MTP K/V after its target
        # layers. Outputs equal a plain tp 2 daemon's; acceptance as without preemption.
        # the mixed fixture (1 layer, about half the drafts accepted: a wrong MTP K/V shows in the rate)
        seqs, target_block, mtp_block = 4, 2 * 1 * 16 * 32 * 4, 2 * 16 * 32 * 4  # all ranks together
        tiny = ["--kv-cache-bytes", str(6 * (target_block + mtp_block) + seqs * 2 * mtp_block)]
        common = [*TP2, "--max-model-len", "96", "--max-num-seqs", str(seqs), "--max-logprobs", "8"]
        reqs = [{"prompt": p, "n": 2, "max_tokens": 50, "temperature": 0, "logprobs": 2, "ignore_eos": True} for p in PROMPTS]
        with Daemon(*common, model=self.mixed) as plain:
            want = [choices(plain, r) for r in reqs]
        with Daemon(*common, "--speculative-config", MTP(3), model=self.mixed) as ref:
            self.assertEqual(in_parallel(lambda r: choices(ref, r), reqs), want)
            _, ref_proposed, ref_accepted = spec_by_version(ref)["0"]
        for extra in (["--swap-space", "0.001"], []):  # swap, then recompute (no pool)
            with self.subTest(extra=extra), Daemon(*common, *tiny, *extra, "--speculative-config", MTP(3), model=self.mixed) as d:
                self.assertEqual(d.get("/health")[1]["kv_cache"]["blocks"], 6)
                self.assertEqual(in_parallel(lambda r: choices(d, r), reqs), want)
                kind = "swap_preemptions_total" if extra else "recompute_preemptions_total"
                preempted = [ln for ln in d.get("/metrics")[1].splitlines() if ln.startswith(f"fdrollout_{kind} ")]
                self.assertGreater(float(preempted[0].rsplit(" ", 1)[1]), 0)
                _, proposed, accepted = spec_by_version(d)["0"]
                self.assertGreater(accepted / proposed, ref_accepted / ref_proposed - 0.05, (proposed, accepted, ref_proposed, ref_accepted))

    def test_updates_replace_the_mtp_layer_on_both_ranks(self):
        import safetensors_np
        root = make_mtp_fixture.mtp_fixture(os.path.dirname(BIN), quick=True)
        fresh = os.path.join(root, "fresh")

        def layer(v):
            return {k: t for k, t in safetensors_np.load_file(os.path.join(root, v, "model.safetensors")).items()
                    if k.startswith("model.mtp_layers.")}

        reqs = [{"prompt": p, "max_tokens": 40, "temperature": 0, "logprobs": 2, "ignore_eos": True} for p in PROMPTS]
        src = os.path.join(os.path.dirname(BIN), "fixtures", f"mtp-tp2-test-{os.getpid()}")
        try:
            copy_checkpoint(fresh, src)
            rewrite_tensors(src, lambda t: t.update(layer("untrained")))  # version 0 drafts with the untrained layer
            with Daemon(*TP2, model=fresh) as plain:
                want = [choices(plain, b) for b in reqs]
            with Daemon(*TP2, "--dynamic-load-weight", "--speculative-config", MTP(2), model=src) as d:
                self.assertEqual([choices(d, b) for b in reqs], want)
                # one phase: the trained layer on both ranks
                self.ok(d, "/v1/pause")
                rewrite_tensors(src, lambda t: t.update(layer("fresh")))
                self.ok(d, "/v1/update_weights", {"version": "fresh", "verify_checksum": False})
                self.ok(d, "/v1/resume")
                self.assertEqual([choices(d, b) for b in reqs], want)
                # two phases (stage, commit): the untrained layer again, on both ranks
                self.ok(d, "/v1/pause")
                rewrite_tensors(src, lambda t: t.update(layer("untrained")))
                self.assertTrue(self.ok(d, "/v1/update_weights", {"version": "again", "commit": False, "verify_checksum": False})["staged"])
                self.ok(d, "/v1/commit_weights", {"version": "again"})
                self.ok(d, "/v1/resume")
                self.assertEqual([choices(d, b) for b in reqs], want)
                per = spec_by_version(d)
                rate = {v: acc / prop for v, (_, prop, acc) in per.items()}
                self.assertGreater(rate["fresh"], 0.35, per)  # both ranks' shards of the trained layer
                self.assertLess(rate["0"], rate["fresh"] / 2, per)
                self.assertEqual(per["again"], per["0"])  # the same layer back: the same drafts
        finally:
            shutil.rmtree(src, ignore_errors=True)

if __name__ == "__main__":
    unittest.main()
