"""Soak: 64 concurrent clients while 20 pause → update_weights → resume cycles alternate between
checkpoints A and B. No hang, no crash; every response is complete, aborted or 503 (a stream
submitted as a pause reached the engine gets its 503 in-band, its head being out); every
completed one equals what its reported weight_version produces."""
import http.client
import json
import os
import random
import shutil
import tempfile
import threading
import time
import unittest

from fdtest import STORIES, Daemon, copy_checkpoint, perturbed

PROMPTS = ["Once upon a time", "Lily and Tom", "The little dog", "Mom said"]
N_CLIENTS, N_CYCLES, MAX_TOKENS = 64, 20, 24


def one_request(port, prompt, stream):
    """(status, weight_version, token_ids, finish_reason) of one completion; 503s included."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode()
        if resp.status != 200:
            return resp.status, None, None, json.loads(text)["error"]["type"]
        if not stream:
            j = json.loads(text)
            return 200, j["weight_version"], j["choices"][0]["token_ids"], j["choices"][0]["finish_reason"]
        ids, finish, versions, done = [], None, set(), False
        for line in text.split("\n"):
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                c = json.loads(line[6:])
                if "error" in c:  # submitted as a pause reached the engine: the 503 of admission, in-band
                    assert c["error"]["code"] == 503 and not ids and text.rstrip().endswith("data: [DONE]"), text
                    return 503, None, None, c["error"]["type"]
                versions.add(c["weight_version"])
                ids += c["choices"][0]["token_ids"]
                finish = c["choices"][0]["finish_reason"] or finish
        assert done and len(versions) == 1, (done, versions)
        return 200, versions.pop(), ids, finish
    finally:
        conn.close()


class Soak(unittest.TestCase):
    def test_clients_during_update_cycles(self):
        tmp = tempfile.mkdtemp(prefix="fd-soak-")
        try:
            A = copy_checkpoint(STORIES, os.path.join(tmp, "A"))
            B = perturbed(STORIES, os.path.join(tmp, "B"), seed=5)
            src = copy_checkpoint(A, os.path.join(tmp, "src"))
            expected = {}
            with Daemon(model=B) as fb:
                expected["B"] = {p: fb.complete(prompt=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)["choices"][0]["token_ids"] for p in PROMPTS}
            with Daemon("--dynamic-load-weight", "--weight-version", "A-0", model=src) as d:
                expected["A"] = {p: d.complete(prompt=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)["choices"][0]["token_ids"] for p in PROMPTS}
                self.assertNotEqual(expected["A"], expected["B"])
                stop = threading.Event()
                results, errors = [], []

                def client(i):
                    rnd = random.Random(i)
                    while not stop.is_set():
                        p = rnd.choice(PROMPTS)
                        try:
                            results.append((p, *one_request(d.port, p, rnd.random() < 0.4)))
                            if results[-1][1] == 503:
                                time.sleep(0.01)  # a client backing off, as a real one would
                        except Exception as e:  # a hang (timeout) or a broken stream
                            errors.append(repr(e))

                threads = [threading.Thread(target=client, args=(i,)) for i in range(N_CLIENTS)]
                for t in threads:
                    t.start()
                for cycle in range(1, N_CYCLES + 1):
                    time.sleep(0.15)
                    fam = "B" if cycle % 2 else "A"
                    for path, body in [("/v1/pause", None), (None, None), ("/v1/update_weights", {"version": f"{fam}-{cycle}"}), ("/v1/resume", None)]:
                        if path is None:
                            copy_checkpoint(B if fam == "B" else A, src)
                            continue
                        status, j = d.post(path, body, timeout=60)
                        self.assertEqual(status, 200, (path, j))
                time.sleep(0.2)
                stop.set()
                for t in threads:
                    t.join(90)
                self.assertFalse(any(t.is_alive() for t in threads), "a client hung")
                self.assertEqual(errors, [])
                self.assertEqual(d.proc.poll(), None, "daemon died")
                counts = {"complete": 0, "abort": 0, "503": 0}
                for p, status, version, ids, finish in results:
                    if status == 503:
                        self.assertEqual(finish, "engine_paused")
                        counts["503"] += 1
                        continue
                    self.assertEqual(status, 200)
                    want = expected[version[0]][p]
                    if finish == "abort":
                        counts["abort"] += 1
                        self.assertEqual(ids, want[:len(ids)], (p, version))
                    else:
                        counts["complete"] += 1
                        self.assertEqual(finish, "length")
                        self.assertEqual(ids, want, (p, version))
                print("soak:", counts, "requests:", len(results))
                self.assertGreater(counts["complete"], N_CYCLES)
                self.assertGreater(counts["503"] + counts["abort"], 0)
                self.assertEqual(d.get("/health")[1]["weight_version"], f"A-{N_CYCLES}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
