"""vLLM's and SGLang's control routes are thin aliases over the V1 control service (issue #13).

ALIASES is the one table (documented in docs/peer_aliases.md): each row is a peer's call, the
V1 call it stands for, and the response shape the peer documents. The test replays each row
over HTTP on a fresh state, checks the peer's shape, and checks that the daemon's state
(/health) afterwards is exactly what the V1 call leaves — on a twin daemon given the V1 call."""
import os
import shutil
import tempfile
import unittest

from fdtest import copy_checkpoint, Daemon, greedy, perturbed, STORIES

# (peer, method, path, body, setup, V1 call (method, path, body), expected status, shape check)
#   setup: V1 calls run first on both daemons (e.g. pause before an update)
#   shape: a function (status, body) -> None raising on mismatch, from the peer's docs/source
def keys(*names):
    def check(tc, body):
        tc.assertIsInstance(body, dict, body)
        tc.assertTrue(set(names) <= set(body), (names, body))
    return check


def exact(value):
    """The peer's exact body; a JSON object also carries our request_id (every control answer does)."""
    def check(tc, body):
        if isinstance(body, dict):
            tc.assertTrue(body.pop("request_id", "").startswith("ctrl-"), body)
        tc.assertEqual(body, value)
    return check


def text(prefix):
    def check(tc, body):
        tc.assertIsInstance(body, str)
        tc.assertTrue(body.startswith(prefix), body)
    return check


PAUSE = ("POST", "/v1/pause", None)
SLEEP_ALL = ("POST", "/v1/sleep", None)

ALIASES = [
    # vLLM (vllm/entrypoints/serve/*/api_router.py)
    ("vllm", "POST", "/sleep?level=1", None, [], SLEEP_ALL, 200, keys("status", "level", "elapsed_ms")),
    ("vllm", "POST", "/sleep?level=2", None, [], SLEEP_ALL, 200, keys("status", "level", "elapsed_ms")),
    ("vllm", "POST", "/sleep?tags=kv_cache", None, [], ("POST", "/v1/sleep?tags=kv_cache", None), 200, keys("status", "level")),
    ("vllm", "POST", "/sleep?tags=weights", None, [], ("POST", "/v1/sleep?tags=weight", None), 200, keys("status", "level")),
    ("vllm", "POST", "/wake_up", None, [SLEEP_ALL], ("POST", "/v1/wakeup", None), 200, keys("status", "tags_woken", "elapsed_ms")),
    ("vllm", "POST", "/wake_up?tags=kv_cache", None, [SLEEP_ALL], ("POST", "/v1/wakeup?tags=kv_cache", None), 200,
     keys("status", "tags_woken")),
    ("vllm", "POST", "/wake_up?tags=weights&tags=kv_cache", None, [SLEEP_ALL], ("POST", "/v1/wakeup?tags=weight,kv_cache", None), 200,
     keys("status", "tags_woken")),
    ("vllm", "GET", "/is_sleeping", None, [SLEEP_ALL], ("GET", "/health", None), 200, exact({"is_sleeping": True})),
    ("vllm", "GET", "/is_sleeping", None, [], ("GET", "/health", None), 200, exact({"is_sleeping": False})),
    ("vllm", "POST", "/pause", None, [], PAUSE, 200, exact({"status": "paused"})),
    ("vllm", "POST", "/pause?mode=abort", None, [], PAUSE, 200, exact({"status": "paused"})),
    ("vllm", "POST", "/pause?mode=wait", None, [], ("POST", "/v1/pause?mode=wait", None), 200, exact({"status": "paused"})),
    ("vllm", "POST", "/pause?mode=keep", None, [], ("POST", "/v1/pause?mode=keep", None), 200, exact({"status": "paused"})),
    ("vllm", "POST", "/pause?wait_for_inflight_requests=true", None, [], ("POST", "/v1/pause?mode=wait", None), 200,
     exact({"status": "paused"})),
    ("vllm", "POST", "/pause?mode=later", None, [], ("GET", "/health", None), 400, keys("error")),
    ("vllm", "POST", "/pause?mode=keep&wait_for_inflight_requests=true", None, [], ("GET", "/health", None), 400, keys("error")),
    ("vllm", "POST", "/sleep?level=1&mode=wait", None, [], [("POST", "/v1/pause?mode=wait", None), SLEEP_ALL], 200,
     keys("status", "level")),
    ("vllm", "POST", "/sleep?mode=keep", None, [], ("GET", "/health", None), 400, keys("error")),
    ("vllm", "POST", "/resume", None, [PAUSE], ("POST", "/v1/resume", None), 200, exact({"status": "resumed"})),
    ("vllm", "GET", "/is_paused", None, [PAUSE], ("GET", "/v1/is_paused", None), 200, exact({"is_paused": True})),
    ("vllm", "POST", "/reset_prefix_cache", None, [], ("GET", "/health", None), 200, exact("")),
    # vLLM's bool parameters: their defaults pass, true (what this route cannot do) and non-bools are 400
    ("vllm", "POST", "/reset_prefix_cache?reset_running_requests=false&reset_external=false", None, [], ("GET", "/health", None), 200,
     exact("")),
    ("vllm", "POST", "/reset_prefix_cache?reset_running_requests=true", None, [], ("GET", "/health", None), 400, keys("error")),
    ("vllm", "POST", "/pause?wait_for_inflight_requests=maybe", None, [], ("GET", "/health", None), 400, keys("error")),
    ("vllm", "POST", "/pause?wait_for_inflight_requests=", None, [], ("GET", "/health", None), 400, keys("error")),
    # vLLM's dev-mode RL route (vllm/entrypoints/serve/dev/rlhf/api_router.py); live requests: test_abort.py
    ("vllm", "POST", "/abort_requests", {}, [], ("POST", "/v1/abort", {"abort_all": True}), 200,
     exact({"status": "aborted", "aborted": 0})),
    ("vllm", "POST", "/abort_requests", {"request_ids": []}, [], ("POST", "/v1/abort", {"abort_all": True}), 200,
     exact({"status": "aborted", "aborted": 0})),
    ("vllm", "POST", "/abort_requests", {"request_ids": ["cmpl-unknown"]}, [], ("GET", "/health", None), 200,
     exact({"status": "aborted", "aborted": 0, "not_found": ["cmpl-unknown"]})),
    ("vllm", "POST", "/abort_requests", {"request_ids": "cmpl-1"}, [], ("GET", "/health", None), 400, keys("error")),
    ("vllm", "POST", "/abort_requests", {"request_id": ["cmpl-1"]}, [], ("GET", "/health", None), 400, keys("error")),
    ("vllm", "POST", "/sleep?level=0", None, [], ("GET", "/health", None), 400, keys("error")),
    ("vllm", "POST", "/sleep?tags=nope", None, [], ("GET", "/health", None), 400, keys("error")),
    # SGLang (python/sglang/srt/entrypoints/http_server.py)
    ("sglang", "POST", "/release_memory_occupation", {}, [], SLEEP_ALL, 200, exact(None)),
    ("sglang", "POST", "/release_memory_occupation", {"tags": ["kv_cache"]}, [], ("POST", "/v1/sleep?tags=kv_cache", None), 200, exact(None)),
    ("sglang", "POST", "/resume_memory_occupation", {}, [SLEEP_ALL], ("POST", "/v1/wakeup", None), 200, exact(None)),
    ("sglang", "POST", "/resume_memory_occupation", {"tags": ["weights"]}, [SLEEP_ALL], ("POST", "/v1/wakeup?tags=weight", None), 200,
     exact(None)),
    ("sglang", "POST", "/flush_cache", None, [], ("GET", "/health", None), 200, text("Cache flushed.")),
    ("sglang", "GET", "/get_weight_version", None, [], ("GET", "/health", None), 200, keys("weight_version")),
    ("sglang", "POST", "/update_weights_from_disk", {"model_path": "@MODEL", "weight_version": "w2"}, [],
     [PAUSE, ("POST", "/v1/update_weights", {"version": "w2"}), ("POST", "/v1/resume", None)], 200,
     keys("success", "message", "num_paused_requests")),
    ("sglang", "POST", "/update_weights_from_disk", {"model_path": "@MODEL", "weight_version": "w3"}, [PAUSE],
     ("POST", "/v1/update_weights", {"version": "w3"}), 200, keys("success", "message", "num_paused_requests")),
    # another dir is a checkpoint of its own (AReaL's weight_update_v{N}, issue 26; it was a 400):
    # a missing one is 503 and nothing changes; a relative path that is not --model stays 400
    ("sglang", "POST", "/update_weights_from_disk", {"model_path": "/elsewhere", "weight_version": "w4"}, [],
     ("GET", "/health", None), 503, keys("success", "message", "num_paused_requests")),
    ("sglang", "POST", "/update_weights_from_disk", {"model_path": "elsewhere", "weight_version": "w4"}, [],
     ("GET", "/health", None), 400, keys("error")),
    ("sglang", "POST", "/update_weights_from_disk", {"model_path": "@MODEL", "bogus": 1}, [], ("GET", "/health", None), 400, keys("error")),
    ("sglang", "POST", "/update_weights_from_disk", {"model_path": "@MODEL", "weight_version": "w5", "abort_all_requests": True}, [],
     [PAUSE, ("POST", "/v1/update_weights", {"version": "w5"}), ("POST", "/v1/resume", None)], 200,
     keys("success", "message", "num_paused_requests")),
    # (aborting a live request by id: tests/e2e/test_pause_modes.py)
    ("sglang", "POST", "/abort_request", {"abort_all": True}, [], ("POST", "/v1/abort", {"abort_all": True}), 200, exact("")),
    # an unknown (or finished) rid: SGLang's empty 200 (http_server.py abort_request; it was our 404)
    ("sglang", "POST", "/abort_request", {"rid": "cmpl-unknown"}, [], ("GET", "/health", None), 200, exact("")),
    ("sglang", "POST", "/abort_request", {"rid": 7}, [], ("GET", "/health", None), 400, keys("error")),
    # neither: SGLang's AbortReq() defaults (rid "", abort_all false) abort nothing and answer 200 (it was our 400)
    ("sglang", "POST", "/abort_request", {}, [], ("GET", "/health", None), 200, exact("")),
    ("sglang", "POST", "/abort_request", {"rid": None, "abort_all": False}, [], ("GET", "/health", None), 200, exact("")),
]

# /health fields that must agree between the alias daemon and its V1 twin after each row
STATE = ("state", "is_paused", "sleeping_tags", "weights_valid", "weight_version", "staged_weight_version")


class PeerAliases(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-pa-")
        cls.model = copy_checkpoint(STORIES, os.path.join(cls.tmp, "m"))
        cls.alias = Daemon("--dynamic-load-weight", model=cls.model)
        cls.twin = Daemon("--dynamic-load-weight", model=cls.model)

    @classmethod
    def tearDownClass(cls):
        cls.alias.__exit__(None)
        cls.twin.__exit__(None)
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def reset(self, d):
        """Back to serving, awake, on the start-up version."""
        d.post("/v1/wakeup")
        d.post("/v1/pause")
        d.post("/v1/update_weights", {"version": "w0"})
        d.post("/v1/resume")
        h = d.get("/health")[1]
        self.assertEqual((h["state"], h["weight_version"]), ("serving", "w0"), h)

    def state(self, d):
        h = d.get("/health")[1]
        return {k: h[k] for k in STATE}

    def test_alias_table(self):
        for peer, method, path, body, setup, v1, status, shape in ALIASES:
            with self.subTest(peer=peer, call=f"{method} {path}", body=body):
                for d in (self.alias, self.twin):
                    self.reset(d)
                    for m, p, b in setup:
                        self.assertEqual(d.request(m, p, b)[0], 200)
                if isinstance(body, dict):
                    body = {k: (self.model if v == "@MODEL" else v) for k, v in body.items()}
                got_status, got = self.alias.request(method, path, body)
                self.assertEqual(got_status, status, got)
                shape(self, got)
                for m, p, b in (v1 if isinstance(v1, list) else [v1]):
                    self.assertEqual(self.twin.request(m, p, b)[0], 200)
                self.assertEqual(self.state(self.alias), self.state(self.twin))

    def test_sglang_update_weights_from_tensor_names_the_alternatives(self):
        """SGLang's update_weights_from_tensor (pickled torch tensors over CUDA IPC) does not map:
        a 400 naming what works instead, as /weights_checker and /init_broadcaster (it was a bare
        "no route" 404); nothing changes."""
        before = self.state(self.alias)
        code, j = self.alias.post("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"], "load_format": None,
                                                                  "flush_cache": True})
        self.assertEqual((code, j["error"]["type"]), (400, "invalid_argument"), j)
        for says in ("not supported", "/update_weights_from_disk", "--load-strategy ipc", "/update_weights_from_distributed"):
            self.assertIn(says, j["error"]["message"])
        self.assertEqual(self.state(self.alias), before)

    def test_aliases_drive_the_same_engine(self):
        """An RL loop written against vLLM's routes, then SGLang's: outputs match a fresh daemon."""
        b = perturbed(STORIES, os.path.join(self.tmp, "b"), seed=3)
        src = copy_checkpoint(STORIES, os.path.join(self.tmp, "src"))
        with Daemon(model=b) as fresh:
            want = greedy(fresh)[:2]
        with Daemon("--dynamic-load-weight", model=src) as d:
            before = greedy(d)[:2]
            self.assertEqual(d.post("/sleep?level=2")[1]["status"], "sleeping")
            self.assertTrue(d.get("/is_sleeping")[1]["is_sleeping"])
            copy_checkpoint(b, src)  # the trainer writes new weights
            # tags_woken: what this call woke, in vLLM's names (the query was echoed: a repeated
            # tag twice, an awake tag as woken)
            j = d.post("/wake_up?tags=weights&tags=weights")[1]
            self.assertEqual((j["status"], j["tags_woken"]), ("sleeping", ["weights"]), j)
            self.assertEqual(d.post("/wake_up?tags=weights")[1]["tags_woken"], [])
            j = d.post("/wake_up")[1]
            self.assertEqual((j["status"], j["tags_woken"]), ("awake", ["kv_cache"]), j)
            self.assertEqual(greedy(d)[:2], want)
            copy_checkpoint(STORIES, src)
            code, j = d.post("/update_weights_from_disk", {"model_path": src, "weight_version": "back"})
            self.assertEqual((code, j["success"]), (200, True), j)
            self.assertEqual(d.get("/get_weight_version")[1]["weight_version"], "back")
            self.assertEqual(greedy(d)[:2], before)  # resumed on its own, on the old weights again


if __name__ == "__main__":
    unittest.main()
