"""The RL frameworks' own control sequences, replayed over HTTP in their order with their bodies
(issue #26, SPEC §13, docs/peer_aliases.md). Each sequence cites the file it was read from
(the framework's repository at the commit named there) and ends by checking that greedy outputs
equal the reference of the version the daemon reports: the numpy forward (np_llama.py) of the
checkpoint that version names. The trainer's side (writing new weights) is a file copy into the
daemon's --model dir, with the version.yaml `step` fdctl publish writes.
"""
import os
import shutil
import sys
import tempfile
import unittest

import np_llama
from fdtest import copy_checkpoint, Daemon, perturbed, REF, REPO, STORIES

PROMPT = "Once upon a time"
N_REF = 12  # greedy tokens compared with the numpy reference


def numpy_ids(model_dir):
    cfg, w = np_llama.load(model_dir)
    return np_llama.greedy(cfg, w, REF[PROMPT]["prompt_ids"], N_REF)[0]


class ClientSequences(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-cs-")
        cls.addClassCleanup(shutil.rmtree, cls.tmp, True)  # also when the rest of setUpClass fails
        # scale 0.3: enough noise that the three generate different greedy tokens
        cls.ckpt = {"A": STORIES, "B": perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=3, scale=0.3),
                    "C": perturbed(STORIES, os.path.join(cls.tmp, "C"), seed=5, scale=0.3)}
        cls.ref = {name: numpy_ids(d) for name, d in cls.ckpt.items()}
        assert len({tuple(v) for v in cls.ref.values()}) == 3, "the three checkpoints must generate differently"

    def setUp(self):
        self.src = copy_checkpoint(STORIES, tempfile.mkdtemp(prefix="src-", dir=self.tmp))
        self.names = {}  # weight_version label -> checkpoint name (A, B, C)

    def publish(self, name, step):
        """The trainer writes checkpoint `name` into --model with version.yaml step `step`."""
        copy_checkpoint(self.ckpt[name], self.src)
        with open(os.path.join(self.src, "version.yaml"), "w") as f:
            f.write(f"step: {step}\n")
        self.names[str(step)] = name

    def daemon(self, *args):
        d = Daemon("--dynamic-load-weight", *args, model=self.src)
        self.addCleanup(d.__exit__, None)
        self.names[d.get("/health")[1]["weight_version"]] = "A"
        return d

    def ok(self, d, method, path, body=None, want=200):
        code, j = d.request(method, path, body)
        self.assertEqual(code, want, (method, path, body, j))
        return j

    def assert_serves_reference(self, d, label=None):
        """Serving; the reported version is `label` (when given), and greedy output equals the
        numpy reference of the checkpoint that version names."""
        h = d.get("/health")[1]
        self.assertEqual((h["state"], h["sleeping_tags"]), ("serving", []), h)
        v = h["weight_version"]
        if label is not None:
            self.assertEqual(v, label)
        j = d.complete(prompt=PROMPT, max_tokens=N_REF, temperature=0)
        self.assertEqual(j["weight_version"], v)
        self.assertEqual(j["choices"][0]["token_ids"], self.ref[self.names[v]], f"version {v} = checkpoint {self.names[v]}")

    # ---- FastDeploy ----

    def test_fastdeploy_ce_tags_in_the_body(self):
        """FastDeploy's CE stability loop (tests/ce/stable_cases/run.sh: clear/update rounds, then
        chat) with V1 sleep/wakeup, tags sent in a JSON body as a string and as a list (issue #26)."""
        d = self.daemon()
        self.ok(d, "POST", "/v1/sleep", {"tags": "weight,kv_cache"})
        self.assertEqual(sorted(d.get("/health")[1]["sleeping_tags"]), ["kv_cache", "weight"])
        self.publish("B", 1)
        self.ok(d, "POST", "/v1/wakeup", {"tags": ["weight", "kv_cache"]})
        self.assert_serves_reference(d, "1")
        # one tag, string form; query and body naming the same set agree
        self.ok(d, "POST", "/v1/sleep?tags=kv_cache", {"tags": "kv_cache"})
        self.assertEqual(d.get("/health")[1]["sleeping_tags"], ["kv_cache"])
        self.ok(d, "POST", "/v1/wakeup?tags=weight,kv_cache", {"tags": ["kv_cache", "weight"]})
        self.assert_serves_reference(d, "1")
        # disagreeing, malformed or unknown: 400 and nothing is freed
        for path, body in [("/v1/sleep?tags=kv_cache", {"tags": "weight"}), ("/v1/sleep", {"tags": ["weight", 3]}),
                           ("/v1/sleep", {"tags": {"weight": True}}), ("/v1/sleep", {"tags": []}),
                           ("/v1/sleep", {"tags": "weights,nope"}), ("/v1/sleep", {"tags": "weight", "level": 1}),
                           # a list naming no tag: malformed, never "release everything" (the empty text,
                           # `?tags=`, stays FastDeploy's "not given": test_weight_control)
                           ("/v1/sleep?tags=,,,", None), ("/v1/sleep?tags=%20", None), ("/v1/sleep", {"tags": [""]}),
                           ("/v1/sleep", {"tags": " , "}), ("/sleep?tags=", None), ("/release_memory_occupation", {"tags": [""]})]:
            with self.subTest(path=path, body=body):
                code, j = d.post(path, body)
                self.assertEqual((code, j["error"]["type"]), (400, "invalid_argument"), j)
                self.assertEqual(d.get("/health")[1]["sleeping_tags"], [])
        self.assert_serves_reference(d, "1")

    # ---- SGLang servers: slime, AReaL ----

    def test_slime_colocated_disk_update(self):
        self.slime_colocated_disk_update()

    def test_slime_colocated_disk_update_with_cuda_graphs(self):
        """The same with --use-cudagraph (issue #26: its staged resume, weights before kv_cache +
        cuda_graph, was a 409). On the CPU the graph steps run padded and eagerly; the order rule
        is the engine's, the same on every backend."""
        self.slime_colocated_disk_update("--use-cudagraph")

    def slime_colocated_disk_update(self, *args):
        """slime (THUDM/slime@624b824): train.py's loop with --offload-rollout and a full disk
        update into the local checkpoint dir (= the daemon's --model):
        RolloutManager.offload → SGLangEngine.release_memory_occupation (GET /flush_cache until
        200, then POST /release_memory_occupation {}); onload_weights → resume_memory_occupation
        {"tags": ["weights"]}; RayTrainGroup._reload_rollout_weights_from_disk (slime/ray/
        actor_group.py): pull_weights, pause_generation, flush_cache, update_weights_from_disk
        {"model_path", "weight_version": str(step)}, get_weight_version (ci_test), continue_generation;
        onload_kv → resume_memory_occupation {"tags": ["kv_cache", "cuda_graph"]}
        (slime/backends/sglang_utils/sglang_engine.py, slime/ray/rollout.py)."""
        d = self.daemon(*args)
        for step, name in [(1, "B"), (2, "C")]:
            with self.subTest(step=step):
                # offload
                self.assertEqual(d.get("/flush_cache"), (200, "Cache flushed.\n"))
                self.assertIsNone(self.ok(d, "POST", "/release_memory_occupation", {}))
                self.assertEqual(sorted(d.get("/health")[1]["sleeping_tags"]), ["kv_cache", "weight"])
                # (train) onload_weights
                self.assertIsNone(self.ok(d, "POST", "/resume_memory_occupation", {"tags": ["weights"]}))
                self.assertEqual(d.get("/health")[1]["sleeping_tags"], ["kv_cache"])
                # update_weights: pull into the local dir, then the engine reloads it
                self.publish(name, step)
                j = self.ok(d, "POST", "/pause_generation", {})
                self.assertTrue(j.pop("request_id").startswith("ctrl-"))  # every control answer carries one
                self.assertEqual(j, {"message": "Generation paused successfully.", "status": "ok"})
                self.assertEqual(d.get("/flush_cache")[0], 200)
                j = self.ok(d, "POST", "/update_weights_from_disk", {"model_path": self.src, "weight_version": str(step)})
                self.assertTrue(j["success"], j)
                self.assertEqual(self.ok(d, "GET", "/get_weight_version")["weight_version"], str(step))
                self.assertEqual(self.ok(d, "POST", "/continue_generation", {})["status"], "ok")
                # onload_kv: the last tag back, the engine serves
                self.assertIsNone(self.ok(d, "POST", "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}))
                self.assert_serves_reference(d, str(step))

    def test_areal_offload_and_disk_update(self):
        """AReaL (inclusionAI/AReaL@4aef98d): PPOTrainer._offload_rollout / _onload_rollout
        (areal/trainer/rl_trainer.py: pause_generation then offload; onload then
        continue_generation) with the SGLang backend's bodies (areal/engine/sglang_remote.py:
        /pause_generation {}, /release_memory_occupation {}, /resume_memory_occupation {},
        /continue_generation {}), and FSDPEngine._update_weights_from_disk
        (areal/engine/fsdp_engine.py: pause_generation, update_weights_from_disk {"model_path",
        "abort_all_requests": true} while the trainer saves, continue_generation). AReaL sends
        no weight_version: the label comes from the checkpoint's version.yaml step."""
        d = self.daemon()
        self.ok(d, "POST", "/pause_generation", {})
        self.ok(d, "POST", "/release_memory_occupation", {})
        self.ok(d, "POST", "/resume_memory_occupation", {})
        self.ok(d, "POST", "/continue_generation", {})
        self.assert_serves_reference(d)
        self.ok(d, "POST", "/pause_generation", {})
        self.publish("B", 4)
        j = self.ok(d, "POST", "/update_weights_from_disk", {"model_path": self.src, "abort_all_requests": True})
        self.assertEqual((j["success"], j["num_paused_requests"]), (True, 0), j)
        self.assertTrue(d.get("/health")[1]["is_paused"])  # paused before the update: stays paused
        self.ok(d, "POST", "/continue_generation", {})
        self.assert_serves_reference(d, "4")

    def test_areal_disk_update_into_its_own_dir(self):
        """AReaL's disk update as it runs (inclusionAI/AReaL@4aef98d): the trainer saves each
        version to its own dir (areal/api/io_struct.py: WeightUpdateMeta.from_disk names
        <save root>/weight_update, with_version(v) makes it weight_update_v{v}); rank 0 calls
        pause_generation, then (areal/infra/remote_inf_engine.py _update_weights_from_disk, once
        the save is announced) POST /update_weights_from_disk {"model_path": that dir,
        "abort_all_requests": true} (areal/engine/sglang_remote.py
        build_disk_weight_update_requests: no weight_version, no version.yaml in the dir), deletes
        the dir after the load (clear_checkpoint_after_load, rl_trainer.py sets it true), then
        continue_generation (areal/engine/fsdp_engine.py _update_weights_from_disk). Nothing names
        the new bytes, so the label is their fingerprint fp-<hex>: a new one per version, and the
        outputs are that checkpoint's."""
        d = self.daemon()
        root = tempfile.mkdtemp(prefix="areal-", dir=self.tmp)
        labels = []
        for v, name in [(1, "B"), (2, "C")]:
            with self.subTest(version=v):
                self.ok(d, "POST", "/pause_generation", {})
                path = copy_checkpoint(self.ckpt[name], os.path.join(root, f"weight_update_v{v}"))
                self.assertFalse(os.path.exists(os.path.join(path, "version.yaml")))
                j = self.ok(d, "POST", "/update_weights_from_disk", {"model_path": path, "abort_all_requests": True})
                self.assertEqual((j["success"], j["num_paused_requests"]), (True, 0), j)
                shutil.rmtree(path)  # clear_checkpoint_after_load
                label = self.ok(d, "GET", "/get_weight_version")["weight_version"]
                self.assertRegex(label, r"^fp-[0-9a-f]{16}$")
                self.assertNotIn(label, labels + ["0"])
                labels.append(label)
                self.names[label] = name
                self.ok(d, "POST", "/continue_generation", {})
                self.assert_serves_reference(d, label)
        # offload / onload (_offload_rollout, _onload_rollout) after the dir was deleted: the
        # weights cannot come back from it, so they come from --model (still A), under the label
        # that named A's bytes at start-up, never C's label
        start = next(k for k, v in self.names.items() if v == "A")
        self.ok(d, "POST", "/pause_generation", {})
        self.ok(d, "POST", "/release_memory_occupation", {})
        self.ok(d, "POST", "/resume_memory_occupation", {})
        self.ok(d, "POST", "/continue_generation", {})
        self.assert_serves_reference(d, start)
        # a relative model_path (not --model) is refused, nothing changes
        self.ok(d, "POST", "/pause_generation", {})
        code, j = d.post("/update_weights_from_disk", {"model_path": "weight_update_v3"})
        self.assertEqual(code, 400, j)
        self.assertIn("absolute", j["error"]["message"])
        self.ok(d, "POST", "/continue_generation", {})
        self.assert_serves_reference(d, start)

    def test_areal_colocated_disk_update_while_released(self):
        """AReaL with actor and rollout on the same GPUs (inclusionAI/AReaL@4aef98d,
        areal/trainer/rl_trainer.py: _is_actor_rollout_colocated sets _should_offload_rollout;
        _apply_initial_offload_policy offloads first; each train() step is _onload_rollout
        (rollout.onload = POST /resume_memory_occupation {}, then continue_generation), the
        rollout, _offload_rollout (pause_generation, then rollout.offload = POST
        /release_memory_occupation {}: areal/engine/sglang_remote.py get_offload_request /
        get_onload_request), the train step, then actor.update_weights with the disk meta
        (areal/engine/fsdp_engine.py _update_weights_from_disk: pause_generation, POST
        /update_weights_from_disk {"model_path": .../weight_update_v{N}, "abort_all_requests": true}
        from build_disk_weight_update_requests, the dir deleted once answered:
        areal/infra/remote_inf_engine.py update_weights_from_disk, clear_checkpoint_after_load;
        then continue_generation). So the update arrives while the weights are released, and the
        dir is gone before the next onload: the daemon loads the new weights at once (SGLang's
        update_weights_from_disk loads at once too), all-or-nothing; /get_weight_version names
        them from then on. Ends with outputs equal to the reference of the version reported."""
        d = self.daemon()
        root = tempfile.mkdtemp(prefix="areal-colo-", dir=self.tmp)
        start = d.get("/health")[1]["weight_version"]

        def offload():
            self.ok(d, "POST", "/pause_generation", {})
            self.assertIsNone(self.ok(d, "POST", "/release_memory_occupation", {}))
            self.assertEqual(sorted(d.get("/health")[1]["sleeping_tags"]), ["kv_cache", "weight"])

        def onload(label):
            self.assertIsNone(self.ok(d, "POST", "/resume_memory_occupation", {}))
            self.ok(d, "POST", "/continue_generation", {})
            self.assert_serves_reference(d, label)

        offload()  # _apply_initial_offload_policy
        label = start
        for v, name in [(1, "B"), (2, "C")]:
            with self.subTest(version=v):
                onload(label)
                offload()
                # the train step, then update_weights: the save is announced, the request sent
                self.ok(d, "POST", "/pause_generation", {})
                path = copy_checkpoint(self.ckpt[name], os.path.join(root, f"weight_update_v{v}"))
                j = self.ok(d, "POST", "/update_weights_from_disk", {"model_path": path, "abort_all_requests": True})
                self.assertEqual((j["success"], j["num_paused_requests"]), (True, 0), j)
                shutil.rmtree(path)  # clear_checkpoint_after_load
                h = d.get("/health")[1]
                self.assertEqual((h["sleeping_tags"], h["is_paused"], h["weights_valid"]), (["kv_cache"], True, True), h)
                label = self.ok(d, "GET", "/get_weight_version")["weight_version"]  # the bytes now loaded
                self.assertRegex(label, r"^fp-[0-9a-f]{16}$")
                self.names[label] = name
                self.ok(d, "POST", "/continue_generation", {})  # kv_cache asleep: stays paused until the onload
                self.assertTrue(d.get("/health")[1]["is_paused"])
        onload(label)
        # all-or-nothing while released: a checkpoint that does not fit (a tensor cut short) is
        # refused, the weights stay released and the next onload serves the previous version
        offload()
        bad = copy_checkpoint(self.ckpt["B"], os.path.join(root, "weight_update_v3"))
        with open(os.path.join(bad, "model.safetensors"), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(bad, "model.safetensors")) - 4096)
        self.ok(d, "POST", "/pause_generation", {})
        code, j = d.post("/update_weights_from_disk", {"model_path": bad, "abort_all_requests": True})
        self.assertEqual((code, j["success"]), (422, False), j)
        h = d.get("/health")[1]
        self.assertEqual((sorted(h["sleeping_tags"]), h["weight_version"]), (["kv_cache", "weight"], label), h)
        # the dir the serving weights came from was deleted: the onload loads --model (A) under
        # the label that named A at start-up (docs/peer_aliases.md, prime-rl's weight routes)
        onload(start)

    def test_sglang_pause_modes_and_no_op_routes(self):
        """/pause_generation's modes (SGLang's PauseGenerationReqInput: abort, retract, in_place),
        /post_process_weights as a no-op (nothing is quantized), /weights_checker refused."""
        d = self.daemon()
        for mode, ours in [(None, "abort"), ("abort", "abort"), ("in_place", "keep"), ("retract", "keep")]:
            with self.subTest(mode=mode):
                self.ok(d, "POST", "/pause_generation", {} if mode is None else {"mode": mode})
                self.assertEqual(d.get("/health")[1]["pause_mode"], ours)
                self.ok(d, "POST", "/continue_generation", {})
        code, j = d.post("/pause_generation", {"mode": "later"})
        self.assertEqual(code, 400, j)
        self.assertFalse(d.get("/health")[1]["is_paused"])
        self.assertEqual(self.ok(d, "POST", "/post_process_weights",
                                 {"restore_weights_before_load": False, "post_process_quantization": True})["success"], True)
        code, j = d.post("/weights_checker", {"action": "snapshot"})
        self.assertEqual((code, j["error"]["type"]), (400, "invalid_argument"), j)
        # cuda_graph alone: on CUDA the graphs and their buffers go back (tests/e2e/
        # test_cuda_graph_sleep.py); here there are none. Like any sleep it pauses; it is not a
        # sleeping state, and its resume brings the engine back.
        self.assertEqual(d.post("/release_memory_occupation", {"tags": ["cuda_graph"]}), (200, None))
        h = d.get("/health")[1]
        self.assertEqual((h["is_paused"], h["sleeping_tags"]), (True, []), h)
        self.assertEqual(d.post("/resume_memory_occupation", {"tags": ["cuda_graph"]}), (200, None))
        self.assert_serves_reference(d)

    # ---- vLLM servers: verl, OpenRLHF, TRL, prime-rl ----

    def test_verl_colocated_staged_wake_up(self):
        """verl (volcengine/verl@b178a3c): vLLMHttpServer.sleep in colocated mode (sleep level=1,
        verl/workers/rollout/vllm_rollout/vllm_async_server.py), then ActorRolloutRefWorker.
        update_weights (verl/workers/engine_workers.py): resume(tags=["weights"]), push the
        weights, resume(tags=["kv_cache"]). The push is our /v1/update_weights with an integer
        step (verl's transfer is CUDA IPC; the call order around it is what is replayed)."""
        d = self.daemon()
        for step, name in [(1, "B"), (2, "C")]:
            self.assertEqual(self.ok(d, "POST", "/sleep?level=1")["status"], "sleeping")
            self.assertEqual(self.ok(d, "POST", "/wake_up?tags=weights")["status"], "sleeping")  # kv_cache still asleep
            self.publish(name, step)
            self.assertEqual(self.ok(d, "POST", "/v1/update_weights", {"version": step})["result"]["version"], str(step))
            self.assertEqual(self.ok(d, "POST", "/wake_up?tags=kv_cache")["status"], "awake")
            self.assert_serves_reference(d, str(step))

    def test_openrlhf_sleep_broadcast_wake(self):
        """OpenRLHF (OpenRLHF/OpenRLHF@3c3be62): SamplesGenerator sleeps the engines after
        generating (sleep, level 1), PPOTrainer.broadcast_to_vllm wakes weights only
        (openrlhf/trainer/ppo_trainer.py), then before generating wake_up() wakes every tag one
        call per tag (openrlhf/trainer/ray/vllm_engine.py: weights, then kv_cache); its
        pause_generation(mode="keep") / resume_generation are /pause?mode=keep and /resume."""
        d = self.daemon()
        self.ok(d, "POST", "/sleep?level=1")
        self.ok(d, "POST", "/wake_up?tags=weights")
        self.publish("B", 7)
        self.ok(d, "POST", "/v1/update_weights", {"version": 7})
        self.assertEqual(self.ok(d, "POST", "/wake_up?tags=weights")["status"], "sleeping")  # already awake: skipped
        self.assertEqual(self.ok(d, "POST", "/wake_up?tags=kv_cache")["status"], "awake")
        self.assert_serves_reference(d, "7")
        self.ok(d, "POST", "/pause?mode=keep")
        self.ok(d, "POST", "/resume")
        self.assert_serves_reference(d, "7")

    def test_trl_colocate_sync_weights(self):
        """TRL (huggingface/trl@f2cd577): VLLMGeneration sleeps at start-up (sleep level=2),
        sync_weights wakes weights (trl/generation/vllm_generation.py), pushes the parameters,
        resets the prefix cache; generation wakes kv_cache."""
        d = self.daemon()
        self.ok(d, "POST", "/sleep?level=2")
        self.ok(d, "POST", "/wake_up?tags=weights")
        self.publish("C", 3)
        self.ok(d, "POST", "/v1/update_weights", {"version": "3"})
        self.assertEqual(d.post("/reset_prefix_cache"), (200, ""))
        self.ok(d, "POST", "/wake_up?tags=kv_cache")
        self.assert_serves_reference(d, "3")

    def test_prime_rl_init_broadcaster_names_the_alternatives(self):
        """prime-rl's NCCL weight broadcast (init_nccl_broadcast posts /init_broadcaster with this
        body) has no receiver here: a 400 that names the filesystem route prime-rl can use
        instead; nothing changes."""
        d = self.daemon()
        code, j = d.post("/init_broadcaster", {"host": "127.0.0.1", "port": 29501, "rank_offset": 0, "inference_world_size": 1,
                                               "timeout": 1200, "quantize_in_weight_transfer": False})
        self.assertEqual((code, j["status"], j["error"]["type"]), (400, "error", "invalid_argument"), j)
        for says in ("not supported", "/update_weights {\"weight_dir\"", "/v1/update_weights", "filesystem weight broadcast"):
            self.assertIn(says, j["error"]["message"])
        self.assertFalse(d.get("/health")[1]["is_paused"])
        self.assert_serves_reference(d)

    def test_vllm_release_kv_cache_memory(self):
        """vLLM's KV-only release (vllm/entrypoints/serve/dev/sleep/api_router.py): needs a
        completed pause; wake_up?tags=kv_cache brings it back."""
        d = self.daemon()
        code, j = d.post("/release_kv_cache_memory")
        self.assertEqual(code, 409, j)
        self.assertEqual(d.get("/health")[1]["sleeping_tags"], [])
        self.ok(d, "POST", "/pause")
        self.assertEqual(d.post("/release_kv_cache_memory"), (200, ""))
        self.assertEqual(d.get("/health")[1]["sleeping_tags"], ["kv_cache"])
        self.ok(d, "POST", "/wake_up?tags=kv_cache")
        self.ok(d, "POST", "/resume")
        self.assert_serves_reference(d)

    def test_prime_rl_keep_pause_keeps_the_prefix_cache(self):
        """prime-rl (PrimeIntellect-ai/prime-rl@559b447): _pause_engines posts /pause with
        params {"mode": "keep", "clear_cache": "false"}, then the update, then /resume
        (src/prime_rl/utils/client.py). A pause without an update keeps the prefix cache (the
        next request hits it); an update still invalidates it."""
        d = self.daemon("--enable-prefix-caching", "--block-size", "4")
        long_prompt = PROMPT + " there was a little girl named Lily. She loved to play outside"

        def cached():
            j = d.complete(prompt=long_prompt, max_tokens=1, temperature=0)
            return j["usage"]["prompt_tokens_details"]["cached_tokens"]

        self.assertEqual(cached(), 0)
        self.assertGreater(cached(), 0)
        self.ok(d, "POST", "/pause?mode=keep&clear_cache=false")
        self.ok(d, "POST", "/resume")
        self.assertGreater(cached(), 0)  # kept across the pause
        self.ok(d, "POST", "/pause?mode=keep")  # clear_cache defaults to true
        self.ok(d, "POST", "/resume")
        self.assertEqual(cached(), 0)
        self.assertGreater(cached(), 0)
        self.ok(d, "POST", "/pause?mode=keep&clear_cache=false")
        self.publish("B", 11)
        self.ok(d, "POST", "/v1/update_weights", {"version": 11})
        self.ok(d, "POST", "/resume")
        self.assertEqual(cached(), 0)  # the update flushed it
        self.assert_serves_reference(d, "11")
        code, j = d.post("/pause?clear_cache=maybe")
        self.assertEqual(code, 400, j)
        self.assertFalse(d.get("/health")[1]["is_paused"])
        # The same flag on POST /v1/pause, as fdrollout.Client.pause(clear_cache=False) sends it
        # (a probe: /v1/pause refused it, so the documented Client call always failed 400).
        sys.path.insert(0, os.path.join(REPO, "python"))
        from fdrollout import Client
        c = Client(f"127.0.0.1:{d.port}", timeout=30)
        self.assertGreater(cached(), 0)
        c.pause(mode="keep", clear_cache=False)
        c.resume()
        self.assertGreater(cached(), 0)
        c.pause(mode="keep", clear_cache=True)
        c.resume()
        self.assertEqual(cached(), 0)
        code, j = d.post("/v1/pause?clear_cache=maybe")
        self.assertEqual((code, j["error"]["type"]), (400, "invalid_argument"), j)
        self.assertIn("clear_cache", j["error"]["message"])
        self.assertFalse(d.get("/health")[1]["is_paused"])


if __name__ == "__main__":
    unittest.main()
