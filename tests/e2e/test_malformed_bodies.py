"""Malformed-body corpus for POST /v1/completions (issue 12, defects 6 and 7, generation side):
every wrong type or value of every field is a 400 `invalid_argument` OpenAI error naming the field
(`param`), in our words — never a JSON library's raw message, never a 500 — and the daemon keeps
answering exactly as before. Also: a bodiless POST to an unknown route is a 404 at once."""
import http.client
import json
import socket
import time
import unittest

from fdtest import Daemon

GOOD = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
STREAM = {**GOOD, "stream": True}

# Values of every JSON type; each field below lists which of them are wrong for it.
WRONG = {
    "str": "x", "empty_str": "", "true": True, "obj": {"a": 1}, "empty_obj": {}, "list": [1, 2], "list_str": ["a"],
    "float": 1.5, "neg": -1, "huge": 2 ** 63, "huger": 2 ** 64 + 5, "neg_huge": -(2 ** 63),
}
FIELDS = {
    # field: wrong values (names from WRONG), extra (value, why) cases
    "max_tokens": (["str", "true", "obj", "list", "float", "neg", "huge", "huger", "neg_huge"], [(0, "zero")]),
    "temperature": (["str", "true", "obj", "list", "neg", "huge"], []),
    "top_p": (["str", "true", "obj", "list", "neg", "huge"], [(0, "zero")]),
    "top_k": (["str", "true", "obj", "list", "float", "huge", "huger", "neg_huge"], [(-2, "below -1")]),
    "n": (["str", "true", "obj", "list", "float", "neg", "huge", "huger"], [(0, "zero"), (10 ** 6, "too many")]),
    "logprobs": (["str", "true", "obj", "list", "float", "neg", "huge", "huger"], [(-1, "minus one"), (21, "above the cap")]),
    "seed": (["str", "true", "obj", "list", "float"], []),
    "stop": (["true", "obj", "float", "neg", "huge"], [([1], "list of ints"), ([""], "empty stop string")]),
    "stop_token_ids": (["str", "true", "obj", "float", "list_str"], [([512], "outside the vocabulary"), ([-1], "negative"),
                                                                       ([2 ** 63], "huge")]),
    "ignore_eos": (["str", "obj", "list", "float", "neg"], []),
    "echo": (["str", "obj", "list", "float", "neg"], []),
    "stream": (["str", "obj", "list", "float", "neg"], []),
    "user": (["true", "obj", "list", "float", "neg"], []),
    "model": (["true", "obj", "list", "float", "neg"], []),
    "prompt": (["true", "obj", "empty_obj", "float", "neg", "huge"], [([1, 2.5], "float token"), ([[1], "a"], "mixed lists"),
                                                                    ([2 ** 64 + 5], "huge token id"), ([[]], "empty token list")]),
}
# stream_options needs "stream": true to be meaningful; each of these is a 400 naming it.
STREAM_OPTIONS = [
    ({"include_usage": "x"}, "stream_options.include_usage"),
    ({"include_usage": 1}, "stream_options.include_usage"),
    ({"include_usage": {}}, "stream_options.include_usage"),
    ({"include_usage": True, "continuous": True}, "stream_options.continuous"),
    ("yes", "stream_options"),
    ([True], "stream_options"),
    (True, "stream_options"),
]
RAW = [
    # (description, raw body): the body itself is broken
    ("truncated JSON", b'{"prompt": "a", '),
    ("trailing garbage", b'{"prompt": "a"} x'),
    ("a JSON string", b'"prompt"'),
    ("JSON null", b"null"),
    ("a number", b"42"),
    ("empty body", b""),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}'),
    ("number overflow", b'{"prompt": "a", "max_tokens": 1e999}'),
    ("deep nesting", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("NaN literal", b'{"prompt": "a", "temperature": NaN}'),
    ("duplicate key wrong type", b'{"prompt": "a", "max_tokens": 3, "max_tokens": "3"}'),
]


class MalformedBodies(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon()
        cls.good = cls.d.complete(**GOOD)["choices"][0]["token_ids"]

    @classmethod
    def tearDownClass(cls):
        cls.d.__exit__(None)

    def check_400(self, status, j, param):
        self.assertEqual(status, 400, j)
        self.assertEqual(j["error"]["type"], "invalid_argument", j)
        self.assertEqual(j["error"]["code"], 400)
        msg = j["error"]["message"]
        self.assertNotIn("json.exception", msg)  # nlohmann's own words never reach a client
        self.assertNotIn("type_error", msg)
        if param is not None:
            self.assertEqual(j["error"]["param"], param, j)
            self.assertIn(param.split(".")[-1].split("_")[0], msg)

    def test_every_wrong_value_of_every_field_is_a_400_naming_it(self):
        n = 0
        for field, (wrong, extra) in FIELDS.items():
            cases = [(WRONG[w], w) for w in wrong] + extra
            for value, why in cases:
                with self.subTest(field=field, value=why):
                    status, j = self.d.post("/v1/completions", {**GOOD, field: value})
                    self.check_400(status, j, field)
                    n += 1
        self.assertGreater(n, 100)
        self.assertEqual(self.d.complete(**GOOD)["choices"][0]["token_ids"], self.good)

    def test_stream_options_of_the_wrong_shape_are_a_400_not_a_500(self):
        for value, param in STREAM_OPTIONS:
            with self.subTest(value=value):
                status, j = self.d.post("/v1/completions", {**STREAM, "stream_options": value})
                self.check_400(status, j, param)
        status, j = self.d.post("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}})
        self.check_400(status, j, "stream_options")  # without "stream": true (as vLLM)
        chunks, done = self.d.stream(**GOOD, stream_options={"include_usage": True})
        self.assertTrue(done)
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 8)
        chunks, done = self.d.stream(**GOOD, stream_options=None)
        self.assertTrue(done)

    def test_a_broken_body_is_a_400(self):
        for desc, raw in RAW:
            with self.subTest(desc):
                status, j = self.d.request("POST", "/v1/completions", raw=raw)
                self.check_400(status, j, None)
        self.assertEqual(self.d.complete(**GOOD)["choices"][0]["token_ids"], self.good)

    def test_valid_values_still_work(self):
        j = self.d.complete(**GOOD, user="trainer-7", logprobs=0, stop_token_ids=[511], seed=2 ** 63 - 1, top_k=-1, n=2)
        self.assertEqual(j["choices"][0]["token_ids"], self.good)
        self.assertEqual(len(j["choices"][0]["logprobs"]["token_logprobs"]), 8)
        j = self.d.complete(**GOOD, logprobs=None, user=None, stream_options=None)
        self.assertIsNone(j["choices"][0]["logprobs"])

    def test_a_deeply_nested_body_is_a_400_on_every_route_and_the_daemon_lives(self):
        """20,000 nested arrays in 40 KB crashed the daemon (a stack overflow in the chat template's
        conversion of tools and kwargs, and in the error message quoting the value): now any body
        nesting deeper than 128 arrays/objects is a 400 before it is read, on every route that
        parses one, control routes included; a body 100 deep still reaches the field checks, whose
        message quotes at most 100 bytes of the value."""
        deep = lambda n: "[" * n + "]" * n
        msg = [{"role": "user", "content": "hi"}]
        cases = [
            ("/v1/completions", '{"prompt": "a", "max_tokens": 2, "user": %s}'),
            ("/v1/chat/completions", json.dumps({"messages": msg, "max_tokens": 2,
                                                 "tools": [{"type": "function", "function": {"name": "f", "parameters": "@"}}]})),
            ("/tokenize", json.dumps({"messages": msg, "chat_template_kwargs": {"x": "@"}})),
            ("/detokenize", '{"tokens": %s}'),
        ]
        for path, tpl in cases:
            with self.subTest(path):
                raw = tpl.replace('"@"', "%s") % deep(20000)
                status, j = self.d.request("POST", path, raw=raw.encode())
                self.check_400(status, j, None)
                self.assertIn("nests deeper than 128", j["error"]["message"])
        with Daemon("--dynamic-load-weight") as c:  # control routes answer only with it
            status, j = c.request("POST", "/v1/pause", raw=('{"x": %s}' % deep(20000)).encode())
            self.assertEqual(status, 400, j)
            self.assertIn("nests deeper than 128", j["error"]["message"])
            self.assertEqual(c.get("/health")[0], 200)
        status, j = self.d.request("POST", "/v1/completions", raw=('{"prompt": "a", "user": %s}' % deep(100)).encode())
        self.check_400(status, j, "user")
        self.assertLess(len(j["error"]["message"]), 200)
        self.assertEqual(self.d.complete(**GOOD)["choices"][0]["token_ids"], self.good)

    def test_a_bodiless_post_to_an_unknown_route_is_a_404_at_once(self):
        # (/update_weights was the third example until prime-rl's route of that name existed, issue 26)
        for path in ("/v1/nope", "/v1/chat/nope", "/update_weights_nope"):
            with self.subTest(path):
                s = socket.create_connection(("127.0.0.1", self.d.port), timeout=10)
                try:
                    t0 = time.time()
                    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                    data = b""
                    while b"\r\n\r\n" not in data:
                        chunk = s.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                    self.assertLess(time.time() - t0, 2.0)
                    self.assertTrue(data.startswith(b"HTTP/1.1 404"), data)
                finally:
                    s.close()
        # With Content-Length: 0 too.
        conn = http.client.HTTPConnection("127.0.0.1", self.d.port, timeout=10)
        t0 = time.time()
        conn.request("POST", "/v1/nope", body=b"", headers={"Content-Length": "0"})
        r = conn.getresponse()
        self.assertEqual(r.status, 404)
        self.assertEqual(json.loads(r.read())["error"]["type"], "not_found")
        self.assertLess(time.time() - t0, 2.0)
        conn.close()


if __name__ == "__main__":
    unittest.main()
