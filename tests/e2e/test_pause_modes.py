"""Pause modes abort | wait | keep with requests in flight, weight-version spans across an update
under keep, and aborting one request by id (issue #13); the version label of kept requests on every
ending (issue #29, KeptVersions). (`fdctl wait` on a fleet: test_fleet.py.)

The daemon runs with FD_DEBUG_STEP_DELAY_MS (a test-only stretch of every step) so requests are
still running when a pause arrives. References nobody here computed: an uninterrupted run on
the same daemon (keep without update: bitwise equal), and a fresh daemon started on the new
weights continuing the same token prefix (keep + update: the tokens after the switch)."""
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import unittest

from fdtest import copy_checkpoint, Daemon, fdctl, http_request, perturbed, STORIES, wait_until

PROMPTS = ["Once upon a time", "Lily and Tom", "The cat sat", "One day, a little"]
MAX_TOKENS = 150
STEP_DELAY = {"FD_DEBUG_STEP_DELAY_MS": "10"}


def body(prompt, **kw):
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 1, **kw}


class InFlight:
    """Completions posted from threads; .results[i] = (status, body) once each ends."""

    def __init__(self, d, bodies, headers=None):
        self.results = [None] * len(bodies)
        self.threads = [threading.Thread(target=self._run, args=(d, i, b, headers)) for i, b in enumerate(bodies)]
        for t in self.threads:
            t.start()

    def _run(self, d, i, b, headers):
        self.results[i] = d.post("/v1/completions", b, headers=headers, timeout=300)

    def join(self):
        for t in self.threads:
            t.join(300)
        return self.results


def wait_running(d, n, timeout=30):
    """Until /health counts n running choices that each have generated a token or more."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = d.get("/health")[1]
        if h["num_requests_running"] >= n:
            time.sleep(0.1)  # a few steps: every choice is decoding
            return
        time.sleep(0.01)
    raise TimeoutError(f"{n} requests never ran: {h}")


class PauseModes(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-pause-")
        cls.model = copy_checkpoint(STORIES, os.path.join(cls.tmp, "m"))
        cls.d = Daemon("--dynamic-load-weight", model=cls.model, env=STEP_DELAY)
        # the uninterrupted reference, on the same daemon
        cls.ref = [cls.d.complete(**body(p)) for p in PROMPTS]

    @classmethod
    def tearDownClass(cls):
        cls.d.__exit__(None)
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.d.post("/v1/resume")
        self.assertEqual(self.d.get("/health")[1]["state"], "serving")

    def test_abort_is_the_default(self):
        f = InFlight(self.d, [body(p) for p in PROMPTS])
        wait_running(self.d, len(PROMPTS))
        code, j = self.d.post("/v1/pause")
        self.assertEqual(code, 200, j)
        self.assertEqual((j["result"]["mode"], j["result"]["aborted"]), ("abort", len(PROMPTS)))
        for status, r in f.join():
            self.assertEqual(status, 200, r)
            self.assertEqual(r["choices"][0]["finish_reason"], "abort")
            self.assertLess(len(r["choices"][0]["token_ids"]), MAX_TOKENS)

    def test_wait_lets_every_request_finish(self):
        f = InFlight(self.d, [body(p) for p in PROMPTS])
        wait_running(self.d, len(PROMPTS))
        answer = {}
        t = threading.Thread(target=lambda: answer.update(r=self.d.post("/v1/pause?mode=wait", timeout=120)))
        t0 = time.time()
        t.start()
        # while draining: admission is closed (503) and the pause has not answered yet
        deadline = time.time() + 10
        while time.time() < deadline and self.d.get("/health")[1]["control_in_flight"] != "pause":
            time.sleep(0.005)
        code, j = self.d.post("/v1/completions", body("late"))
        self.assertEqual(code, 503, j)
        self.assertNotIn("r", answer)
        t.join(120)
        code, j = answer["r"]
        self.assertEqual(code, 200, j)
        self.assertEqual((j["result"]["mode"], j["result"]["drained"], j["result"]["is_paused"]), ("wait", len(PROMPTS), True))
        for (status, r), ref in zip(f.join(), self.ref):
            self.assertEqual(status, 200, r)
            c = r["choices"][0]
            self.assertEqual((c["finish_reason"], len(c["token_ids"])), ("length", MAX_TOKENS))
            self.assertEqual(c["token_ids"], ref["choices"][0]["token_ids"])
        h = self.d.get("/health")[1]
        self.assertEqual((h["state"], h["pause_mode"]), ("paused", "wait"))
        print(f"pause mode=wait answered after {time.time() - t0:.2f} s")

    def test_wait_past_its_deadline_changes_nothing(self):
        f = InFlight(self.d, [body(p) for p in PROMPTS])
        wait_running(self.d, len(PROMPTS))
        code, j = self.d.post("/v1/pause?mode=wait", headers={"X-Request-Timeout": "0.2"})
        self.assertEqual(code, 504, j)
        self.assertEqual(j["error"]["type"], "timeout")
        self.assertIn("nothing changed", j["error"]["message"])
        h = self.d.get("/health")[1]
        self.assertEqual((h["state"], h["is_paused"]), ("serving", False))
        self.assertEqual(self.d.post("/v1/completions", body("still open", max_tokens=2))[0], 200)  # admission reopened
        for status, r in f.join():
            self.assertEqual((status, r["choices"][0]["finish_reason"]), (200, "length"))

    def test_commands_during_a_drain_wait_their_turn_but_abort_ends_it(self):
        f = InFlight(self.d, [body(p) for p in PROMPTS[:2]], headers={"X-Request-Id": "drain-me"})
        wait_running(self.d, 2)
        done = []
        pause = threading.Thread(target=lambda: done.append(("pause", self.d.post("/v1/pause?mode=wait", timeout=120))))
        pause.start()
        while self.d.get("/health")[1]["control_in_flight"] != "pause":
            time.sleep(0.005)
        resume = threading.Thread(target=lambda: done.append(("resume", self.d.post("/v1/resume", timeout=120))))
        resume.start()
        time.sleep(0.2)
        self.assertEqual(done, [])  # the resume is held behind the drain
        code, j = self.d.post("/v1/abort", {"request_id": "drain-me"})  # runs at once, and ends the drain
        self.assertEqual((code, j["result"]["aborted"]), (200, 2), j)
        pause.join(60)
        resume.join(60)
        got = dict(done)  # (the client threads may record the two answers in either order)
        self.assertEqual((got["pause"][0], got["resume"][0]), (200, 200), got)
        # the abort ended both: aborted, not drained (a probe: they were counted as "ran to their end")
        res = got["pause"][1]["result"]
        self.assertEqual((res["is_paused"], res["drained"], res["aborted"]), (True, 0, 2))
        # the engine ran them in order: the resume came after the pause, so it serves again
        self.assertEqual(self.d.get("/health")[1]["state"], "serving")
        for status, r in f.join():
            self.assertEqual(r["choices"][0]["finish_reason"], "abort")

    def test_keep_then_resume_equals_an_uninterrupted_run(self):
        f = InFlight(self.d, [body(p) for p in PROMPTS])
        wait_running(self.d, len(PROMPTS))
        code, j = self.d.post("/v1/pause", {"mode": "keep"})  # the body form
        self.assertEqual(code, 200, j)
        self.assertEqual((j["result"]["mode"], j["result"]["kept"]), ("keep", len(PROMPTS)))
        h = self.d.get("/health")[1]
        self.assertEqual((h["state"], h["pause_mode"], h["kept_requests"]), ("paused", "keep", len(PROMPTS)))
        used = h["kv_blocks"]["used"]
        self.assertGreater(used, 0)  # frozen with their KV
        time.sleep(0.3)
        self.assertEqual(self.d.get("/health")[1]["kv_blocks"]["used"], used)  # nothing ran
        self.assertEqual(self.d.post("/v1/resume")[0], 200)
        for (status, r), ref in zip(f.join(), self.ref):
            self.assertEqual(status, 200, r)
            c, rc = r["choices"][0], ref["choices"][0]
            self.assertEqual(c["finish_reason"], "length")
            self.assertEqual(c["token_ids"], rc["token_ids"])
            self.assertEqual(c["logprobs"]["token_logprobs"], rc["logprobs"]["token_logprobs"])  # bitwise (same JSON floats)
            self.assertNotIn("weight_versions", c)  # one version: weight_version as before

    def test_sleep_while_kept_aborts_them(self):
        f = InFlight(self.d, [body(p) for p in PROMPTS[:2]])
        wait_running(self.d, 2)
        self.assertEqual(self.d.post("/v1/pause?mode=keep")[1]["result"]["kept"], 2)
        code, j = self.d.post("/v1/sleep?tags=kv_cache")
        self.assertEqual((code, j["result"]["aborted"]), (200, 2), j)
        for status, r in f.join():
            self.assertEqual(r["choices"][0]["finish_reason"], "abort")
        self.assertEqual(self.d.post("/v1/wakeup")[0], 200)

    def test_a_draining_pause_says_so(self):
        """While a pause mode=wait drains, /health's state is "pausing" (pause_draining true, not
        yet paused), /v1/is_paused and /metrics say so too, and a new request's 503 names the
        drain (a probe: state "serving", and a 503 telling to resume an engine not paused)."""
        f = InFlight(self.d, [body(p) for p in PROMPTS[:2]])
        wait_running(self.d, 2)
        answer = {}
        t = threading.Thread(target=lambda: answer.update(r=self.d.post("/v1/pause?mode=wait", timeout=120)))
        t.start()
        deadline = time.time() + 10
        while time.time() < deadline and self.d.get("/health")[1]["control_in_flight"] != "pause":
            time.sleep(0.005)
        h = self.d.get("/health")[1]
        self.assertEqual((h["state"], h.get("pause_draining"), h["is_paused"]), ("pausing", True, False), h)
        j = self.d.get("/v1/is_paused")[1]
        self.assertEqual((j["is_paused"], j.get("pause_draining")), (False, True), j)
        self.assertIn("\nfdrollout_pause_draining 1\n", self.d.get("/metrics")[1])
        code, j = self.d.post("/v1/completions", body("late"))
        self.assertEqual((code, j["error"]["type"]), (503, "engine_paused"), j)
        self.assertIn("a pause (mode=wait) is draining", j["error"]["message"])
        self.assertNotIn("r", answer)
        t.join(120)
        self.assertEqual(answer["r"][0], 200, answer)
        for status, r in f.join():
            self.assertEqual((status, r["choices"][0]["finish_reason"]), (200, "length"))
        h = self.d.get("/health")[1]
        self.assertEqual((h["state"], h["pause_draining"], h["is_paused"]), ("paused", False, True), h)
        self.assertIn("\nfdrollout_pause_draining 0\n", self.d.get("/metrics")[1])

    def test_wait_on_a_keep_pause_is_refused(self):
        """pause?mode=wait on an engine paused with mode=keep cannot let the kept requests finish:
        409 naming the mode, the kept count and the ways out (it was a 200 at once with them
        still frozen). The same mode again stays an idempotent 200."""
        f = InFlight(self.d, [body(p) for p in PROMPTS[:2]])
        wait_running(self.d, 2)
        self.assertEqual(self.d.post("/v1/pause?mode=keep")[0], 200)
        code, j = self.d.post("/v1/pause?mode=wait", timeout=30)
        self.assertEqual(code, 409, j)
        self.assertEqual(j["error"]["type"], "wrong_state", j)
        for says in ("mode=keep", "2 kept", "/v1/resume", "mode=abort"):
            self.assertIn(says, j["error"]["message"])
        h = self.d.get("/health")[1]
        self.assertEqual((h["state"], h["pause_mode"], h["kept_requests"]), ("paused", "keep", 2), h)
        self.assertEqual(self.d.post("/v1/pause?mode=keep")[1]["result"]["kept"], 2)  # the same mode: 200
        self.assertEqual(self.d.post("/v1/resume")[0], 200)
        for (status, r), ref in zip(f.join(), self.ref):
            self.assertEqual(r["choices"][0]["token_ids"], ref["choices"][0]["token_ids"])
        for _ in range(2):  # wait on a wait pause: 200, nothing changes
            code, j = self.d.post("/v1/pause?mode=wait")
            self.assertEqual((code, j["result"]["mode"], j["result"]["is_paused"]), (200, "wait", True), j)

    def test_abort_one_request_by_id(self):
        f = InFlight(self.d, [body(p) for p in PROMPTS[:2]], headers={"X-Request-Id": "rollout-7"})
        g = InFlight(self.d, [body(PROMPTS[2])])
        wait_running(self.d, 3)
        code, j = self.d.post("/v1/abort", {"request_id": "rollout-7"})  # both requests carry it
        self.assertEqual((code, j["result"]["aborted"]), (200, 2), j)
        for status, r in f.join():
            self.assertEqual((status, r["choices"][0]["finish_reason"]), (200, "abort"))
            self.assertLess(len(r["choices"][0]["token_ids"]), MAX_TOKENS)
        status, r = g.join()[0]
        self.assertEqual(r["choices"][0]["finish_reason"], "length")  # the other one ran on
        self.assertEqual(r["choices"][0]["token_ids"], self.ref[2]["choices"][0]["token_ids"])
        code, j = self.d.post("/v1/abort", {"request_id": r["id"]})  # finished: forgotten
        self.assertEqual((code, j["error"]["type"]), (404, "not_found"), j)
        self.assertEqual(self.d.post("/v1/abort", {"request_id": "a b"})[0], 400)
        self.assertEqual(self.d.post("/v1/abort", {})[0], 400)
        self.assertEqual(self.d.get("/health")[1]["kv_blocks"]["used"], 0)  # their KV is freed

    def test_abort_by_completion_id_while_streaming(self):
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", self.d.port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({**body(PROMPTS[0]), "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = json.loads(resp.readline().decode()[len("data: "):])
        code, j = http_request(self.d.port, "POST", "/abort_request", {"rid": first["id"]})  # SGLang's alias
        self.assertEqual((code, j), (200, ""))
        rest = resp.read().decode()
        conn.close()
        finals = [json.loads(l[6:]) for l in rest.split("\n") if l.startswith("data: {")]
        self.assertEqual(finals[-1]["choices"][0]["finish_reason"], "abort")
        self.assertTrue(rest.rstrip().endswith("data: [DONE]"))
        # an unknown (or finished) rid: SGLang's empty 200 (http_server.py abort_request ignores it)
        self.assertEqual(http_request(self.d.port, "POST", "/abort_request", {"rid": "nope"}), (200, ""))

    def test_shm_mailbox_carries_the_mode(self):
        f = InFlight(self.d, [body(p) for p in PROMPTS[:2]])
        wait_running(self.d, 2)
        rc, out, err = fdctl(self.d.port, "--transport", "shm", "--json", "pause", "--mode", "keep")
        self.assertEqual(rc, 0, err)
        self.assertEqual((json.loads(out)["result"]["mode"], json.loads(out)["result"]["kept"]), ("keep", 2))
        rc, out, err = fdctl(self.d.port, "--transport", "shm", "pause", "--mode", "bogus")
        self.assertEqual(rc, 2, err)  # usage: nothing sent
        rc, out, err = fdctl(self.d.port, "--transport", "shm", "resume")
        self.assertEqual(rc, 0, err)
        for (status, r), ref in zip(f.join(), self.ref):
            self.assertEqual(r["choices"][0]["token_ids"], ref["choices"][0]["token_ids"])


class KeepAcrossUpdate(unittest.TestCase):
    """keep + update_weights: every kept choice reports its version spans, and the tokens after
    the switch are what a fresh daemon on the new weights generates from the same prefix."""

    def test_spans_and_no_stale_kv(self):
        tmp = tempfile.mkdtemp(prefix="fd-keep-")
        try:
            model = copy_checkpoint(STORIES, os.path.join(tmp, "m"))
            new = perturbed(STORIES, os.path.join(tmp, "new"), seed=5)
            with Daemon("--dynamic-load-weight", model=model, env=STEP_DELAY) as d:
                v0 = d.get("/health")[1]["weight_version"]
                f = InFlight(d, [body(p) for p in PROMPTS[:3]])
                stream = {}
                t = threading.Thread(target=lambda: stream.update(r=d.stream(**body(PROMPTS[3]))))
                t.start()
                wait_running(d, 4)
                self.assertEqual(d.post("/v1/pause?mode=keep")[1]["result"]["kept"], 4)
                copy_checkpoint(new, model)  # the trainer writes new weights
                code, j = d.post("/v1/update_weights", {"version": "v2"})
                self.assertEqual(code, 200, j)
                self.assertEqual(d.get("/health")[1]["kept_requests"], 4)
                self.assertEqual(d.post("/v1/resume")[0], 200)
                results = [r for _, r in f.join()]
                t.join(300)
                chunks, done = stream["r"]
                self.assertTrue(done)
            choices = [(PROMPTS[i], r["choices"][0]) for i, r in enumerate(results)]
            final = [c for ch in chunks for c in ch.get("choices", []) if c.get("finish_reason")]
            self.assertEqual(len(final), 1)
            self.assertIn("weight_versions", final[0])  # streamed on the finishing chunk
            ids = [i for ch in chunks for c in ch.get("choices", []) for i in c["token_ids"]]
            first = next(c for ch in chunks for c in ch.get("choices", []) if "prompt_token_ids" in c)
            choices.append((PROMPTS[3], {"token_ids": ids, "weight_versions": final[0]["weight_versions"],
                                         "prompt_token_ids": first["prompt_token_ids"], "finish_reason": final[0]["finish_reason"]}))
            with Daemon(model=new) as fresh:
                for prompt, c in choices:
                    with self.subTest(prompt=prompt):
                        self.assertEqual((c["finish_reason"], len(c["token_ids"])), ("length", MAX_TOKENS))
                        spans = c["weight_versions"]
                        self.assertEqual([s["version"] for s in spans], [v0, "v2"], spans)
                        k = spans[1]["first_token"]
                        self.assertEqual((spans[0]["first_token"], spans[0]["last_token"], spans[1]["last_token"]), (0, k - 1, MAX_TOKENS - 1))
                        self.assertGreater(k, 0)
                        want = fresh.complete(prompt=c["prompt_token_ids"] + c["token_ids"][:k], max_tokens=MAX_TOKENS - k,
                                              temperature=0, ignore_eos=True)
                        self.assertEqual(c["token_ids"][k:], want["choices"][0]["token_ids"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_prompt_logprobs_of_a_prefill_cut_by_the_update_are_all_the_new_weights(self):
        """A probe: keep + update in the middle of a chunked prefill gave prompt_logprobs whose
        first rows were the old weights' and the rest the new weights', under the new label with
        no span saying so. The prompt is scored again with the new weights: every row equals a
        fresh daemon's on them."""
        tmp = tempfile.mkdtemp(prefix="fd-keep-plp-")
        try:
            model = copy_checkpoint(STORIES, os.path.join(tmp, "m"))
            new = perturbed(STORIES, os.path.join(tmp, "new"), seed=5)
            prompt = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park with her "
                      "friends and her dog every day")
            req = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 0, "logprobs": 0}
            with Daemon("--dynamic-load-weight", "--max-num-batched-tokens", "4", model=model, env={"FD_DEBUG_STEP_DELAY_MS": "150"}) as d:
                out = {}
                t = threading.Thread(target=lambda: out.update(j=d.complete(**req)))
                t.start()
                wait_running(d, 1)
                time.sleep(0.8)  # a few 4-token chunks of the prompt are scored
                self.assertEqual(d.post("/v1/pause?mode=keep")[1]["result"]["kept"], 1)
                copy_checkpoint(new, model)
                self.assertEqual(d.post("/v1/update_weights", {"version": "v2"})[0], 200)
                self.assertEqual(d.post("/v1/resume")[0], 200)
                t.join(120)
            got = out["j"]
            self.assertEqual(got["weight_version"], "v2")
            with Daemon("--max-num-batched-tokens", "4", model=new) as fresh:
                want = fresh.complete(**req)
            self.assertEqual(got["choices"][0]["token_ids"], want["choices"][0]["token_ids"])
            self.assertEqual(got["choices"][0]["prompt_logprobs"], want["choices"][0]["prompt_logprobs"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


KEPT_MAX_TOKENS = 300


def kept_body(prompt, **kw):
    return {"prompt": prompt, "max_tokens": KEPT_MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}


class KeptVersions(unittest.TestCase):
    """Kept requests name the version their tokens came from on every ending (issue #29, defect 2).
    
    Four greedy completions (three whole, one streamed) run with ignore_eos; `pause?mode=keep`
    freezes them; `update_weights` moves the daemon to v2 (a perturbed checkpoint). Before this issue,
    a kept request that then ended WITHOUT a token under v2 (abort_all, a plain pause, sleep, a
    shutdown) was labelled "v2", though every token came from the old weights. Now each such choice
    says weight_version == the old version, carries no weight_versions, and its tokens equal a fresh
    daemon's on the old checkpoint (a prefix of its greedy output: the independent reference); the
    stream's every chunk, the final one included, says the old version. A kept request that did
    continue under v2 before it was aborted carries both spans and the label v2."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-keptver-")
        cls.old = copy_checkpoint(STORIES, os.path.join(cls.tmp, "old"))
        cls.new = perturbed(STORIES, os.path.join(cls.tmp, "new"), seed=5)
        with Daemon(model=cls.old, extra=False) as fresh:  # the reference: every prompt's full greedy run on the old weights
            cls.ref = [fresh.complete(**kept_body(p))["choices"][0]["token_ids"] for p in PROMPTS]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def kept_then_updated(self, name, *args):
        """A daemon with the four requests kept across an update to v2; returns (d, v0, collect)."""
        model = copy_checkpoint(self.old, os.path.join(self.tmp, name))
        d = Daemon("--dynamic-load-weight", *args, model=model, env=STEP_DELAY)
        self.addCleanup(d.__exit__)
        v0 = d.get("/health")[1]["weight_version"]
        results = [None] * len(PROMPTS)

        def run(i):
            if i == 3:
                results[i] = d.stream(timeout=300, **kept_body(PROMPTS[i]))
            else:
                results[i] = d.post("/v1/completions", kept_body(PROMPTS[i]), timeout=300)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        wait_until(lambda: d.get("/health")[1]["num_requests_running"] >= 4, 30, "4 requests decoding")
        start = generated_tokens(d)
        wait_until(lambda: generated_tokens(d) >= start + 4 * 5, 30, "a few steps: every choice has tokens")
        self.assertEqual(d.post("/v1/pause?mode=keep")[1]["result"]["kept"], 4)
        copy_checkpoint(self.new, model)
        status, j = d.post("/v1/update_weights", {"version": "v2"})
        self.assertEqual(status, 200, j)

        def collect():
            for t in threads:
                t.join(300)
            out = []
            for i, r in enumerate(results[:3]):
                status, j = r
                self.assertEqual(status, 200, j)
                c = j["choices"][0]
                out.append((j["weight_version"], c.get("weight_versions"), c["token_ids"], c["finish_reason"], None))
            chunks, done = results[3]
            self.assertTrue(done)
            labelled = [ch for ch in chunks if ch.get("choices")]
            final = [c for ch in labelled for c in ch["choices"] if c.get("finish_reason")]
            self.assertEqual(len(final), 1)
            ids = [i for ch in labelled for c in ch["choices"] for i in c["token_ids"]]
            out.append((labelled[-1]["weight_version"], final[0].get("weight_versions"), ids, final[0]["finish_reason"],
                        {ch["weight_version"] for ch in labelled}))
            return out

        return d, v0, collect

    def assert_old_only(self, v0, out):
        for i, (label, spans, ids, finish, stream_labels) in enumerate(out):
            with self.subTest(choice=i):
                self.assertEqual(finish, "abort")
                self.assertEqual((label, spans), (v0, None))
                if stream_labels is not None:
                    self.assertEqual(stream_labels, {v0})  # every chunk, the final one included
                self.assertGreater(len(ids), 0)
                self.assertLess(len(ids), KEPT_MAX_TOKENS)
                self.assertEqual(ids, self.ref[i][:len(ids)])  # every token from the old weights

    def test_kept_requests_ended_without_a_new_token_keep_the_old_label(self):
        endings = {
            "abort_all": lambda d: d.post("/v1/abort", {"abort_all": True}),
            "pause": lambda d: d.post("/v1/pause"),
            "sleep": lambda d: d.post("/v1/sleep"),
            "shutdown": lambda d: d.stop(signal.SIGTERM),
        }
        for name, end in endings.items():
            with self.subTest(ending=name):
                d, v0, collect = self.kept_then_updated(f"m-{name}", "--shutdown-grace-s", "1")
                r = end(d)
                if name != "shutdown":
                    self.assertEqual(r[0], 200, r)
                self.assert_old_only(v0, collect())

    def test_kept_requests_continued_under_the_new_version_carry_both_spans(self):
        d, v0, collect = self.kept_then_updated("m-continued")
        before = generated_tokens(d)
        self.assertEqual(d.post("/v1/resume")[0], 200)
        # a few tokens under v2 (after the recompute), then abort everything
        wait_until(lambda: generated_tokens(d) >= before + 4 * 3, 30, "tokens under v2")
        self.assertEqual(d.post("/v1/abort", {"abort_all": True})[0], 200)
        for i, (label, spans, ids, finish, stream_labels) in enumerate(collect()):
            with self.subTest(choice=i):
                self.assertEqual(finish, "abort")
                self.assertEqual(label, "v2")
                self.assertEqual([s["version"] for s in spans], [v0, "v2"], spans)
                k = spans[1]["first_token"]
                self.assertEqual((spans[0]["first_token"], spans[0]["last_token"], spans[1]["last_token"]), (0, k - 1, len(ids) - 1))
                self.assertEqual(ids[:k], self.ref[i][:k])  # the old span: the old weights' tokens


def generated_tokens(d):
    """fdrollout_generation_tokens_total from /metrics."""
    status, text = d.get("/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("fdrollout_generation_tokens_total"))


class BehindAPause(unittest.TestCase):
    def test_a_request_submitted_behind_a_pause_gets_503_not_an_empty_abort(self):
        """A request that passes admission while a pause (or sleep) is on its way to the engine
        thread reaches the engine behind it: it gets the 503 admission gives a moment later. A
        probe saw it come back 200 with finish_reason "abort" and no tokens (empty rollouts while
        weight streams committed). FD_DEBUG_CONTROL_DELAY_MS holds the command in the engine
        before it acts, with admission still open."""
        with Daemon("--dynamic-load-weight", env={"FD_DEBUG_CONTROL_DELAY_MS": "3000"}) as d:
            ref = d.complete(**body(PROMPTS[0], max_tokens=4))["choices"][0]["token_ids"]
            for path in ("/v1/pause?mode=abort", "/v1/pause?mode=wait", "/v1/sleep"):
                with self.subTest(path):
                    ctl = threading.Thread(target=d.post, args=(path,))
                    ctl.start()
                    wait_until(lambda: d.get("/health")[1]["control_in_flight"] in ("pause", "sleep"), 30, "the command in the engine")
                    streamed = []
                    s = threading.Thread(target=lambda: streamed.append(d.stream(**body(PROMPTS[1], max_tokens=4))))
                    s.start()
                    time.sleep(0.3)  # the stream is submitted too, inside the command's 3 s hold
                    status, j = d.post("/v1/completions", body(PROMPTS[0], max_tokens=4))
                    s.join()
                    ctl.join()
                    self.assertEqual((status, j["error"]["type"]), (503, "engine_paused"), j)
                    chunks, done = streamed[0]
                    self.assertTrue(done, chunks)
                    self.assertEqual([c["error"]["type"] for c in chunks], ["engine_paused"], chunks)
                    self.assertEqual(d.post("/v1/wakeup" if path == "/v1/sleep" else "/v1/resume")[0], 200)
                    self.assertEqual(d.complete(**body(PROMPTS[0], max_tokens=4))["choices"][0]["token_ids"], ref)


if __name__ == "__main__":
    unittest.main()
