"""Weight-stream refusals that must not leave bytes or state behind (daemon/src/stream/, the
routes in daemon/src/api/stream_routes.cpp), driven over the documented wire protocol by hand as
a trainer that does not use fdrollout.Client would:

- a bucket refused before its bytes were read (no update open, an unknown update_info field, a
  malformed announcement) closes the transport: the trainer is already writing the bucket's
  frames, and they were read as the next bucket's (a probe: a 409'd bucket of the base weights was
  committed by the next update under its new label);
- /abort_weight_update while the finish commits is a 409 and changes nothing (a probe: it
  answered "serving weights unchanged", removed the staging dir the ranks read, the finish
  committed anyway, and a later wakeup served the --model weights under the committed label).
"""
import http.client
import json
import os
import socket
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from fdtest import STORIES, Daemon, StreamChecks, wait_until  # noqa: E402
from fdrollout import Client  # noqa: E402
from fdrollout.weight_stream import _bytes_of, _frame, _send_all  # noqa: E402


class RawTrainer:
    """The vLLM-style TCP transport by hand: init, connect, hello; buckets announced over HTTP and
    their frames written on the socket while the announcement is answered."""

    def __init__(self, port):
        self.port = port
        st, info = self.post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})
        assert st == 200, info
        self.sock = socket.create_connection(("127.0.0.1", info["port"]))
        self.sock.sendall(_frame({"token": info["token"]}))

    def post(self, path, body, timeout=60):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        try:
            r = c.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            c.close()

    def bucket(self, tensors, extra_info=None):
        """POST /update_weights announcing every tensor of `tensors` and write their frames at
        once (as a trainer does: its broadcast does not wait for the answer). Returns the answer."""
        names = sorted(tensors)
        ui = {"names": names, "dtype_names": ["F32"] * len(names), "shapes": [list(tensors[n].shape) for n in names], **(extra_info or {})}
        out = {}
        th = threading.Thread(target=lambda: out.update(r=self.post("/update_weights", {"update_info": ui})), daemon=True)
        th.start()
        views = []
        for n in names:
            a = tensors[n]
            views += [_frame({"name": n, "dtype": "F32", "shape": list(a.shape)}, a.nbytes), _bytes_of(a)]
        try:
            _send_all(self.sock, views)
        except OSError:
            pass  # the daemon closed the connection: the answer says why
        th.join(60)
        return out["r"]

    def close(self):
        self.sock.close()


class StreamRefusals(StreamChecks, unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.perturbed_stories("fd-refusals-")
        cls.d = Daemon("--dynamic-load-weight", "--control-timeout-s", "20", model=STORIES, extra=False)
        cls.c = Client(f"127.0.0.1:{cls.d.port}", timeout=20)

    def raw_update(self, t, version, tensors):
        st, j = t.post("/start_weight_update", {"version": version})
        self.assertEqual(st, 200, j)
        st, j = t.bucket(tensors)
        self.assertEqual(st, 200, j)
        st, j = t.post("/finish_weight_update", {})
        self.assertEqual(st, 200, j)
        return j

    def test_1_a_bucket_without_start_closes_the_connection(self):
        t = RawTrainer(self.d.port)
        try:
            self.raw_update(t, "pre", self.tensors)  # the transport stays open after a commit (init once)
            self.assert_serving(self.ref_new, "pre")
            st, j = t.bucket(self.base)  # no start: refused, while its frames are on the wire
            self.assertEqual(st, 409, j)
            self.assertIn("start_weight_update", j["error"]["message"])
            self.assertIn("connection was closed", j["error"]["message"])
            self.assertFalse(self.c.health()["weight_stream"]["connected"])
            # the next update on that connection cannot start: it must init again
            st, j = t.post("/start_weight_update", {"version": "post"})
            self.assertEqual(st, 409, j)
        finally:
            t.close()
        self.assert_serving(self.ref_new, "pre")
        t = RawTrainer(self.d.port)
        try:
            self.raw_update(t, "post", self.base)
        finally:
            t.close()
        self.assert_serving(self.ref_old, "post")  # the bytes sent for "post", not a refused bucket's

    def test_2_an_unknown_update_info_field_drops_and_closes(self):
        t = RawTrainer(self.d.port)
        try:
            st, j = t.post("/start_weight_update", {"version": "u1"})
            self.assertEqual(st, 200, j)
            st, j = t.bucket(self.base, {"packed_num_buffers": 2})  # vLLM's packed-transfer knob: not ours
            self.assertEqual(st, 400, j)
            self.assertIn("packed_num_buffers", j["error"]["message"])
            ws = self.c.health()["weight_stream"]
            self.assertEqual((ws["update_open"], ws["connected"]), (False, False), ws)
            st, j = t.post("/finish_weight_update", {})
            self.assertEqual(st, 400, j)  # the drop is what the finish answers: nothing applied
        finally:
            t.close()
        self.assertEqual(self.c.weight_version(), self.c.health()["weight_version"])
        self.assertEqual(self.stream("u2", self.tensors)["weight_version"], "u2")
        self.assert_serving(self.ref_new, "u2")


    def test_3_an_abort_stops_a_start_waiting_for_the_trainer(self):
        # /start_weight_update waits for the trainer to connect; its message says "connect the
        # trainer, or POST /abort_weight_update": the abort must end that wait, not answer that
        # nothing was open.
        st, info = self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})
        self.assertEqual(st, 200, info)
        out = {}
        th = threading.Thread(target=lambda: out.update(r=self.d.post("/start_weight_update", {"version": "w"},
                                                                      headers={"X-Request-Timeout": "30"})))
        th.start()
        wait_until(lambda: self.c.health()["weight_stream"]["state"] == "connecting", 30, "the start waiting for the trainer")
        t0 = time.monotonic()
        st, j = self.d.post("/abort_weight_update", {})
        self.assertEqual((st, j["message"]), (200, "Weight update aborted; serving weights unchanged"), j)
        th.join(30)
        self.assertLess(time.monotonic() - t0, 10)
        self.assertGreaterEqual(out["r"][0], 400, out)
        self.assertEqual(self.c.health()["weight_stream"]["state"], "idle")
        self.assertEqual(self.stream("after-abort", self.tensors)["weight_version"], "after-abort")


class AbortWhileFinishing(StreamChecks, unittest.TestCase):
    """Every control op stretched by 1.5 s (FD_DEBUG_CONTROL_DELAY_MS), so the finish's commit is
    in flight long enough to abort into it."""

    @classmethod
    def setUpClass(cls):
        cls.perturbed_stories("fd-abort-finish-", old_ref=False)
        cls.d = Daemon("--dynamic-load-weight", "--control-timeout-s", "30", model=STORIES, extra=False,
                       env={"FD_DEBUG_CONTROL_DELAY_MS": "1500"})
        cls.c = Client(f"127.0.0.1:{cls.d.port}", timeout=30)

    def test_abort_while_finishing_is_a_409_and_the_commit_stands(self):
        out = {}

        def trainer():
            try:
                with self.c.weight_stream("vA") as ws:
                    for name in sorted(self.tensors):
                        ws.send(name, self.tensors[name])
                out["r"] = ws.result
            except Exception as e:  # noqa: BLE001 - the assertion below names it
                out["e"] = e

        th = threading.Thread(target=trainer, daemon=True)
        th.start()
        wait_until(lambda: self.c.health()["weight_stream"]["state"] == "finishing", 30, "the finish sealed the update")
        st, j = self.d.post("/abort_weight_update", {})
        self.assertEqual(st, 409, j)
        self.assertIn("finishing", j["error"]["message"])
        th.join(60)
        self.assertEqual(out.get("r", {}).get("weight_version"), "vA", out)
        ws = self.c.health()["weight_stream"]
        self.assertEqual(ws["serving_stream_version"], "vA", ws)
        self.assert_serving(self.ref_new, "vA")
        self.c.sleep()  # the wakeup reloads the committed stream's dir: it was not removed
        self.c.wakeup()
        self.assert_serving(self.ref_new, "vA")
        # no update open: the abort says so
        st, j = self.d.post("/abort_weight_update", {})
        self.assertEqual(st, 200, j)
        self.assertIn("No weight update was open", j["message"])


if __name__ == "__main__":
    unittest.main()
