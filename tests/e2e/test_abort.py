"""Aborting requests from the shell and from vLLM clients (issue #13): `fdctl abort REQUEST_ID` and
`fdctl abort --all` over both transports (the shm control block carries the id since ABI 3),
vLLM's `POST /abort_requests`, and `fdctl --hosts ... abort` across a fleet.

The daemons run with FD_DEBUG_STEP_DELAY_MS (a test-only stretch of every step) so requests are
still running when the abort arrives. Reference nobody here computed: the same prompt run
uninterrupted on the same daemon; an aborted stream's tokens are a strict prefix of it, and
/health shows the engine still serving (an abort never pauses) with the KV freed."""
import http.client
import json
import os
import shutil
import struct
import tempfile
import time
import unittest

from fdtest import copy_checkpoint, Daemon, fdctl, free_port, http_request, STORIES
import test_pause_modes as pm  # InFlight, wait_running, body, STEP_DELAY (its test class is not collected here)

PROMPT = "Once upon a time"


class Stream:
    """A streaming completion whose first chunk has arrived (so it is running): .id is the
    completion id; finish() reads to [DONE] and returns (finish_reason, token ids)."""

    def __init__(self, port, headers=None, prompt=PROMPT):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.conn.request("POST", "/v1/completions", body=json.dumps({**pm.body(prompt), "stream": True}),
                          headers={"Content-Type": "application/json", **(headers or {})})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.status
        first = json.loads(self.resp.readline().decode()[len("data: "):])
        self.id = first["id"]
        self.tokens = list(first["choices"][0].get("token_ids", []))

    def finish(self):
        rest = self.resp.read().decode()
        self.conn.close()
        finish = None
        for line in rest.split("\n"):
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                self.tokens += ch.get("token_ids", [])
                finish = ch.get("finish_reason") or finish
        assert rest.rstrip().endswith("data: [DONE]"), rest[-200:]
        return finish, self.tokens


def settle(d, timeout=10):
    """/health once nothing runs any more (the aborted choices' KV is freed)."""
    deadline = time.time() + timeout
    while True:
        h = d.get("/health")[1]
        if h["num_requests_running"] == 0 and h["kv_blocks"]["used"] == 0 or time.time() > deadline:
            return h
        time.sleep(0.02)


class Abort(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-abort-")
        cls.model = copy_checkpoint(STORIES, os.path.join(cls.tmp, "m"))
        cls.d = Daemon(model=cls.model, env=pm.STEP_DELAY)
        cls.ref = cls.d.complete(**pm.body(PROMPT))["choices"][0]["token_ids"]
        assert len(cls.ref) == pm.MAX_TOKENS

    @classmethod
    def tearDownClass(cls):
        cls.d.__exit__(None)
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def assert_aborted(self, stream):
        finish, tokens = stream.finish()
        self.assertEqual(finish, "abort")
        self.assertLess(len(tokens), pm.MAX_TOKENS)
        self.assertEqual(tokens, self.ref[:len(tokens)])  # what it had: a prefix of the uninterrupted run
        h = settle(self.d)
        self.assertEqual((h["state"], h["kv_blocks"]["used"]), ("serving", 0), h)  # never paused; KV freed

    def test_abort_by_x_request_id_over_both_transports(self):
        for transport in ("shm", "v1"):
            with self.subTest(transport=transport):
                s = Stream(self.d.port, headers={"X-Request-Id": f"rollout-{transport}"})
                rc, out, err = fdctl(self.d.port, "--transport", transport, "abort", f"rollout-{transport}")
                self.assertEqual((rc, out.strip()), (0, "aborted 1 choice(s)"), err)
                self.assert_aborted(s)

    def test_abort_by_completion_id_over_both_transports(self):
        for transport in ("shm", "v1"):
            with self.subTest(transport=transport):
                s = Stream(self.d.port)
                self.assertTrue(s.id.startswith("cmpl-"), s.id)
                rc, out, err = fdctl(self.d.port, "--transport", transport, "--json", "abort", s.id)
                self.assertEqual(rc, 0, err)
                self.assertEqual(json.loads(out)["result"]["aborted"], 1, out)
                self.assert_aborted(s)

    def test_unknown_or_finished_id_is_not_found(self):
        done = self.d.complete(**pm.body(PROMPT, max_tokens=2))["id"]
        for transport in ("shm", "v1"):
            for rid in ("rollout-nobody", done):
                with self.subTest(transport=transport, rid=rid):
                    rc, out, err = fdctl(self.d.port, "--transport", transport, "abort", rid)
                    self.assertEqual(rc, 3, (out, err))  # not_found, as documented in fdctl --help
                    self.assertIn("not_found", err)

    def test_usage_errors_send_nothing(self):
        for args in (["abort"], ["abort", "x", "--all"], ["abort", "a b"], ["abort", "x" * 129]):
            with self.subTest(args=args):
                rc, out, err = fdctl(self.d.port, "--transport", "shm", *args)
                self.assertEqual(rc, 2, (out, err))

    def test_abort_all_over_both_transports(self):
        for transport in ("shm", "v1"):
            with self.subTest(transport=transport):
                f = pm.InFlight(self.d, [pm.body(p) for p in pm.PROMPTS[:3]])
                pm.wait_running(self.d, 3)
                rc, out, err = fdctl(self.d.port, "--transport", transport, "--json", "abort", "--all")
                self.assertEqual(rc, 0, err)
                self.assertEqual(json.loads(out)["result"]["aborted"], 3, out)
                for status, r in f.join():
                    self.assertEqual((status, r["choices"][0]["finish_reason"]), (200, "abort"))
                self.assertEqual(settle(self.d)["state"], "serving")
                # serving as before: a new request runs to its end, equal to the reference
                self.assertEqual(self.d.complete(**pm.body(PROMPT))["choices"][0]["token_ids"], self.ref)

    def test_vllm_abort_requests(self):
        f = pm.InFlight(self.d, [pm.body(PROMPT)], headers={"X-Request-Id": "vllm-a"})
        g = pm.InFlight(self.d, [pm.body(PROMPT)], headers={"X-Request-Id": "vllm-b"})
        pm.wait_running(self.d, 2)
        code, j = http_request(self.d.port, "POST", "/abort_requests", {"request_ids": ["vllm-a", "vllm-gone"]})
        self.assertEqual(code, 200, j)
        j.pop("request_id")
        # vLLM's dev RL route answers {"status": "aborted", "aborted": N}; not_found is ours
        self.assertEqual(j, {"status": "aborted", "aborted": 1, "not_found": ["vllm-gone"]})
        self.assertEqual(f.join()[0][1]["choices"][0]["finish_reason"], "abort")
        # a bad id anywhere in the list: 400 and nothing aborted (vllm-b runs on)
        code, j = http_request(self.d.port, "POST", "/abort_requests", {"request_ids": ["vllm-b", "a b"]})
        self.assertEqual(code, 400, j)
        self.assertEqual(self.d.get("/health")[1]["num_requests_running"], 1)
        code, j = http_request(self.d.port, "POST", "/abort_requests", {})  # no list: every request
        self.assertEqual((code, j["status"], j["aborted"]), (200, "aborted", 1), j)
        self.assertEqual(g.join()[0][1]["choices"][0]["finish_reason"], "abort")
        self.assertEqual(settle(self.d)["state"], "serving")

    def test_vllm_request_id_in_the_body(self):
        """vLLM's body `request_id`: the response id is "cmpl-<id>" (vllm serving_completion's
        f"cmpl-{request_id}"), and /abort_requests finds the request by either form."""
        f = pm.InFlight(self.d, [pm.body(PROMPT, request_id="rollout-17")])
        g = pm.InFlight(self.d, [pm.body(PROMPT, request_id="rollout-18")])
        pm.wait_running(self.d, 2)
        code, j = http_request(self.d.port, "POST", "/abort_requests", {"request_ids": ["rollout-17", "cmpl-rollout-18"]})
        self.assertEqual((code, j["aborted"]), (200, 2), j)
        for inflight, rid in ((f, "rollout-17"), (g, "rollout-18")):
            status, r = inflight.join()[0]
            self.assertEqual((status, r["id"], r["choices"][0]["finish_reason"]), (200, f"cmpl-{rid}", "abort"), r)
        # run to its end: the id is the client's, the tokens those of a request without it
        code, r = self.d.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                       "request_id": "chat-1"})
        self.assertEqual((code, r["id"]), (200, "chatcmpl-chat-1"), r)
        self.assertEqual(self.d.complete(**pm.body(PROMPT, request_id="done-1"))["choices"][0]["token_ids"], self.ref)
        for bad in ("a b", "", 7, "x" * 129):
            code, j = self.d.post("/v1/completions", pm.body(PROMPT, request_id=bad))
            self.assertEqual((code, j["error"]["param"]), (400, "request_id"), (bad, j))
        self.assertEqual(settle(self.d)["state"], "serving")

    def test_block_of_another_abi_is_refused_by_name(self):
        """An fdrollout of control-block ABI 2 (before cmd_request_id): fdctl names the ABI, sends nothing."""
        port = free_port()
        path = f"/dev/shm/fdrollout.{port}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self.addCleanup(os.unlink, path)
        os.write(fd, struct.pack("<QII", 0x4243_4C4C_4F52_4446, 2, 33264) + bytes(33264 - 16))  # ABI 2's size
        os.close(fd)
        rc, out, err = fdctl(port, "--transport", "shm", "abort", "x")
        self.assertEqual(rc, 10, (out, err))
        self.assertIn("ABI version 2", err)
        with open(path, "rb") as f:
            self.assertEqual(f.read()[16:], bytes(33264 - 16))  # nothing was written into it


class FleetAbort(unittest.TestCase):
    """`fdctl --hosts A,B abort ID`: the host running ID aborts it, the other says not running here."""

    @classmethod
    def setUpClass(cls):
        cls.a = Daemon(env=pm.STEP_DELAY)
        cls.b = Daemon(env=pm.STEP_DELAY)
        cls.hosts = f"127.0.0.1:{cls.a.port},127.0.0.1:{cls.b.port}"

    @classmethod
    def tearDownClass(cls):
        cls.a.__exit__(None)
        cls.b.__exit__(None)

    def test_abort_finds_the_request_on_its_host(self):
        s = Stream(self.b.port, headers={"X-Request-Id": "fleet-r1"})
        rc, out, err = fdctl(0, "--hosts", self.hosts, "abort", "fleet-r1")
        self.assertEqual(rc, 0, (out, err))
        self.assertIn(f"127.0.0.1:{self.a.port}  abort: not running here", out)
        self.assertIn(f"127.0.0.1:{self.b.port}  abort: ok  aborted 1 choice(s)", out)
        self.assertEqual(s.finish()[0], "abort")

    def test_unknown_everywhere_is_not_found(self):
        rc, out, err = fdctl(0, "--hosts", self.hosts, "--json", "abort", "fleet-nobody")
        self.assertEqual(rc, 3, (out, err))
        self.assertEqual((json.loads(out)["aborted"], json.loads(out)["exit_code"]), (0, 3))

    def test_a_silent_host_is_a_partial_failure(self):
        s = Stream(self.a.port, headers={"X-Request-Id": "fleet-r2"})
        dead = f"127.0.0.1:{free_port()}"
        rc, out, err = fdctl(0, "--hosts", f"127.0.0.1:{self.a.port},{dead}", "abort", "fleet-r2")
        self.assertEqual(rc, 20, (out, err))  # aborted on A, but it might also run on the silent host
        self.assertIn("may still run there", err)
        self.assertEqual(s.finish()[0], "abort")

    def test_abort_all_on_every_host(self):
        sa, sb = Stream(self.a.port), Stream(self.b.port)
        rc, out, err = fdctl(0, "--hosts", self.hosts, "--json", "abort", "--all")
        self.assertEqual(rc, 0, (out, err))
        self.assertEqual([r["body"]["result"]["aborted"] for r in json.loads(out)["results"]], [1, 1])
        self.assertEqual((sa.finish()[0], sb.finish()[0]), ("abort", "abort"))


if __name__ == "__main__":
    unittest.main()
