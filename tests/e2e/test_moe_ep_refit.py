"""Refits under expert parallelism (issue 23, SPEC §10): every load path of a daemon started with
`--tensor-parallel-size 2 --enable-expert-parallel`, fed from the publishers' per-rank cuts.

- The state dict per rank: `fdctl model-info --tp 2 --ep`, `RolloutModel(enable_expert_parallel=True)`
  and `fdpublish.to_rollout_names(expert_parallel=True)` agree on names and shapes; rank r holds
  experts [r*E/2, (r+1)*E/2) whole and no other (the union over the ranks is every expert once);
  the values are the HF tensors (gate | up stacked), checked against the checkpoint read here.
- ipc_snapshot (Qwen2-MoE-like, shared expert), ipc (Mixtral-like) and rsync (Qwen3-MoE-like,
  with a dense layer; the two-phase stage / commit and a fleet of an EP=2 and a tp=1 daemon) each
  refit the live EP=2 daemon to other weights: it then serves bitwise what a fresh EP=2 daemon
  on those weights serves, and tp=1's greedy tokens with logprobs within 1e-4 (attention's o_proj
  sum over two ranks keeps EP=2 from being bitwise tp=1's; test_moe_ep.py).
- On each path a missing, a duplicated and a mis-shaped expert (for the records: one cut for
  TP-MoE, each expert sliced) is a 422 naming layer and expert; the weights served before keep
  serving bitwise (on every rank: each rank holds different experts).
- transformers v5's Mixtral names (its conversion_mapping.py: `mlp.gate`, the stacked
  `mlp.experts.gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`) serve bitwise what the v4 names
  serve (tp=1 and EP=2), give the same state dict per EP rank (fdctl model-info, to_rollout_names)
  and refit an EP=2 daemon; a tensor under both names is a 422 naming the layer.
- EP with 4 ranks (Qwen2-MoE-like: 12 experts, 4 KV heads) serves tp=1's greedy tokens,
  logprobs within 1e-4, the same as EP=2's."""
import glob
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
import unittest

import numpy as np

from fdtest import FDCTL, STORIES, Daemon, copy_checkpoint, fdctl, make_checkpoint, perturbed, rewrite_tensors

import fdpublish  # noqa: E402  (fdtest puts scripts/ on the path)
import safetensors_np  # noqa: E402

N_NEW = 8
LOGPROB_TOL = 1e-4
EP2 = ("--tensor-parallel-size", "2", "--enable-expert-parallel", "--threads", "1")
EP4 = ("--tensor-parallel-size", "4", "--enable-expert-parallel", "--threads", "1")


def prompt_ids(n=20, seed=3):
    rng = np.random.default_rng(seed)
    return [1] + [int(x) for x in rng.integers(3, 512, n - 1)]


PROMPT = prompt_ids()


def generate(d):
    c = d.complete(prompt=PROMPT, max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=1)["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"]


def fresh(model_dir, *args):
    with Daemon(*args, model=model_dir) as d:
        return generate(d)


def shm_records(port):
    return glob.glob(f"/dev/shm/fdrollout.{port}.weights.*")


class EpRefits(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-moe-ep-refit-")
        cls.ck, cls.other, cls.want_ep, cls.want_tp1, cls.base_ep = {}, {}, {}, {}, {}
        for i, p in enumerate(("qwen2-moe-like", "mixtral-like", "qwen3-moe-like")):
            cls.ck[p] = make_checkpoint(os.path.join(cls.tmp, p), "--preset", p, "--seed", str(40 + i))
            cls.other[p] = perturbed(cls.ck[p], os.path.join(cls.tmp, p + "-other"), seed=7 + i, scale=0.3)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def references(self, preset):
        """(base served by EP=2, other served by a fresh EP=2, other served by tp=1)."""
        if preset not in self.want_ep:
            self.base_ep[preset] = fresh(self.ck[preset], *EP2)
            self.want_ep[preset] = fresh(self.other[preset], *EP2)
            self.want_tp1[preset] = fresh(self.other[preset])
            self.assertNotEqual(self.want_ep[preset][0], self.base_ep[preset][0], "the perturbation must change the tokens")
        return self.base_ep[preset], self.want_ep[preset], self.want_tp1[preset]

    def ok(self, d, path, body=None):
        status, j = d.post(path, body)
        self.assertEqual(status, 200, j)
        return j.get("result", j)

    def update(self, d, version, **extra):
        self.ok(d, "/v1/pause")
        status, j = d.post("/v1/update_weights", {"version": version, **extra})
        self.assertEqual(d.post("/v1/resume")[0], 200)
        return status, j

    def assert_refused(self, d, version, served, *needles):
        """An update to `version` is a 422 whose message has every needle; `served` still serves."""
        status, j = self.update(d, version)
        self.assertEqual(status, 422, j)
        print(f"{version}: {status} {j['error']['message']}")
        for n in needles:
            self.assertIn(n, j["error"]["message"])
        self.assertEqual(generate(d), served)  # bitwise: every rank kept its old experts
        return j["error"]["message"]

    def assert_serves(self, d, preset):
        got = generate(d)
        self.assertEqual(got, self.want_ep[preset])  # bitwise a fresh EP=2 daemon on the new weights
        want = self.want_tp1[preset]
        self.assertEqual(got[0], want[0])
        for i, (g, w) in enumerate(zip(got[1], want[1])):
            self.assertAlmostEqual(g, w, delta=LOGPROB_TOL, msg=f"{preset} step {i} vs tp=1")

    # ---- the state dict per rank: fdctl model-info, RolloutModel, to_rollout_names ----

    def test_state_dict_per_rank_lists_only_that_ranks_experts(self):
        from fdrollout import RolloutModel, RolloutModelConfig
        d = self.ck["qwen2-moe-like"]
        cfg = fdpublish.load_config(d)
        hf = fdpublish.load_checkpoint(d)
        p = subprocess.run([FDCTL, "model-info", "--model", d, "--tp", "2", "--ep", "--json"], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        info = json.loads(p.stdout)
        self.assertEqual((info["tp"], info["ep"]), (2, 2))
        rm = RolloutModel(RolloutModelConfig(d, tensor_parallel_size=2, enable_expert_parallel=True))
        seen = []
        for r in (0, 1):
            rank = info["ranks"][r]
            self.assertEqual(rank["experts"], [6 * r, 6 * r + 6])
            self.assertEqual(list(rm.rank_experts(r)), list(range(6 * r, 6 * r + 6)))
            sd = {t["name"]: t["shape"] for t in rank["state_dict"]}
            for layer in (0, 1):
                b = f"model.layers.{layer}.mlp."
                self.assertEqual(sd[b + "gate.weight"], [12, 64])
                for e in range(12):
                    mine = 6 * r <= e < 6 * r + 6
                    self.assertEqual(b + f"experts.{e}.gate_up_proj.weight" in sd, mine, (r, e))
                    if mine:  # whole: 2 * moe_intermediate rows, all of down's columns
                        self.assertEqual(sd[b + f"experts.{e}.gate_up_proj.weight"], [64, 64])
                        self.assertEqual(sd[b + f"experts.{e}.down_proj.weight"], [64, 32])
                        seen.append((layer, e))
                self.assertEqual(sd[b + "shared_expert.gate_up_proj.weight"], [256, 64])  # whole on every rank
                self.assertEqual(sd[b + "shared_expert.down_proj.weight"], [64, 128])
            self.assertEqual(sd["model.layers.0.self_attn.o_proj.weight"], [64, 32])  # attention stays tp-sliced
            py = fdpublish.to_rollout_names(hf, cfg, tp=2, rank=r, expert_parallel=True)
            self.assertEqual({k: list(v.shape) for k, v in py.items()}, sd)
            vals = rm.state_dict(r)
            self.assertEqual(set(vals), set(sd))
            e = 6 * r + 1
            x = f"model.layers.1.mlp.experts.{e}."
            np.testing.assert_array_equal(vals[x + "gate_up_proj.weight"],
                                          np.concatenate([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]]))
            np.testing.assert_array_equal(vals[x + "down_proj.weight"], hf[x + "down_proj.weight"])
            # this rank's mapping names only its experts; fdctl's and RolloutModel's agree
            self.assertEqual(rank["name_mappings_to_training"], rm.get_name_mappings_to_training(rank=r))
            self.assertEqual(rank["name_mappings_to_training"][x + "gate_up_proj.weight"],
                             [x + "gate_proj.weight", x + "up_proj.weight"])
        self.assertEqual(sorted(seen), [(layer, e) for layer in (0, 1) for e in range(12)])  # every expert once
        every = rm.get_name_mappings_to_training()
        self.assertEqual(every, info["name_mappings_to_training"])
        self.assertIn("model.layers.0.mlp.experts.11.down_proj.weight", every)
        # refused naming why: a dense model, and a size that does not divide the experts
        p = subprocess.run([FDCTL, "model-info", "--model", d, "--tp", "5", "--ep"], capture_output=True, text=True, timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("num_experts = 12", p.stderr)
        with self.assertRaisesRegex(ValueError, "num_experts = 12"):
            fdpublish.to_rollout_names(hf, cfg, tp=5, rank=0, expert_parallel=True)
        p = subprocess.run([FDCTL, "model-info", "--model", STORIES, "--ep"], capture_output=True, text=True, timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("dense", p.stderr)

    # ---- ipc_snapshot ----

    def test_ipc_snapshot_under_ep(self):
        preset = "qwen2-moe-like"
        base, want, _ = self.references(preset)
        model = copy_checkpoint(self.ck[preset], os.path.join(self.tmp, "snap-live"))
        cfg = fdpublish.load_config(model)
        hf = fdpublish.load_checkpoint(self.other[preset])

        def publish(cut, rank, name=None):
            path = os.path.join(model, name or f"model_state.tp{rank}.safetensors")
            safetensors_np.save_file(cut, path)

        def cuts(**kw):
            return [fdpublish.to_rollout_names(hf, cfg, tp=2, rank=r, **kw) for r in (0, 1)]

        with Daemon(*EP2, "--dynamic-load-weight", "--load-strategy", "ipc_snapshot", model=model) as d:
            self.assertEqual(generate(d), base)
            # a record cut for TP-MoE (each expert sliced): every expert mis-shaped for an EP rank
            for r, c in enumerate(cuts()):
                publish(c, r)
            self.assert_refused(d, "tp-cut", base, "layer 0, expert 0", "[32, 64]", "[64, 64]")
            # rank 1's file lacks expert 7's down_proj
            good = cuts(expert_parallel=True)
            publish(good[0], 0)
            miss = dict(good[1])
            miss.pop("model.layers.1.mlp.experts.7.down_proj.weight")
            publish(miss, 1)
            self.assert_refused(d, "missing", base, "model.layers.1.mlp.experts.7.down_proj.weight", "layer 1, expert 7")
            # an expert past the model's (index num_experts) in rank 0's file: no rank holds it, so
            # no rank may pass it as "another rank's" (a probe: accepted at EP=2, label changed)
            src_name = next(k for k in good[0] if ".experts." in k)
            extra_name = re.sub(r"\.experts\.\d+\.", f".experts.{fdpublish.n_experts(cfg)}.", src_name)
            publish({**good[0], extra_name: good[0][src_name]}, 0)
            publish(good[1], 1)
            self.assert_refused(d, "extra", base, extra_name, "unknown tensor")
            # expert 2 of rank 0 in two of its part files
            os.unlink(os.path.join(model, "model_state.tp0.safetensors"))
            publish(good[1], 1)
            dup = "model.layers.0.mlp.experts.2.gate_up_proj.weight"
            publish(good[0], 0, "model_state.tp0.part0.safetensors")
            publish({dup: good[0][dup]}, 0, "model_state.tp0.part1.safetensors")
            self.assert_refused(d, "dup", base, dup, "layer 0, expert 2", "is also in")
            # the good cut (python publisher): every rank its experts whole
            for f in glob.glob(os.path.join(model, "model_state.tp0.part*")):
                os.unlink(f)
            for r in (0, 1):
                fdpublish.publish_ipc_snapshot(good[r], model, rank=r)
            status, j = self.update(d, "py-ep")
            self.assertEqual(status, 200, j)
            self.assert_serves(d, preset)
            # fdctl publish --ep back to the base weights: the base served again, bitwise
            rc, out, err = fdctl(0, "publish", "--strategy", "ipc_snapshot", "--from", self.ck[preset], "--model", model,
                                 "--tp", "2", "--ep", "--json")
            self.assertEqual(rc, 0, err)
            self.assertEqual(json.loads(out)["ep"], 2)
            status, j = self.update(d, "fdctl-ep")
            self.assertEqual(status, 200, j)
            self.assertEqual(generate(d), base)

    # ---- ipc (POSIX shm records) ----

    def test_ipc_under_ep(self):
        preset = "mixtral-like"
        base, want, _ = self.references(preset)
        model = copy_checkpoint(self.ck[preset], os.path.join(self.tmp, "ipc-live"))
        cfg = fdpublish.load_config(model)
        hf = fdpublish.load_checkpoint(self.other[preset])
        with Daemon(*EP2, "--dynamic-load-weight", "--load-strategy", "ipc", model=model) as d:
            self.addCleanup(lambda: [os.unlink(p) for p in shm_records(d.port)])
            self.assertEqual(generate(d), base)
            good = [fdpublish.to_rollout_names(hf, cfg, tp=2, rank=r, expert_parallel=True) for r in (0, 1)]
            # TP-MoE records: mis-shaped experts
            for r in (0, 1):
                fdpublish.publish_ipc(fdpublish.to_rollout_names(hf, cfg, tp=2, rank=r), d.port, "tp-cut", rank=r, tp_size=2)
            self.assert_refused(d, "tp-cut", base, "layer 0, expert 0", "[96, 64]", "[192, 64]")
            # rank 0's record lacks expert 3's w13
            miss = dict(good[0])
            miss.pop("model.layers.0.block_sparse_moe.experts.3.w13.weight")
            fdpublish.publish_ipc(miss, d.port, "missing", rank=0, tp_size=2)
            fdpublish.publish_ipc(good[1], d.port, "missing", rank=1, tp_size=2)
            self.assert_refused(d, "missing", base, "model.layers.0.block_sparse_moe.experts.3.w13.weight", "layer 0, expert 3")
            # rank 1's record names expert 5's w2 twice (the entry of expert 6's w2 renamed)
            fdpublish.publish_ipc(good[0], d.port, "dup", rank=0, tp_size=2)
            fdpublish.publish_ipc(good[1], d.port, "dup", rank=1, tp_size=2)
            names = sorted(good[1])
            src, dst = (names.index(f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight") for e in (6, 5))
            with open(fdpublish.ipc_path(d.port, 1), "r+b") as f:
                f.seek(256 + 320 * src)
                f.write(struct.pack("192s", names[dst].encode()))
            self.assert_refused(d, "dup", base, names[dst], "layer 1, expert 5", "appears twice")
            # the good records, by fdctl publish: it reads the running daemon's layout (EP) itself
            rc, out, err = fdctl(d.port, "publish", "--strategy", "ipc", "--from", self.other[preset], "--version", "fd-ep",
                                 "--json")
            self.assertEqual(rc, 0, err)
            self.assertEqual((json.loads(out)["tp"], json.loads(out)["ep"]), (2, 2))
            status, j = self.update(d, "fd-ep")
            self.assertEqual(status, 200, j)
            self.assert_serves(d, preset)
            # and by the python publisher, back to the base weights
            hf0 = fdpublish.load_checkpoint(self.ck[preset])
            for r in (0, 1):
                fdpublish.publish_ipc(fdpublish.to_rollout_names(hf0, cfg, tp=2, rank=r, expert_parallel=True), d.port, "py-ep",
                                      rank=r, tp_size=2)
            status, j = self.update(d, "py-ep")
            self.assertEqual(status, 200, j)
            self.assertEqual(generate(d), base)

    # ---- rsync, two-phase and a fleet ----

    def test_rsync_two_phase_and_fleet_under_ep(self):
        preset = "qwen3-moe-like"
        base, want, want_tp1 = self.references(preset)
        base_tp1 = fresh(self.ck[preset])
        store = os.path.join(self.tmp, "store")
        hf = fdpublish.load_checkpoint(self.other[preset])
        tmpl = self.ck[preset]
        # v-miss: layer 2's expert 13 has no up_proj; v-shape: layer 0's expert 9 down is [64, 31];
        # v-dup: layer 2's experts given per expert and stacked; v-good: the other weights
        miss = dict(hf)
        miss.pop("model.layers.2.mlp.experts.13.up_proj.weight")
        fdpublish.publish_rsync(miss, store, "v-miss", tmpl)
        shape = dict(hf)
        shape["model.layers.0.mlp.experts.9.down_proj.weight"] = hf["model.layers.0.mlp.experts.9.down_proj.weight"][:, :31]
        fdpublish.publish_rsync(shape, store, "v-shape", tmpl)
        dup = dict(hf)
        dup["model.layers.2.mlp.experts.down_proj"] = np.stack([hf[f"model.layers.2.mlp.experts.{e}.down_proj.weight"]
                                                                for e in range(16)])
        fdpublish.publish_rsync(dup, store, "v-dup", tmpl)
        fdpublish.publish_rsync(hf, store, "v-good", tmpl)

        def rsync_daemon(i, *args):
            cfg = {"source": store, "staging_dir": os.path.join(self.tmp, f"staging{i}")}
            return Daemon(*args, "--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", json.dumps(cfg),
                          model=copy_checkpoint(tmpl, os.path.join(self.tmp, f"rsync-live{i}")))

        with rsync_daemon(0, *EP2) as d, rsync_daemon(1) as t:
            self.assertEqual(generate(d), base)
            # the rank that owns the bad expert refuses; the other rank's experts are untouched too
            self.assert_refused(d, "v-miss", base, "model.layers.2.mlp.experts.13.up_proj.weight", "layer 2, expert 13")
            self.assert_refused(d, "v-shape", base, "layer 0, expert 9", "[64, 31]")
            self.assert_refused(d, "v-dup", base, "layer 2 expert 0", "given twice")
            # two-phase: staged on both ranks, not served; commit makes it live
            self.ok(d, "/v1/pause")
            status, j = d.post("/v1/update_weights", {"version": "v-good", "commit": False})
            self.assertEqual(status, 200, j)
            self.assertEqual(d.get("/health")[1]["staged_weight_version"], "v-good")
            self.ok(d, "/v1/resume")
            self.assertEqual(generate(d), base)  # staged weights are not served
            self.ok(d, "/v1/pause")
            self.ok(d, "/v1/commit_weights", {"version": "v-good"})
            self.ok(d, "/v1/resume")
            self.assert_serves(d, preset)
            # a fleet of the EP=2 daemon and a tp=1 one: a version with a missing expert is
            # staged nowhere (both refuse it), all keep what they serve; the base lands on both
            hosts = f"127.0.0.1:{d.port},127.0.0.1:{t.port}"
            self.assertEqual(fdctl(0, "--hosts", hosts, "pause")[0], 0)
            rc, out, err = fdctl(0, "--hosts", hosts, "--json", "update-weights", "--version", "v-miss")
            # both refused (422), but d serves v-good and t its first version: the fleet was split
            # before the update, so 21 naming who serves what (5, "every host keeps its old
            # version" before: the fleet fix of a probe)
            self.assertEqual(rc, 21, err)
            self.assertIn("this update committed nothing, but the hosts serve different versions", err)
            rep = json.loads(out)
            self.assertEqual([h["ok"] for h in rep["stage"]], [False, False])
            self.assertIn("layer 2, expert 13", rep["stage"][0]["body"]["error"]["message"])
            self.assertEqual(fdctl(0, "--hosts", hosts, "resume")[0], 0)
            self.assertEqual(generate(d), want)
            self.assertEqual(generate(t), base_tp1)
            fdpublish.publish_rsync(fdpublish.load_checkpoint(tmpl), store, "v-base", tmpl)
            self.assertEqual(fdctl(0, "--hosts", hosts, "pause")[0], 0)
            rc, out, err = fdctl(0, "--hosts", hosts, "update-weights", "--version", "v-base")
            self.assertEqual(rc, 0, err)
            self.assertEqual(out.count("commit: ok"), 2, out)
            self.assertEqual(fdctl(0, "--hosts", hosts, "resume")[0], 0)
            self.assertEqual(generate(d), base)
            self.assertEqual(generate(t), base_tp1)
            self.assertEqual([x.get("/health")[1]["weight_version"] for x in (d, t)], ["v-base", "v-base"])

    # ---- transformers v5's Mixtral names ----

    def test_v5_mixtral_names_serve_list_and_refit_like_v4(self):
        preset = "mixtral-like"
        base, want, _ = self.references(preset)
        v5 = to_v5_mixtral(self.ck[preset], os.path.join(self.tmp, "mx-v5"))
        t = safetensors_np.load_file(os.path.join(v5, "model.safetensors"))
        self.assertEqual(t["model.layers.1.mlp.experts.gate_up_proj"].shape, (8, 192, 64))
        self.assertNotIn("model.layers.1.block_sparse_moe.gate.weight", t)
        self.assertEqual(fresh(v5), fresh(self.ck[preset]))  # tp=1, bitwise
        self.assertEqual(fresh(v5, *EP2), base)
        # the state dict per EP rank: the same names, shapes and values from either naming
        cfg = fdpublish.load_config(v5)
        hf4, hf5 = fdpublish.load_checkpoint(self.ck[preset]), fdpublish.load_checkpoint(v5)
        infos = []
        for d in (self.ck[preset], v5):
            p = subprocess.run([FDCTL, "model-info", "--model", d, "--tp", "2", "--ep", "--json"], capture_output=True,
                               text=True, timeout=60)
            self.assertEqual(p.returncode, 0, p.stderr)
            infos.append([(r["state_dict"], r["training_slices"]) for r in json.loads(p.stdout)["ranks"]])
        self.assertEqual(infos[0], infos[1])
        for r in (0, 1):
            a = fdpublish.to_rollout_names(hf4, cfg, tp=2, rank=r, expert_parallel=True)
            b = fdpublish.to_rollout_names(hf5, cfg, tp=2, rank=r, expert_parallel=True)
            self.assertEqual(sorted(a), sorted(b))
            for k in a:
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        # an EP=2 daemon (v4 names) refitted from a v5 checkpoint of other weights serves them
        model = copy_checkpoint(self.ck[preset], os.path.join(self.tmp, "mx-v5-live"))
        other5 = to_v5_mixtral(self.other[preset], os.path.join(self.tmp, "mx-v5-other"))
        both = to_v5_mixtral(self.other[preset], os.path.join(self.tmp, "mx-v5-both"))
        rewrite_tensors(both, lambda x: x.update({"model.layers.0.block_sparse_moe.gate.weight":
                                                  x["model.layers.0.mlp.gate.weight"]}))
        with Daemon(*EP2, "--dynamic-load-weight", model=model) as d:
            shutil.copyfile(os.path.join(both, "model.safetensors"), os.path.join(model, "model.safetensors"))
            self.assert_refused(d, "both", base, "layer 0 router is given twice", "model.layers.0.mlp.gate.weight")
            shutil.copyfile(os.path.join(other5, "model.safetensors"), os.path.join(model, "model.safetensors"))
            status, j = self.update(d, "v5")
            self.assertEqual(status, 200, j)
            self.assert_serves(d, preset)


def to_v5_mixtral(src, dst):
    """dst = the Mixtral checkpoint src under transformers v5's names (conversion_mapping.py):
    block_sparse_moe.gate -> mlp.gate; experts' w1 | w3 -> mlp.experts.gate_up_proj [E, 2I, H]
    (MergeModulelist(dim=0) then Concatenate(dim=1)), w2 -> mlp.experts.down_proj [E, H, I]."""
    cfg = fdpublish.load_config(src)

    def mutate(t):
        for layer in range(cfg["num_hidden_layers"]):
            b, v5 = f"model.layers.{layer}.block_sparse_moe.", f"model.layers.{layer}.mlp."
            t[v5 + "gate.weight"] = t.pop(b + "gate.weight")
            e = range(cfg["num_local_experts"])
            w1, w3, w2 = ([t.pop(f"{b}experts.{i}.{w}.weight") for i in e] for w in ("w1", "w3", "w2"))
            t[v5 + "experts.gate_up_proj"] = np.concatenate([np.stack(w1), np.stack(w3)], axis=1)
            t[v5 + "experts.down_proj"] = np.stack(w2)

    return rewrite_tensors(copy_checkpoint(src, dst), mutate)


class Ep4(unittest.TestCase):
    """EP with 4 ranks on 2 cores: Qwen2-MoE-like (12 experts, 4 KV heads), --threads 1."""

    def test_ep4_equals_tp1(self):
        tmp = tempfile.mkdtemp(prefix="fd-moe-ep4-")
        self.addCleanup(shutil.rmtree, tmp, True)
        ck = make_checkpoint(os.path.join(tmp, "q2"), "--preset", "qwen2-moe-like", "--seed", "40")
        tp1 = fresh(ck)
        t0 = time.time()
        with Daemon(*EP4, model=ck) as d:
            h = d.get("/health")[1]
            self.assertEqual((h["tensor_parallel_size"], h["expert_parallel_size"]), (4, 4), h)
            ep4 = generate(d)
        print(f"EP=4 daemon start + {N_NEW} tokens: {time.time() - t0:.1f} s")
        ep2 = fresh(ck, *EP2)
        self.assertEqual(ep4[0], tp1[0])
        self.assertEqual(ep4[0], ep2[0])
        for i, (g, w) in enumerate(zip(ep4[1], tp1[1])):
            self.assertAlmostEqual(g, w, delta=LOGPROB_TOL, msg=f"EP=4 step {i} vs tp=1")


if __name__ == "__main__":
    unittest.main(verbosity=2)
