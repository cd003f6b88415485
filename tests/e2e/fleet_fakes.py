"""A fake fleet member for the fleet tests (fdctl --fleet in test_fleet.py, fdrollout.Fleet in
tests/python/test_fleet.py): an HTTP server that stages fine and answers its commit and /health
as a test says, so every partial-failure case of a fleet update can be made on purpose."""
import http.server
import json
import threading
import time


class FakeMember(http.server.BaseHTTPRequestHandler):
    """Stages fine; its commit answers `commit_status` (409: wrong_state, other errors:
    rank_failed; 0: no answer for `commit_delay` s, then the connection closes, so the caller
    cannot know whether it committed); /health reports `health_version`; the paths of the POSTs
    go to `log`, the port of each drop to `drops` (lists, when set). `odd`: answers like a
    service that is not fdrollout (/health 200 with an empty body, every POST 200 {"result": {}})."""
    commit_status = 200
    odd = False
    health_version = "old"
    commit_delay = 9.0
    drops = None
    log = None

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.log is not None:
            self.log.append(self.path)
        if self.odd:
            return self.answer(200, {"result": {}})
        if self.path == "/v1/commit_weights" and self.commit_status != 200:
            if self.commit_status == 0:
                time.sleep(self.commit_delay)
                return
            etype = "wrong_state" if self.commit_status == 409 else "rank_failed"
            return self.answer(self.commit_status, {"status": "error", "error": {"type": etype, "message": "simulated"}})
        if self.path == "/v1/drop_staged_weights" and self.drops is not None:
            self.drops.append(self.server.server_port)
        self.answer(200, {"status": "success", "result": {"is_paused": True, "version": "v3", "staged": True, "bytes": 0,
                                                          "dropped_version": None}})

    def do_GET(self):
        if self.odd:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            return self.end_headers()
        self.answer(200, {"state": "paused", "weight_version": self.health_version, "is_paused": True, "staged_weight_version": None})

    def log_message(self, *args):
        pass


def serve_fake(tc, **attrs):
    """Start a FakeMember with `attrs` (commit_status, health_version, ...) for test case `tc`
    (stopped at its cleanup); returns its "127.0.0.1:port"."""
    handler = type("Fake", (FakeMember,), attrs)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    tc.addCleanup(srv.server_close)
    tc.addCleanup(srv.shutdown)
    return f"127.0.0.1:{srv.server_port}"
