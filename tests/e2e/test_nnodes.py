"""Ranks on several hosts (--nnodes 2, issue #9), two "hosts" on one machine: node 0's daemon and
rank 0 on 127.0.0.1, node 1's agent and rank 1 on 127.0.0.2, tensor-parallel size 2. Greedy outputs
equal tp=1 (and llama2.c's); an update and sleep/wakeup reach the remote rank; a killed remote
rank (or a stopped one, by its heartbeat over the link) is rank_failed naming it and wakeup waits for node 1 to rejoin (the node agent restarts its
rank), after which outputs equal a fresh daemon; shutting node 0 down ends node 1. Refusals: a
node that never joins fails start-up within the timeout naming it; a wrong token, a different
model config or --tensor-parallel-size is refused with a clear error; a token file others can
read is refused before anything starts; a second copy of node 1 started by mistake is refused
(exit 4, wrong_state) and leaves the running node alone. /health rss_bytes and the sleep result
count the remote rank's RSS. The host swap tier (--swap-space) runs on the remote rank too: with
forced preemption, outputs equal a tp=2 daemon on one node that never preempts."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

from fdtest import BIN, REF, STORIES, Daemon, copy_checkpoint, free_port, greedy, log_dir, perturbed, rss_bytes
from test_swap import TINY_POOL, bodies, metrics, run_concurrently

TP2 = ("--tensor-parallel-size", "2", "--threads", "1", "--dynamic-load-weight")


class Node:
    """Node k > 0: `fdrollout --nnodes 2 --node-rank 1 ...` binding 127.0.0.2 (a context manager)."""

    def __init__(self, master_port, token_file, *args, model=STORIES, tp=2, timeout_s=30, env=None):
        self.log = tempfile.NamedTemporaryFile(prefix="fdnode-", suffix=".log", delete=False, dir=log_dir())
        cmd = [BIN, "--model", model, "--tensor-parallel-size", str(tp), "--nnodes", "2", "--node-rank", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(master_port), "--node-addr", "127.0.0.2",
               "--dist-token-file", token_file, "--control-timeout-s", str(timeout_s), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def output(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def rank_pids(self):
        from fdtest import children, cmdline
        return [c for c in children(self.proc.pid) if b"--fd-rank-process" in cmdline(c)]

    def wait(self, timeout=30):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node 1 still running after {timeout} s:\n{self.output()}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)


def node0(master_port, token_file, *args, model=STORIES, timeout_s=30, wait=False):
    return Daemon(*TP2, "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(master_port),
                  "--dist-token-file", token_file, "--control-timeout-s", str(timeout_s), *args, model=model, wait=wait,
                  extra=False)


def wait_exit(d, timeout):
    try:
        return d.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"node 0 still running after {timeout} s:\n{d.output()}")


class TwoNodes(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-nnodes-")
        cls.token = os.path.join(cls.tmp, "token")
        with open(os.open(cls.token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        cls.other_token = os.path.join(cls.tmp, "other-token")
        with open(os.open(cls.other_token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(os.urandom(32).hex())
        cls.B = perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=11)
        with Daemon(model=cls.B, extra=False) as fresh:  # tp=1, in process: the reference
            cls.b_out = greedy(fresh)[:2]
        with Daemon(extra=False) as fresh:
            cls.a_out = greedy(fresh)[:2]
        with Daemon(*TP2, extra=False) as fresh:  # tp=2 on one node: the same sums, so bitwise equal
            cls.a_tp2 = greedy(fresh)[:2]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def assert_like_tp1(self, got, want):
        """Token ids equal; logprobs within 1e-4 (tp=2 sums the row-parallel partials in another order)."""
        self.assertEqual(got[0], want[0])
        self.assertLess(max(abs(a - b) for a, b in zip(got[1], want[1])), 1e-4)

    def ok(self, d, path, body=None):
        status, j = d.post(path, body)
        self.assertEqual(status, 200, j)
        return j["result"]

    def test_two_nodes_serve_update_sleep_and_recover_a_killed_remote_rank(self):
        src = copy_checkpoint(STORIES, os.path.join(self.tmp, "src"))
        port = free_port()
        with node0(port, self.token, model=src) as d, Node(port, self.token, model=src) as n:
            d.wait_ready(60)
            h = d.get("/health")[1]
            self.assertEqual((h["executor"], h["degraded_ranks"], h["comm_group"]["state"]), ("mp", [], "connected"), h)
            self.assertEqual(len(d.rank_pids()), 1)  # rank 0 here; rank 1 is node 1's
            [remote] = n.rank_pids()
            # Node 1's rank joined from 127.0.0.2 and bound its Gloo pairs there.
            self.assertIn("joined from 127.0.0.2:", d.output())
            self.assertIn("127.0.0.2)", n.output())
            # Greedy outputs equal tp=1 in one process (and tp=2 on one node bitwise), and llama2.c's.
            got = greedy(d)
            self.assertEqual(got, (*self.a_tp2, "0"))
            self.assert_like_tp1(got, self.a_out)
            for prompt, ref in REF.items():
                self.assertEqual(d.complete(prompt=prompt, max_tokens=60, temperature=0)["choices"][0]["token_ids"], ref["ids"])

            # A weight stream is refused at init, naming why (node 1's rank could not read the
            # staged tensors on real separate hosts); nothing opened, the daemon serves on.
            for path, body in (("/init_weight_transfer_engine", {"init_info": {"backend": "tcp"}}),
                               ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                                               "world_size": 2, "group_name": "g", "backend": "tcp"})):
                status, j = d.post(path, body)
                self.assertEqual(status, 409, j)
                self.assertIn("--nnodes 2", json.dumps(j), j)
            self.assertEqual(greedy(d), (*self.a_tp2, "0"))

            # An update reaches both nodes' ranks (each fetches its own shard from --model).
            self.ok(d, "/v1/pause")
            copy_checkpoint(self.B, src)
            res = self.ok(d, "/v1/update_weights", {"version": "b"})
            self.assertEqual([(r["rank"], r["version"]) for r in res["ranks"]], [(0, "b"), (1, "b")])
            self.ok(d, "/v1/resume")
            b_here = greedy(d)
            self.assertEqual(b_here[2], "b")
            self.assert_like_tp1(b_here, self.b_out)

            # Sleep and wakeup across nodes: the group closes and reopens; outputs unchanged.
            res = self.ok(d, "/v1/sleep")
            self.assertEqual([r["rank"] for r in res["ranks"]], [0, 1])
            self.assertEqual(d.get("/health")[1]["comm_group"]["state"], "disconnected")
            self.ok(d, "/v1/wakeup")
            self.assertEqual(d.get("/health")[1]["comm_group"]["state"], "connected")
            self.assertEqual(greedy(d), b_here)

            # The remote rank dies: rank_failed naming it, /health degraded; wakeup waits for node 1's
            # agent to start a new rank and rejoin, then serves what a fresh daemon serves.
            os.kill(remote, signal.SIGKILL)
            deadline = time.time() + 10
            while d.get("/health")[1]["state"] != "degraded" and time.time() < deadline:
                time.sleep(0.05)
            status, h = d.get("/health")
            self.assertEqual((status, h["degraded_ranks"]), (503, [1]), h)
            status, j = d.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
            self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
            self.assertIn("rank 1 on node 1 closed its link", d.output())
            res = self.ok(d, "/v1/wakeup")
            self.assertFalse(res["is_paused"])
            self.assertEqual(d.get("/health")[1]["degraded_ranks"], [])
            [again] = n.rank_pids()
            self.assertNotEqual(again, remote)
            self.assertEqual(greedy(d), b_here)

            # Node 0 stops: node 1's rank is told to shut down and node 1 exits 0.
            self.assertEqual(d.stop(), 0)
            self.assertEqual(n.wait(30), 0, n.output())
            self.assertIn("node 0 shut the ranks down", n.output())
            self.assertEqual(n.rank_pids(), [])

    def test_a_stopped_remote_rank_is_caught_by_its_heartbeat_then_wakeup_recovers(self):
        # Node 0 sees no process of node 1's: only the rank's beats over its TCP link tell it the
        # rank is stopped. Before they existed this waited for the deadline (0.9 x 30 s here).
        port = free_port()
        with node0(port, self.token, "--rank-heartbeat-s", "1") as d, Node(port, self.token) as n:
            d.wait_ready(60)
            before = greedy(d)
            [remote] = n.rank_pids()
            os.kill(remote, signal.SIGSTOP)
            try:
                t0 = time.time()
                status, j = d.post("/v1/completions", {"prompt": "Once", "max_tokens": 4, "temperature": 0})
                took = time.time() - t0
                self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
                self.assertGreater(took, 0.9)  # the heartbeat's bound, not earlier
                self.assertLess(took, 1 + 3)   # not the deadline (27 s)
                self.assertIn("rank 1 on node 1 sent no heartbeat for", j["error"]["message"])
                self.assertEqual(d.get("/health")[1]["degraded_ranks"], [1])
            finally:
                os.kill(remote, signal.SIGCONT)
            self.assertFalse(self.ok(d, "/v1/wakeup")["is_paused"])
            self.assertNotIn(remote, n.rank_pids())
            self.assertEqual(greedy(d), before)

    def test_a_stuck_remote_rank_exits_when_its_link_closes_so_wakeup_recovers(self):
        # A probe: a rank of node 1 whose main loop hung (its beat thread alive) was failed as
        # stuck, but nothing ended its process: node 1's agent rejoins only when its rank exits,
        # so every wakeup failed ("node 1 did not join") and the daemon stayed degraded. The rank
        # now exits when the daemon closes its link during a request.
        port = free_port()
        mark = os.path.join(self.tmp, "hang-mark")
        open(mark, "w").close()
        with node0(port, self.token, "--rank-stuck-s", "2") as d, Node(port, self.token, env={"FD_TEST_HANG_AT": f"forward:1:{mark}"}) as n:
            d.wait_ready(60)
            before = greedy(d)
            [remote] = n.rank_pids()
            os.unlink(mark)  # rank 1's next forward hangs: its main loop stuck, its beats going on
            status, j = d.post("/v1/completions", {"prompt": "Once", "max_tokens": 4, "temperature": 0})
            self.assertEqual((status, j["error"]["type"]), (503, "rank_failed"), j)
            self.assertIn("rank 1 on node 1 is stuck", j["error"]["message"])
            t0 = time.time()
            self.assertFalse(self.ok(d, "/v1/wakeup")["is_paused"])
            self.assertLess(time.time() - t0, 10)
            self.assertNotIn(remote, n.rank_pids())
            self.assertEqual(greedy(d), before)

    def test_a_node_that_never_joins_fails_start_up_naming_it(self):
        port = free_port()
        t0 = time.time()
        with node0(port, self.token, timeout_s=3) as d:
            rc = wait_exit(d, 30)
            took = time.time() - t0
            self.assertEqual(rc, 14, d.output())  # rank_failed
            self.assertIn("node 1 (rank(s) 1) did not join within 3 s", d.output())
            self.assertIn(f"--node-rank 1 --master-addr 127.0.0.1 --master-port {port}", d.output())
            self.assertLess(took, 3 + 15)

    def test_a_wrong_token_is_refused(self):
        port = free_port()
        with node0(port, self.token, timeout_s=6) as d, Node(port, self.other_token, timeout_s=6) as n:
            self.assertEqual(n.wait(30), 13, n.output())  # forbidden
            self.assertIn("authentication failed", n.output())
            self.assertEqual(wait_exit(d, 30), 14, d.output())
            self.assertIn("refused a join from 127.0.0.2:", d.output())
            self.assertIn("join token differs", d.output())
            self.assertIn("did not join", d.output())

    def test_a_node_with_a_different_model_config_or_tp_is_refused(self):
        other = copy_checkpoint(STORIES, os.path.join(self.tmp, "other-config"))
        with open(os.path.join(other, "config.json")) as f:
            cfg = json.load(f)
        cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-5) * 2
        with open(os.path.join(other, "config.json"), "w") as f:
            json.dump(cfg, f)
        port = free_port()
        with node0(port, self.token, timeout_s=8) as d:
            with Node(port, self.token, model=other, timeout_s=8) as n:
                self.assertEqual(n.wait(30), 10, n.output())  # invalid_argument
                self.assertIn("model config.json", n.output())
                self.assertIn("differs from node 0's", n.output())
            with Node(port, self.token, "--threads", "1", tp=4, timeout_s=8) as n:
                self.assertEqual(n.wait(30), 10, n.output())
                self.assertIn("node 0 runs --nnodes 2 --tensor-parallel-size 2", n.output())
            self.assertEqual(wait_exit(d, 30), 14, d.output())

    def test_a_second_copy_of_node_1_is_refused_and_rss_covers_the_remote_rank(self):
        port = free_port()
        with node0(port, self.token) as d, Node(port, self.token) as n:
            d.wait_ready(60)
            before = greedy(d)
            [remote] = n.rank_pids()
            [local] = d.rank_pids()
            # /health counts the daemon, its rank and node 1's rank (as that rank last reported).
            here = rss_bytes(d.proc.pid) + rss_bytes(local)
            there = rss_bytes(remote)
            got = d.get("/health")[1]["rss_bytes"]
            self.assertGreater(there, 4 << 20)
            self.assertGreater(got, here + 0.7 * there, (got, here, there))
            self.assertLess(got, here + 1.3 * there + (16 << 20), (got, here, there))
            res = self.ok(d, "/v1/sleep")
            r1 = [r for r in res["ranks"] if r["rank"] == 1][0]
            self.assertLess(abs(r1["rss_bytes"] - rss_bytes(remote)), 4 << 20, (r1, rss_bytes(remote)))
            self.assertGreater(res["rss_after_bytes"], rss_bytes(d.proc.pid) + rss_bytes(local) + 0.7 * rss_bytes(remote))
            self.ok(d, "/v1/wakeup")
            # A second `fdrollout --node-rank 1` for the same node: refused at once, naming why.
            with Node(port, self.token) as twin:
                self.assertEqual(twin.wait(30), 4, twin.output())  # wrong_state
                self.assertIn("rank 1 of node 1 is already running", twin.output())
                self.assertEqual(twin.rank_pids(), [])
            self.assertIn("refused a join from 127.0.0.2:", d.output())
            self.assertEqual(n.rank_pids(), [remote])  # the running node is untouched
            self.assertEqual(d.get("/health")[1]["degraded_ranks"], [])
            self.assertEqual(greedy(d), before)
            # After node 1's rank dies, node 1 itself rejoins (its old link closed): not refused.
            os.kill(remote, signal.SIGKILL)
            deadline = time.time() + 10
            while d.get("/health")[1]["state"] != "degraded" and time.time() < deadline:
                time.sleep(0.05)
            self.assertFalse(self.ok(d, "/v1/wakeup")["is_paused"])
            self.assertEqual(greedy(d), before)

    def test_swap_tier_with_a_remote_rank_equals_no_preemption(self):
        reqs = bodies()
        with Daemon(*TP2, "--max-model-len", "80", extra=False) as ref:  # one node, a pool that never preempts
            want = run_concurrently(ref, reqs)
            self.assertEqual(metrics(ref)["fdrollout_preemptions_total"], 0)
        port = free_port()
        with node0(port, self.token, *TINY_POOL, "--swap-space", "0.01") as d, Node(port, self.token) as n:
            d.wait_ready(60)
            got = run_concurrently(d, reqs)
            for i, (g, w) in enumerate(zip(got, want)):
                self.assertEqual(g, w, f"request {i} ({reqs[i]['prompt']!r}) differs with swapping over two nodes")
            m = metrics(d)
            self.assertGreater(m["fdrollout_swap_preemptions_total"], 0, m)
            self.assertEqual(m["fdrollout_recompute_preemptions_total"], 0, m)
            self.assertEqual(m["fdrollout_kv_swap_in_bytes_total"], m["fdrollout_kv_swap_out_bytes_total"])
            self.assertEqual(len(n.rank_pids()), 1)
            self.assertEqual(d.get("/health")[1]["degraded_ranks"], [])

    def test_a_token_file_others_can_read_is_refused(self):
        loose = os.path.join(self.tmp, "loose-token")
        with open(loose, "w") as f:
            f.write(os.urandom(32).hex())
        os.chmod(loose, 0o644)
        with Node(free_port(), loose) as n:
            self.assertEqual(n.wait(30), 13, n.output())
            self.assertIn("chmod 600", n.output())
        with Node(free_port(), os.path.join(self.tmp, "missing")) as n:
            self.assertEqual(n.wait(30), 10, n.output())


if __name__ == "__main__":
    unittest.main()
