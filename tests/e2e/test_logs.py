"""Operator logs: one access-log line per request (method, route, status, tokens, latency), the
periodic throughput line, and --log-format json (every line one JSON object)."""
import json
import os
import re
import socket
import time
import unittest
import urllib.request

from fdtest import Daemon, wait_until


class Logs(unittest.TestCase):
    def test_access_line_per_request_with_tokens_and_latency(self):
        with Daemon() as d:
            t0 = time.time()
            j = d.complete(prompt="Once upon a time", max_tokens=7, temperature=0)
            client_ms = (time.time() - t0) * 1000
            chunks, done = d.stream(prompt="Lily", max_tokens=4, temperature=0, ignore_eos=True)
            self.assertTrue(done)
            status, _ = d.post("/v1/completions", {"prompt": "x", "bogus": 1})
            self.assertEqual(status, 400)
            d.get("/v1/models")
            d.get("/no/such/route")
            # each line is written after its response's last byte: wait for all five, not a fixed time
            access = lambda: [l for l in d.output().splitlines() if "[access]" in l]
            wait_until(lambda: len(access()) >= 5, 30, f"5 access lines: {access()}")
            lines = access()
            comp = [l for l in lines if "POST /v1/completions 200" in l]
            self.assertEqual(len(comp), 2, lines)
            # Each line is written after its response went out, so the two may log in either
            # order: the non-streamed request is the one with the longer prompt.
            comp.sort(key=lambda l: -int(re.search(r"tokens=(\d+)/", l).group(1)))
            m = re.search(r"POST /v1/completions 200 tokens=(\d+)/(\d+) ([\d.]+) ms", comp[0])
            self.assertEqual((int(m.group(1)), int(m.group(2))), (j["usage"]["prompt_tokens"], j["usage"]["completion_tokens"]))
            # The daemon stops its clock when its write of the last byte completes, which it can
            # notice after the client already read that byte (2 busy cores); and it prints 0.1 ms.
            # CI at a8c9098 logged 9.3 ms for a client's 9.12: up to 1 ms over is that, not more.
            self.assertGreater(float(m.group(3)), 0.0)
            self.assertLessEqual(float(m.group(3)), client_ms + 1.0)
            self.assertRegex(comp[1], r"tokens=\d+/4 ")
            self.assertEqual(len([l for l in lines if "POST /v1/completions 400 tokens=-/-" in l]), 1, lines)
            self.assertEqual(len([l for l in lines if "GET /v1/models 200" in l]), 1, lines)
            self.assertEqual(len([l for l in lines if "GET /no/such/route 404" in l]), 1, lines)
            # Probes log at debug: the readiness polls of the harness left no info lines.
            self.assertFalse([l for l in lines if "GET /health" in l], lines)

    def test_throughput_line_while_busy_and_silence_when_idle(self):
        with Daemon("--log-stats-interval-s", "0.2") as d:
            time.sleep(0.5)
            self.assertNotIn("throughput:", d.output())  # idle: nothing to say
            d.complete(prompt="Once upon a time", max_tokens=400, temperature=0, ignore_eos=True)
            time.sleep(0.5)
            lines = [l for l in d.output().splitlines() if "throughput:" in l]
            self.assertTrue(lines)
            gen = [float(x) for l in lines for x in re.findall(r"generation ([\d.]+) tok/s", l)]
            self.assertGreater(max(gen), 0)
            self.assertRegex(lines[0], r"\[stats\] throughput: prompt [\d.]+ tok/s, generation [\d.]+ tok/s \| running \d+, waiting \d+ "
                                       r"\| KV [\d.]+% used \| new requests \d+ \| weight_version 0")
            n = len(lines)
            time.sleep(0.6)
            self.assertLessEqual(len([l for l in d.output().splitlines() if "throughput:" in l]), n + 1)

    def test_json_format_every_line_is_an_object(self):
        with Daemon("--log-format", "json") as d:
            d.complete(prompt='He said "hi"\n', max_tokens=3, temperature=0)
            d.post("/v1/completions", {"prompt": "x", "max_tokens": "three"})
            wait_until(lambda: d.output().count('"logger":"access"') >= 2, 30, "the two access lines")  # written after the last byte
            objs = [json.loads(l) for l in d.output().splitlines() if l.strip()]
            self.assertGreater(len(objs), 3)
            for o in objs:
                self.assertEqual(set(o), {"time", "level", "logger", "msg", "pid", "thread"})
                self.assertRegex(o["time"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
                self.assertEqual(o["pid"], d.proc.pid)
            self.assertTrue(any(o["logger"] == "access" and o["msg"].startswith("POST /v1/completions 200 tokens=") for o in objs))
            self.assertTrue(any(o["logger"] == "api" and o["level"] == "info" and "listening on" in o["msg"] for o in objs))

    def test_json_lines_stay_utf8_with_stray_bytes_in_a_path_or_the_model_name(self):
        # A probe: GET /v1/models/caf\xe9 (any client, no key needed) put the raw byte into the
        # access line, and --served-model-name with one into the start-up line and /metrics'
        # model_name label: not JSON, not a valid exposition. Such bytes are now U+FFFD.
        with Daemon("--log-format", "json", "--served-model-name", os.fsdecode(b"m\xe9")) as d:
            with socket.create_connection(("127.0.0.1", d.port), timeout=10) as c:
                c.sendall(b"GET /v1/models/caf\xe9 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                while c.recv(4096):
                    pass
            wait_until(lambda: "caf" in d.output(), 30, "the access line")
            raw = urllib.request.urlopen(f"http://127.0.0.1:{d.port}/metrics", timeout=10).read()
            raw.decode("utf-8")  # strict: raises on a stray byte
            self.assertIn('model_name="m\ufffd"', raw.decode("utf-8"))
            with open(d.log.name, "rb") as f:
                lines = [l for l in f.read().split(b"\n") if l.strip()]
            objs = [json.loads(l.decode("utf-8")) for l in lines]  # strict UTF-8, then JSON
            self.assertTrue(any(o["logger"] == "access" and o["msg"].startswith("GET /v1/models/caf\ufffd 404") for o in objs), objs[-3:])

    def test_a_request_whose_head_never_parsed_still_gets_its_access_line(self):
        # A probe: 413 (by its Content-Length), 431 and malformed requests were answered but never
        # logged ("one line per HTTP request").
        with Daemon() as d:
            for raw in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % ((64 << 20) + 1),
                        b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n", b"GARBAGE\r\n\r\n"):
                with socket.create_connection(("127.0.0.1", d.port), timeout=10) as c:
                    c.sendall(raw)
                    while c.recv(4096):
                        pass
            for status in (413, 431, 400):
                wait_until(lambda: re.search(r"\[access\] - - %d tokens=-/-" % status, d.output()), 30, f"the {status} line")

    def test_unknown_log_format_is_a_usage_error(self):
        d = Daemon("--log-format", "xml", wait=False)
        try:
            self.assertEqual(d.proc.wait(30), 2)
            self.assertIn("--log-format", d.output())
        finally:
            d.__exit__(None)


if __name__ == "__main__":
    unittest.main()
