"""Client.weight_stream (python/fdrollout/weight_stream.py) against the real daemon at tp=1 and
tp=2: a stream's weights serve exactly as a fresh daemon started on the same weights (written to
a checkpoint with safetensors_np); bad input is a 4xx naming the tensor and changes nothing; a
trainer killed mid-send or gone silent leaves the old version serving and the next stream works.
"""
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

from fdtest import PYTHON, STORIES, Daemon, StreamChecks, device_args, free_port, greedy, kill_when_sent, perturbed, stop_process, wait_until  # noqa: E402
from fdrollout import Client, FdRolloutError  # noqa: E402
from fdrollout import safetensors_np  # noqa: E402
from fdrollout.weight_stream import _frame, _send_all  # noqa: E402

# The killed trainer (modes mid, between, unannounced): tests/python/killed_trainer.py.
KILLED_TRAINER = os.path.join(HERE, "killed_trainer.py")


def stream_dirs(port, kind=""):
    """The daemon's staging dirs on `port`: kind "" the live ones, "-spare" the recycled stream's."""
    pat = f"fdrollout-stream{kind}.{port}.*"
    return sorted(glob.glob(os.path.join("/dev/shm", pat))) + sorted(glob.glob(os.path.join(tempfile.gettempdir(), pat)))


class GatheredSend(unittest.TestCase):
    """weight_stream._send_all: a bucket's frames and payloads in few sendmsg calls arrive whole
    and in order, whatever each call manages to send (the kernel may take any prefix)."""

    class ShortSocket:
        def __init__(self, most):
            self.most, self.got, self.calls = most, bytearray(), 0

        def sendmsg(self, views):
            self.calls += 1
            n = 0
            for v in views:  # take at most `most` bytes, possibly ending inside a buffer
                k = min(len(v), self.most - n)
                self.got += bytes(v[:k])
                n += k
                if n == self.most:
                    break
            return n

    def test_every_byte_in_order_at_any_short_send(self):
        rng = np.random.default_rng(3)
        parts = [_frame({"name": "w", "dtype": "F32", "shape": [5]}, 20), rng.standard_normal(5).astype(np.float32),
                 b"", np.arange(7, dtype=np.int32), rng.integers(0, 255, 1000, dtype=np.uint8)]
        want = b"".join(p if isinstance(p, bytes) else p.tobytes() for p in parts)
        views = [p if isinstance(p, bytes) else memoryview(p.reshape(-1).view(np.uint8)) for p in parts]
        for most in (1, 3, 7, 20, 64, 4096):
            sock = self.ShortSocket(most)
            _send_all(sock, list(views), iov_max=2)
            self.assertEqual(bytes(sock.got), want, f"at most {most} bytes a call")
        self.assertEqual(self.ShortSocket(1 << 20).calls, 0)
        sock = self.ShortSocket(1 << 20)
        _send_all(sock, list(views), iov_max=512)
        self.assertEqual(sock.calls, 1)  # everything in one call when the kernel takes it all


class StaleDirs(unittest.TestCase):
    """A daemon that was killed leaves its staging dirs (fdrollout-stream.<port>.<pid>.<n>), a
    replaced dir still being removed (fdrollout-stream-retired.<port>.<pid>.<n>) and the spare
    (fdrollout-stream-spare.<port>.<pid>.<n>) behind: the next daemon on that port removes every
    kind of a dead pid at start, and nothing of a live pid's."""

    def test_dead_daemons_dirs_are_removed_at_start(self):
        root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        port = free_port()
        dead = subprocess.Popen(["true"])
        dead.wait()
        made = {}
        kinds = ("stream", "stream-retired", "stream-spare")
        for kind, pid in [(k, p) for k in kinds for p in (dead.pid, os.getpid())]:
            d = os.path.join(root, f"fdrollout-{kind}.{port}.{pid}.7")
            os.makedirs(d, mode=0o700)
            with open(os.path.join(d, "bucket-00001.safetensors"), "wb") as f:
                f.write(b"x" * 4096)
            made[(kind, pid)] = d
        try:
            with Daemon("--dynamic-load-weight", port=port, extra=False):
                for (kind, pid), d in made.items():
                    self.assertEqual(os.path.isdir(d), pid != dead.pid, f"{d}: removed only when its pid is gone")
        finally:
            for d in made.values():
                shutil.rmtree(d, ignore_errors=True)


class SquattedNames(unittest.TestCase):
    """Another local user who creates the staging dir names a daemon would take next
    (fdrollout-stream.<port>.<pid>.<n>, n = 0..99) no longer blocks every stream: a probe got
    500 "no free staging dir name" until root removed them. The names end in mkdtemp's random
    suffix now."""

    def test_a_stream_commits_past_squatted_names(self):
        root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        tensors = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
        with Daemon("--dynamic-load-weight", model=STORIES, extra=False) as d:
            squat = [os.path.join(root, f"fdrollout-stream.{d.port}.{d.proc.pid}.{n}") for n in range(100)]
            try:
                for p in squat:
                    os.mkdir(p, 0o700)
                c = Client(f"127.0.0.1:{d.port}", timeout=20)
                with c.weight_stream("q1") as ws:
                    for name in sorted(tensors):
                        ws.send(name, tensors[name])
                self.assertEqual(c.weight_version(), "q1")
            finally:
                for p in squat:
                    shutil.rmtree(p, ignore_errors=True)


class NoRecycling(unittest.TestCase):
    """FD_STREAM_RECYCLE_STAGING=0: a full commit removes the dir it replaced (no spare, no
    recycled pages); the streams serve as with recycling."""

    def test_no_spare_is_kept(self):
        tmp = tempfile.mkdtemp(prefix="fd-pystream-")
        try:
            new = os.path.join(tmp, "new")
            perturbed(STORIES, new)
            tensors = safetensors_np.load_file(os.path.join(new, "model.safetensors"))
            with Daemon("--dynamic-load-weight", model=STORIES, extra=False, env={"FD_STREAM_RECYCLE_STAGING": "0"}) as d:
                c = Client(f"127.0.0.1:{d.port}", timeout=20)
                for v in ("n1", "n2", "n3"):
                    with c.weight_stream(v) as ws:
                        for name in sorted(tensors):
                            ws.send(name, tensors[name])
                        ws.flush()
                        self.assertEqual(c.health()["weight_stream"]["recycled_bytes"], 0)
                    wait_until(lambda: len(stream_dirs(d.port)) == 1, 10, "the replaced dir removed")
                    self.assertEqual((stream_dirs(d.port, "-spare"), c.health()["weight_stream"]["spare_bytes"]), ([], 0))
                self.assertEqual(c.weight_version(), "n3")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class StreamTp1(StreamChecks, unittest.TestCase):
    TP_ARGS = device_args()  # FD_TEST_DAEMON_ARGS's --device (scripts/gpu_check.sh's extra runs: cuda)
    ENV = {"FD_STREAM_STAGE_AHEAD": "0"}  # the ranks stage at the finish (StreamAheadTp2: bucket by bucket)

    @classmethod
    def setUpClass(cls):
        # The references: fresh daemons at the same tensor-parallel size on the same weights.
        cls.perturbed_stories("fd-pystream-", *cls.TP_ARGS)
        cls.d = Daemon("--dynamic-load-weight", "--control-timeout-s", "20", *cls.TP_ARGS, model=STORIES, extra=False, env=cls.ENV)
        cls.c = Client(f"127.0.0.1:{cls.d.port}", timeout=20)

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)
        left = stream_dirs(cls.d.port) + stream_dirs(cls.d.port, "-spare")
        assert not left, f"the daemon left staging dirs: {left}"

    def test_1_stream_commits_and_equals_a_fresh_daemon(self):
        r = self.stream("s1", self.tensors)
        self.assertEqual(r["weight_version"], "s1")
        self.assertEqual(r["n_tensors"], len(self.tensors))
        self.assertEqual(r["bytes"], sum(a.nbytes for a in self.tensors.values()))
        self.assert_serving(self.ref_new, "s1")
        self.assertEqual(len(stream_dirs(self.d.port)), 1, "the serving stream's dir is kept for wakeup")
        # sleep / wakeup reloads the streamed weights (from the kept dir), same label
        self.c.sleep()
        self.c.wakeup()
        self.assert_serving(self.ref_new, "s1")
        # the next stream replaces it (and its dir)
        r = self.stream("s2", self.base, bucket_bytes=1 << 14)
        self.assertEqual(r["weight_version"], "s2")
        self.assert_serving(self.ref_old, "s2")
        self.assertEqual(len(stream_dirs(self.d.port)), 1)

    def test_2_bad_input_is_a_4xx_naming_it_and_changes_nothing(self):
        self.stream("good", self.base)
        name = "model.layers.0.mlp.down_proj.weight"
        self.bad(422, "invalid_checkpoint", ["model.layers.9.nothing"], {**self.tensors, "model.layers.9.nothing": np.zeros(3, np.float32)})
        self.bad(422, "invalid_checkpoint", [name, "shape"], {**self.tensors, name: np.zeros((2, 2), np.float32)})
        nan = self.tensors[name].copy()
        nan[1, 2] = np.nan
        e = self.bad(422, "invalid_checkpoint", [name, "non-finite"], {**self.tensors, name: nan})
        self.assertIn("(NaN or Inf) at element 174", e.message)  # row 1, column 2 of [64, 172], found as it arrived
        missing = dict(self.tensors)
        del missing[name]
        # refused at the seal, before any rank loads the dir (the loader would refuse it too, later)
        self.bad(422, "invalid_checkpoint", [name, "the update is missing 1 tensor(s)"], missing)
        # an explicit dtype unlike the model's (F32): the bytes are not reinterpreted
        with self.assertRaises(FdRolloutError) as e:
            with self.c.weight_stream("bad") as ws:
                ws.send(name, self.tensors[name].astype(np.float16), dtype="F16")
        self.assertEqual(e.exception.status, 422)
        self.assertIn("dtype F16", e.exception.message)
        # a duplicate across buckets
        with self.assertRaises(FdRolloutError) as e:
            with self.c.weight_stream("bad", bucket_bytes=1) as ws:
                ws.send(name, self.tensors[name])
                ws.send(name, self.tensors[name])
        self.assertEqual((e.exception.status, e.exception.type), (400, "invalid_argument"))
        self.assertIn(f"'{name}' was sent twice", e.exception.message)
        self.assert_serving(self.ref_old, "good")
        self.assertEqual(len(stream_dirs(self.d.port)), 1, "no staging dir of a failed stream survives")

    def test_3_protocol_order(self):
        # the finish of a failed stream answers its failure, as a 4xx naming it
        name = "model.layers.0.mlp.down_proj.weight"
        ws = self.c.weight_stream("dup", bucket_bytes=1).__enter__()
        ws.send(name, self.tensors[name])
        with self.assertRaises(FdRolloutError):
            ws.send(name, self.tensors[name])
        ws._close()
        st, j = self.d.post("/finish_weight_update", {})
        self.assertEqual(st, 400, j)
        self.assertIn("was dropped, nothing was applied: tensor 'model.layers.0.mlp.down_proj.weight' was sent twice", j["error"]["message"])
        # finish without start
        self.assertEqual(self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})[0], 200)
        st, j = self.d.post("/finish_weight_update", {})
        self.assertEqual(st, 409, j)
        self.assertIn("start_weight_update", j["error"]["message"])
        # a second start, a second init while an update is open
        ws = self.c.weight_stream("x").__enter__()
        try:
            st, j = self.d.post("/start_weight_update", {})
            self.assertEqual(st, 409, j)
            self.assertIn("already open", j["error"]["message"])
            st, j = self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})
            self.assertEqual(st, 409, j)
            self.assertIn("weight update is open", j["error"]["message"])
            st, j = self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "carrier-pigeon"}})
            self.assertEqual(st, 409, j)  # the open update is checked first: nothing is touched
        finally:
            ws.__exit__(RuntimeError, RuntimeError("test"), None)  # aborts
        st, j = self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "carrier-pigeon"}})
        self.assertEqual(st, 400, j)
        # NCCL's rendezvous is the trainer's ncclUniqueId in the body (no TCP store): required, checked
        st, j = self.d.post("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1", "master_port": 29500,
                                                                           "rank_offset": 1, "world_size": 2}})
        self.assertEqual(st, 400, j)
        self.assertIn("nccl_unique_id", j["error"]["message"])
        st, j = self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "nccl", "nccl_unique_id": "ab"}})
        self.assertIn(st, (400, 404), j)  # malformed id (CUDA build) or no CUDA in this build
        st, j = self.d.post("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["F32"]}})
        self.assertEqual(st, 400, j)
        # init fields of the wrong type or range: 400 naming the field (a timeout past ~9e9 s overflowed
        # the deadline's ticks: every wait then ended at once)
        for body, field in (({"init_info": {"backend": "tcp", "timeout_s": 1e10}}, "timeout_s"),
                            ({"init_info": {"backend": "tcp", "timeout_s": "10"}}, "timeout_s"),
                            ({"init_info": {"backend": 3}}, "backend"),
                            ({"init_info": {"backend": "tcp", "rank_offset": "1"}}, "rank_offset")):
            st, j = self.d.post("/init_weight_transfer_engine", body)
            self.assertEqual(st, 400, (body, j))
            self.assertIn(field, j["error"]["message"])
        for body, field in (({"master_port": "x"}, "master_port"), ({"master_port": 70000}, "master_port"), ({"timeout_s": 1e300}, "timeout_s")):
            st, j = self.d.post("/init_weights_update_group", body)
            self.assertEqual(st, 400, (body, j))
            self.assertIn(field, j["error"]["message"])
        # a finish naming another version than the start's: 400, the update stays open, and the
        # start's version then commits (it was silently relabelled before)
        ws = self.c.weight_stream("named-at-start").__enter__()
        try:
            for name in sorted(self.tensors):
                ws.send(name, self.tensors[name])
            ws.flush()
            st, j = self.d.post("/finish_weight_update", {"version": "other-at-finish"})
            self.assertEqual(st, 400, j)
            self.assertIn("started as 'named-at-start'", j["error"]["message"])
            self.assertTrue(self.c.health()["weight_stream"]["update_open"])
        finally:
            ws.__exit__(None, None, None)  # finishes with the start's version
        self.assertEqual(ws.result["weight_version"], "named-at-start")
        self.assertEqual(self.stream("after-order", self.tensors)["weight_version"], "after-order")
        self.assert_serving(self.ref_new, "after-order")

    def test_4_exception_inside_the_block_drops(self):
        before = self.c.weight_version()
        with self.assertRaises(KeyError):
            with self.c.weight_stream("dropped") as ws:
                for name in sorted(self.tensors)[:5]:
                    ws.send(name, self.tensors[name])
                ws.flush()
                raise KeyError("trainer bug")
        self.assertEqual(self.c.weight_version(), before)
        self.assertEqual(self.stream("after-drop", self.tensors)["weight_version"], "after-drop")

    def test_5_trainer_killed_mid_send(self):
        self.killed_trainer("mid")

    def test_7_trainer_killed_between_buckets(self):
        self.killed_trainer("between")

    def test_5b_trainer_killed_before_announcing_its_bytes(self):
        # Its frames are queued behind the daemon's full receive window and no bucket reads them:
        # the daemon still sees the death at once (the accepted frame left unread makes it a reset).
        self.killed_trainer("unannounced")

    def killed_trainer(self, mode):
        before = self.c.weight_version()
        ckpt = os.path.join(self.new, "model.safetensors")
        p = subprocess.Popen([PYTHON, KILLED_TRAINER, str(self.d.port), os.path.join(HERE, "..", "..", "python"), ckpt, mode],
                             stdout=subprocess.PIPE, text=True)
        t0 = kill_when_sent(self, p)
        # The daemon sees the connection close and drops the update: a new init is accepted.
        def reinit():
            st, j = self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})
            return st == 200
        wait_until(reinit, 10, "the killed trainer's update dropped")
        self.assertLess(time.monotonic() - t0, 10, "dropped well before the 20 s stream timeout: the closed connection is seen")
        self.assertEqual(self.c.weight_version(), before)
        self.assertEqual(self.c.health()["state"], "serving")
        self.assertLessEqual(len(stream_dirs(self.d.port)), 1, "the killed stream's staging dir is removed")
        self.assertEqual(self.stream("after-kill", self.tensors)["weight_version"], "after-kill")
        self.assert_serving(self.ref_new, "after-kill")

    def test_6_silent_trainer_is_dropped_at_the_timeout(self):
        before = self.c.weight_version()
        ws = self.c.weight_stream("silent", timeout=1.5).__enter__()
        t0 = time.monotonic()
        try:
            def dropped():
                st, j = self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})
                return st == 200
            wait_until(dropped, 15, "the silent trainer's update dropped")
            self.assertGreaterEqual(time.monotonic() - t0, 1.0)
        finally:
            ws._close()
        self.assertEqual(self.c.weight_version(), before)
        self.assertEqual(self.stream("after-silence", self.tensors)["weight_version"], "after-silence")


    def test_9_stopped_daemon_makes_the_trainer_raise(self):
        """The trainer's side is bounded too: a daemon that stops answering (SIGSTOP) makes the
        stream raise within its timeout, never hang; resumed, the daemon drops the update."""
        before = self.c.weight_version()
        ws = self.c.weight_stream("stopped", timeout=2).__enter__()
        stop_process(self.d.proc.pid)
        t0 = time.monotonic()
        try:
            with self.assertRaises((FdRolloutError, OSError)):
                for name in sorted(self.tensors):
                    ws.send(name, self.tensors[name])
                ws.flush()
            self.assertLess(time.monotonic() - t0, 20, "raised within the timeout (2 s) plus the client's grace")
        finally:
            self.d.proc.send_signal(signal.SIGCONT)
            ws._close()
        wait_until(lambda: self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})[0] == 200, 15,
                   "the stopped stream's update dropped after SIGCONT")
        self.assertEqual(self.c.weight_version(), before)
        self.assertEqual(self.stream("after-stop", self.tensors)["weight_version"], "after-stop")

    def test_8_sglang_update_group(self):
        """SGLang's pair as slime sends it: init the group, then buckets labelled weight_version;
        the bucket that completes the model commits it (before that the old version serves)."""
        before = self.c.weight_version()
        # master_port as AReaL sends it (str(port): SGLang's pydantic int takes it), and its pp_rank
        st, info = self.d.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "29500", "rank_offset": 1,
                                                               "world_size": 2, "group_name": "actor", "backend": "gloo", "pp_rank": 0})
        self.assertEqual(st, 200, info)
        self.assertTrue(info["success"])
        s = socket.create_connection(("127.0.0.1", info["port"]), timeout=20)
        try:
            s.sendall(_frame({"token": info["token"]}))
            names = sorted(self.tensors)
            half = len(names) // 2
            answers = []
            for part in (names[:half], names[half:]):
                body = {"names": part, "dtypes": ["torch.float32"] * len(part), "shapes": [list(self.tensors[n].shape) for n in part],
                        "group_name": "actor", "flush_cache": True, "weight_version": "sg-1",
                        "abort_all_requests": True, "torch_empty_cache": False}  # AReaL's (sglang_remote.py)
                out = {}
                th = threading.Thread(target=lambda: out.update(r=self.d.post("/update_weights_from_distributed", body)))
                th.start()
                for n in part:
                    a = self.tensors[n]
                    s.sendall(_frame({"name": n, "dtype": "F32", "shape": list(a.shape)}, a.nbytes) + a.tobytes())
                th.join(30)
                answers.append(out["r"])
                if len(answers) == 1:
                    self.assertEqual(self.c.weight_version(), before, "nothing serves before the last tensor arrived")
        finally:
            s.close()
        (st1, j1), (st2, j2) = answers
        self.assertEqual((st1, j1["success"], j1["n_received"], j1["n_expected"]), (200, True, half, len(names)), j1)
        self.assertEqual((st2, j2["success"], j2["weight_version"]), (200, True, "sg-1"), j2)
        self.assert_serving(self.ref_new, "sg-1")

    def test_8a_a_sglang_bucket_before_any_group_is_a_409_naming_the_init(self):
        """A probe: on a daemon that never had a transport, the first update_weights_from_distributed
        was a 422 blaming real tensor names; nothing can arrive yet: 409 naming the init."""
        with Daemon("--dynamic-load-weight") as d:
            name = sorted(self.tensors)[0]
            st, j = d.post("/update_weights_from_distributed", {"names": [name], "dtypes": ["float32"],
                                                                "shapes": [list(self.tensors[name].shape)], "weight_version": "x"})
            self.assertEqual(st, 409, j)
            self.assertIn("init_weights_update_group", json.dumps(j))

    def test_8b_a_sglang_bucket_naming_no_tensor_never_waits_for_the_trainer(self):
        """SGLang's first bucket opens the update, which waits for the trainer to connect: a bucket
        naming no tensor of the model waited there (up to the stream timeout) after its client
        left, /health said idle and the next start got 'already open' (a probe). Now it is a 422
        naming the tensor at once, and a start that does wait shows as 'connecting'."""
        st, info = self.d.post("/init_weights_update_group", {})
        self.assertEqual(st, 200, info)
        t0 = time.monotonic()
        st, j = self.d.post("/update_weights_from_distributed", {"names": ["not_a_tensor"], "dtypes": ["float32"], "shapes": [[1]]})
        self.assertLess(time.monotonic() - t0, 5)
        self.assertEqual(st, 422, j)
        self.assertIn("not_a_tensor", j["message"] if "message" in j else j["error"]["message"])
        self.assertEqual(self.c.health()["weight_stream"]["state"], "idle")
        # refused before its bytes were read: the transport closed (a trainer already writing them
        # would feed them to the next bucket), so the group is made again
        self.assertIsNone(self.c.health()["weight_stream"]["transport"])
        st, info = self.d.post("/init_weights_update_group", {})
        self.assertEqual(st, 200, info)
        name = sorted(self.tensors)[0]
        good = {"names": [name], "dtypes": ["float32"], "shapes": [list(self.tensors[name].shape)]}
        th = threading.Thread(target=lambda: self.d.request("POST", "/update_weights_from_distributed", body=good,
                                                            headers={"X-Request-Timeout": "3"}))
        th.start()
        try:
            deadline = time.monotonic() + 10
            while self.c.health()["weight_stream"]["state"] != "connecting" and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(self.c.health()["weight_stream"]["state"], "connecting")
            st, j = self.d.post("/start_weight_update", {})
            self.assertEqual(st, 409, j)
            self.assertIn("waiting for the trainer to connect", json.dumps(j))
        finally:
            th.join(30)
        self.d.post("/abort_weight_update", {})

    def test_10_transport_opened_once_across_streams(self):
        """As vLLM's protocol (init once, then start/update/finish per step): a client's streams
        after a commit reuse its connection, no init between them; a failed stream closes it and
        the next one inits anew; a transport the daemon replaced (another trainer's init) makes the
        next stream init anew too (its start is retried once). Every one of them commits right."""
        def inits():
            return self.d.output().count("weight stream: listening on")
        c = Client(f"127.0.0.1:{self.d.port}", timeout=20)
        n0 = inits()
        self.assertEqual(self.stream_with(c, "k1", self.tensors)["weight_version"], "k1")
        self.assertEqual(self.stream_with(c, "k2", self.base)["weight_version"], "k2")
        self.assertEqual(self.stream_with(c, "k3", self.tensors)["weight_version"], "k3")
        self.assertEqual(inits() - n0, 1, "one init for three committed streams")
        self.assert_serving(self.ref_new, "k3")
        # a failed stream: its transport goes on both sides; the next stream opens a new one
        with self.assertRaises(FdRolloutError):
            self.stream_with(c, "bad", {**self.tensors, "model.layers.9.nothing": np.zeros(3, np.float32)})
        self.assertEqual(self.stream_with(c, "k4", self.base)["weight_version"], "k4")
        self.assertEqual(inits() - n0, 2)
        self.assert_serving(self.ref_old, "k4")
        # another trainer's init closes this client's connection on the daemon's side
        st, _ = self.d.post("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}})
        self.assertEqual(st, 200)
        self.assertEqual(self.stream_with(c, "k5", self.tensors)["weight_version"], "k5")
        self.assertEqual(inits() - n0, 4, "the other init and this client's new one")
        self.assert_serving(self.ref_new, "k5")

    def test_11_a_full_stream_writes_over_the_replaced_streams_pages(self):
        """The dir a full commit replaces is kept as the spare (fdrollout-stream-spare.*); the next
        full stream moves its bucket files into its own dir, one per bucket, and writes over their
        pages (recycled_bytes): the same buckets all of them, smaller buckets as far as the spare's
        files go (cut to size, each with its own header). Each serves exactly as a fresh daemon on
        those weights. A weight sleep removes the spare; the next stream takes fresh pages."""
        st = lambda: self.c.health()["weight_stream"]  # noqa: E731
        total = sum(a.nbytes for a in self.tensors.values())

        def stream_seen(version, tensors, **kw):  # the stream's recycled_bytes, read before its finish
            with self.c.weight_stream(version, **kw) as ws:
                for name in sorted(tensors):
                    ws.send(name, tensors[name])
                ws.flush()
                seen = st()["recycled_bytes"]
                self.assertEqual(st()["spare_bytes"], 0, "every spare file taken (or none was there)")
            return seen

        self.stream("r1", self.base)
        self.stream("r2", self.base)  # r1's dir: the spare
        self.assertEqual(len(stream_dirs(self.d.port, "-spare")), 1)
        spare = st()["spare_bytes"]
        self.assertGreater(spare, total)  # the tensors and each bucket's header
        # other bytes than the spare holds: a byte not written over would show in the outputs
        self.assertEqual(stream_seen("r3", self.tensors), spare, "the same buckets land in r1's pages, all of them")
        self.assert_serving(self.ref_new, "r3")
        # r2's dir is the spare: buckets of 64 KiB take its files' first pages, headers rewritten
        recycled = stream_seen("r4", self.base, bucket_bytes=1 << 16)
        self.assertGreater(recycled, 0)
        self.assertLess(recycled, total)
        self.assert_serving(self.ref_old, "r4")
        self.assertEqual(len(stream_dirs(self.d.port, "-spare")), 1, "r3's dir")
        self.c.sleep()  # tags weight and kv_cache
        self.assertEqual((st()["spare_bytes"], stream_dirs(self.d.port, "-spare")), (0, []))
        self.c.wakeup()
        self.assert_serving(self.ref_old, "r4")
        self.assertEqual(stream_seen("r5", self.tensors), 0, "fresh pages after the sleep")
        self.assert_serving(self.ref_new, "r5")

    def test_13_stream_while_the_weights_sleep(self):
        # As /v1/update_weights while the weights are released (AReaL's colocated loop): the
        # streamed weights load at once into fresh memory, all-or-nothing, and `weight` is awake
        # after. A delta needs the base bytes, so it is refused while they sleep.
        self.stream("w0", self.base)
        self.c.sleep(tags="weight")
        with self.assertRaises(FdRolloutError) as e:
            with self.c.weight_stream("wd", base_version="w0") as ws:
                ws.send_delta("model.norm.weight", np.array([0], np.int64), np.array([1.0], np.float32))
        self.assertEqual(e.exception.status, 409, e.exception.message)
        self.assertIn("asleep", e.exception.message)
        r = self.stream("w1", self.tensors)
        self.assertEqual(r["weight_version"], "w1")
        self.assertNotIn("weight", self.c.health().get("sleeping_tags", []))
        if self.c.health()["state"] == "paused":  # the sleep's implicit pause stays until a resume
            self.c.resume()
        self.assert_serving(self.ref_new, "w1")

    @staticmethod
    def stream_with(c, version, tensors):
        with c.weight_stream(version) as ws:
            for name in sorted(tensors):
                ws.send(name, tensors[name])
        return ws.result


    def test_14_torch_bfloat16_is_widened_and_a_closed_stream_refuses(self):
        """A probe: torch bfloat16 tensors (a trainer's usual dtype) were sent as BF16 to a rollout
        holding F32 and refused (422), where the docs say send casts to the rollout's dtype; and
        a stream used after its block ended raised AttributeError from inside flush."""
        try:
            import torch
        except ImportError:
            self.skipTest("no torch")
        bf = {n: torch.from_numpy(a).to(torch.bfloat16) for n, a in self.tensors.items()}
        self.stream("t16", bf)
        got = greedy(self.d)[:2]
        self.stream("n16", {n: t.float().numpy() for n, t in bf.items()})  # the same values, widened by torch
        self.assertEqual(greedy(self.d), (*got, "n16"))
        with self.c.weight_stream("closed") as ws:
            for name in sorted(self.tensors):
                ws.send(name, self.tensors[name])
        for call in (lambda: ws.send("model.norm.weight", self.tensors["model.norm.weight"]), ws.flush):
            with self.assertRaisesRegex(RuntimeError, "closed"):
                call()
        self.assert_serving(self.ref_new, "closed")

    def test_15_a_tied_lm_head_may_be_left_out(self):
        """stories260K ties its head to the embedding (and stores a copy): RolloutModel's mapping
        leaves lm_head out, as the landed path does; a full stream of the rest commits and serves
        the new weights (a probe: 422 "the update is missing 1 tensor(s): lm_head.weight")."""
        self.stream("nohead", {n: a for n, a in self.tensors.items() if n != "lm_head.weight"})
        self.assert_serving(self.ref_new, "nohead")
        self.c.sleep()  # the wakeup reloads the kept stream dir, which has no lm_head
        self.c.wakeup()
        self.assert_serving(self.ref_new, "nohead")

class StreamTp2(StreamTp1):
    TP_ARGS = ["--tensor-parallel-size", "2", "--threads", "1", *device_args()]

    # tp=2 repeats the end-to-end paths; the input checks run before any rank is involved.
    test_2_bad_input_is_a_4xx_naming_it_and_changes_nothing = None
    test_3_protocol_order = None
    test_6_silent_trainer_is_dropped_at_the_timeout = None
    test_8_sglang_update_group = None
    test_9_stopped_daemon_makes_the_trainer_raise = None



class StreamAheadTp2(StreamTp2):
    """The tp=2 paths again with every bucket staged on the ranks as it arrives
    (FD_STREAM_STAGE_AHEAD=1; auto turns it on only where the host has tp + 2 hardware threads):
    the same answers, and a trainer dying between buckets still changes nothing."""
    ENV = {"FD_STREAM_STAGE_AHEAD": "1"}

    def test_12_buckets_are_staged_as_they_arrive(self):
        self.assertTrue(self.c.health()["weight_stream"]["stage_ahead"])
        before = self.d.output().count("staged bucket by bucket")
        r = self.stream("a1", self.tensors, bucket_bytes=1 << 16)
        self.assertEqual(r["weight_version"], "a1")
        self.assert_serving(self.ref_new, "a1")
        self.assertEqual(self.d.output().count("staged bucket by bucket") - before, 2, "both ranks committed the buckets they staged")


if __name__ == "__main__":
    unittest.main()
