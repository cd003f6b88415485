"""Hostile or odd HTTP input a probe found mishandled (the HTTP layer: daemon/src/api/http/,
the routes' parsers; the rest of the hardening: test_http_server.py, test_malformed_bodies.py):

- a body of many small objects was parsed in time quadratic in their number (the parse callback
  that checked the depth): 400,000 {} in one field held a data thread for about a minute, and two
  such bodies stopped all generation; now a linear depth scan, then a plain parse;
- a client without the API key could make the daemon read a body of up to 64 MiB before its 401:
  a large body is now read only once the route admitted the request's head;
- /tokenize and /detokenize answered nlohmann's own parse message; now the generation routes'
  wording;
- `Transfer-Encoding: gzip, chunked` was read as chunked alone, the gzip bytes used as the body:
  now 501;
- /v1/models/{id} compared the raw, percent-encoded path with the served name.
"""
import json
import socket
import threading
import time
import unittest

from fdtest import Daemon
from test_http_server import raw_exchange, status_of

GOOD = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}


class HostileHttp(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon("--threads", "1", "--api-key", "gen-key", "--served-model-name", "org/my model", extra=False)
        cls.auth = {"Authorization": "Bearer gen-key"}

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()

    def post(self, path, body=None, raw=None, headers=None, timeout=120):
        return self.d.request("POST", path, body, raw=raw, headers={**self.auth, **(headers or {})}, timeout=timeout)

    def test_many_small_objects_parse_in_linear_time(self):
        raw = ('{"prompt": "a", "user": [%s]}' % ",".join(["{}"] * 400000)).encode()  # 1.2 MB
        t0 = time.monotonic()
        status, j = self.post("/v1/completions", raw=raw)
        took = time.monotonic() - t0
        self.assertEqual(status, 400, j)
        self.assertIn("'user' must be a string", j["error"]["message"])
        self.assertLess(took, 20, "a 1.2 MB body took minutes when the parse was quadratic in its objects")
        status, j = self.post("/v1/completions", GOOD)
        self.assertEqual(status, 200, j)

    def test_a_large_body_without_the_key_is_refused_before_it_is_read(self):
        with socket.create_connection(("127.0.0.1", self.d.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 52428800\r\n\r\n" + b" " * 4096)  # 50 MiB announced, 4 KiB sent, then nothing
            out = b""
            while b"\r\n\r\n" not in out:
                chunk = s.recv(65536)  # the old daemon read on, waiting for the body: socket.timeout
                if not chunk:
                    break
                out += chunk
        self.assertEqual(status_of(out), 401, out[:300])
        self.assertIn(b"missing or wrong API key", out)
        # with the key, the same head is admitted (a small body: the 400 comes from the handler)
        status, j = self.post("/v1/completions", raw=b"{}" + b" " * 70000)
        self.assertEqual(status, 400, j)

    def test_tokenize_says_where_the_json_breaks(self):
        for path in ("/tokenize", "/detokenize"):
            with self.subTest(path):
                status, j = self.post(path, raw=b'{"prompt": ')
                self.assertEqual(status, 400, j)
                self.assertIn("syntax error at byte", j["error"]["message"])
                self.assertNotIn("json.exception", j["error"]["message"])
                status, j = self.post(path, raw=b"")
                self.assertEqual((status, j["error"]["message"]), (400, "request body is empty; send a JSON object"), j)

    def test_a_transfer_coding_other_than_chunked_is_501(self):
        body = json.dumps({"prompt": "Once"}).encode()
        req = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer gen-key\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: gzip, chunked\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
        out = raw_exchange(self.d.port, req)
        self.assertEqual(status_of(out), 501, out[:300])
        req = req.replace(b"gzip, chunked", b"Chunked")  # chunked alone, any case: read as before
        self.assertEqual(status_of(raw_exchange(self.d.port, req, read_all=False)), 200)

    def test_a_model_id_is_percent_decoded(self):
        for path in ("/v1/models/org/my%20model", "/v1/models/org%2Fmy%20model", "/v1/models/org/my model".replace(" ", "%20")):
            with self.subTest(path):
                status, j = self.d.get(path, headers=self.auth)
                self.assertEqual((status, j.get("id")), (200, "org/my model"), j)
        status, j = self.d.get("/v1/models/org/my+model", headers=self.auth)  # '+' is not a space in a path
        self.assertEqual(status, 404, j)


if __name__ == "__main__":
    unittest.main()
