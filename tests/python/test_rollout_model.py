"""fdrollout.RolloutModel (python/fdrollout/rollout_model.py): the seed's RolloutModelConfig /
RolloutModel API. Reference: the C++ RolloutModel as `fdctl model-info --json` prints it (names,
shapes and training-name mappings per tp rank), and the checkpoint's own tensors: every rollout
tensor equals its training tensors sliced and concatenated as the mapping says."""
import json
import os
import subprocess
import sys
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from fdtest import FDCTL, STORIES  # noqa: E402
from fdrollout import RolloutModel, RolloutModelConfig, safetensors_np  # noqa: E402


def model_info(model, tp):
    out = subprocess.run([FDCTL, "--json", "model-info", "--model", model, "--tp", str(tp)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


class RolloutModelTest(unittest.TestCase):
    def test_matches_fdctl_model_info(self):
        for tp in (1, 2, 4):
            rm = RolloutModel(RolloutModelConfig(STORIES, tensor_parallel_size=tp, load_strategy="ipc_snapshot"))
            ref = model_info(STORIES, tp)
            self.assertEqual(rm.get_name_mappings_to_training(), ref["name_mappings_to_training"], f"tp={tp}")
            for r in ref["ranks"]:
                sd = rm.state_dict(rank=r["rank"])
                self.assertEqual({k: list(v.shape) for k, v in sd.items()}, {e["name"]: e["shape"] for e in r["state_dict"]},
                                 f"tp={tp} rank={r['rank']}")

    def test_mimo_mtp_layers_travel_with_the_target(self):
        # MiMo's model.mtp_layers.N.* (draft weights) are part of the state dict: names, shapes
        # and mappings equal the C++ layout's at tp 1 and 2, values as the mapping says.
        import tempfile
        from fdtest import make_checkpoint
        with tempfile.TemporaryDirectory(prefix="fd-rm-mimo-") as d:
            make_checkpoint(d, "--preset", "tiny-mimo")
            for tp in (1, 2):
                rm = RolloutModel(RolloutModelConfig(d, tensor_parallel_size=tp))
                ref = model_info(d, tp)
                self.assertEqual(rm.get_name_mappings_to_training(), ref["name_mappings_to_training"], f"tp={tp}")
                for r in ref["ranks"]:
                    self.assertEqual({k: list(v.shape) for k, v in rm.state_dict(rank=r["rank"]).items()},
                                     {e["name"]: e["shape"] for e in r["state_dict"]}, f"tp={tp} rank={r['rank']}")
            mapping = RolloutModel(RolloutModelConfig(d)).get_name_mappings_to_training()
            self.assertEqual(mapping["model.mtp_layers.0.self_attn.qkv_proj.weight"],
                             [f"model.mtp_layers.0.self_attn.{x}_proj.weight" for x in "qkv"])
            self.assertEqual(mapping["model.mtp_layers.0.input_proj.weight"], ["model.mtp_layers.0.input_proj.weight"])
            hf = safetensors_np.load_file(os.path.join(d, "model.safetensors"))
            sd = RolloutModel(RolloutModelConfig(d)).state_dict()
            for name, parts in mapping.items():
                np.testing.assert_array_equal(sd[name], np.concatenate([hf[p] for p in parts], axis=0), name)

    def test_values_follow_the_mapping(self):
        hf = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
        rm = RolloutModel(RolloutModelConfig(STORIES, tensor_parallel_size=1))
        sd = rm.state_dict()
        for name, parts in rm.get_name_mappings_to_training().items():
            np.testing.assert_array_equal(sd[name], np.concatenate([hf[p] for p in parts], axis=0), name)
        # tp=2 rank 1 of a fused tensor: the second half of each part, in order.
        sd1 = RolloutModel(RolloutModelConfig(STORIES, tensor_parallel_size=2)).state_dict(rank=1)
        name = "model.layers.0.mlp.gate_up_proj.weight"
        g, u = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
        np.testing.assert_array_equal(sd1[name], np.concatenate([g[g.shape[0] // 2:], u[u.shape[0] // 2:]]))

    def test_bad_config(self):
        with self.assertRaises(ValueError):
            RolloutModelConfig("/nonexistent")
        with self.assertRaises(ValueError):
            RolloutModelConfig(STORIES, tensor_parallel_size=0)
        with self.assertRaises(ValueError):
            RolloutModelConfig(STORIES, load_strategy="nfs")
        with self.assertRaises(ValueError):
            RolloutModel(RolloutModelConfig(STORIES, tensor_parallel_size=2)).state_dict(rank=2)
        with self.assertRaises(ValueError):  # 172 / 3: the intermediate size does not shard
            RolloutModel(RolloutModelConfig(STORIES, tensor_parallel_size=3)).state_dict()

    def test_integral_numbers_count_bools_do_not(self):
        """np.int64(2) was refused as "must be an integer" while True passed as tp 1 (a probe)."""
        cfg = RolloutModelConfig(STORIES, tensor_parallel_size=np.int64(2))
        self.assertEqual((cfg.tensor_parallel_size, type(cfg.tensor_parallel_size)), (2, int))
        rm = RolloutModel(cfg)
        sd = rm.state_dict(np.int64(1))
        want = rm.state_dict(1)
        self.assertEqual(sorted(sd), sorted(want))
        for name in want:
            np.testing.assert_array_equal(sd[name], want[name], name)
        self.assertEqual(list(rm.rank_experts(np.int32(1))), list(rm.rank_experts(1)))
        for bad in (True, False, 2.0, "2"):
            with self.assertRaises(ValueError, msg=repr(bad)) as e:
                RolloutModelConfig(STORIES, tensor_parallel_size=bad)
            self.assertIn("tensor_parallel_size", str(e.exception))
        for bad in (True, 1.0, np.int64(2)):
            with self.assertRaises(ValueError, msg=repr(bad)) as e:
                rm.state_dict(bad)
            self.assertIn("rank", str(e.exception))


if __name__ == "__main__":
    unittest.main()
