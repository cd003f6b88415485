"""The event-driven HTTP layer (Boost.Beast): thousands of idle connections do not starve a
completion, many streams and control calls are all answered, a client that goes away frees its
sequences (streamed or not), malformed HTTP gets 400/413/431 or a closed connection and the
daemon keeps serving, and HTTP/1.1 details (keep-alive, pipelining, 100-continue, HEAD, 405)."""
import http.client
import json
import re
import resource
import socket
import threading
import time
import unittest

from fdtest import wait_control_in_flight, wait_until, REF, Daemon

PROMPT = "Once upon a time"
GOOD = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
GOOD_IDS = REF[PROMPT]["ids"][:12]


def raise_fd_limit(n):
    """This test holds more sockets than the default soft limit of 1024 allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raw_exchange(port, data, timeout=10, read_all=True):
    """Send `data` on a fresh connection; return everything read until the server closes (or
    until a full response head when read_all is False)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
            if not read_all and b"\r\n\r\n" in out:
                break
        return out


def status_of(raw):
    m = re.match(rb"HTTP/1\.[01] (\d{3})", raw)
    return int(m.group(1)) if m else None


def generated_tokens(d):
    _, text = d.get("/metrics")
    return int(float(re.search(r"^fdrollout_generation_tokens_total\{[^}]*\} (\S+)", text, re.M).group(1)))


def aborted_choices(d):
    _, text = d.get("/metrics")
    return int(float(re.search(r'^fdrollout_requests_finished_total\{[^}]*finished_reason="abort"\} (\S+)', text, re.M).group(1)))


class Concurrency(unittest.TestCase):
    def test_a_completion_is_answered_with_1000_idle_connections_open(self):
        self.assertGreaterEqual(raise_fd_limit(4096), 2100)
        with Daemon("--http-keep-alive-s", "120") as d:
            idle = []
            try:
                for _ in range(1000):
                    idle.append(socket.create_connection(("127.0.0.1", d.port), timeout=10))
                # Every one of them is accepted and held (a thread-per-connection server would
                # leave most in its queue): a request on the last one opened is answered.
                idle[-1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                self.assertEqual(status_of(idle[-1].recv(4096)), 200)
                status, j = d.post("/v1/completions", GOOD, timeout=60)
                self.assertEqual(status, 200)
                self.assertEqual(j["choices"][0]["token_ids"], GOOD_IDS)
                chunks, done = d.stream(**GOOD, timeout=60)
                self.assertTrue(done)
                self.assertEqual([t for c in chunks for t in c["choices"][0]["token_ids"]], GOOD_IDS)
                _, m = d.get("/metrics")
                self.assertGreaterEqual(int(re.search(r"^process_open_fds (\d+)", m, re.M).group(1)), 1000)
            finally:
                for s in idle:
                    s.close()

    def test_64_streams_and_control_calls_are_all_answered(self):
        with Daemon("--dynamic-load-weight") as d:
            n_streams = 64
            results, errors = [None] * n_streams, []
            body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0}

            def stream(i):
                try:
                    results[i] = d.stream(**body, timeout=120)
                except Exception as e:  # reported below
                    errors.append(repr(e))

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(n_streams)]
            for t in threads:
                t.start()
            control = []
            while any(t.is_alive() for t in threads):
                for method, path in (("GET", "/v1/is_paused"), ("GET", "/health"), ("GET", "/v1/models")):
                    control.append(d.request(method, path, timeout=30)[0])
            for t in threads:
                t.join(120)
            self.assertEqual(errors, [])
            self.assertTrue(control)
            self.assertEqual(set(control), {200})
            for chunks, done in results:
                self.assertTrue(done)
                self.assertEqual([t for c in chunks for t in c["choices"][0]["token_ids"]], REF[PROMPT]["ids"])
            # pause/resume while streams run: answered, and the streams end (aborted) cleanly
            threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
            results[:8] = [None] * 8
            for t in threads:
                t.start()
            time.sleep(0.2)
            self.assertEqual(d.post("/v1/pause", timeout=30)[0], 200)
            self.assertEqual(d.post("/v1/resume", timeout=30)[0], 200)
            for t in threads:
                t.join(120)
            self.assertEqual(errors, [])
            self.assertTrue(all(done for _, done in results[:8]))


    def test_abort_and_queries_answer_while_every_control_thread_waits_on_the_engine(self):
        """A probe: while a pause?mode=wait drained, 40 more control calls queued behind it held
        all 32 control threads, so /v1/abort and /v1/is_paused waited for the whole drain (the
        abort could not end it). They run on a lane of their own now."""
        with Daemon("--dynamic-load-weight", env={"FD_DEBUG_STEP_DELAY_MS": "40"}) as d:
            gens = [threading.Thread(target=lambda: d.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True},
                                                           timeout=120)) for _ in range(4)]
            for t in gens:
                t.start()
            wait_until(lambda: d.get("/health")[1]["num_requests_running"] >= 4, 30, "4 running")
            pause = {}
            drain = threading.Thread(target=lambda: pause.update(r=d.post("/v1/pause?mode=wait", timeout=120)))
            drain.start()
            wait_control_in_flight(d, "pause")
            calls = [threading.Thread(target=lambda: d.post("/v1/flush_cache", timeout=120)) for _ in range(40)]
            for t in calls:
                t.start()
            time.sleep(1.0)  # they queue behind the drain, one control thread each
            t0 = time.time()
            code, j = d.request("GET", "/v1/is_paused", timeout=60)
            self.assertEqual(code, 200, j)
            code, j = d.post("/v1/abort", {"abort_all": True}, timeout=60)
            self.assertEqual(code, 200, j)
            self.assertGreater(j["result"]["aborted"], 0)  # it ended the drain's requests
            self.assertLess(time.time() - t0, 3.0)
            drain.join(60)
            self.assertEqual(pause["r"][0], 200, pause)
            for t in gens + calls:
                t.join(60)


class Disconnects(unittest.TestCase):
    # 8 choices of 480 tokens, 2 at a time: 4 rounds of 480 steps, far longer than noticing a
    # closed socket takes. A cancelled sequence is dropped without a finishing event, so the
    # evidence is the generated-token counter stopping short of 8 x 480 once the engine is idle
    # (uncancelled, a non-streamed request runs to its end: exactly 8 x 480).
    N, MAX_TOKENS = 8, 480

    @classmethod
    def setUpClass(cls):
        cls.d = Daemon("--max-num-seqs", "2")

    @classmethod
    def tearDownClass(cls):
        cls.d.__exit__(None)

    def send_and_close(self, stream, wait_running):
        body = json.dumps({"prompt": PROMPT, "max_tokens": self.MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                           "n": self.N, "stream": stream}).encode()
        s = socket.create_connection(("127.0.0.1", self.d.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.time() + 10
        while wait_running and time.time() < deadline and self.d.get("/health")[1]["num_requests_running"] == 0:
            time.sleep(0.005)
        s.close()

    def wait_idle(self):
        deadline = time.time() + 10
        while time.time() < deadline:
            _, h = self.d.get("/health")
            if h["kv_blocks"]["used"] == 0 and h["num_requests_running"] == 0 and h["num_requests_waiting"] == 0:
                return h
            time.sleep(0.05)
        return h

    def test_a_non_streamed_client_that_goes_away_frees_its_sequences(self):
        # The engine is told at once (the socket is watched while the engine works), not when
        # the answer would be written. Its choices count as aborted in /metrics (vLLM's count of
        # a disconnect; a probe: they were counted nowhere).
        before, aborted = generated_tokens(self.d), aborted_choices(self.d)
        self.send_and_close(stream=False, wait_running=True)
        h = self.wait_idle()
        self.assertEqual(h["kv_blocks"]["used"], 0)
        self.assertLess(generated_tokens(self.d) - before, self.N * self.MAX_TOKENS)
        self.assertEqual(aborted_choices(self.d) - aborted, self.N)
        self.assertEqual(self.d.complete(**GOOD)["choices"][0]["token_ids"], GOOD_IDS)

    def test_a_client_that_pipelines_a_request_and_goes_away_frees_its_sequences(self):
        # A probe: bytes of a pipelined request ended the watch on the socket, so the close that
        # followed went unseen and the first request ran to its end.
        before = generated_tokens(self.d)
        body = json.dumps({"prompt": PROMPT, "max_tokens": self.MAX_TOKENS, "ignore_eos": True, "temperature": 0, "n": self.N}).encode()
        s = socket.create_connection(("127.0.0.1", self.d.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.time() + 10
        while time.time() < deadline and self.d.get("/health")[1]["num_requests_running"] == 0:
            time.sleep(0.005)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
        s.close()
        h = self.wait_idle()
        self.assertEqual(h["kv_blocks"]["used"], 0)
        self.assertLess(generated_tokens(self.d) - before, self.N * self.MAX_TOKENS)
        self.assertEqual(self.d.complete(**GOOD)["choices"][0]["token_ids"], GOOD_IDS)

    def test_a_streaming_client_that_goes_away_before_any_token_frees_its_sequences(self):
        before = generated_tokens(self.d)
        self.send_and_close(stream=True, wait_running=False)
        h = self.wait_idle()
        self.assertEqual(h["kv_blocks"]["used"], 0)
        self.assertLess(generated_tokens(self.d) - before, self.N * self.MAX_TOKENS)


class Malformed(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon("--http-read-timeout-s", "2")

    @classmethod
    def tearDownClass(cls):
        cls.d.__exit__(None)

    def still_serving(self):
        self.assertEqual(self.d.complete(**GOOD)["choices"][0]["token_ids"], GOOD_IDS)

    def test_garbage_is_a_400(self):
        for data in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n",  # a TLS hello
                     b"GET\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"GET / HTTP/1.1\r\nNo colon here\r\n\r\n",
                     b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
                     b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
            with self.subTest(data=data[:30]):
                out = raw_exchange(self.d.port, data)
                self.assertEqual(status_of(out), 400, out)
                self.assertIn(b"Connection: close", out)
                self.assertEqual(json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["type"], "invalid_argument")
        self.still_serving()

    def test_a_transfer_encoding_other_than_chunked_is_a_400_and_closes(self):
        # RFC 9112 6.1. A probe: read as an empty body, with the connection kept open, the body
        # ran as a second request (smuggling behind a proxy that reads the coding otherwise).
        inner = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
        hidden = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(inner)}\r\n\r\n".encode() + inner)
        for te in (b"xchunked", b"gzip", b"chunked, gzip", b"identity"):
            with self.subTest(te=te):
                out = raw_exchange(self.d.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + te
                                   + b"\r\n\r\n" + hidden)
                self.assertEqual(status_of(out), 400, out)
                self.assertIn(b"Connection: close", out)
                self.assertEqual(out.count(b"HTTP/1.1 "), 1, out)  # nothing ran after it
        self.still_serving()

    def test_the_read_timeout_bounds_header_and_body_together(self):
        # --http-read-timeout-s 2: a header over 1.5 s then a body over 1.5 s is cut at 2 s (a
        # probe: each had its own timeout, so a request could take twice as long).
        body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode())
        s = socket.create_connection(("127.0.0.1", self.d.port), timeout=10)
        t0 = time.time()
        try:
            for chunk, pause in ((head[:-4], 1.5), (head[-4:], 0.0), (body[:-1], 1.5), (body[-1:], 0.0)):
                s.sendall(chunk)
                time.sleep(pause)
            out = s.recv(4096)
        except (BrokenPipeError, ConnectionResetError):
            out = b""
        finally:
            s.close()
        self.assertEqual(out, b"", "the request was answered past its 2 s")
        self.assertLess(time.time() - t0, 5)
        self.still_serving()

    def test_huge_header_is_a_431(self):
        out = raw_exchange(self.d.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n")
        self.assertEqual(status_of(out), 431, out[:200])
        self.still_serving()

    def test_body_over_64_mib_is_a_413_before_it_is_read(self):
        t0 = time.time()
        out = raw_exchange(self.d.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                        + f"Content-Length: {(64 << 20) + 1}\r\n\r\n".encode() + b"{" * 1000)
        self.assertEqual(status_of(out), 413, out[:200])
        self.assertLess(time.time() - t0, 10)  # answered from the header, not after a read timeout
        self.still_serving()

    def test_a_stalled_partial_header_is_cut_off_and_does_not_block_others(self):
        slow = [socket.create_connection(("127.0.0.1", self.d.port), timeout=20) for _ in range(50)]
        try:
            for s in slow:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")  # ... and nothing more
            self.still_serving()
            t0 = time.time()
            for s in slow:
                self.assertEqual(s.recv(4096), b"")  # closed by the server (--http-read-timeout-s 2)
            self.assertLess(time.time() - t0, 15)
        finally:
            for s in slow:
                s.close()
        self.still_serving()

    def test_unknown_method_on_a_known_route_is_a_405(self):
        status, j = self.d.get("/v1/completions")
        self.assertEqual(status, 405)
        self.assertEqual(j["error"]["type"], "invalid_argument")
        status, j = self.d.request("DELETE", "/health")
        self.assertEqual(status, 405)


class Http11(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon("--http-keep-alive-s", "1")

    @classmethod
    def tearDownClass(cls):
        cls.d.__exit__(None)

    def test_a_body_at_the_64_mib_limit_is_read(self):
        # (here, not in Malformed: 64 MiB may take longer than its 2 s read timeout under load)
        status, j = self.d.request("POST", "/v1/completions", raw=b" " * (64 << 20), timeout=120)
        self.assertEqual(status, 400)  # refused as JSON, not as too large
        self.assertEqual(j["error"]["type"], "invalid_argument")
        self.assertNotIn("larger than", j["error"]["message"])

    def test_keep_alive_then_idle_close(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.d.port, timeout=10)
        try:
            for _ in range(3):
                conn.request("POST", "/v1/completions", body=json.dumps(GOOD), headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                self.assertEqual(json.loads(r.read())["choices"][0]["token_ids"], GOOD_IDS)
            sock = conn.sock
            sock.settimeout(60)
            self.assertEqual(sock.recv(1), b"")  # the server closes it after --http-keep-alive-s 1 idle
        finally:
            conn.close()

    def test_pipelined_requests_are_answered_in_order(self):
        body = json.dumps(GOOD).encode()
        post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        out = raw_exchange(self.d.port, post + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
                           + b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        heads = re.findall(rb"HTTP/1\.1 (\d{3})", out)
        self.assertEqual(heads, [b"200", b"200", b"200"])
        self.assertLess(out.index(b'"text_completion"'), out.index(b'"object":"list"'))
        self.assertLess(out.index(b'"object":"list"'), out.index(b'"git_commit"'))

    def test_expect_100_continue(self):
        body = json.dumps(GOOD).encode()
        with socket.create_connection(("127.0.0.1", self.d.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode())
            self.assertTrue(s.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n\r\n"))
            s.sendall(body)
            out = b""
            while b'"usage"' not in out:
                chunk = s.recv(65536)
                self.assertTrue(chunk)
                out += chunk
            self.assertEqual(status_of(out), 200)

    def test_http_1_0_stream_ends_with_the_connection(self):
        body = json.dumps({**GOOD, "stream": True}).encode()
        out = raw_exchange(self.d.port, b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                                        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head, payload = out.split(b"\r\n\r\n", 1)
        self.assertEqual(status_of(head), 200)
        self.assertNotIn(b"chunked", head.lower())
        events = [l[6:] for l in payload.decode().split("\n") if l.startswith("data: ")]
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual([t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]], GOOD_IDS)

    def test_head_has_the_get_headers_and_no_body(self):
        out = raw_exchange(self.d.port, b"HEAD /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head, rest = out.split(b"\r\n\r\n", 1)
        self.assertEqual(status_of(head), 200)
        self.assertEqual(rest, b"")
        n = int(re.search(rb"Content-Length: (\d+)", head).group(1))
        self.assertEqual(n, len(json.dumps(self.d.get("/version")[1], separators=(",", ":"))))


if __name__ == "__main__":
    unittest.main()
