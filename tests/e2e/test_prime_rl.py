"""prime-rl's weight routes (issue 26; docs/peer_aliases.md): its orchestrator drives a vLLM server
with its own routes, and fdrollout answers them with the same engine operation as
/v1/update_weights, all-or-nothing.

Replayed from prime-rl's source (PrimeIntellect-ai/prime-rl):
  - src/prime_rl/orchestrator/clients.py, AdminPlane.update_weights: POST /pause with params
    {"mode": "keep", "clear_cache": "false"}, POST /update_weights with
    json={"weight_dir": <checkpoint dir>, "version_uid": <str or None>}, then POST /resume; every
    call only checks raise_for_status();
  - src/prime_rl/orchestrator/client.py, reload_weights: POST /reload_weights with body {};
  - src/prime_rl/inference/vllm/server.py: the routes (update_weights reads data["weight_dir"]).
The pause here is mode=keep without clear_cache=false: keeping the prefix cache across a pause is
the client-fields part of issue 26 (another branch); the update itself invalidates it anyway.

After every step the greedy ids and logprobs equal a fresh daemon's on the checkpoint loaded, and
the weight_version reported is that checkpoint's label.
"""
import json
import os
import shutil
import tempfile
import unittest

from fdtest import STORIES, Daemon, copy_checkpoint, fresh_daemon, greedy, perturbed, rewrite_tensors


class PrimeRl(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-prime-")
        cls.A = copy_checkpoint(STORIES, os.path.join(cls.tmp, "A"))
        # prime-rl writes one checkpoint dir per step under its output dir
        cls.step = {n: perturbed(STORIES, os.path.join(cls.tmp, "weights", f"step_{n}"), seed=40 + n) for n in (1, 2)}
        cls.ref = {}
        for name, path in (("A", cls.A), (1, cls.step[1]), (2, cls.step[2])):
            with fresh_daemon(path) as fresh:
                cls.ref[name] = greedy(fresh)[:2]
        assert len({tuple(v[0]) for v in cls.ref.values()}) == 3

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        # started from the run's dir, as prime-rl starts its vLLM server and orchestrator
        self.d = Daemon("--dynamic-load-weight", model=self.A, cwd=self.tmp)
        self.addCleanup(self.d.__exit__)

    def post(self, path, body=None, want=200):
        status, j = self.d.post(path, body)
        self.assertEqual(status, want, (path, j))
        return j

    def prime_update(self, body):
        """AdminPlane.update_weights' three calls."""
        self.post("/pause?mode=keep")
        j = self.post("/update_weights", body)
        self.post("/resume")
        return j

    def serves(self, name, label):
        ids, lps, got = greedy(self.d)
        self.assertEqual((ids, lps), self.ref[name], f"not the weights of {name} (label {got})")
        self.assertEqual(self.d.get("/health")[1]["weight_version"], got)
        if label == "fp":
            self.assertRegex(got, r"^fp-[0-9a-f]{16}$")
        else:
            self.assertEqual(got, label)
        return got

    def test_update_from_weight_dirs_then_reload_the_base(self):
        self.serves("A", "0")
        j = self.prime_update({"weight_dir": self.step[1], "version_uid": None})
        self.assertEqual(j["status"], "ok")
        label = self.serves(1, "fp")  # no version given, no version.yaml: named by its fingerprint
        self.assertEqual(j["weight_version"], label)
        # sleep + wakeup (vLLM's routes) re-read the dir the weights came from
        self.post("/sleep?level=1")
        self.post("/wake_up")
        self.serves(1, label)
        # an integer version becomes its string; version_uid names a version too
        self.prime_update({"weight_dir": self.step[2], "version": 2})
        self.serves(2, "2")
        self.prime_update({"weight_dir": self.step[1], "version_uid": "uid-1"})
        self.serves(1, "uid-1")
        # prime-rl's default config sends weight_dir relative to the run's dir ("outputs/<run>/
        # broadcasts/step_N"), which its vLLM server resolves against its working directory: so
        # does the daemon, and echoes the resolved path (it was a 400, and prime-rl died at step 0)
        j = self.prime_update({"weight_dir": "weights/./step_2", "version": "rel"})
        self.assertEqual(j["weight_dir"], os.path.join(os.path.realpath(self.tmp), "weights", "step_2"))
        self.serves(2, "rel")
        # on a serving engine the call pauses (wait), updates and resumes by itself
        self.post("/update_weights", {"weight_dir": self.step[2], "version": "s2"})
        self.assertFalse(self.d.get("/health")[1]["is_paused"])
        self.serves(2, "s2")
        # /reload_weights {}: the base --model, labelled as at start-up
        j = self.post("/reload_weights", {})
        self.assertEqual(j["weight_version"], "0")
        self.serves("A", "0")

    def test_bad_weight_dirs_change_nothing(self):
        self.prime_update({"weight_dir": self.step[1], "version": 1})
        self.serves(1, "1")
        self.post("/pause?mode=keep")

        def refused(body, status, etype, *words):
            j = self.post("/update_weights", body, want=status)
            self.assertEqual(j["error"]["type"], etype, j)
            for w in words:
                self.assertIn(w, j["error"]["message"])

        cwd = os.path.realpath(self.tmp)  # a relative weight_dir is resolved there, then checked like any other
        refused({"weight_dir": "weights/step_9"}, 503, "source_unavailable", os.path.join(cwd, "weights", "step_9"))
        refused({}, 400, "invalid_argument", "weight_dir")
        refused({"weight_dir": self.step[2], "extra": 1}, 400, "invalid_argument", "extra")
        refused({"weight_dir": self.step[2], "version": -1}, 400, "invalid_argument", "non-negative")
        refused({"weight_dir": os.path.join(self.tmp, "nowhere")}, 503, "source_unavailable", "not a reachable directory")
        # another user's dir, or one anybody may write into: 403 naming it (SPEC §8.6)
        other = copy_checkpoint(self.step[2], os.path.join(self.tmp, "other"))
        os.chown(other, 65534, 65534)
        refused({"weight_dir": other}, 403, "forbidden", other, "65534")
        refused({"weight_dir": "other"}, 403, "forbidden", os.path.join(cwd, "other"), "65534")
        os.chown(other, 0, 0)
        os.chmod(other, 0o777)
        refused({"weight_dir": other}, 403, "forbidden", other)
        os.chmod(other, 0o755)
        os.chown(os.path.join(other, "model.safetensors"), 65534, 65534)
        refused({"weight_dir": other}, 403, "forbidden", "model.safetensors")
        # a checkpoint of another shape: 422 naming the tensor, nothing applied
        bad = rewrite_tensors(copy_checkpoint(self.step[2], os.path.join(self.tmp, "bad")),
                              lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:-1]}))
        refused({"weight_dir": bad}, 422, "invalid_checkpoint", "model.norm.weight")
        # the same tensors under a config.json of other math (the running model keeps its own):
        # 422 naming the field, never served wrong under the new label (a probe updated an MoE
        # model to num_experts_per_tok 2 and it still routed top-4)
        for field, value in (("rope_theta", 500000.0), ("rms_norm_eps", 1e-3), ("tie_word_embeddings", False)):
            other_cfg = copy_checkpoint(self.step[2], os.path.join(self.tmp, f"cfg-{field}"))
            with open(os.path.join(other_cfg, "config.json")) as f:
                cfg = json.load(f)
            if cfg.get(field) == value:
                continue
            cfg[field] = value
            with open(os.path.join(other_cfg, "config.json"), "w") as f:
                json.dump(cfg, f)
            refused({"weight_dir": other_cfg}, 422, "invalid_checkpoint", f"config.json: {field}", "the running model")
        self.post("/resume")
        self.serves(1, "1")
        # the same dir once it is ours again
        os.chown(os.path.join(other, "model.safetensors"), 0, 0)
        self.prime_update({"weight_dir": other, "version": "own"})
        self.serves(2, "own")


if __name__ == "__main__":
    unittest.main()
