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
    service that is not fdrollout (/health 200 with an empty body, every POST 200 {"result": {}}).
    `stage_status` / `drop_status` answer the stage (update_weights) / drop alike (0: no answer
    for `stage_delay` s; 409, 422, 504 answer that status's error type)."""
    commit_status = 200
    stage_status = 200
    drop_status = 200
    stage_delay = 9.0
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

    def fail(self, status, delay):
        """An error answer of `status` (0: none, the connection closes after `delay` s)."""
        if status == 0:
            time.sleep(delay)
            return
        etype = {409: "wrong_state", 422: "invalid_checkpoint", 504: "timeout"}.get(status, "rank_failed")
        self.answer(status, {"status": "error", "error": {"type": etype, "message": "simulated"}})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.log is not None:
            self.log.append(self.path)
        if self.odd:
            return self.answer(200, {"result": {}})
        if self.path == "/v1/commit_weights" and self.commit_status != 200:
            return self.fail(self.commit_status, self.commit_delay)
        if self.path == "/v1/update_weights" and self.stage_status != 200:
            return self.fail(self.stage_status, self.stage_delay)
        if self.path == "/v1/drop_staged_weights" and self.drops is not None:
            self.drops.append(self.server.server_port)
        if self.path == "/v1/drop_staged_weights" and self.drop_status != 200:
            return self.fail(self.drop_status, self.stage_delay)
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
