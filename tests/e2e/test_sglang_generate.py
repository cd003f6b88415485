"""SGLang's native generation route POST /generate, GET /server_info (/get_server_info) and GET
/health_generate (docs/peer_aliases.md, "SGLang's /generate").

The bodies are the ones the RL frameworks send, read from their source (mirrors in
/work/.mirror): slime 624b824 slime/rollout/sglang_rollout.py (GenerateState.sampling_params
:95-104, generate() payload :176-191, parsing :206-219), AReaL 4aef98d areal/engine/sglang_remote.py
(build_generation_request :43-89, parse_generation_response :91-127), verl b178a3c
verl/workers/rollout/sglang_rollout/http_server_engine.py (generate() payload :828-842 with Nones
dropped, /health_generate polled at :162), slime slime/backends/sglang_utils/external.py
(get_server_info :74-83, parallel_config :29-42). Answers are parsed the way those lines parse
them, and compared with /v1/completions on the same daemon for the same prompt and sampling:
tokens, logprobs and text must be equal, not just present. With speculation the per-request
spec_* counters are recomputed from the tokens (n-gram) or the daemon's own counters (MTP)."""
import base64
import http.client
import json
import os
import shutil
import tempfile
import threading
import time
import unittest

import numpy as np

from fdtest import copy_checkpoint, Daemon, make_checkpoint, perturbed, REF, STORIES

PROMPT = REF["Once upon a time"]["prompt_ids"]


def slime_sampling_params(**kw):
    """slime's GenerateState.sampling_params (sglang_rollout.py:95-104) with its defaults
    (--rollout-top-k -1, --rollout-stop/--rollout-stop-token-ids None, skip special tokens off)."""
    return {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 20, "stop": None, "stop_token_ids": None,
            "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False, **kw}


def slime_payload(prompt_ids, sampling_params):
    """slime's generate() payload (sglang_rollout.py:176-191), text-only: input_ids."""
    return {"sampling_params": sampling_params, "return_logprob": True, "input_ids": prompt_ids}


def slime_parse(output):
    """slime's parsing (sglang_rollout.py:206-219): tokens and logprobs from output_token_logprobs."""
    lps = output["meta_info"]["output_token_logprobs"]
    return [item[1] for item in lps], [item[0] for item in lps], output["text"]


def areal_payload(input_ids, max_new_tokens=20, greedy=True, temperature=1.0, stop_token_ids=(), stop=None):
    """AReaL's build_generation_request (sglang_remote.py:43-89) with GenerationHyperparameters'
    defaults (areal/api/cli_args.py: top_p 1.0, top_k 1e8, frequency_penalty 0.0)."""
    sample_params = {"top_p": 1.0, "top_k": int(1e8), "max_new_tokens": max_new_tokens,
                     "temperature": 0.0 if greedy else temperature, "stop_token_ids": list(stop_token_ids),
                     "ignore_eos": False, "skip_special_tokens": True, "frequency_penalty": 0.0}
    if stop:
        sample_params["stop"] = stop
    return {"input_ids": list(input_ids), "image_data": None, "sampling_params": sample_params, "return_logprob": True,
            "stream": False}


def areal_parse(response):
    """AReaL's parse_generation_response (sglang_remote.py:91-127)."""
    meta_info = response["meta_info"]
    stop_reason = meta_info["finish_reason"]["type"]
    return [x[1] for x in meta_info["output_token_logprobs"]], [x[0] for x in meta_info["output_token_logprobs"]], stop_reason


def sse(port, path, body, timeout=120):
    """POST and read an SSE answer: (list of parsed chunks, saw [DONE])."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, (resp.status, resp.read())
        assert resp.getheader("Content-Type", "").startswith("text/event-stream")
        chunks, done = [], False
        for line in resp.read().decode().split("\n"):
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    done = True
                else:
                    chunks.append(json.loads(line[6:]))
        return chunks, done
    finally:
        conn.close()


class Generate(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon("--dynamic-load-weight")

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()

    def gen(self, body, status=200):
        code, j = self.d.post("/generate", body)
        self.assertEqual(code, status, j)
        return j

    def complete(self, **body):
        j = self.d.complete(**body)
        return j, j["choices"][0]

    def test_slime_greedy_equals_completions(self):
        out = self.gen(slime_payload(PROMPT, slime_sampling_params()))
        tokens, logprobs, text = slime_parse(out)
        j, c = self.complete(prompt=PROMPT, max_tokens=20, temperature=0, top_p=1.0, top_k=-1, logprobs=0,
                             skip_special_tokens=False, include_stop_str_in_output=True, spaces_between_special_tokens=False)
        self.assertEqual(tokens, c["token_ids"])
        self.assertEqual(tokens, REF["Once upon a time"]["ids"][:20])
        self.assertEqual(logprobs, c["logprobs"]["token_logprobs"])
        self.assertEqual(text, c["text"])
        self.assertEqual(out["output_ids"], tokens)
        m = out["meta_info"]
        self.assertEqual(m["finish_reason"], {"type": "length", "length": 20})
        self.assertEqual((m["prompt_tokens"], m["completion_tokens"]), (len(PROMPT), 20))
        self.assertEqual(m["weight_version"], j["weight_version"])
        self.assertEqual(m["weight_versions"], [{"version": j["weight_version"], "start": 0, "end": 20}])
        self.assertEqual(m["input_token_logprobs"], [[None, PROMPT[-1], None]])  # logprob_start_len -1: the last prompt token
        self.assertGreaterEqual(m["e2e_latency"], 0)
        self.assertNotIn("output_top_logprobs", m)
        self.assertTrue(m["id"])

    def test_seeded_sampling_equals_completions(self):
        """slime with --sglang-enable-deterministic-inference sets sampling_seed (sglang_rollout.py:319-322)."""
        sp = slime_sampling_params(temperature=0.9, top_p=0.95, top_k=50, max_new_tokens=30, sampling_seed=1234)
        tokens, logprobs, text = slime_parse(self.gen(slime_payload(PROMPT, sp)))
        _, c = self.complete(prompt=PROMPT, max_tokens=30, temperature=0.9, top_p=0.95, top_k=50, seed=1234, logprobs=0,
                             skip_special_tokens=False, include_stop_str_in_output=True, spaces_between_special_tokens=False)
        self.assertEqual((tokens, logprobs, text), (c["token_ids"], c["logprobs"]["token_logprobs"], c["text"]))
        self.assertNotEqual(tokens, REF["Once upon a time"]["ids"][:30])  # it sampled
        again = slime_parse(self.gen(slime_payload(PROMPT, {**sp, "sampling_seed": None, "seed": 1234})))
        self.assertEqual(again[0], tokens)  # `seed` is accepted as sampling_seed

    def test_areal_stop_token(self):
        stop_id = REF["Once upon a time"]["ids"][3]
        out = self.gen(areal_payload(PROMPT, max_new_tokens=20, stop_token_ids=[stop_id]))
        tokens, logprobs, stop_reason = areal_parse(out)
        _, c = self.complete(prompt=PROMPT, max_tokens=20, temperature=0, top_k=int(1e8), stop_token_ids=[stop_id], logprobs=0)
        self.assertEqual((tokens, logprobs), (c["token_ids"], c["logprobs"]["token_logprobs"]))
        self.assertEqual(tokens, REF["Once upon a time"]["ids"][:4])
        self.assertEqual(stop_reason, "stop")
        self.assertEqual(out["meta_info"]["finish_reason"], {"type": "stop", "matched": stop_id})
        self.assertEqual(out["text"], c["text"])

    def test_stop_string_trimmed_or_kept(self):
        body = {"text": "Once upon a time", "sampling_params": {"temperature": 0, "max_new_tokens": 40, "stop": "Lily"}}
        out = self.gen(body)
        _, c = self.complete(prompt="Once upon a time", max_tokens=40, temperature=0, stop="Lily")
        _, kept_c = self.complete(prompt="Once upon a time", max_tokens=40, temperature=0, stop="Lily", include_stop_str_in_output=True)
        self.assertEqual(out["meta_info"]["finish_reason"], {"type": "stop", "matched": "Lily"})
        self.assertEqual((out["text"], out["output_ids"]), (c["text"], c["token_ids"]))
        self.assertFalse(out["text"].endswith("Lily"))
        kept = self.gen({**body, "sampling_params": {**body["sampling_params"], "no_stop_trim": True}})
        self.assertEqual(kept["text"], kept_c["text"])  # no_stop_trim keeps the matched string
        self.assertTrue(kept["text"].endswith("Lily"))

    def test_batch_and_n_order(self):
        texts = ["Once upon a time", "Lily and Tom"]
        out = self.gen({"text": texts, "sampling_params": {"temperature": 0, "max_new_tokens": 60}, "return_logprob": True})
        self.assertIsInstance(out, list)
        self.assertEqual(len(out), 2)
        for o, t in zip(out, texts):
            self.assertEqual(o["output_ids"], REF[t]["ids"])
            self.assertEqual(REF[t]["text"], t + o["text"])
        one = self.gen({"input_ids": [PROMPT], "sampling_params": {"temperature": 0, "max_new_tokens": 5}})
        self.assertIsInstance(one, list)  # a list input answers a list, also of one
        sp = {"temperature": 1.0, "max_new_tokens": 12, "n": 3, "sampling_seed": 7}
        out = self.gen({"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True})
        j = self.d.complete(prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=7, logprobs=0)
        self.assertEqual([o["output_ids"] for o in out], [c["token_ids"] for c in j["choices"]])
        self.assertEqual([slime_parse(o)[1] for o in out], [c["logprobs"]["token_logprobs"] for c in j["choices"]])
        self.assertEqual(len({o["meta_info"]["id"] for o in out}), 3)

    def test_skyrl_batch(self):
        """SkyRL's RemoteInferenceEngine.generate, sglang backend (NovaSky-AI/SkyRL 01dc9de
        skyrl-train/skyrl_train/inference_engines/remote_inference_engine.py: payload
        {"input_ids": [[...], ...], "sampling_params"}, parsed as a list: output_ids and
        meta_info.finish_reason.type)."""
        prompts = [REF[t]["prompt_ids"] for t in ("Once upon a time", "Lily and Tom")]
        response = self.gen({"input_ids": prompts, "sampling_params": {"temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                                                      "max_new_tokens": 25, "min_p": 0.0}})
        output_ids = [o["output_ids"] for o in response]
        finish_reasons = [o["meta_info"]["finish_reason"]["type"] for o in response]
        self.assertEqual(output_ids, [REF[t]["ids"][:25] for t in ("Once upon a time", "Lily and Tom")])
        self.assertEqual(finish_reasons, ["length", "length"])

    def test_logprobs_prompt_and_top(self):
        """verl's HttpServerAdapter.generate payload (http_server_engine.py:828-842: every field,
        the Nones dropped), here with prompt and top logprobs; plus return_text_in_logprobs."""
        body = {"text": None, "sampling_params": {"temperature": 0, "max_new_tokens": 8}, "input_ids": PROMPT, "image_data": None,
                "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "token_ids_logprob": None,
                "lora_path": None, "custom_logit_processor": None}
        body = {k: v for k, v in body.items() if v is not None}
        body["return_text_in_logprobs"] = True
        m = self.gen(body)["meta_info"]
        _, c = self.complete(prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, prompt_logprobs=2,
                             return_tokens_as_token_ids=True)
        ins = m["input_token_logprobs"]
        self.assertEqual([e[1] for e in ins], PROMPT)
        self.assertIsNone(ins[0][0])
        self.assertEqual([e[0] for e in ins[1:]], [c["prompt_logprobs"][i][str(t)]["logprob"] for i, t in enumerate(PROMPT) if i > 0])
        self.assertEqual(m["input_top_logprobs"][0], None)
        self.assertEqual(len(m["output_top_logprobs"]), 8)
        for tops, want in zip(m["output_top_logprobs"], c["logprobs"]["top_logprobs"]):
            self.assertEqual(len(tops), 2)
            for lp, tid, txt in tops:
                self.assertEqual(want[f"token_id:{tid}"], lp)
                self.assertIsInstance(txt, str)
        self.assertEqual([e[0] for e in m["output_token_logprobs"]], c["logprobs"]["token_logprobs"])
        self.assertEqual(m["output_token_logprobs_length"], 8)

    def test_stream_reassembles(self):
        body = {"text": ["Once upon a time", "Lily and Tom"], "sampling_params": {"temperature": 0, "max_new_tokens": 30},
                "return_logprob": True, "stream": True}
        whole = self.gen({**body, "stream": False})
        chunks, done = sse(self.d.port, "/generate", body)
        self.assertTrue(done)
        last = {}
        for ch in chunks:  # SGLang's default stream: each chunk cumulative, `index` in a batch
            i = ch["index"]
            if i in last:
                self.assertTrue(ch["text"].startswith(last[i]["text"]))
                self.assertEqual(ch["output_ids"][:len(last[i]["output_ids"])], last[i]["output_ids"])
            last[i] = ch
        self.assertEqual(sorted(last), [0, 1])
        for i in (0, 1):
            got, want = last[i], whole[i]
            self.assertEqual((got["text"], got["output_ids"]), (want["text"], want["output_ids"]))
            self.assertEqual(got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"])
            self.assertEqual(got["meta_info"]["finish_reason"], {"type": "length", "length": 30})
        self.assertTrue(any(ch["meta_info"]["finish_reason"] is None for ch in chunks))  # running chunks: null
        chunks, done = sse(self.d.port, "/generate", {"input_ids": PROMPT, "stream": True,
                                                     "sampling_params": {"temperature": 0, "max_new_tokens": 10}})
        self.assertTrue(done)
        self.assertNotIn("index", chunks[-1])  # one prompt: no index
        self.assertEqual(chunks[-1]["output_ids"], REF["Once upon a time"]["ids"][:10])

    def test_bad_input_names_the_field(self):
        cases = [
            ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
            ({"text": "x", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}}, "sampling_params.min_new_tokens"),
            ({"text": "x", "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
            ({"text": "x", "sampling_params": {"custom_params": {"return_top_p_token_ids": True}}}, "sampling_params.custom_params"),
            ({"text": "x", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
            ({"text": "x", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
            ({"text": "x", "bogus": 1}, "bogus"),
            ({"text": "x", "image_data": "img.png"}, "image_data"),
            ({"text": "x", "lora_path": "a"}, "lora_path"),
            ({"text": "x", "input_ids": [1, 2]}, "input_ids"),
            ({"sampling_params": {}}, "text"),
            ({"input_ids": [1, 100000]}, "input_ids"),
            ({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
            ({"input_ids": PROMPT, "top_logprobs_num": 1000}, "top_logprobs_num"),
            ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 100000}}, "sampling_params.max_new_tokens"),
            ({"input_ids": PROMPT, "rid": "a b"}, "rid"),
            ({"input_ids": PROMPT, "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params"),
        ]
        for body, field in cases:
            with self.subTest(body=body):
                j = self.gen(body, 400)
                self.assertEqual(j["error"]["param"], field, j)
                self.assertTrue(j["error"]["message"], j)
        j = self.gen({"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400)
        self.assertIn("max_new_tokens", j["error"]["message"])
        self.assertNotIn("max_tokens", j["error"]["message"])
        ok = self.gen({"text": "x", "image_data": None, "lora_path": None, "return_hidden_states": False,
                       "sampling_params": {"max_new_tokens": 2, "json_schema": None, "stop_regex": [], "custom_params": None}})
        self.assertEqual(len(ok["output_ids"]), 2)  # neutral values pass

    def test_paused_is_503_and_health_generate(self):
        self.assertEqual(self.d.get("/health_generate")[0], 200)
        self.assertEqual(self.d.post("/pause_generation", {})[0], 200)
        try:
            j = self.gen({"input_ids": PROMPT}, 503)
            self.assertEqual(j["error"]["type"], "engine_paused", j)
            self.assertEqual(self.d.get("/health_generate")[0], 503)
        finally:
            self.assertEqual(self.d.post("/continue_generation", {})[0], 200)
        self.assertEqual(self.d.get("/health_generate")[0], 200)

    def test_server_info(self):
        for path in ("/server_info", "/get_server_info"):
            code, info = self.d.get(path)
            self.assertEqual(code, 200, info)
            # slime external.py:29-42, 103-105: the parallel config it derives
            pp = int(info.get("pp_size") or info.get("pipeline_parallel_size") or 1)
            tp = int(info.get("tp_size") or info.get("tensor_parallel_size") or 1)
            self.assertEqual((tp, pp, int(info.get("ep_size") or 1)), (1, 1, 1))
            self.assertEqual(int(info.get("num_gpus") or info.get("num_gpus_per_engine") or tp * pp), 1)
            self.assertNotIn(info.get("disaggregation_mode"), ("prefill", "decode"))
            self.assertFalse(info.get("encoder_only"))
            self.assertEqual(info["weight_version"], self.d.get("/get_weight_version")[1]["weight_version"])
            self.assertEqual(info["model_path"], STORIES)
            self.assertTrue(info["enable_memory_saver"])  # --dynamic-load-weight: release/resume work
            self.assertGreater(info["max_total_num_tokens"], 0)
            self.assertTrue(info["version"])
            # slime before 2026-06 (03b32d8, sglang_engine.py _init_external) asserts these equal its own
            self.assertEqual({k: info.get(k) for k in ("host", "port", "node_rank", "gpu_id_step", "base_gpu_id")},
                             {"host": "127.0.0.1", "port": self.d.port, "node_rank": 0, "gpu_id_step": 1, "base_gpu_id": 0})


STEP_DELAY = {"FD_DEBUG_STEP_DELAY_MS": "10"}  # a test-only stretch of every step: requests still run when a call arrives


def wait_running(d, timeout=30):
    deadline = time.time() + timeout
    while d.get("/health")[1]["num_requests_running"] < 1:
        if time.time() > deadline:
            raise TimeoutError("the request never ran")
        time.sleep(0.01)
    time.sleep(0.2)  # a few tokens decoded


def slime_num_requests(load):
    """slime's num_requests_from_load (slime/backends/sglang_utils/server_control.py)."""
    if isinstance(load, list):
        return sum(slime_num_requests(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return slime_num_requests(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (waiting if isinstance(waiting, int) else 0)


class InFlight(unittest.TestCase):
    """Requests that are still running: aborted by rid, or kept across a weight update."""

    def test_abort_by_rid(self):
        with Daemon(env=STEP_DELAY) as d:
            body = {"input_ids": PROMPT, "rid": "rollout-42", "return_logprob": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}}
            res = {}
            t = threading.Thread(target=lambda: res.update(r=d.post("/generate", body, timeout=300)))
            t.start()
            wait_running(d)
            self.assertEqual(d.post("/abort_request", {"rid": "rollout-42"})[0], 200)  # SGLang's abort by rid
            t.join(300)
            code, out = res["r"]
            self.assertEqual(code, 200, out)
            self.assertEqual(out["meta_info"]["id"], "rollout-42")
            tokens, _, stop_reason = areal_parse(out)
            self.assertEqual(stop_reason, "abort")
            self.assertEqual(tokens, out["output_ids"])
            self.assertLess(len(tokens), 400)

    def test_slime_aborts_until_idle(self):
        """slime's abort_server_until_idle (server_control.py): POST /abort_request {"abort_all":
        true}, then GET /v1/loads?include=core until no request is left (it was a 404). The
        answer has SGLang's shape (entrypoints/v1_loads.py)."""
        with Daemon(env=STEP_DELAY) as d:
            body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}}
            ts = [threading.Thread(target=d.post, args=("/generate", body), kwargs={"timeout": 300}) for _ in range(2)]
            for t in ts:
                t.start()
            wait_running(d)
            code, load = d.get("/v1/loads?include=core")
            self.assertEqual(code, 200, load)
            self.assertEqual(slime_num_requests(load), 2, load)
            self.assertEqual((load["dp_rank_count"], load["loads"][0]["dp_rank"], load["aggregate"]["total_reqs"]), (1, 0, 2))
            self.assertEqual(d.post("/abort_request", {"abort_all": True}), (200, ""))
            deadline = time.time() + 30
            while slime_num_requests(d.get("/v1/loads?include=core,disagg,queues,inflight")[1]) > 0:
                self.assertLess(time.time(), deadline, "requests left after abort_all")
                time.sleep(0.05)
            for t in ts:
                t.join(60)
            code, load = d.get("/v1/loads?dp_rank=1")  # a DP rank this daemon does not have: none
            self.assertEqual((code, load["loads"], load["dp_rank_count"]), (200, [], 0))
            self.assertEqual(d.get("/v1/loads?format=prometheus")[0], 400)
            self.assertEqual(d.get("/v1/loads?dp_rank=x")[0], 400)

    def test_update_and_spans(self):
        """meta_info.weight_version names the weights after slime's disk update, and a request kept
        across the update (pause_generation in_place) reports SGLang's spans."""
        tmp = tempfile.mkdtemp(prefix="fd-sgl-")
        try:
            model = copy_checkpoint(STORIES, os.path.join(tmp, "m"))
            new = perturbed(STORIES, os.path.join(tmp, "new"), seed=5)
            with Daemon("--dynamic-load-weight", model=model, env=STEP_DELAY) as d:
                v0 = d.get("/get_weight_version")[1]["weight_version"]
                body = slime_payload(PROMPT, slime_sampling_params(max_new_tokens=150, ignore_eos=True))
                res = {}
                t = threading.Thread(target=lambda: res.update(r=d.post("/generate", body, timeout=300)))
                t.start()
                wait_running(d)
                self.assertEqual(d.post("/pause_generation", {"mode": "in_place"})[0], 200)
                copy_checkpoint(new, model)  # the trainer writes new weights
                code, j = d.post("/update_weights_from_disk", {"model_path": model, "weight_version": "2"})
                self.assertEqual((code, j["success"]), (200, True), j)
                self.assertEqual(d.post("/continue_generation", {})[0], 200)
                t.join(300)
                code, out = res["r"]
                self.assertEqual(code, 200, out)
                m = out["meta_info"]
                self.assertEqual(m["weight_version"], "2")
                spans = m["weight_versions"]
                self.assertEqual([s["version"] for s in spans], [v0, "2"], spans)
                k = spans[1]["start"]
                self.assertEqual((spans[0]["start"], spans[0]["end"], spans[1]["end"]), (0, k, 150))
                self.assertGreater(k, 0)
                after = d.post("/generate", slime_payload(PROMPT, slime_sampling_params()))[1]
                c = d.complete(prompt=PROMPT, max_tokens=20, temperature=0, logprobs=0, skip_special_tokens=False,
                               include_stop_str_in_output=True, spaces_between_special_tokens=False)
                self.assertEqual(after["meta_info"]["weight_version"], "2")
                self.assertEqual(after["meta_info"]["weight_versions"], [{"version": "2", "start": 0, "end": 20}])
                self.assertEqual(slime_parse(after)[:2], (c["choices"][0]["token_ids"], c["choices"][0]["logprobs"]["token_logprobs"]))
                self.assertNotEqual(after["output_ids"], REF["Once upon a time"]["ids"][:20])  # new weights serve
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class RoutedExperts(unittest.TestCase):
    def test_areal_decodes_the_routes(self):
        """AReaL's return_routed_experts (sglang_remote.py:77-79) decoded as it does (:101-110):
        base64 int32 reshaped to [prompt_tokens + completion_tokens - 1, layers x top_k]; the rows
        equal /v1/completions' routed_experts (tests/e2e/test_moe_routes.py checks those against numpy)."""
        tmp = tempfile.mkdtemp(prefix="fd-sgl-moe-")
        try:
            ck = make_checkpoint(os.path.join(tmp, "q3"), "--preset", "qwen3-moe-like", "--seed", "20")
            prompt = [1, 17, 300, 41, 99, 7, 256, 12]
            with Daemon("--enable-return-routed-experts", model=ck) as d:
                body = {**areal_payload(prompt, max_new_tokens=6), "return_routed_experts": True}
                body["sampling_params"]["ignore_eos"] = True
                code, response = d.post("/generate", body)
                self.assertEqual(code, 200, response)
                meta_info = response["meta_info"]
                num_sgl_token = meta_info["prompt_tokens"] + meta_info["completion_tokens"] - 1
                routed = np.frombuffer(base64.b64decode(meta_info["routed_experts"].encode("utf-8")), dtype=np.int32).reshape(num_sgl_token, -1)
                c = d.complete(prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True, return_routed_experts=True)["choices"][0]
                self.assertEqual(response["output_ids"], c["token_ids"])
                self.assertEqual(routed.tolist(), [[e for layer in row for e in layer] for row in c["routed_experts"]])
                self.assertEqual(d.post("/generate", {**body, "routed_experts_start_len": 3})[0], 400)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def replay_ngram(prompt, out, k, max_new):
    """SGLang's per-request counters of a greedy n-gram run, recomputed from its tokens alone:
    each decode step after the prefill's token drafts ngram_reference(context, 1, 3, k') (k' also
    bounded by max_new_tokens), the target keeps the drafts equal to its own greedy tokens, and
    the step gives those plus one (fewer when the choice ends inside it). SGLang's accepted count
    per step is the tokens it gave minus one (scheduler spec_accepted_tokens += accept_lens - 1)."""
    from test_speculative import ngram_reference
    verify = drafted = accepted = 0
    n = 1
    while n < len(out):
        kk = min(k, max_new - n - 1)
        draft = ngram_reference(prompt + out[:n], 1, 3, kk) if kk > 0 else []
        a = 0
        while a < len(draft) and n + a < len(out) and draft[a] == out[n + a]:
            a += 1
        step = min(a + 1, len(out) - n)
        verify, drafted, accepted, n = verify + 1, drafted + len(draft), accepted + step - 1, n + step
    return verify, drafted, accepted


SPEC_KEYS = ("spec_verify_ct", "spec_accept_token_num", "spec_draft_token_num", "spec_num_correct_drafts",
             "spec_num_proposed_drafts", "spec_accept_rate", "spec_accept_length")


class Speculative(unittest.TestCase):
    """With --speculative-config the finished meta_info carries SGLang's per-request counters
    (tokenizer_manager.py _calculate_spec_decoding_metrics), which slime's Sample.SpecInfo.add
    (slime/utils/types.py:168-172) sums with .get(key, 0) under --sglang-speculative-algorithm; and
    /server_info names the algorithm in SGLang's spelling (server_args.py)."""

    def check_counts(self, m, out, verify, drafted, accepted):
        self.assertEqual((m["spec_verify_ct"], m["spec_draft_token_num"], m["spec_accept_token_num"]), (verify, drafted, accepted), m)
        self.assertEqual((m["spec_num_proposed_drafts"], m["spec_num_correct_drafts"]), (drafted, accepted))
        self.assertEqual(m["completion_tokens"], len(out))
        self.assertEqual(len(out), 1 + verify + accepted)  # SGLang's identity: the prefill's token, then 1 + accepted per step
        self.assertAlmostEqual(m["spec_accept_rate"], accepted / drafted)
        self.assertAlmostEqual(m["spec_accept_length"], len(out) / verify)

    def test_ngram_counters_equal_a_replay_and_server_info(self):
        from test_speculative import REPETITIVE, SPEC
        with Daemon("--speculative-config", SPEC) as d:
            for sp in ({"max_new_tokens": 30, "ignore_eos": True}, {"max_new_tokens": 7, "ignore_eos": True},
                       {"max_new_tokens": 60, "stop": ["They"]}):  # ends on the first step's third draft, accepted
                with self.subTest(sp=sp):
                    body = {"text": REPETITIVE, "sampling_params": {"temperature": 0, **sp}, "return_prompt_token_ids": True}
                    code, j = d.post("/generate", body)
                    self.assertEqual(code, 200, j)
                    verify, drafted, accepted = replay_ngram(j["prompt_token_ids"], j["output_ids"], 3, sp["max_new_tokens"])
                    self.assertGreater(accepted, 0)
                    if "stop" in sp:  # ' b' | 'all', '.', ' They' (drafts): SGLang counts 2 accepted, vLLM's counter 3
                        self.assertEqual((len(j["output_ids"]), verify, accepted), (4, 1, 2))
                    self.check_counts(j["meta_info"], j["output_ids"], verify, drafted, accepted)
                    chunks, done = sse(d.port, "/generate", {**body, "stream": True})  # the last chunk only, as SGLang
                    self.assertTrue(done)
                    self.assertEqual(chunks[-1]["output_ids"], j["output_ids"])
                    self.check_counts(chunks[-1]["meta_info"], j["output_ids"], verify, drafted, accepted)
                    self.assertFalse(any(k in ch["meta_info"] for ch in chunks[:-1] for k in SPEC_KEYS))
            info = d.get("/server_info")[1]
            self.assertEqual(info["speculative_algorithm"], "NGRAM")
        with Daemon() as plain:  # no speculation: no spec_* at all, as SGLang without --speculative-algorithm
            code, j = plain.post("/generate", {"text": REPETITIVE, "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
            self.assertFalse([k for k in j["meta_info"] if k.startswith("spec_")])
            self.assertIsNone(plain.get("/server_info")[1]["speculative_algorithm"])

    def test_mtp_counters_equal_the_metrics_and_server_info_says_eagle(self):
        """MTP is SGLang's NEXTN, which its ServerArgs turns into EAGLE (_handle_speculative_decoding).
        One greedy request alone, no stop: its counters are the daemon's vLLM counters' increase."""
        from test_speculative import metrics, series
        tmp = tempfile.mkdtemp(prefix="fd-sgl-mtp-")
        try:
            ck = make_checkpoint(os.path.join(tmp, "mimic"), "--preset", "tiny-mimo", "--mtp-mimic", "--seed", "3")
            with Daemon("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2}), model=ck) as d:
                self.assertEqual(d.get("/server_info")[1]["speculative_algorithm"], "EAGLE")
                names = ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
                         "vllm:spec_decode_num_drafts_total")
                before = [series(metrics(d), n) for n in names]
                code, j = d.post("/generate", {"input_ids": [1, 17, 300, 41, 99], "sampling_params": {
                    "temperature": 0, "max_new_tokens": 25, "ignore_eos": True}})
                self.assertEqual(code, 200, j)
                drafted, accepted, steps_drafted = [series(metrics(d), n) - b for n, b in zip(names, before)]
                self.assertGreater(accepted, 0)
                out = j["output_ids"]
                self.check_counts(j["meta_info"], out, len(out) - 1 - accepted, drafted, accepted)
                # every decode step counts, also one with no draft (no room for one under max_new_tokens)
                self.assertGreaterEqual(j["meta_info"]["spec_verify_ct"], steps_drafted)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
