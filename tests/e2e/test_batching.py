"""Continuous batching must not change results: 16 concurrent mixed requests (prompts, lengths,
streaming or not, greedy or seeded sampling) return exactly what each returns alone, logprobs
bitwise equal; prefix caching on and off give identical outputs and report cached tokens."""
import threading
import unittest

from fdtest import REF, Daemon, merge_stream

PROMPTS = [
    "Once upon a time", "Lily and Tom", "The little dog", "One day, a girl named Sue",
    "Tom had a red ball. He", "The sun was", "Mom said", "There was a big tree in the park and",
]


def requests_mix():
    reqs = []
    for i in range(16):
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8 + (i * 7) % 40, "logprobs": 2,
                "stream": i % 3 == 0, "ignore_eos": True}
        if i % 4 == 1:
            body.update(temperature=0.8, top_p=0.95, top_k=40, seed=100 + i)
        elif i % 4 == 3:
            body.update(temperature=1.2, seed=7, n=2)
        else:
            body.update(temperature=0)
        reqs.append(body)
    return reqs


def run(d, body):
    """Return [(token_ids, token_logprobs, text, finish)] per choice, streaming or not."""
    if body.get("stream"):
        chunks, done = d.stream(**{k: v for k, v in body.items() if k != "stream"})
        assert done
        merged = merge_stream(chunks)
        return [(m["token_ids"], m["token_logprobs"], m["text"], m["finish_reason"]) for _, m in sorted(merged.items())]
    j = d.complete(**body)
    return [(c["token_ids"], c["logprobs"]["token_logprobs"], c["text"], c["finish_reason"]) for c in j["choices"]]


class Batching(unittest.TestCase):
    def test_concurrent_requests_equal_each_alone(self):
        with Daemon("--max-num-seqs", "32") as d:
            reqs = requests_mix()
            alone = [run(d, r) for r in reqs]
            together = [None] * len(reqs)

            def worker(i):
                together[i] = run(d, reqs[i])

            for _ in range(2):  # two rounds: different interleavings
                threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
                for i in range(len(reqs)):
                    self.assertEqual(together[i], alone[i], f"request {i} differs when batched: {reqs[i]}")
            # sanity: the greedy reference survived batching
            self.assertEqual(alone[0][0][0], REF["Once upon a time"]["ids"][:8])
            status, h = d.get("/health")
            self.assertEqual(h["kv_blocks"]["used"], 0)

    def test_an_answered_request_is_off_the_books(self):
        # A client holding its answer finds /health past it: blocks freed, nothing running. (The
        # engine once pushed answers mid-step and freed at the step's end: under load 8-13 of 60
        # answers here found blocks still held.)
        with Daemon("--max-num-seqs", "8") as d:
            for i in range(60):
                d.complete(prompt=["Once upon a time", "Lily"], n=2, max_tokens=4 + i % 5, temperature=0.8, seed=i, ignore_eos=True)
                h = d.get("/health")[1]
                self.assertEqual((h["kv_blocks"]["used"], h["num_requests_running"]), (0, 0), f"after answer {i}")

    def test_preemption_by_recompute_keeps_outputs(self):
        # A pool of 6 blocks x 16 tokens cannot hold 4 sequences of 5 + 60 tokens at once.
        with Daemon("--kv-cache-bytes", str(6 * 20480), "--max-model-len", "80") as d:
            # n=4 admits all four choices in the same step, so they grow together and collide.
            j = d.complete(prompt="Once upon a time", max_tokens=60, temperature=0, n=4, logprobs=1)
            alone = d.complete(prompt="Once upon a time", max_tokens=60, temperature=0, logprobs=1)
            for c in j["choices"]:
                self.assertEqual(c["token_ids"], REF["Once upon a time"]["ids"])
                self.assertEqual(c["logprobs"], alone["choices"][0]["logprobs"])
            _, metrics = d.get("/metrics")
            pre = [l for l in metrics.splitlines() if l.startswith("fdrollout_preemptions_total ")][0]
            self.assertGreater(int(pre.split()[1]), 0)

    def test_prefix_caching_on_and_off_are_identical(self):
        long_prompt = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
                       "One day, she saw a big, red ball.")
        body = {"prompt": long_prompt, "max_tokens": 30, "temperature": 0, "logprobs": 3}
        with Daemon() as off, Daemon("--enable-prefix-caching") as on:
            a = off.complete(**body)
            b1 = on.complete(**body)
            b2 = on.complete(**body)
            n_prompt = len(a["choices"][0]["prompt_token_ids"])
            self.assertGreater(n_prompt, 33)
            self.assertEqual(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            self.assertEqual(b1["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            self.assertEqual(b2["usage"]["prompt_tokens_details"]["cached_tokens"], (n_prompt - 1) // 16 * 16)
            for x in (b1, b2):
                self.assertEqual(x["choices"][0]["token_ids"], a["choices"][0]["token_ids"])
                self.assertEqual(x["choices"][0]["logprobs"], a["choices"][0]["logprobs"])
            # A prompt sharing only the first block reuses exactly that block.
            other = long_prompt[:70] + " The end came soon and everyone was happy again."
            c_on = on.complete(prompt=other, max_tokens=10, temperature=0)
            c_off = off.complete(prompt=other, max_tokens=10, temperature=0)
            self.assertEqual(c_on["choices"][0]["token_ids"], c_off["choices"][0]["token_ids"])
            shared = 0
            for x, y in zip(c_on["choices"][0]["prompt_token_ids"], a["choices"][0]["prompt_token_ids"]):
                if x != y:
                    break
                shared += 1
            self.assertEqual(c_on["usage"]["prompt_tokens_details"]["cached_tokens"], shared // 16 * 16)
            _, metrics = on.get("/metrics")
            cached = [l for l in metrics.splitlines() if l.startswith('fdrollout_prompt_tokens_cached_total{model_name="stories260K"} ')][0]
            self.assertEqual(int(cached.split()[1]), (n_prompt - 1) // 16 * 16 + shared // 16 * 16)


if __name__ == "__main__":
    unittest.main()
