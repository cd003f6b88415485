"""Kept requests name the version their tokens came from on every ending (issue #29, defect 2).

Four greedy completions (three whole, one streamed) run with ignore_eos; `pause?mode=keep`
freezes them; `update_weights` moves the daemon to v2 (a perturbed checkpoint). Before this issue,
a kept request that then ended WITHOUT a token under v2 (abort_all, a plain pause, sleep, a
shutdown) was labelled "v2", though every token came from the old weights. Now each such choice
says weight_version == the old version, carries no weight_versions, and its tokens equal a fresh
daemon's on the old checkpoint (a prefix of its greedy output: the independent reference); the
stream's every chunk, the final one included, says the old version. A kept request that did
continue under v2 before it was aborted carries both spans and the label v2."""
import os
import shutil
import signal
import tempfile
import threading
import unittest

from fdtest import copy_checkpoint, Daemon, perturbed, STORIES, wait_until

PROMPTS = ["Once upon a time", "Lily and Tom", "The cat sat", "One day, a little"]
MAX_TOKENS = 300
STEP_DELAY = {"FD_DEBUG_STEP_DELAY_MS": "10"}


def body(prompt, **kw):
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}


class KeptVersions(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-keptver-")
        cls.old = copy_checkpoint(STORIES, os.path.join(cls.tmp, "old"))
        cls.new = perturbed(STORIES, os.path.join(cls.tmp, "new"), seed=5)
        with Daemon(model=cls.old, extra=False) as fresh:  # the reference: every prompt's full greedy run on the old weights
            cls.ref = [fresh.complete(**body(p))["choices"][0]["token_ids"] for p in PROMPTS]

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
                results[i] = d.stream(timeout=300, **body(PROMPTS[i]))
            else:
                results[i] = d.post("/v1/completions", body(PROMPTS[i]), timeout=300)

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
                self.assertLess(len(ids), MAX_TOKENS)
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


if __name__ == "__main__":
    unittest.main(verbosity=2)
