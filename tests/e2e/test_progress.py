"""Progress of a long operation: while an rsync pull runs (slowed with --bwlimit), /health
`progress` shows the transfer's bytes done / total, the total matching the version's bytes on
disk; fdctl on a terminal (a pty) draws a bar on stderr from it, and draws nothing with --quiet
or when stderr is not a terminal."""
import json
import os
import pty
import select
import shutil
import subprocess
import tempfile
import threading
import time
import unittest

from fdtest import FDCTL, STORIES, Daemon, fdctl

BWLIMIT_KIB = 400  # stories260K's 1.2 MB then take about 3 s


class Progress(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-progress-")
        cls.store = os.path.join(cls.tmp, "store")
        for v in ["1", "2"]:
            rc, out, err = fdctl(0, "publish", "--strategy", "rsync", "--from", STORIES, "--store", cls.store, "--version", v)
            assert rc == 0, err
        cls.version_bytes = sum(os.path.getsize(os.path.join(cls.store, "1", f)) for f in os.listdir(os.path.join(cls.store, "1")))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def daemon(self):
        cfg = {"source": self.store, "staging_dir": os.path.join(self.tmp, f"staging-{time.monotonic_ns()}"),
               "args": [f"--bwlimit={BWLIMIT_KIB}"],
               "link": False}  # copy, as from a remote store: a hard-linked local pull moves no bytes to watch
        return Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", json.dumps(cfg))

    def test_health_shows_the_transfer(self):
        with self.daemon() as d:
            self.assertIsNone(d.get("/health")[1]["progress"])
            self.assertEqual(d.post("/v1/pause")[0], 200)
            seen, stop = [], threading.Event()

            def poll():
                while not stop.is_set():
                    p = d.get("/health", timeout=5)[1]["progress"]
                    if p:
                        seen.append(p)
                    time.sleep(0.02)

            t = threading.Thread(target=poll)
            t.start()
            status, j = d.post("/v1/update_weights", {"version": "1"})
            stop.set()
            t.join()
            self.assertEqual(status, 200, j)
            transfer = [p for p in seen if p["phase"] == "transfer"]
            self.assertTrue(transfer, seen)
            self.assertTrue(all(p["op"] == "update_weights" for p in seen), seen)
            done = [p["bytes_done"] for p in transfer]
            self.assertEqual(done, sorted(done))  # never goes back
            totals = [p["bytes_total"] for p in transfer if p["bytes_total"]]
            self.assertTrue(totals, transfer)  # rsync printed a percentage while we watched
            for tot in totals:  # estimated from rsync's percentage: within 2 % of the files' bytes
                self.assertLess(abs(tot - self.version_bytes), 0.02 * self.version_bytes, (tot, self.version_bytes))
            self.assertTrue(all(p["bytes_done"] <= self.version_bytes for p in transfer))
            self.assertIsNone(d.get("/health")[1]["progress"])
            self.assertTrue(any(l.startswith("fdrollout_progress_total_bytes 0") for l in d.get("/metrics")[1].splitlines()))

    def run_on_pty(self, *args):
        """fdctl with stderr on a pseudo-terminal; returns (exit code, stdout, what the terminal got)."""
        master, slave = pty.openpty()
        p = subprocess.Popen([FDCTL, *args], stdout=subprocess.PIPE, stderr=slave, text=True)
        os.close(slave)
        term = b""
        while True:
            r, _, _ = select.select([master], [], [], 0.1)
            if r:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                term += chunk
            elif p.poll() is not None:
                break
        out = p.stdout.read()
        p.wait()
        os.close(master)
        return p.returncode, out, term.decode(errors="replace")

    def test_fdctl_draws_a_bar_on_a_terminal_only(self):
        with self.daemon() as d:
            port = str(d.port)
            for transport in ["v1", "shm"]:
                version = {"v1": "1", "shm": "2"}[transport]
                self.assertEqual(fdctl(d.port, "pause")[0], 0)
                rc, out, term = self.run_on_pty("--port", port, "--transport", transport, "update-weights", "--version", version)
                self.assertEqual(rc, 0, term)
                self.assertIn(f"weight_version {version}", out)
                self.assertIn("update_weights transfer", term)
                self.assertRegex(term, r"\[[#.]{20}\] +\d+%")
                self.assertTrue(term.endswith("\r\x1b[K"), repr(term[-40:]))  # the bar is erased at the end
            # --quiet on a terminal, and a pipe instead of a terminal: no bar
            self.assertEqual(fdctl(d.port, "resume")[0], 0)
            self.assertEqual(fdctl(d.port, "pause")[0], 0)
            rc, out, term = self.run_on_pty("--port", port, "--quiet", "update-weights", "--version", "1")
            self.assertEqual((rc, out, term), (0, "", ""))
            rc, out, err = fdctl(d.port, "update-weights", "--version", "2")
            self.assertEqual(rc, 0, err)
            self.assertNotIn("transfer", err)


if __name__ == "__main__":
    unittest.main()
