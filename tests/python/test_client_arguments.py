"""fdrollout.Client, Fleet and WeightStream without a daemon (a probe's findings): urls with parts
the calls would drop, IPv6 urls, timeouts that cannot be waited for, a 2xx answer that is empty
or lacks the field asked for (not fdrollout: FdRolloutError "unreachable", never a bare
TypeError / KeyError), a weight-stream transport that cannot be reached (FdRolloutError, never a
bare OSError), an empty version label, and a fleet member whose call raises something unexpected.
Fakes: tiny HTTP servers in threads (http.server)."""
import http.server
import json
import os
import socket
import sys
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from fdtest import free_port  # noqa: E402
from fdrollout import Client, FdRolloutError, Fleet  # noqa: E402


class Fake(http.server.BaseHTTPRequestHandler):
    """GET answers `gets[path]` (raw bytes, status 200); POST answers `posts[path]` (a dict,
    JSON), else {"result": {}}."""
    gets, posts = {}, {}

    def answer(self, data):
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer(self.gets.get(self.path.split("?")[0], b""))

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.answer(json.dumps(self.posts.get(self.path.split("?")[0], {"result": {}})).encode())

    def log_message(self, *args):
        pass


def serve(tc, gets=None, posts=None):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("F", (Fake,), {"gets": gets or {}, "posts": posts or {}}))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    tc.addCleanup(srv.server_close)
    tc.addCleanup(srv.shutdown)
    return f"127.0.0.1:{srv.server_port}"


class Urls(unittest.TestCase):
    def test_parts_the_calls_would_drop_are_refused(self):
        """Client("http://h:p/prefix/") called http://h:p/health (a probe); fdctl refuses it."""
        for url, part in (("http://127.0.0.1:8000/prefix/", "a path"), ("http://127.0.0.1:8000/v1", "a path"),
                          ("http://127.0.0.1:8000?x=1", "a query"), ("http://127.0.0.1:8000#top", "a fragment"),
                          ("http://user:pw@127.0.0.1:8000", "user info"), ("user@127.0.0.1:8000", "user info")):
            with self.assertRaises(ValueError, msg=url) as e:
                Client(url)
            self.assertIn(part, str(e.exception))
        self.assertEqual(Client("http://127.0.0.1:8000/").url, "http://127.0.0.1:8000")
        self.assertEqual(Client("127.0.0.1:8000").url, "http://127.0.0.1:8000")

    def test_ipv6_hosts_are_bracketed(self):
        """Client("[::1]:P").url was "http://::1:P" (a probe)."""
        c = Client("[::1]:8123")
        self.assertEqual((c.url, c.host, c.port), ("http://[::1]:8123", "::1", 8123))
        self.assertEqual(repr(c), "Client('http://[::1]:8123')")
        self.assertEqual(Client("http://[::1]:8123/").url, "http://[::1]:8123")
        self.assertEqual([m.url for m in Fleet(["[::1]:8123", "[::1]:8124"]).members], ["http://[::1]:8123", "http://[::1]:8124"])

    def test_ipv6_calls_reach_the_host(self):
        server6 = type("Server6", (http.server.ThreadingHTTPServer,), {"address_family": socket.AF_INET6})
        try:
            srv = server6(("::1", 0), type("F", (Fake,), {"gets": {"/health": b'{"weight_version": "v6"}'}}))
        except OSError:
            self.skipTest("no IPv6 loopback")
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        self.addCleanup(srv.server_close)
        self.addCleanup(srv.shutdown)
        self.assertEqual(Client(f"[::1]:{srv.server_address[1]}", timeout=5).weight_version(), "v6")

    def test_bad_types_name_the_argument(self):
        for bad in (None, 8000, b"127.0.0.1:8000"):
            with self.assertRaises(TypeError, msg=repr(bad)) as e:
                Client(bad)
            self.assertIn("url", str(e.exception))
        with self.assertRaises(TypeError) as e:
            Fleet("127.0.0.1:8000")  # its characters were the members
        self.assertIn("list", str(e.exception))

    def test_timeouts_that_cannot_be_waited_for_are_refused(self):
        """inf, 1e12 and nan raised inside a Timer thread or the socket, at the first call (a probe)."""
        for bad in (float("inf"), 1e12, float("nan"), 0, -1, 1e7 + 1):
            with self.assertRaises(ValueError, msg=repr(bad)) as e:
                Client("127.0.0.1:8000", timeout=bad)
            self.assertIn("timeout", str(e.exception))
        for bad in ("5", True, None):
            with self.assertRaises(TypeError, msg=repr(bad)) as e:
                Client("127.0.0.1:8000", timeout=bad)
            self.assertIn("timeout", str(e.exception))
        self.assertEqual(Client("127.0.0.1:8000", timeout=1e7).timeout, 1e7)
        with self.assertRaises(ValueError):
            Client("127.0.0.1:8000").wait(timeout=float("inf"))


class AnswersThatAreNotFdrollout(unittest.TestCase):
    def test_an_empty_2xx_body_is_unreachable(self):
        """vLLM's /health answers 200 with an empty body: request returned None and
        weight_version() raised a bare TypeError (a probe)."""
        c = Client(serve(self, gets={}), timeout=5)
        for call in (c.health, c.weight_version, c.is_paused, lambda: c.wait("serving", timeout=1)):
            with self.assertRaises(FdRolloutError) as e:
                call()
            self.assertEqual((e.exception.status, e.exception.type), (0, "unreachable"))
            self.assertIn("empty body", e.exception.message)
            self.assertIn("not an fdrollout daemon", e.exception.message)

    def test_a_2xx_without_the_field_is_unreachable(self):
        """weight_version() raised KeyError, is_paused() KeyError, wait() AttributeError on a list."""
        c = Client(serve(self, gets={"/health": b'{"status": "ok"}', "/v1/is_paused": b'{"paused": false}'}), timeout=5)
        for call, field in ((c.weight_version, "weight_version"), (c.is_paused, "is_paused"),
                            (lambda: c.wait("serving", timeout=1), "state")):
            with self.assertRaises(FdRolloutError) as e:
                call()
            self.assertEqual((e.exception.status, e.exception.type), (0, "unreachable"))
            self.assertIn(repr(field), e.exception.message)
        c = Client(serve(self, gets={"/health": b'["serving"]'}), timeout=5)
        for call in (c.health, lambda: c.wait("serving", timeout=1)):
            with self.assertRaises(FdRolloutError) as e:
                call()
            self.assertIn("not an object", e.exception.message)

    def test_a_fleet_member_raising_anything_is_its_failure(self):
        """Fleet.map let any exception but FdRolloutError, OSError and ValueError escape."""
        def fn(c):
            if c.port == 1:
                raise TypeError("odd answer")
            return c.port
        res = Fleet(["127.0.0.1:1", "127.0.0.1:2"]).map(fn)
        self.assertEqual(res["http://127.0.0.1:2"], 2)
        self.assertIsInstance(res["http://127.0.0.1:1"], TypeError)


class StreamTransport(unittest.TestCase):
    def listener(self):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        self.addCleanup(s.close)
        return s.getsockname()[1]

    def test_a_transport_that_cannot_be_reached_is_an_FdRolloutError(self):
        """socket.create_connection's ConnectionRefusedError came out bare (a probe)."""
        dead = free_port()
        init = {"host": "127.0.0.1", "port": dead, "token": "t", "tensors": []}
        c = Client(serve(self, posts={"/init_weight_transfer_engine": init}), timeout=5)
        with self.assertRaises(FdRolloutError) as e:
            with c.weight_stream("v1"):
                pass
        self.assertEqual((e.exception.status, e.exception.type), (0, "unreachable"))
        self.assertIn(f"weight-stream transport: cannot connect to 127.0.0.1:{dead}", e.exception.message)

    def test_a_landing_connection_that_cannot_be_reached_is_an_FdRolloutError(self):
        dead = free_port()
        init = {"host": "127.0.0.1", "port": self.listener(), "token": "t", "tensors": []}
        start = {"land": [{"host": "127.0.0.1", "port": dead, "token": "r0", "parts": []}]}
        c = Client(serve(self, posts={"/init_weight_transfer_engine": init, "/start_weight_update": start}), timeout=5)
        with self.assertRaises(FdRolloutError) as e:
            with c.weight_stream("v1", land=True):
                pass
        self.assertEqual((e.exception.status, e.exception.type), (0, "unreachable"))
        self.assertIn(f"rank 0's landing connection: cannot connect to 127.0.0.1:{dead}", e.exception.message)

    def test_an_empty_label_is_refused_before_any_call(self):
        """weight_stream("") committed under a fingerprint label, where update_weights(version="")
        is a 400 (a probe). Nothing listens here: a ValueError means no call was made."""
        c = Client(f"127.0.0.1:{free_port()}", timeout=5)
        for kw in ({"version": ""}, {"version": "v2", "base_version": ""}):
            with self.assertRaises(ValueError, msg=kw) as e:
                c.weight_stream(**kw).__enter__()
            self.assertIn("''", str(e.exception))


if __name__ == "__main__":
    unittest.main()
