"""Every malformed request gets a 4xx OpenAI error object naming the field, and the daemon keeps
serving exactly as before; a client that disconnects mid-stream frees its KV blocks."""
import json
import socket
import time
import unittest

from fdtest import REF, Daemon

GOOD = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}

CASES = [
    # (description, raw body or dict, status, error.type, error.param)
    ("malformed JSON", '{"prompt": "x", ', 400, "invalid_argument", None),
    ("not an object", "[1, 2]", 400, "invalid_argument", None),
    ("missing prompt", {"max_tokens": 3}, 400, "invalid_argument", "prompt"),
    ("prompt wrong type", {"prompt": 42}, 400, "invalid_argument", "prompt"),
    ("empty prompt list", {"prompt": []}, 400, "invalid_argument", "prompt"),
    ("mixed prompt list", {"prompt": ["a", 3]}, 400, "invalid_argument", "prompt"),
    ("token id out of vocab", {"prompt": [1, 403, 512]}, 400, "invalid_argument", "prompt"),
    ("negative token id", {"prompt": [[1, -4]]}, 400, "invalid_argument", "prompt"),
    ("max_tokens zero", {"prompt": "a", "max_tokens": 0}, 400, "invalid_argument", "max_tokens"),
    ("max_tokens negative", {"prompt": "a", "max_tokens": -5}, 400, "invalid_argument", "max_tokens"),
    ("max_tokens string", {"prompt": "a", "max_tokens": "12"}, 400, "invalid_argument", "max_tokens"),
    ("max_tokens past context", {"prompt": "a", "max_tokens": 600}, 400, "invalid_argument", "max_tokens"),
    ("prompt too long", {"prompt": [1] + [403] * 600, "max_tokens": 1}, 400, "invalid_argument", "prompt"),
    ("temperature negative", {"prompt": "a", "temperature": -1}, 400, "invalid_argument", "temperature"),
    ("temperature string", {"prompt": "a", "temperature": "hot"}, 400, "invalid_argument", "temperature"),
    ("top_p zero", {"prompt": "a", "top_p": 0}, 400, "invalid_argument", "top_p"),
    ("top_k bad", {"prompt": "a", "top_k": -7}, 400, "invalid_argument", "top_k"),
    ("n zero", {"prompt": "a", "n": 0}, 400, "invalid_argument", "n"),
    ("n absurd", {"prompt": "a", "n": 100000}, 400, "invalid_argument", "n"),
    ("logprobs absurd", {"prompt": "a", "logprobs": 1000}, 400, "invalid_argument", "logprobs"),
    ("logprobs float", {"prompt": "a", "logprobs": 1.5}, 400, "invalid_argument", "logprobs"),
    ("seed string", {"prompt": "a", "seed": "x"}, 400, "invalid_argument", "seed"),
    ("stop wrong type", {"prompt": "a", "stop": 5}, 400, "invalid_argument", "stop"),
    ("stop empty string", {"prompt": "a", "stop": [""]}, 400, "invalid_argument", "stop"),
    ("stop_token_ids wrong", {"prompt": "a", "stop_token_ids": "1"}, 400, "invalid_argument", "stop_token_ids"),
    ("stream not bool", {"prompt": "a", "stream": "yes"}, 400, "invalid_argument", "stream"),
    ("unknown model", {"prompt": "a", "model": "gpt-5"}, 404, "not_found", "model"),
    ("misspelled field", {"prompt": "a", "temperatur": 0}, 400, "invalid_argument", "temperatur"),
    ("max_tokens zero without echo", {"prompt": "a", "max_tokens": 0, "logprobs": 1}, 400, "invalid_argument", "max_tokens"),
    ("unsupported best_of", {"prompt": "a", "best_of": 2}, 400, "invalid_argument", "best_of"),
    ("best_of below n", {"prompt": "a", "best_of": 1, "n": 2}, 400, "invalid_argument", "best_of"),  # vLLM's rule
    ("min_p out of [0, 1]", {"prompt": "a", "min_p": 1.5}, 400, "invalid_argument", "min_p"),  # min_p is implemented (issue #26)
    ("presence_penalty out of range", {"prompt": "a", "presence_penalty": 2.5}, 400, "invalid_argument", "presence_penalty"),
    ("frequency_penalty out of range", {"prompt": "a", "frequency_penalty": -3}, 400, "invalid_argument", "frequency_penalty"),
    ("frequency_penalty string", {"prompt": "a", "frequency_penalty": "1"}, 400, "invalid_argument", "frequency_penalty"),
    ("repetition_penalty zero", {"prompt": "a", "repetition_penalty": 0}, 400, "invalid_argument", "repetition_penalty"),
    ("repetition_penalty negative", {"prompt": "a", "repetition_penalty": -1.2}, 400, "invalid_argument", "repetition_penalty"),
    ("logit_bias not an object", {"prompt": "a", "logit_bias": [5, 10]}, 400, "invalid_argument", "logit_bias"),
    ("logit_bias key not an id", {"prompt": "a", "logit_bias": {"the": 10}}, 400, "invalid_argument", "logit_bias"),
    ("logit_bias key out of vocab", {"prompt": "a", "logit_bias": {"512": 10}}, 400, "invalid_argument", "logit_bias"),
    ("logit_bias key negative", {"prompt": "a", "logit_bias": {"-1": 10}}, 400, "invalid_argument", "logit_bias"),
    ("logit_bias value too big", {"prompt": "a", "logit_bias": {"5": 100.5}}, 400, "invalid_argument", "logit_bias"),
    ("logit_bias value string", {"prompt": "a", "logit_bias": {"5": "10"}}, 400, "invalid_argument", "logit_bias"),
    ("min_tokens negative", {"prompt": "a", "min_tokens": -1}, 400, "invalid_argument", "min_tokens"),
    ("min_tokens past max_tokens", {"prompt": "a", "max_tokens": 4, "min_tokens": 5}, 400, "invalid_argument", "min_tokens"),
    ("prompt_logprobs negative", {"prompt": "a", "prompt_logprobs": -1}, 400, "invalid_argument", "prompt_logprobs"),
    ("prompt_logprobs absurd", {"prompt": "a", "prompt_logprobs": 1000}, 400, "invalid_argument", "prompt_logprobs"),
    ("prompt_logprobs streamed", {"prompt": "a", "prompt_logprobs": 1, "stream": True}, 400, "invalid_argument", "prompt_logprobs"),
    ("include_stop_str_in_output not bool", {"prompt": "a", "include_stop_str_in_output": 1}, 400, "invalid_argument",
     "include_stop_str_in_output"),
    ("return_tokens_as_token_ids not bool", {"prompt": "a", "return_tokens_as_token_ids": "yes"}, 400, "invalid_argument",
     "return_tokens_as_token_ids"),
]


class BadInput(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon()
        cls.good = cls.d.complete(**GOOD)

    @classmethod
    def tearDownClass(cls):
        cls.d.__exit__(None)

    def test_every_bad_request_is_rejected_and_the_next_one_succeeds(self):
        for desc, body, status, etype, param in CASES:
            with self.subTest(desc):
                if isinstance(body, str):
                    got, j = self.d.request("POST", "/v1/completions", raw=body)
                else:
                    got, j = self.d.post("/v1/completions", body)
                self.assertEqual(got, status, j)
                self.assertEqual(j["error"]["type"], etype)
                self.assertEqual(j["error"]["code"], status)
                self.assertIsInstance(j["error"]["message"], str)
                self.assertGreater(len(j["error"]["message"]), 10)
                if param:
                    self.assertEqual(j["error"]["param"], param)
                    self.assertIn(param.split("_")[0], j["error"]["message"])
                after = self.d.complete(**GOOD)
                self.assertEqual(after["choices"][0]["token_ids"], self.good["choices"][0]["token_ids"])

    def test_neutral_values_of_unsupported_fields_are_accepted(self):
        j = self.d.complete(**GOOD, presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1.0, best_of=1, user="rl",
                            min_p=0, min_tokens=0, logit_bias={}, include_stop_str_in_output=False)
        self.assertEqual(j["choices"], self.good["choices"])

    def test_fields_openai_or_vllm_define_pass_at_their_neutral_values_only(self):
        """Client libraries send some of OpenAI's and vLLM's fields at their defaults: those pass
        and change nothing; any other value is a 400 naming the field (a probe found 'echo':
        false on chat, 'use_beam_search': false, 'store': false, ... refused as unknown fields)."""
        both = dict(use_beam_search=False, length_penalty=1.0, bad_words=[], allowed_token_ids=None, structured_outputs=None,
                    logits_processors=[], vllm_xargs={}, kv_transfer_params=None, request_id=None, store=False,
                    service_tier="auto", metadata={}, best_of=1, suffix="")
        j = self.d.complete(**GOOD, **both)
        self.assertEqual(j["choices"], self.good["choices"])
        msgs = [{"role": "user", "content": "Lily"}]
        chat = dict(max_tokens=3, temperature=0, messages=msgs)
        ref = self.d.post("/v1/chat/completions", chat)[1]["choices"]
        extra = dict(echo=False, parallel_tool_calls=True, include_reasoning=True, reasoning_effort=None)
        status, j = self.d.post("/v1/chat/completions", {**chat, **both, **extra})
        self.assertEqual((status, j["choices"]), (200, ref), j)
        wrong = dict(use_beam_search=True, length_penalty=2.0, bad_words=["x"], allowed_token_ids=[1], logits_processors=["m"],
                     vllm_xargs={"a": 1}, store=True, service_tier="flex", metadata={"k": "v"}, best_of=2, suffix="x")
        for key, value in wrong.items():
            with self.subTest(key):
                status, j = self.d.post("/v1/completions", {**GOOD, key: value})
                self.assertEqual((status, j["error"]["param"]), (400, key), j)
                self.assertIn("not supported by fdrollout yet", j["error"]["message"])
        for key, value in dict(echo=True, parallel_tool_calls=False, reasoning_effort="high").items():
            with self.subTest(key):
                status, j = self.d.post("/v1/chat/completions", {**chat, key: value})
                self.assertEqual((status, j["error"]["param"]), (400, key), j)
        status, j = self.d.post("/v1/completions", {**GOOD, "parallel_tool_calls": True})  # a chat field
        self.assertEqual((status, j["error"]["message"]), (400, "unknown field 'parallel_tool_calls'"), j)

    def test_every_guided_field_vllm_defines_passes_at_null(self):
        """docs/coming_from_vllm.md: `guided_*` pass at null. vLLM's protocol.py defines six; a probe
        found guided_decoding_backend and guided_whitespace_pattern refused as unknown fields."""
        guided = ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                  "guided_whitespace_pattern"]
        chat = dict(max_tokens=3, temperature=0, messages=[{"role": "user", "content": "Lily"}])
        ref = self.d.post("/v1/chat/completions", chat)[1]["choices"]
        j = self.d.complete(**GOOD, **{k: None for k in guided})
        self.assertEqual(j["choices"], self.good["choices"])
        status, j = self.d.post("/v1/chat/completions", {**chat, **{k: None for k in guided}})
        self.assertEqual((status, j["choices"]), (200, ref), j)
        for key in guided:
            with self.subTest(key):
                status, j = self.d.post("/v1/completions", {**GOOD, key: "x"})
                self.assertEqual((status, j["error"]["param"]), (400, key), j)
                self.assertIn("not supported by fdrollout yet", j["error"]["message"])

    def test_a_lone_surrogate_escape_is_named(self):
        """JSON's \\ud800 without its low half (or a low half alone) is no Unicode text: the 400 says
        so and where, not just "syntax error" (a probe); a proper pair is U+1F642."""
        for raw in ('{"prompt": "a\\ud800b", "max_tokens": 1}', '{"prompt": "a\\udc00", "max_tokens": 1}'):
            status, j = self.d.request("POST", "/v1/completions", raw=raw)
            self.assertEqual(status, 400, j)
            self.assertRegex(j["error"]["message"], r"^request body is not valid JSON: a lone surrogate at byte \d+ ", raw)
        status, j = self.d.request("POST", "/v1/completions", raw='{"prompt": "a\\ud83d\\ude42", "max_tokens": 1}')
        self.assertEqual(status, 200, j)

    def test_bodiless_post_gets_an_error_object(self):
        status, j = self.d.request("POST", "/v1/completions", raw=None, headers={})
        self.assertEqual(status, 400)
        self.assertEqual(j["error"]["type"], "invalid_argument")

    def test_unknown_route_and_method(self):
        status, j = self.d.get("/v1/nope")
        self.assertEqual(status, 404)
        self.assertEqual(j["error"]["type"], "not_found")
        self.assertEqual(self.d.complete(**GOOD)["choices"], self.good["choices"])

    def test_disconnect_mid_stream_frees_kv_blocks(self):
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True,
                           "temperature": 0, "stream": True, "n": 4}).encode()
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", self.d.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            first = s.recv(4096)
            self.assertIn(b"200", first.split(b"\r\n")[0])
            s.close()
        deadline = time.time() + 10
        while time.time() < deadline:
            _, h = self.d.get("/health")
            if h["kv_blocks"]["used"] == 0 and h["num_requests_running"] == 0:
                break
            time.sleep(0.05)
        self.assertEqual(h["kv_blocks"]["used"], 0)
        self.assertEqual(h["num_requests_running"], 0)
        self.assertEqual(self.d.complete(**GOOD)["choices"], self.good["choices"])


class ApiKey(unittest.TestCase):
    def test_api_key_is_required_on_v1_routes(self):
        with Daemon("--api-key", "s3cret") as d:
            status, j = d.post("/v1/completions", GOOD)
            self.assertEqual(status, 401)
            self.assertEqual(j["error"]["type"], "unauthorized")
            status, j = d.post("/v1/completions", GOOD, headers={"Authorization": "Bearer s3cret"})
            self.assertEqual(status, 200)
            self.assertEqual(j["choices"][0]["token_ids"], REF["Once upon a time"]["ids"][:12])
            self.assertEqual(d.get("/health")[0], 200)


if __name__ == "__main__":
    unittest.main()
