"""The multi-process executor (--distributed-executor-backend mp, issue #9): ranks in their own
processes give the same outputs as the in-process rank; a rank killed (SIGKILL) or stopped
(SIGSTOP) during decode, update or sleep fails the call with rank_failed naming it, never a hang;
/health says degraded and new requests get 503 until wakeup respawns the rank and reloads the
serving version (outputs then equal a fresh daemon); sleep closes the rank's communication
sockets (seen in /proc/<pid>/net/tcp; --dist-backend gloo) or unmaps its shared-memory segment
(seen in /proc/<pid>/maps; shm, the default on one host: a memfd handed to each rank, never in
/dev/shm, not even after the daemon is SIGKILLed, whose ranks die with it) and wakeup reopens them; shm and gloo give bitwise the same outputs at tp=2; bad flags stop
start-up clearly."""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest

from fdtest import BIN, REF, STORIES, Daemon, GREEDY, copy_checkpoint, free_port, greedy, perturbed, rss_bytes, wait_until

MP = ("--distributed-executor-backend", "mp", "--dynamic-load-weight")
PROMPT = "Once upon a time"


def fd_targets(pid):
    """Where process pid's open descriptors point (readlink of /proc/<pid>/fd/*)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


def tcp_sockets(pid):
    """TCP sockets (v4 and v6) open in process pid: /proc/<pid>/fd inodes found in /proc/<pid>/net/tcp*."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[9] in inodes:
                    found.append((cols[1], cols[3]))  # local address, state
    return found


class MpExecutor(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-mp-")
        cls.B = perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=11)
        with Daemon(model=cls.B, extra=False) as fresh:
            cls.b_out = greedy(fresh)[:2]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def ok(self, d, path, body=None):
        status, j = d.post(path, body)
        self.assertEqual(status, 200, j)
        return j["result"]

    def rank(self, d):
        pids = d.rank_pids()
        self.assertEqual(len(pids), 1, pids)
        return pids[0]

    def assert_degraded(self, d, rank_pid):
        status, h = d.get("/health")
        self.assertEqual((status, h["state"], h["degraded_ranks"]), (503, "degraded", [0]), h)
        status, j = d.post("/v1/completions", GREEDY)
        self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
        self.assertIn("wakeup", j["error"]["message"])
        status, j = d.post("/v1/resume")
        self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
        self.assertIn("rank(s) [0] failed", j["error"]["message"])
        self.assertIn('fdrollout_rank_failed{rank="0"} 1', d.get("/metrics")[1])

    def recover(self, d, old_pid):
        res = self.ok(d, "/v1/wakeup")
        self.assertFalse(res["is_paused"])
        self.assertNotEqual(self.rank(d), old_pid)
        h = d.get("/health")[1]
        self.assertEqual((h["state"], h["degraded_ranks"], h["comm_group"]["state"]), ("serving", [], "connected"))

    def test_outputs_equal_the_in_process_rank_and_llama2c(self):
        with Daemon(*MP) as d, Daemon(extra=False) as uni:
            for prompt, ref in REF.items():
                j = d.complete(prompt=prompt, max_tokens=60, temperature=0)
                self.assertEqual(j["choices"][0]["token_ids"], ref["ids"])
            self.assertEqual(greedy(d), greedy(uni))  # ids and logprobs bit-equal
            body = {"prompt": [PROMPT, "Lily and Tom"], "max_tokens": 30, "temperature": 0.8, "seed": 7, "n": 3, "logprobs": 1}
            a, b = d.complete(**body), uni.complete(**body)
            self.assertEqual([c["token_ids"] for c in a["choices"]], [c["token_ids"] for c in b["choices"]])
            h = d.get("/health")[1]
            self.assertEqual((h["executor"], h["comm_group"]), ("mp", {"backend": "shm", "state": "connected"}))  # auto, one host
            self.assertEqual(uni.get("/health")[1]["comm_group"], {"backend": "null", "state": "none"})
            # CPU ranks: no device memory in /health or /metrics (issue #10's fields are CUDA-only).
            self.assertIn("device_memory", h)
            self.assertIsNone(h["device_memory"])
            self.assertIsNone(uni.get("/health")[1]["device_memory"])
            self.assertNotIn("fdrollout_device_memory_used_bytes", d.get("/metrics")[1])
            # RSS of the rank process is in /health and in each rank's sleep report.
            self.assertGreater(h["rss_bytes"], d.rss() // 2)
            res = self.ok(d, "/v1/sleep")
            r0 = res["ranks"][0]
            self.assertEqual(r0["rank"], 0)
            self.assertNotIn("device_bytes_freed", r0)  # a CPU rank measures no device memory
            self.assertNotIn("device_bytes_freed", res)
            self.assertLess(abs(r0["rss_bytes"] - rss_bytes(self.rank(d))), 8 << 20)  # that rank process's own RSS
            self.ok(d, "/v1/wakeup")
            self.assertEqual(greedy(d), greedy(uni))

    def test_rank_killed_during_decode_then_wakeup_recovers(self):
        with Daemon(*MP, "--control-timeout-s", "20") as d:
            pid = self.rank(d)
            out = {}
            body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
            t = threading.Thread(target=lambda: out.__setitem__("r", d.post("/v1/completions", body)))
            t.start()
            deadline = time.time() + 10
            while time.time() < deadline and d.get("/health")[1]["num_requests_running"] == 0:
                time.sleep(0.002)
            os.kill(pid, signal.SIGKILL)
            t.join(30)
            self.assertFalse(t.is_alive())
            status, j = out["r"]
            self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)  # the request ended with the error
            self.assertIn("rank 0", j["error"]["message"])
            self.assert_degraded(d, pid)
            self.recover(d, pid)
            for prompt, ref in REF.items():
                self.assertEqual(d.complete(prompt=prompt, max_tokens=60, temperature=0)["choices"][0]["token_ids"], ref["ids"])

    def test_rank_stopped_during_update_fails_within_the_timeout_then_recovers(self):
        src = copy_checkpoint(STORIES, os.path.join(self.tmp, "upd"))
        with Daemon(*MP, "--control-timeout-s", "3", model=src) as d:
            before = greedy(d)
            pid = self.rank(d)
            self.ok(d, "/v1/pause")
            # the serving files set aside untouched (a rewrite, even with the same bytes, would get
            # a fingerprint label on recovery: docs/weight_sources.md, "The version label")
            st = os.path.join(src, "model.safetensors")
            os.rename(st, st + ".serving")
            copy_checkpoint(self.B, src)
            os.kill(pid, signal.SIGSTOP)
            try:
                t0 = time.time()
                status, j = d.post("/v1/update_weights", {"version": "b"})
                took = time.time() - t0
                self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
                self.assertLess(took, 3.0 + 2.0)
                self.assertIn("rank 0", j["error"]["message"])
                self.assertIn("stopped", j["error"]["message"])
                self.assert_degraded(d, pid)
                self.assertEqual(d.get("/health")[1]["weight_version"], "0")  # the failed update changed nothing
            finally:
                os.kill(pid, signal.SIGCONT)
            os.replace(st + ".serving", st)  # the serving version is back in the source
            self.recover(d, pid)
            self.assertEqual(greedy(d), before)
            # A later update works on the respawned rank.
            self.ok(d, "/v1/pause")
            copy_checkpoint(self.B, src)
            self.assertEqual(self.ok(d, "/v1/update_weights", {"version": "b"})["version"], "b")
            self.ok(d, "/v1/resume")
            self.assertEqual(greedy(d), (*self.b_out, "b"))

    def test_rank_killed_while_asleep_then_wakeup_recovers(self):
        with Daemon(*MP) as d:
            before = greedy(d)
            self.ok(d, "/v1/sleep?tags=weight")
            pid = self.rank(d)
            os.kill(pid, signal.SIGKILL)
            deadline = time.time() + 10  # noticed while idle
            while time.time() < deadline and d.get("/health")[1]["state"] != "degraded":
                time.sleep(0.01)
            self.assert_degraded(d, pid)
            self.recover(d, pid)
            self.assertEqual(greedy(d), before)

    def test_shm_group_segment_is_a_memfd_never_in_dev_shm_even_after_sigkill_tp2(self):
        def mapped(pid):
            """The rank's mappings of a tensor-parallel segment (a memfd: "/memfd:fdrollout-tp (deleted)")."""
            with open(f"/proc/{pid}/maps") as f:
                return [" ".join(line.split()[5:]) for line in f if "fdrollout-tp" in line]

        def held(pid):
            """Descriptors of pid open on a tensor-parallel segment."""
            return [t for t in fd_targets(pid) if "fdrollout-tp" in t]

        def in_dev_shm(daemon_pid):
            # Before this change the segment was /dev/shm/fdrollout-tp-<daemon pid>-<port>-g<N>;
            # other suites running the old code may hold their own, so only this daemon's count.
            return [n for n in os.listdir("/dev/shm") if n.startswith("fdrollout-tp") and f"-{daemon_pid}-" in n]

        with Daemon(*MP, "--tensor-parallel-size", "2", "--threads", "1", "--dist-backend", "gloo") as g, Daemon(extra=False) as uni:
            want = greedy(g)
            self.assertEqual(g.get("/health")[1]["comm_group"], {"backend": "gloo", "state": "connected"})
            self.assertEqual(greedy(uni)[0], want[0])  # tp=2 ids equal tp=1
        d = Daemon(*MP, "--tensor-parallel-size", "2", "--threads", "1", "--dist-backend", "shm")
        try:
            self.assertEqual(d.get("/health")[1]["comm_group"], {"backend": "shm", "state": "connected"})
            pids = d.rank_pids()
            self.assertEqual(len(pids), 2)
            for pid in pids:
                self.assertEqual(mapped(pid), ["/memfd:fdrollout-tp (deleted)"])  # a memfd: no path anywhere
                self.assertEqual(held(pid), [])  # mapped, then its descriptor closed
                self.assertEqual(tcp_sockets(pid), [])  # no Gloo pairs
            self.assertEqual(held(d.proc.pid), [])  # the daemon let go once every rank answered
            self.assertEqual(in_dev_shm(d.proc.pid), [])
            self.assertEqual(greedy(d), want)  # the same sums in the same order as Gloo: bitwise equal
            self.assertEqual(in_dev_shm(d.proc.pid), [])  # while serving
            self.ok(d, "/v1/sleep?tags=kv_cache")  # only weight sleep closes the group
            self.assertTrue(all(mapped(pid) for pid in pids))
            self.ok(d, "/v1/sleep?tags=weight")
            self.assertEqual([mapped(pid) for pid in pids], [[], []])
            self.assertEqual(d.get("/health")[1]["comm_group"]["state"], "disconnected")
            self.ok(d, "/v1/wakeup")  # a new generation: a new memfd, handed over with comm_connect
            for pid in pids:
                self.assertEqual(mapped(pid), ["/memfd:fdrollout-tp (deleted)"])
                self.assertEqual(held(pid), [])
            self.assertEqual(held(d.proc.pid), [])
            self.assertEqual(in_dev_shm(d.proc.pid), [])
            self.assertEqual(d.get("/health")[1]["comm_group"]["state"], "connected")
            self.assertEqual(greedy(d), want)
            # SIGKILL of the daemon: the ranks die with it (parent-death signal), nothing stays.
            d.proc.kill()
            d.proc.wait()
            wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), 10, f"rank processes {pids} gone")
            self.assertEqual(in_dev_shm(d.proc.pid), [])
        finally:
            d.stop(signal.SIGKILL)
            os.unlink(d.log.name)
            if os.path.exists(f"/dev/shm/fdrollout.{d.port}"):  # the SIGKILLed daemon's control block
                os.unlink(f"/dev/shm/fdrollout.{d.port}")

    def test_sleep_closes_the_comm_sockets_and_wakeup_reopens_them(self):
        with Daemon(*MP, "--dist-backend", "gloo") as d:
            pid = self.rank(d)
            self.assertGreater(len(tcp_sockets(pid)), 0)
            self.ok(d, "/v1/sleep?tags=kv_cache")  # only weight sleep closes the group
            self.assertGreater(len(tcp_sockets(pid)), 0)
            self.ok(d, "/v1/sleep?tags=weight")
            self.assertEqual(tcp_sockets(pid), [])
            h = d.get("/health")[1]
            self.assertEqual(h["comm_group"]["state"], "disconnected")
            self.assertIn("fdrollout_comm_group_connected{", d.get("/metrics")[1])
            self.assertIn('executor="mp"} 0', d.get("/metrics")[1])
            self.ok(d, "/v1/wakeup")
            self.assertGreater(len(tcp_sockets(pid)), 0)
            self.assertEqual(d.get("/health")[1]["comm_group"]["state"], "connected")
            self.assertEqual(d.complete(prompt=PROMPT, max_tokens=60, temperature=0)["choices"][0]["token_ids"], REF[PROMPT]["ids"])
        with Daemon(*MP, "--dist-backend", "gloo", "--no-shutdown-comm-group-if-worker-idle") as d:
            pid = self.rank(d)
            n = len(tcp_sockets(pid))
            self.ok(d, "/v1/sleep")
            self.assertEqual(len(tcp_sockets(pid)), n)
            self.assertEqual(d.get("/health")[1]["comm_group"]["state"], "connected")
            self.ok(d, "/v1/wakeup")

    def test_shutdown_leaves_no_rank_process(self):
        d = Daemon(*MP)
        with d:
            pid = self.rank(d)
            self.assertEqual(d.complete(prompt=PROMPT, max_tokens=5, temperature=0)["choices"][0]["token_ids"], REF[PROMPT]["ids"][:5])
        self.assertEqual(d.proc.returncode, 0)
        self.assertFalse(os.path.exists(f"/proc/{pid}"))
        # A daemon killed outright takes its ranks with it (parent-death signal).
        d = Daemon(*MP)
        pid = self.rank(d)
        d.proc.kill()
        d.proc.wait()
        deadline = time.time() + 5
        while time.time() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.01)
        self.assertFalse(os.path.exists(f"/proc/{pid}"))
        os.unlink(d.log.name)
        if os.path.exists(f"/dev/shm/fdrollout.{d.port}"):  # the SIGKILLed daemon's control block
            os.unlink(f"/dev/shm/fdrollout.{d.port}")

    def test_tp2_equals_tp1_and_a_killed_rank_1_is_named_and_recovered(self):
        with Daemon("--tensor-parallel-size", "2", "--threads", "1", "--dynamic-load-weight", "--control-timeout-s", "10") as d, \
                Daemon(extra=False) as uni:
            self.assertEqual(len(d.rank_pids()), 2)
            for prompt, ref in REF.items():
                self.assertEqual(d.complete(prompt=prompt, max_tokens=60, temperature=0)["choices"][0]["token_ids"], ref["ids"])
            ids, lps, _ = greedy(d)
            uids, ulps, _ = greedy(uni)
            self.assertEqual(ids, uids)
            self.assertLess(max(abs(a - b) for a, b in zip(lps, ulps)), 1e-4)
            res = self.ok(d, "/v1/sleep")
            self.assertEqual([r["rank"] for r in res["ranks"]], [0, 1])
            self.assertEqual([tcp_sockets(p) for p in d.rank_pids()], [[], []])
            res = self.ok(d, "/v1/wakeup")
            self.assertEqual([r["rank"] for r in res["ranks"]], [0, 1])
            self.assertEqual(greedy(d)[0], uids)
            victim = d.rank_pids()[1]
            os.kill(victim, signal.SIGKILL)
            status, j = d.post("/v1/completions", GREEDY)  # fails in the step, or at once if the idle check saw it first
            self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
            status, h = d.get("/health")
            self.assertEqual((status, h["state"], h["degraded_ranks"]), (503, "degraded", [1]), h)
            self.ok(d, "/v1/wakeup")
            self.assertNotIn(victim, d.rank_pids())
            self.assertEqual(greedy(d)[0], uids)
            # The respawned ranks (started while the engine thread ran the wakeup) are shut down in
            # order at SIGTERM, not killed early by a parent-death signal when the engine thread ends.
            self.assertEqual(d.stop(), 0)
            tail = d.output().split("draining", 1)[1]
            for r in (0, 1):
                self.assertIn(f"rank {r}/2: shm group disconnected", tail)

    def test_bad_parallel_flags_stop_start_up(self):
        def start(*args):
            p = subprocess.run([BIN, "--model", STORIES, "--port", str(free_port()), *args], capture_output=True, text=True, timeout=60)
            return p.returncode, p.stderr

        rc, err = start("--tensor-parallel-size", "3")
        self.assertEqual(rc, 10, err)
        self.assertIn("must divide the model's 4 KV heads", err)
        rc, err = start("--tensor-parallel-size", "2", "--distributed-executor-backend", "uni")
        self.assertEqual(rc, 10, err)
        self.assertIn("needs mp", err)
        rc, err = start("--distributed-executor-backend", "gloo")
        self.assertEqual(rc, 2, err)
        rc, err = start("--dist-backend", "nccl2")
        self.assertEqual(rc, 2, err)
        rc, err = start("--tensor-parallel-size", "2", "--dist-backend", "nccl")
        self.assertEqual(rc, 10, err)
        self.assertIn("--dist-backend nccl needs --device cuda", err)
        rc, err = start("--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(free_port()), "--dist-backend", "shm")
        self.assertEqual(rc, 10, err)
        self.assertIn("--dist-backend shm needs every rank on one host", err)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            rc, err = start("--distributed-executor-backend", "mp", "--master-port", str(port))
            self.assertEqual(rc, 10, err)
            self.assertIn(f"127.0.0.1:{port}", err)


if __name__ == "__main__":
    unittest.main()
