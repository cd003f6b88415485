"""Fleet update-weights exit codes in every partial-failure case (issue #29, defect 5).

README's fdctl table: 20 = not every host staged (or committed nothing), so nothing was
committed anywhere and every host keeps its old version; 21 = committed on some hosts only, or
versions differ afterwards; every host failing alike = that code. Before this issue a member that
was down before staging made the drop phase fail there too, and the update exited 21 though no
host had committed anything. Cases:
- one of three real daemons down (nothing listening) → 20; the two live ones keep version "0"
  with nothing staged; the message names every member's weight_version ("unreachable" for the
  dead one);
- a member that stages, then never answers its commit (stopped after its stage: a fake host that
  sleeps past --timeout) → 21, the message says who serves the new version and who may not;
- every member refuses its commit, nobody serves the new version → nothing committed: the
  refusals' shared code (4) when alike, 20 when they differ; the staged copies are dropped."""
import http.server
import json
import threading
import time
import unittest

from fdtest import Daemon, fdctl, free_port


class FakeHost(http.server.BaseHTTPRequestHandler):
    """Stages fine; commit answers `commit_status` (0: never answers within the test's --timeout);
    /health reports `health_version`; counts drops."""
    commit_status = 200
    health_version = "old"
    drops = None

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/v1/commit_weights":
            if self.commit_status == 0:
                time.sleep(9)  # past the caller's --timeout 2 (+ fdctl's 5 s answer grace): its fate is unknown
                return
            if self.commit_status != 200:
                etype = "wrong_state" if self.commit_status == 409 else "rank_failed"
                return self.answer(self.commit_status, {"status": "error", "error": {"type": etype, "message": "simulated"}})
        if self.path == "/v1/drop_staged_weights":
            self.drops.append(self.server.server_port)
        self.answer(200, {"status": "success", "result": {"is_paused": True, "version": "v3", "staged": True, "bytes": 0,
                                                          "dropped_version": None}})

    def do_GET(self):
        self.answer(200, {"state": "paused", "weight_version": self.health_version})

    def log_message(self, *args):
        pass


class FleetFaults(unittest.TestCase):
    def fake(self, commit_status, health_version, drops):
        handler = type("Fake", (FakeHost,), {"commit_status": commit_status, "health_version": health_version, "drops": drops})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        self.addCleanup(srv.server_close)
        self.addCleanup(srv.shutdown)
        return f"127.0.0.1:{srv.server_port}"

    def test_a_member_down_before_staging_exits_20(self):
        with Daemon("--dynamic-load-weight", extra=False) as a, Daemon("--dynamic-load-weight", extra=False) as b:
            dead = f"127.0.0.1:{free_port()}"
            hosts = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}", dead]
            for d in (a, b):
                self.assertEqual(d.post("/v1/pause")[0], 200)
            rc, out, err = fdctl(0, "--hosts", ",".join(hosts), "--timeout", "5", "--json", "update-weights", "--version", "b")
            self.assertEqual(rc, 20, (out, err))
            rep = json.loads(out)
            self.assertEqual([h["ok"] for h in rep["stage"]], [True, True, False])
            self.assertEqual(rep["stage"][2]["exit_code"], 8)
            self.assertNotIn("commit", rep)
            self.assertEqual(rep["weight_versions"], {f"http://{hosts[0]}": "0", f"http://{hosts[1]}": "0", f"http://{dead}": "unreachable"})
            self.assertIn("nothing was committed anywhere", rep["outcome"])
            for d in (a, b):  # the old version, nothing left staged
                h = d.get("/health")[1]
                self.assertEqual((h["weight_version"], h["staged_weight_version"]), ("0", None), h)
            # text mode: the same code, and the message names every member's version
            rc, out, err = fdctl(0, "--hosts", ",".join(hosts), "--timeout", "5", "update-weights", "--version", "b")
            self.assertEqual(rc, 20, (out, err))
            self.assertIn(f'"http://{dead}":"unreachable"', err)
            self.assertIn(f'"http://{hosts[0]}":"0"', err)

    def test_a_member_silent_on_commit_is_inconsistent_21(self):
        drops = []
        good, silent = self.fake(200, "v3", drops), self.fake(0, "old", drops)
        rc, out, err = fdctl(0, "--hosts", f"{good},{silent}", "--timeout", "2", "--json", "update-weights", "--version", "v3")
        self.assertEqual(rc, 21, (out, err))
        rep = json.loads(out)
        self.assertEqual([h["ok"] for h in rep["commit"]], [True, False])
        self.assertEqual(rep["commit"][1]["exit_code"], 7)
        self.assertIn(f"serving v3: http://{good}", rep["outcome"])
        self.assertIn(f"http://{silent} (old)", rep["outcome"])

    def test_commits_refused_everywhere_commit_nothing(self):
        for statuses, want in (((409, 409), 4), ((409, 503), 20)):
            with self.subTest(statuses=statuses):
                drops = []
                hosts = [self.fake(s, "old", drops) for s in statuses]
                rc, out, err = fdctl(0, "--hosts", ",".join(hosts), "--timeout", "5", "--json", "update-weights", "--version", "v3")
                self.assertEqual(rc, want, (out, err))
                rep = json.loads(out)
                self.assertIn("nothing was committed anywhere", rep["outcome"])
                self.assertEqual(sorted(drops), sorted(int(h.rsplit(":", 1)[1]) for h in hosts))  # staged copies dropped


if __name__ == "__main__":
    unittest.main(verbosity=2)
