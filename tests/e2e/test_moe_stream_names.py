"""Weight streams of MoE checkpoints that store their experts stacked (transformers v5's layout:
`model.layers.L.mlp.experts.gate_up_proj [E, 2I, H]`, `...experts.down_proj [E, H, I]`) take the
checkpoint's own names (docs/weight_streams.md, "Names"; docs/architectures.md):

- /init_weight_transfer_engine lists the checkpoint's own names and shapes (the stacked tensors
  as stored), and the per-expert views of each stacked tensor apart (`expert_tensors`);
- a Qwen3-MoE streamed under its own names (tp=1 and EP=2) serves bitwise what a fresh daemon on
  the same weights serves, also after a sleep / wakeup; the per-expert names keep working, and a
  stream may mix both forms (one per expert);
- a Mixtral under transformers v5's names (`mlp.gate`, the stacked `mlp.experts.*`) streams
  under those names;
- the same expert sent stacked and split is a 400 "sent twice"; a stacked tensor left out is the
  422 naming it; a stacked tensor in a delta update is a 400 naming the per-expert names to send,
  and a delta on a per-expert name applies (bitwise a fresh daemon on the edited weights); a landed
  update and a landed delta take the stacked names."""
import os
import shutil
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from fdtest import Daemon, StreamChecks, fresh_daemon, greedy, make_checkpoint, perturbed, rewrite_tensors  # noqa: E402
from fdrollout import Client, FdRolloutError  # noqa: E402
from fdrollout import safetensors_np  # noqa: E402
from test_moe_ep_refit import EP2, PROMPT, to_v5_mixtral  # noqa: E402

ASK = {"prompt": PROMPT, "max_tokens": 8}
L0 = "model.layers.0.mlp.experts."


def load(d):
    return safetensors_np.load_file(os.path.join(d, "model.safetensors"))


def split_experts(t, leaves=("gate_proj", "up_proj", "down_proj")):
    """The per-expert form of the stacked tensors in t (the names split_stacked_experts gives)."""
    out = {}
    for name, a in t.items():
        for kind in ("gate_up_proj", "down_proj"):
            if name.endswith(".experts." + kind):
                p = name[: -len(kind)]
                for e in range(a.shape[0]):
                    if kind == "gate_up_proj":
                        i = a.shape[1] // 2
                        out[f"{p}{e}.{leaves[0]}.weight"], out[f"{p}{e}.{leaves[1]}.weight"] = a[e, :i], a[e, i:]
                    else:
                        out[f"{p}{e}.{leaves[2]}.weight"] = a[e]
                break
        else:
            out[name] = a
    return out


class StreamedMoe(StreamChecks):
    """A daemon on `cls.ck` (stacked experts) and fresh references on other weights `cls.new`."""
    ARGS = ()
    PRESET = "qwen3-moe-like"
    V5_MIXTRAL = False

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-moe-stream-")
        if cls.V5_MIXTRAL:
            v4 = make_checkpoint(os.path.join(cls.tmp, "v4"), "--preset", "mixtral-like", "--seed", "41")
            cls.ck = to_v5_mixtral(v4, os.path.join(cls.tmp, "ck"))
        else:
            cls.ck = make_checkpoint(os.path.join(cls.tmp, "ck"), "--preset", cls.PRESET, "--stacked-experts", "--seed", "40")
        cls.new = perturbed(cls.ck, os.path.join(cls.tmp, "new"), seed=7, scale=0.3)
        cls.tensors, cls.base = load(cls.new), load(cls.ck)
        with fresh_daemon(cls.new, *cls.ARGS) as ref:
            cls.ref_new = greedy(ref, **ASK)[:2]
        with fresh_daemon(cls.ck, *cls.ARGS) as ref:
            cls.ref_old = greedy(ref, **ASK)[:2]
        assert cls.ref_new != cls.ref_old, "the two weight sets must serve apart for the comparisons to mean anything"
        cls.d = Daemon("--dynamic-load-weight", "--control-timeout-s", "60", *cls.ARGS, model=cls.ck, extra=False)
        cls.c = Client(f"127.0.0.1:{cls.d.port}", timeout=60)

    def assert_serving(self, ref, version):
        self.assertEqual(greedy(self.d, **ASK), (*ref, version))
        self.assertEqual(self.c.health()["state"], "serving")


class StackedQwen3Tp1(StreamedMoe, unittest.TestCase):
    def test_1_init_lists_the_checkpoints_own_names(self):
        _, info = self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})
        listed = {t["name"]: t["shape"] for t in info["tensors"]}
        self.assertEqual(listed, {n: list(a.shape) for n, a in self.base.items()})
        self.assertEqual(len(listed[L0 + "gate_up_proj"]), 3)
        views = [t for t in info["expert_tensors"] if t["in"] == L0 + "gate_up_proj"]
        E = listed[L0 + "gate_up_proj"][0]
        self.assertEqual([t["name"] for t in views[:3]], [L0 + "0.gate_proj.weight", L0 + "0.up_proj.weight", L0 + "1.gate_proj.weight"])
        self.assertEqual(len(views), 2 * E)

    def test_2_own_names_then_per_expert_then_mixed(self):
        r = self.stream("own", self.tensors)
        self.assertEqual(r["weight_version"], "own")
        self.assert_serving(self.ref_new, "own")
        self.c.sleep()
        self.c.wakeup()
        self.assert_serving(self.ref_new, "own")
        self.stream("split", split_experts(self.base), bucket_bytes=1 << 16)  # the per-expert names still work
        self.assert_serving(self.ref_old, "split")
        split = split_experts(self.tensors)  # layer 0 stacked, the others per expert
        mixed = {n: a for n, a in split.items() if not n.startswith(L0)}
        mixed.update({n: a for n, a in self.tensors.items() if n.startswith(L0)})
        self.stream("mixed", mixed, bucket_bytes=1 << 16)
        self.assert_serving(self.ref_new, "mixed")

    def test_3_duplicates_and_missing_are_4xx(self):
        self.stream("good", self.base)
        dup = {**self.tensors, L0 + "3.up_proj.weight": split_experts(self.tensors)[L0 + "3.up_proj.weight"]}
        for kw in ({}, {"bucket_bytes": 1}):  # in one bucket, across buckets
            e = self.bad(400, "invalid_argument", ["sent twice", L0 + "3.up_proj.weight", L0 + "gate_up_proj"], dup, **kw)
            self.assertIn("expert 3", e.message)
        missing = {n: a for n, a in self.tensors.items() if n != L0 + "down_proj"}
        self.bad(422, "invalid_checkpoint", ["missing 1 tensor(s)", L0 + "down_proj"], missing)
        part = {n: a for n, a in split_experts(self.tensors).items() if n != L0 + "5.down_proj.weight"}
        self.bad(422, "invalid_checkpoint", ["missing 1 tensor(s)", L0 + "5.down_proj.weight"], part)
        wrong = {**self.tensors, L0 + "down_proj": self.tensors[L0 + "down_proj"][1:]}
        self.bad(422, "invalid_checkpoint", [L0 + "down_proj", "shape"], wrong)
        self.assert_serving(self.ref_old, "good")

    def test_4_deltas_take_the_per_expert_names(self):
        self.stream("base", self.tensors)
        from fdrollout import FdRolloutError as Err
        with self.assertRaises(Err) as e:
            with self.c.weight_stream("d-bad", base_version="base") as ws:
                ws.send_delta(L0 + "down_proj", np.array([0, 5], np.int64), np.array([0.5, -0.5], np.float32))
        self.assertEqual((e.exception.status, e.exception.type), (400, "invalid_argument"), e.exception.message)
        self.assertIn(L0 + "0.down_proj.weight", e.exception.message)
        self.assertEqual(self.c.weight_version(), "base")
        # a delta on one expert's view: bitwise a fresh daemon on the checkpoint with that edit
        idx, vals = np.array([3, 40, 77], np.int64), np.array([0.25, -0.5, 0.75], np.float32)
        with self.c.weight_stream("d1", base_version="base") as ws:
            ws.send_delta(L0 + "2.down_proj.weight", idx, vals)
        edited = os.path.join(self.tmp, "edited")
        shutil.copytree(self.new, edited)

        def edit(t):
            a = t[L0 + "down_proj"].copy()
            a[2].reshape(-1)[idx] = vals
            t[L0 + "down_proj"] = a

        rewrite_tensors(edited, edit)
        with fresh_daemon(edited) as ref:
            want = greedy(ref, **ASK)[:2]
        self.assertNotEqual(want, self.ref_new)
        self.assert_serving(want, "d1")

    def test_5_landed_update_takes_the_stacked_names(self):
        self.stream("land-base", self.base)
        self.stream("landed", self.tensors, land=True)  # the Client sends each stacked tensor's views to the ranks
        self.assert_serving(self.ref_new, "landed")
        self.assertTrue(self.c.health()["weight_stream"]["serving_landed"])
        # and a landed delta under the stacked names (the Client splits it into the views' deltas): back to the base
        from fdrollout import changed_elements
        with self.c.weight_stream("landed-delta", base_version="landed", land=True) as ws:
            for n in sorted(self.base):
                idx, vals = changed_elements(self.tensors[n], self.base[n])
                if idx.size:
                    ws.send_delta(n, idx, vals)
        self.assert_serving(self.ref_old, "landed-delta")


class StackedQwen3Ep2(StreamedMoe, unittest.TestCase):
    ARGS = EP2

    def test_own_names_on_ep2(self):
        self.stream("own", self.tensors, bucket_bytes=1 << 16)
        self.assert_serving(self.ref_new, "own")
        self.c.sleep()
        self.c.wakeup()
        self.assert_serving(self.ref_new, "own")


class V5Mixtral(StreamedMoe, unittest.TestCase):
    V5_MIXTRAL = True

    def test_v5_names(self):
        _, info = self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})
        self.assertEqual({t["name"] for t in info["tensors"]}, set(self.base))
        self.assertIn(L0 + "gate_up_proj", self.base)
        self.assertIn("model.layers.0.mlp.gate.weight", self.base)
        self.stream("v5", self.tensors)
        self.assert_serving(self.ref_new, "v5")
        self.stream("v5-split", split_experts(self.base), bucket_bytes=1 << 16)
        self.assert_serving(self.ref_old, "v5-split")
        dup = {**self.tensors, L0 + "1.gate_proj.weight": split_experts(self.tensors)[L0 + "1.gate_proj.weight"]}
        self.bad(400, "invalid_argument", ["sent twice", L0 + "gate_up_proj"], dup)
        self.assert_serving(self.ref_old, "v5-split")


if __name__ == "__main__":
    unittest.main()
