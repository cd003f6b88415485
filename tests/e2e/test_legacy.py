"""Legacy FastDeploy routes (SPEC §4): /clear_load_weight and /update_model_weight, every row of
the status table with FD_ENABLE_V1_UPDATE_WEIGHTS=0, the V1 mapping with =1, and 404 without
--dynamic-load-weight. FD_DEBUG_CONTROL_DELAY_MS stretches each operation so the in-flight rows
(CLEARING, UPDATING) can be observed deterministically."""
import os
import shutil
import tempfile
import threading
import time
import unittest

from fdtest import REF, STORIES, Daemon, copy_checkpoint

GREEDY = {"prompt": "Lily and Tom", "max_tokens": 60, "temperature": 0}


class Legacy(unittest.TestCase):
    def call(self, d, path):
        status, j = d.get(path)
        self.assertTrue(j.pop("request_id").startswith("ctrl-"), j)  # every control answer carries one
        return status, j

    def wait_status(self, d, word, timeout=10):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if d.get("/health")[1]["model_weights_status"] == word:
                return
            time.sleep(0.005)
        self.fail(f"model_weights_status never became {word}")

    def test_status_word_table(self):
        with Daemon("--dynamic-load-weight", env={"FD_ENABLE_V1_UPDATE_WEIGHTS": "0", "FD_DEBUG_CONTROL_DELAY_MS": "600"}) as d:
            # NORMAL
            self.assertEqual(self.call(d, "/update_model_weight"), (200, {"msg": "model weight is updated"}))
            # NORMAL -> CLEARING (in flight) -> CLEARED
            out = {}
            t = threading.Thread(target=lambda: out.__setitem__("clear", self.call(d, "/clear_load_weight")))
            t.start()
            self.wait_status(d, -1)
            self.assertEqual(self.call(d, "/clear_load_weight"), (400, {"msg": "worker is clearing model weight already"}))
            self.assertEqual(self.call(d, "/update_model_weight"), (403, {"msg": "worker is clearing model weight, cannot update now"}))
            t.join(30)
            self.assertEqual(out["clear"], (200, {"msg": "clear model weight successfully"}))
            h = d.get("/health")[1]
            self.assertEqual((h["model_weights_status"], sorted(h["sleeping_tags"])), (-2, ["kv_cache", "weight"]))
            # CLEARED
            self.assertEqual(self.call(d, "/clear_load_weight"), (200, {"msg": "model weight is cleared"}))
            status, j = d.post("/v1/completions", GREEDY)
            self.assertEqual((status, j["error"]["type"]), (503, "engine_paused"))
            # CLEARED -> UPDATING (in flight) -> NORMAL
            t = threading.Thread(target=lambda: out.__setitem__("update", self.call(d, "/update_model_weight")))
            t.start()
            self.wait_status(d, 1)
            self.assertEqual(self.call(d, "/update_model_weight"), (400, {"msg": "worker is updating model weight already"}))
            self.assertEqual(self.call(d, "/clear_load_weight"), (403, {"msg": "worker is updating model weight, cannot clear now"}))
            t.join(30)
            self.assertEqual(out["update"], (200, {"msg": "update model weight successfully"}))
            self.assertEqual(d.get("/health")[1]["model_weights_status"], 0)
            self.assertEqual(d.complete(**GREEDY)["choices"][0]["token_ids"], REF["Lily and Tom"]["ids"])

    def test_failed_reload_answers_404_and_stays_cleared(self):
        tmp = tempfile.mkdtemp(prefix="fd-legacy-")
        try:
            src = copy_checkpoint(STORIES, os.path.join(tmp, "m"))
            with Daemon("--dynamic-load-weight", model=src) as d:
                self.assertEqual(self.call(d, "/clear_load_weight")[0], 200)
                os.rename(os.path.join(src, "model.safetensors"), os.path.join(tmp, "moved"))
                status, j = self.call(d, "/update_model_weight")
                self.assertEqual((status, j["msg"]), (404, "update model weight timeout"))
                self.assertIn("no *.safetensors file", j["error"])
                self.assertEqual(d.get("/health")[1]["model_weights_status"], -2)
                self.assertEqual(d.post("/v1/completions", GREEDY)[0], 503)
                os.rename(os.path.join(tmp, "moved"), os.path.join(src, "model.safetensors"))
                self.assertEqual(self.call(d, "/update_model_weight"), (200, {"msg": "update model weight successfully"}))
                self.assertEqual(d.complete(**GREEDY)["choices"][0]["token_ids"], REF["Lily and Tom"]["ids"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_clear_after_a_one_tag_sleep_releases_the_other(self):
        # CLEARED settles when either tag sleeps; the clear answered "model weight is cleared" from
        # the word alone and the weights stayed resident after a V1 sleep of kv_cache (a probe).
        with Daemon("--dynamic-load-weight", env={"FD_ENABLE_V1_UPDATE_WEIGHTS": "0"}) as d:
            for first, other in (("kv_cache", "weight"), ("weight", "kv_cache")):
                self.assertEqual(d.post(f"/v1/sleep?tags={first}")[0], 200)
                self.assertEqual(d.get("/health")[1]["model_weights_status"], -2)
                self.assertEqual(self.call(d, "/clear_load_weight"), (200, {"msg": "clear model weight successfully"}))
                h = d.get("/health")[1]
                self.assertEqual((sorted(h["sleeping_tags"]), h["weights_valid"]), (["kv_cache", "weight"], False), (first, other))
                self.assertEqual(self.call(d, "/clear_load_weight"), (200, {"msg": "model weight is cleared"}))
                self.assertEqual(self.call(d, "/update_model_weight"), (200, {"msg": "update model weight successfully"}))
                self.assertEqual(d.complete(**GREEDY)["choices"][0]["token_ids"], REF["Lily and Tom"]["ids"])

    def test_switch_on_maps_to_v1_sleep_and_wakeup(self):
        with Daemon("--dynamic-load-weight", env={"FD_ENABLE_V1_UPDATE_WEIGHTS": "1"}) as d:
            status, j = self.call(d, "/clear_load_weight")
            self.assertEqual((status, j["status"]), (200, "success"))
            self.assertEqual(sorted(j["result"]["tags"]), ["kv_cache", "weight"])
            self.assertIn("freed_bytes", j["result"])
            self.assertEqual(d.get("/health")[1]["model_weights_status"], -2)
            status, j = self.call(d, "/clear_load_weight")  # like V1 sleep: idempotent, tags skipped
            self.assertEqual((status, sorted(j["result"]["skipped"])), (200, ["kv_cache", "weight"]))
            status, j = self.call(d, "/update_model_weight")
            self.assertEqual((status, j["status"], j["result"]["is_paused"]), (200, "success", False))
            self.assertEqual(d.complete(**GREEDY)["choices"][0]["token_ids"], REF["Lily and Tom"]["ids"])

    def test_without_dynamic_load_weight_the_legacy_routes_are_404(self):
        for env in ({"FD_ENABLE_V1_UPDATE_WEIGHTS": "0"}, {"FD_ENABLE_V1_UPDATE_WEIGHTS": "1"}):
            with Daemon(env=env) as d:
                for path in ["/clear_load_weight", "/update_model_weight"]:
                    status, j = self.call(d, path)  # FastDeploy's message in its JSON error body
                    self.assertEqual((status, j["error"]["message"]), (404, "Dynamic Load Weight Disabled."))
                self.assertEqual(d.complete(**GREEDY)["choices"][0]["token_ids"], REF["Lily and Tom"]["ids"])


if __name__ == "__main__":
    unittest.main()
