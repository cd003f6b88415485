"""Weight streams from several threads on one shared fdrollout.Client (a probe): the client keeps
the transport of its last committed stream for the next one, and two streams could take the
same kept socket (the loser's close broke the winner's stream, with a bare ConnectionRefusedError
or OSError), and one's init replaced the transport of another's open update. One stream per
Client is open at a time now: a concurrent one is a clean FdRolloutError 409 at once (the daemon
holds one open update anyway), never another exception, and never breaks the open one; what
serves afterwards is a stream that reported success, bit for bit what a fresh daemon on those
weights serves."""
import os
import shutil
import sys
import tempfile
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import STORIES, Daemon, copy_checkpoint, fresh_daemon, greedy, rewrite_tensors  # noqa: E402
from fdrollout import Client, FdRolloutError  # noqa: E402
from fdrollout import safetensors_np  # noqa: E402

N_THREADS, N_STREAMS = 3, 4


class SharedClientStreams(unittest.TestCase):
    def test_threads_on_one_client(self):
        tmp = tempfile.mkdtemp(prefix="fd-stream-threads-")
        self.addCleanup(shutil.rmtree, tmp, True)
        base = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
        # Thread i streams base scaled by its own factor: what serves names the thread.
        weights = {i: {k: (v * np.float32(1 + 0.02 * (i + 1))).astype(np.float32) for k, v in base.items()}
                   for i in range(N_THREADS)}
        with Daemon("--dynamic-load-weight", model=copy_checkpoint(STORIES, os.path.join(tmp, "m"))) as d:
            c = Client(f"127.0.0.1:{d.port}", timeout=60)
            ok, refused, other = [], [], []
            lock = threading.Lock()

            def trainer(i):
                for k in range(N_STREAMS):
                    version = f"t{i}-{k}"
                    try:
                        with c.weight_stream(version, bucket_bytes=64 << 10) as ws:
                            for name in sorted(weights[i]):
                                ws.send(name, weights[i][name])
                        with lock:
                            ok.append(version)
                    except FdRolloutError as e:
                        with lock:
                            refused.append((version, e.status, e.type, e.message))
                    except Exception as e:  # noqa: BLE001 - the failure this test looks for
                        with lock:
                            other.append((version, repr(e)))

            threads = [threading.Thread(target=trainer, args=(i,)) for i in range(N_THREADS)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(600)
            self.assertEqual(other, [], "every failure is an FdRolloutError")
            self.assertTrue(ok, f"some stream committed; refused: {refused[:3]}")
            self.assertEqual(len(ok) + len(refused), N_THREADS * N_STREAMS)
            self.assertTrue(all(r[1:3] == (409, "wrong_state") for r in refused), refused)
            serving = c.weight_version()
            self.assertIn(serving, ok, "what serves is a stream that reported success")
            got = greedy(d)
            # The last success serves its thread's weights; the transport the client kept works.
            with c.weight_stream("after") as ws:
                for name in sorted(weights[0]):
                    ws.send(name, weights[0][name])
            self.assertEqual(c.weight_version(), "after")
            after = greedy(d)
        winner = int(serving[1:].split("-")[0])
        ref_dir = os.path.join(tmp, "ref")
        rewrite_tensors(copy_checkpoint(STORIES, ref_dir), lambda t: t.update(weights[winner]))
        with fresh_daemon(ref_dir) as ref:
            self.assertEqual(got[:2], greedy(ref)[:2], f"{serving} serves thread {winner}'s weights")
        if winner != 0:
            rewrite_tensors(ref_dir, lambda t: t.update(weights[0]))
            with fresh_daemon(ref_dir) as ref:
                self.assertEqual(after[:2], greedy(ref)[:2])
        else:
            self.assertEqual(after[:2], got[:2])


if __name__ == "__main__":
    unittest.main()
