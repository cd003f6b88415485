"""Control-route input rules (issue #12 item 7) and FastDeploy client compatibility (issue #13):
unknown update_weights fields, repeated query parameters and form bodies are 400 with nothing
done; a disabled legacy route answers FastDeploy's JSON error body; every control response
carries a request_id (echoed from X-Request-Id); rsync_config must equal the configured one;
--load_strategy is accepted. Then the two-phase update on one daemon: staged weights never serve
before commit (greedy outputs vs fresh daemons on each version)."""
import http.client
import json
import os
import shutil
import tempfile
import unittest

from fdtest import copy_checkpoint, Daemon, fdctl, greedy, perturbed, STORIES


def raw(d, method, path, body=b"", headers=None):
    """One request with exactly these headers and body; returns (status, headers, parsed body)."""
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        text = resp.read().decode()
        try:
            return resp.status, dict(resp.getheaders()), json.loads(text)
        except ValueError:
            return resp.status, dict(resp.getheaders()), text
    finally:
        conn.close()


class ControlRoutes(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-cr-")
        cls.A = copy_checkpoint(STORIES, os.path.join(cls.tmp, "A"))
        cls.B = perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=5)
        with Daemon(model=cls.A) as fresh:
            cls.a_out = greedy(fresh)[:2]
        with Daemon(model=cls.B) as fresh:
            cls.b_out = greedy(fresh)[:2]
        assert cls.a_out[0] != cls.b_out[0]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def assert_error(self, got, status, param=None):
        code, j = got
        self.assertEqual(code, status, j)
        self.assertEqual(j["status"], "error", j)
        if param:
            self.assertIn(f"'{param}'", j["error"]["message"])
        return j

    def health(self, d):
        return d.get("/health")[1]

    def test_unknown_update_weights_field_is_400_naming_it_and_nothing_runs(self):
        with Daemon("--dynamic-load-weight") as d:
            self.assertEqual(d.post("/v1/pause")[0], 200)
            j = self.assert_error(d.post("/v1/update_weights", {"version": "v2", "verify_checksums": True}), 400, "verify_checksums")
            self.assertEqual(j["error"]["type"], "invalid_argument")
            self.assertIsNone(self.health(d)["last_control_error"])  # never reached the engine
            self.assertNotEqual(self.health(d)["weight_version"], "v2")
            # a non-object body and a non-JSON body are refused too
            self.assert_error(d.post("/v1/update_weights", raw="[1]"), 400)
            self.assert_error(d.post("/v1/update_weights", raw="version=v2"), 400)
            # the known fields still work
            self.assertEqual(d.post("/v1/update_weights", {"version": "v2", "verify_checksum": False})[0], 200)

    def test_repeated_query_parameter_is_400_and_nothing_sleeps(self):
        with Daemon("--dynamic-load-weight") as d:
            j = self.assert_error(d.post("/v1/sleep?tags=kv_cache&tags=foo"), 400, "tags")
            self.assertIn("more than once", j["error"]["message"])
            h = self.health(d)
            self.assertEqual(h["sleeping_tags"], [])
            self.assertFalse(h["is_paused"])  # not even the implicit pause
            self.assert_error(d.post("/v1/sleep?tags=kv_cache&tags=kv_cache"), 400, "tags")
            self.assertEqual(self.health(d)["sleeping_tags"], [])

    def test_a_form_body_is_never_read_as_query(self):
        with Daemon("--dynamic-load-weight") as d:
            # curl -d 'tags=kv_cache' sends a form body: it must not become ?tags=kv_cache
            code, _, j = raw(d, "POST", "/v1/sleep", b"tags=kv_cache", {"Content-Type": "application/x-www-form-urlencoded"})
            self.assertEqual(code, 400, j)
            self.assertEqual(j["error"]["type"], "invalid_argument")
            self.assertEqual(self.health(d)["sleeping_tags"], [])
            self.assertFalse(self.health(d)["is_paused"])
            # a JSON body sent without a JSON Content-Type is parsed as JSON (curl -d '{...}')
            d.post("/v1/pause")
            code, _, j = raw(d, "POST", "/v1/update_weights", b'{"version": "v3"}', {"Content-Type": "application/x-www-form-urlencoded"})
            self.assertEqual(code, 200, j)
            self.assertEqual(self.health(d)["weight_version"], "v3")
            # ...and a body to an op that takes none is refused unless it is empty JSON
            code, _, j = raw(d, "POST", "/v1/resume", b'{"tags": "weight"}', {"Content-Type": "application/json"})
            self.assertEqual(code, 400, j)
            self.assertTrue(self.health(d)["is_paused"])
            code, _, j = raw(d, "POST", "/v1/resume", b'{}', {"Content-Type": "application/json"})
            self.assertEqual(code, 200, j)

    def test_disabled_legacy_route_answers_fastdeploy_json_error(self):
        with Daemon() as d:
            for path in ("/clear_load_weight", "/update_model_weight"):
                code, j = d.get(path)
                self.assertEqual(code, 404)
                self.assertEqual(j["error"]["message"], "Dynamic Load Weight Disabled.")
                self.assertEqual(set(j["error"]), {"message", "type", "param", "code"})  # FastDeploy's ErrorInfo
                self.assertTrue(j["request_id"])

    def test_weight_aliases_are_404_without_dynamic_load_weight_whatever_their_body(self):
        """vLLM's, SGLang's and prime-rl's weight routes are not there without
        --dynamic-load-weight: 404 before the body is read (a probe got 400 for `{}` and 409 from
        release_kv_cache_memory, while valid bodies got the 404)."""
        # Each in its peer's failure shape (docs/peer_aliases.md; a probe: vLLM's /sleep answered
        # our {"error": {"message", "type"}, "status": "error"}): vLLM {"error": message}, SGLang
        # {"error": {"message"}} (update_weights_from_disk: {"success": false, "message", ...}),
        # prime-rl our error object.
        vllm = lambda j: j["error"]  # noqa: E731
        sglang = lambda j: j["error"]["message"]  # noqa: E731
        ours = lambda j: j["error"]["message"] if j["status"] == "error" and j["error"]["type"] == "not_found" else None  # noqa: E731
        with Daemon() as d:
            for path, body, message in (("/update_weights", {}, ours), ("/update_weights_from_disk", {}, lambda j: j["message"]),
                                        ("/release_kv_cache_memory", None, vllm), ("/sleep", None, vllm), ("/wake_up", None, vllm),
                                        ("/reload_weights", {"x": 1}, ours), ("/release_memory_occupation", {"tags": 3}, sglang),
                                        ("/resume_memory_occupation", None, sglang)):
                with self.subTest(path):
                    code, j = d.post(path, body)
                    self.assertEqual(code, 404, j)
                    self.assertIn("--dynamic-load-weight", message(j), j)
                    self.assertTrue(j.pop("request_id").startswith("ctrl-"), j)
                    if message is vllm:
                        self.assertEqual(list(j), ["error"], j)
                    if message is sglang:
                        self.assertEqual((list(j), list(j["error"])), (["error"], ["message"]), j)
                    if path == "/update_weights_from_disk":
                        self.assertEqual((j["success"], j["num_paused_requests"]), (False, 0), j)
            self.assertEqual(d.complete(prompt="Lily", max_tokens=2)["choices"][0]["finish_reason"], "length")

    def test_every_control_response_carries_request_id(self):
        with Daemon("--dynamic-load-weight", "--api-key", "k") as d:
            auth = {"Authorization": "Bearer k"}
            code, hdr, j = raw(d, "POST", "/v1/pause", b"", {**auth, "X-Request-Id": "trainer-step-7"})
            self.assertEqual(code, 200, j)
            self.assertEqual(j["request_id"], "trainer-step-7")
            self.assertEqual(hdr["X-Request-Id"], "trainer-step-7")
            # generated when absent; present on errors (bad input, wrong key) too
            seen = set()
            for path, headers in [("/v1/is_paused", auth), ("/v1/sleep?tags=nope", auth), ("/v1/resume", {})]:
                code, hdr, j = raw(d, "GET" if "is_paused" in path else "POST", path, b"", headers)
                self.assertTrue(j["request_id"].startswith("ctrl-"), (path, j))
                self.assertEqual(hdr["X-Request-Id"], j["request_id"])
                seen.add(j["request_id"])
            self.assertEqual(len(seen), 3)
            # a malformed id is replaced, never echoed
            code, hdr, j = raw(d, "GET", "/v1/is_paused", b"", {**auth, "X-Request-Id": "x" * 200})
            self.assertTrue(j["request_id"].startswith("ctrl-"))

    def test_rsync_config_must_equal_the_configured_one(self):
        store = os.path.join(self.tmp, "store")
        staging = os.path.join(self.tmp, "staging")
        os.makedirs(staging, exist_ok=True)
        rc, _, err = fdctl(0, "publish", "--strategy", "rsync", "--from", self.B, "--store", store, "--version", "b1")
        self.assertEqual(rc, 0, err)
        cfg = {"source": store, "staging_dir": staging}
        # --load_strategy: FastDeploy's underscore spelling
        with Daemon("--dynamic-load-weight", "--load_strategy", "rsync", "--rsync-config", json.dumps(cfg), model=self.A) as d:
            d.post("/v1/pause")
            j = self.assert_error(d.post("/v1/update_weights", {"version": "b1", "rsync_config": {"source": "/elsewhere", "staging_dir": staging}}),
                                  400, "rsync_config")
            self.assertNotEqual(self.health(d)["weight_version"], "b1")
            # equal (as JSON, key order and string form aside) is accepted and ignored
            code, j = d.post("/v1/update_weights", {"version": "b1", "rsync_config": json.dumps({"staging_dir": staging, "source": store})})
            self.assertEqual(code, 200, j)
            d.post("/v1/resume")
            self.assertEqual(greedy(d)[:2], self.b_out)
        with Daemon("--dynamic-load-weight") as d:  # no --rsync-config: any rsync_config is refused
            d.post("/v1/pause")
            self.assert_error(d.post("/v1/update_weights", {"rsync_config": cfg}), 400, "rsync_config")

    def test_pause_modes_are_validated(self):
        """abort | wait | keep (behaviour under load: test_pause_modes.py); anything else is 400 and pauses nothing."""
        with Daemon() as d:
            for bad, named in (("/v1/pause?mode=bogus", "bogus"), ("/v1/pause?mode=Wait", "Wait"), ("/v1/resume?mode=keep", "mode")):
                self.assert_error(d.post(bad), 400, named)
                self.assertFalse(self.health(d)["is_paused"])
            self.assert_error(d.post("/v1/pause?mode=wait", {"mode": "keep"}), 400, "keep")  # query and body differ
            self.assert_error(d.post("/v1/pause", {"mode": 3}), 400, "mode")
            self.assertFalse(self.health(d)["is_paused"])
            for mode in ("abort", "wait", "keep"):
                code, j = d.post(f"/v1/pause?mode={mode}")
                self.assertEqual((code, j["result"]["mode"]), (200, mode), j)
                self.assertEqual(self.health(d)["pause_mode"], mode)
                self.assertEqual(d.post("/v1/resume")[0], 200)
                self.assertIsNone(self.health(d)["pause_mode"])

    def test_two_phase_update_never_serves_staged_weights(self):
        src = copy_checkpoint(self.A, os.path.join(self.tmp, "src2p"))
        with Daemon("--dynamic-load-weight", model=src) as d:
            self.assert_error(d.post("/v1/commit_weights", {"version": "b"}), 409)  # nothing staged
            d.post("/v1/pause")
            copy_checkpoint(self.B, src)  # the source now holds B
            code, j = d.post("/v1/update_weights", {"version": "b", "commit": False})
            self.assertEqual(code, 200, j)
            self.assertTrue(j["result"]["staged"])
            h = self.health(d)
            self.assertEqual(h["staged_weight_version"], "b")
            self.assertNotEqual(h["weight_version"], "b")
            # serving while staged: still A, bit for bit
            self.assertEqual(d.post("/v1/resume")[0], 200)
            self.assertEqual(greedy(d)[:2], self.a_out)
            # commit needs the pause and the right version; a refused commit changes nothing
            self.assert_error(d.post("/v1/commit_weights", {"version": "b"}), 409)
            d.post("/v1/pause")
            self.assert_error(d.post("/v1/commit_weights", {"version": "other"}), 409)
            self.assert_error(d.post("/v1/commit_weights", {"version": "b", "extra": 1}), 400, "extra")
            self.assertEqual(self.health(d)["staged_weight_version"], "b")
            code, j = d.post("/v1/commit_weights", {"version": "b"})
            self.assertEqual((code, j["result"]["version"]), (200, "b"), j)
            h = self.health(d)
            self.assertEqual((h["weight_version"], h["staged_weight_version"]), ("b", None))
            d.post("/v1/resume")
            out = greedy(d)
            self.assertEqual(out[:2], self.b_out)
            self.assertEqual(out[2], "b")
            # stage then drop: nothing changes
            d.post("/v1/pause")
            copy_checkpoint(self.A, src)
            self.assertEqual(d.post("/v1/update_weights", {"version": "a2", "commit": False})[0], 200)
            # another update (staged or not) while a2 is staged is refused and loses nothing (a
            # probe: a stage that failed had dropped the staged version first)
            for body in ({"version": "a3", "commit": False}, {"version": "a3"}):
                code, j = d.post("/v1/update_weights", body)
                self.assertEqual(code, 409, j)
                self.assertIn("'a2' is staged", j["error"]["message"])
                self.assertEqual(self.health(d)["staged_weight_version"], "a2")
            code, j = d.post("/v1/drop_staged_weights")
            self.assertEqual((code, j["result"]["dropped_version"]), (200, "a2"), j)
            self.assertIsNone(self.health(d)["staged_weight_version"])
            self.assert_error(d.post("/v1/commit_weights", {}), 409)
            d.post("/v1/resume")
            self.assertEqual(greedy(d)[:2], self.b_out)

    def test_two_phase_update_over_fdctl_both_transports(self):
        src = copy_checkpoint(self.A, os.path.join(self.tmp, "src2f"))
        with Daemon("--dynamic-load-weight", model=src) as d:
            for transport, version in (("shm", "s1"), ("v1", "s2")):
                t = ["--transport", transport]
                self.assertEqual(fdctl(d.port, *t, "pause")[0], 0)
                rc, out, err = fdctl(d.port, *t, "--json", "stage-weights", "--version", version)
                self.assertEqual(rc, 0, err)
                self.assertTrue(json.loads(out)["result"]["staged"])
                self.assertEqual(self.health(d)["staged_weight_version"], version)
                rc, _, err = fdctl(d.port, *t, "commit-weights", "--version", "nope")
                self.assertEqual(rc, 4, err)  # wrong_state
                rc, out, err = fdctl(d.port, *t, "commit-weights", "--version", version)
                self.assertEqual(rc, 0, err)
                self.assertEqual(self.health(d)["weight_version"], version)
                self.assertEqual(fdctl(d.port, *t, "stage-weights", "--version", version + "x")[0], 0)
                rc, out, err = fdctl(d.port, *t, "drop-staged-weights")
                self.assertEqual(rc, 0, err)
                self.assertIsNone(self.health(d)["staged_weight_version"])
                self.assertEqual(fdctl(d.port, *t, "resume")[0], 0)


if __name__ == "__main__":
    unittest.main()
