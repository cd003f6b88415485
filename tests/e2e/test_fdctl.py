"""fdctl against a real daemon over both transports (shm control block and V1 HTTP): every
subcommand's stdout, --json and exit code, identical answers on both channels, the fault cases
(no daemon, daemon or fdctl killed mid-call, concurrent calls), block permissions and ABI checks,
and the two example scripts."""
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import unittest

from fdtest import (FDCTL, REF, REPO, STORIES, Daemon, MisbehavingPeer, copy_checkpoint, fdctl, free_port, fresh_daemon, perturbed,
                    wait_control_in_flight, wait_until)

SHM = "/dev/shm/fdrollout.{}"
EXIT = {"ok": 0, "usage": 2, "not_found": 3, "wrong_state": 4, "invalid_checkpoint": 5, "engine_paused": 6,
        "timeout": 7, "unreachable": 8}


def normalized(body):
    """Drop the fields that legitimately differ between two calls (timings, RSS, and the
    request_id HTTP control answers carry). `weight_stream` is compared too: the shm status adds
    it as /health does; only its watchdog countdown (deadline_in_s) moves between two calls."""
    j = json.loads(body)
    j.pop("request_id", None)
    if isinstance(j.get("weight_stream"), dict):
        j["weight_stream"].pop("deadline_in_s", None)
    res = j.get("result", j)
    for k in ["elapsed_s", "rss_before_bytes", "rss_after_bytes", "rss_bytes", "ranks"]:
        res.pop(k, None)
    return j


class Fdctl(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-ctl-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_every_subcommand_gives_the_same_answer_over_both_transports(self):
        script = [  # (args, exit code, human stdout prefix)
            (["is-paused"], 0, "false"),
            (["pause"], 0, "paused (aborted 0 choice(s))"),
            (["pause"], 0, "paused"),
            (["is-paused"], 0, "true"),
            (["status"], 0, "state=paused paused=true"),
            (["sleep", "--tags", "weight"], 0, "asleep: weight"),
            (["sleep", "--tags", "weight,kv_cache"], 0, "asleep: kv_cache (already asleep: weight)"),
            (["resume"], EXIT["wrong_state"], ""),
            # while the weights are released an update loads them at once (issue 26: AReaL's colocated loop)
            (["update-weights", "--version", "v2"], 0, "weight_version v2"),
            (["status"], 0, "state=sleeping paused=true sleeping=kv_cache weights_valid=true weight_version=v2"),
            (["wakeup", "--tags", "kv_cache"], 0, "awake: kv_cache; weight_version v2; serving"),
            (["wakeup"], 0, "awake: -; weight_version v2; serving"),
            (["update-weights", "--version", "v3"], EXIT["wrong_state"], ""),  # not paused
            (["pause"], 0, "paused"),
            (["update-weights", "--version", "v3"], 0, "weight_version v3"),
            (["resume"], 0, "resumed"),
            (["status"], 0, "state=serving paused=false sleeping=- weights_valid=true weight_version=v3"),
            (["clear-load-weight"], 0, "clear model weight successfully"),
            (["clear-load-weight"], 0, "model weight is cleared"),
            (["update-model-weight"], 0, "update model weight successfully"),
            (["update-model-weight"], 0, "model weight is updated"),
            (["wait", "--until", "serving"], 0, "state=serving"),
        ]
        answers = {}
        for transport in ["shm", "v1"]:
            with Daemon("--dynamic-load-weight") as d:
                answers[transport] = []
                for args, code, human in script:
                    rc, out, err = fdctl(d.port, "--transport", transport, *args)
                    self.assertEqual(rc, code, (transport, args, out, err))
                    self.assertTrue(out.startswith(human), (transport, args, out))
                    if code != 0:
                        self.assertIn(args[0].replace("-", "_") if args[0] != "update-weights" else "update_weights", err)
                    if args[0] != "wait":
                        rc2, js, _ = fdctl(d.port, "--transport", transport, "--json", *args) if args[0] in ("is-paused", "status") else (rc, None, None)
                        if js:
                            answers[transport].append(normalized(js))
                            if args[0] == "status":  # both transports carry the weight stream's state
                                self.assertEqual(answers[transport][-1]["weight_stream"]["state"], "idle", (transport, js))
                self.assertEqual(d.complete(prompt="Lily and Tom", max_tokens=60, temperature=0)["weight_version"], "v3")
        self.assertEqual(answers["shm"], answers["v1"])

    def test_json_output_is_the_http_body(self):
        with Daemon("--dynamic-load-weight") as d:
            for transport in ["shm", "v1"]:
                rc, out, _ = fdctl(d.port, "--transport", transport, "--json", "pause")
                self.assertEqual(rc, 0)
                j = json.loads(out)
                self.assertEqual((j["status"], j["result"]["is_paused"]), ("success", True))
                rc, out, _ = fdctl(d.port, "--transport", transport, "--json", "sleep", "--tags", "bogus")
                self.assertEqual((rc, json.loads(out)["error"]["type"]), (EXIT["usage"], "usage"))  # nothing sent, the error as JSON
                self.assertEqual(d.get("/health")[1]["sleeping_tags"], [])
                rc, out, _ = fdctl(d.port, "--transport", transport, "--json", "resume")
                self.assertEqual(rc, 0)
                rc, out, err = fdctl(d.port, "--transport", transport, "--json", "update-weights")
                self.assertEqual(rc, EXIT["wrong_state"])
                self.assertEqual(json.loads(out)["error"]["type"], "wrong_state")
            with Daemon() as plain:  # no --dynamic-load-weight
                for transport in ["shm", "v1"]:
                    rc, out, err = fdctl(plain.port, "--transport", transport, "sleep")
                    self.assertEqual(rc, EXIT["not_found"], err)
                    rc, out, err = fdctl(plain.port, "--transport", transport, "clear-load-weight")
                    self.assertEqual(rc, EXIT["not_found"], err)
                    self.assertIn("Dynamic Load Weight Disabled.", err)

    def test_status_shows_the_staged_version_and_hints_speak_fdctl(self):
        """Issue #26: the one-line status names a staged version; the daemon's route hints reach
        an fdctl user as fdctl commands, over both transports (the --json body stays the daemon's)."""
        with Daemon("--dynamic-load-weight") as d:
            for transport, version in (("shm", "s1"), ("v1", "s2")):
                t = ["--transport", transport]
                rc, out, err = fdctl(d.port, *t, "update-weights", "--version", version)  # not paused
                self.assertEqual(rc, EXIT["wrong_state"], err)
                self.assertIn("run `fdctl pause` first", err)
                self.assertNotIn("POST /v1", err)
                rc, out, _ = fdctl(d.port, *t, "--json", "update-weights", "--version", version)
                self.assertIn("POST /v1/pause first", json.loads(out)["error"]["message"])  # the body is untouched
                self.assertEqual(fdctl(d.port, *t, "pause")[0], 0)
                rc, out, err = fdctl(d.port, *t, "commit-weights")  # nothing staged
                self.assertEqual(rc, EXIT["wrong_state"], err)
                self.assertIn("run `fdctl stage-weights --version V` first", err)
                self.assertNotIn("POST /v1", err)
                rc, out, err = fdctl(d.port, *t, "status")
                self.assertEqual(rc, 0, err)
                self.assertNotIn("staged", out)
                self.assertEqual(fdctl(d.port, *t, "stage-weights", "--version", version)[0], 0)
                rc, out, err = fdctl(d.port, *t, "status")
                self.assertEqual(rc, 0, err)
                self.assertTrue(out.startswith("state=paused paused=true"), out)
                self.assertIn(f"staged_weight_version={version}", out)
                self.assertEqual(fdctl(d.port, *t, "drop-staged-weights")[0], 0)
                rc, out, _ = fdctl(d.port, *t, "status")
                self.assertNotIn("staged", out)
                self.assertEqual(fdctl(d.port, *t, "resume")[0], 0)

    def test_usage_errors_send_nothing(self):
        for args in [["sleep", "--tags", "weights"], ["update-weights", "--version", "../x"], ["wait", "--until", "sleepy"],
                     ["frobnicate"], [], ["--transport", "carrier-pigeon", "status"],
                     # a --timeout past ~9e9 s overflowed the clocks' ticks (an instant timeout, or a wait that never ended)
                     ["--timeout", "1e16", "status"], ["--timeout", "0", "status"], ["--timeout", "nan", "status"],
                     # a tag list naming no tag is malformed, not "release everything"
                     ["sleep", "--tags", ",,"], ["wakeup", "--tags", " "],
                     ["--url", "http://127.0.0.1:1", "--transport", "shm", "status"]]:
            rc, out, err = fdctl(free_port(), *args)
            self.assertEqual(rc, EXIT["usage"], (args, err))
        rc, _, err = fdctl(free_port(), "--timeout", "0", "status")
        self.assertIn("--timeout must be a number of seconds > 0 and <= 1e7", err)
        rc, out, _ = fdctl(free_port(), "--help")
        self.assertEqual(rc, 0)
        self.assertIn("Exit codes", out)

    def test_url_names_the_daemon(self):
        # --url means that daemon over HTTP, whatever --port's control block would reach: with a
        # daemon on --port and nothing at the URL, fdctl says unreachable (it printed the local
        # daemon's status over shm before).
        with Daemon() as d:
            rc, out, err = fdctl(d.port, "--url", f"http://127.0.0.1:{free_port()}", "status")
            self.assertEqual(rc, EXIT["unreachable"], (out, err))
            rc, out, err = fdctl(free_port(), "--url", f"http://127.0.0.1:{d.port}", "--json", "status")
            self.assertEqual(rc, 0, err)
            self.assertEqual(json.loads(out)["state"], "serving")

    def test_wait_names_the_states_as_health_does(self):
        with Daemon("--dynamic-load-weight") as d:
            rc, out, err = fdctl(d.port, "sleep")
            self.assertEqual(rc, 0, err)
            for until in ["sleeping", "asleep", "paused"]:  # asleep: the old name, still accepted
                rc, out, err = fdctl(d.port, "wait", "--until", until, "--timeout", "5")
                self.assertEqual((rc, out), (0, "state=sleeping\n"), (until, err))
            self.assertEqual(d.get("/health")[1]["state"], "sleeping")
            rc, out, err = fdctl(d.port, "wait", "--until", "serving", "--timeout", "0.3")
            self.assertEqual(rc, EXIT["timeout"])
            self.assertIn("state is still 'sleeping', not serving", err)

    def test_version_and_unknown_subcommand(self):
        rc, out, err = fdctl(free_port(), "--version")
        self.assertEqual(rc, 0)
        self.assertRegex(out, r"^fdctl \d+\.\d+\.\d+ \(git \S+\)\n$")
        rc, out, err = fdctl(free_port(), "--json", "frobnicate", "--tags", "x")
        self.assertEqual(rc, EXIT["usage"])
        self.assertIn("unknown subcommand 'frobnicate'", err)
        self.assertIn("update-weights", err)  # the list of valid ones
        rc, out, err = fdctl(free_port(), "--timeout", "3", "pause", "--bogus")
        self.assertEqual(rc, EXIT["usage"])
        self.assertNotIn("unknown subcommand", err)

    def test_daemon_usage_errors_exit_2(self):
        from fdtest import BIN
        for args in [["--bogus"], ["--port", "x"], ["--log-format", "xml"], ["--update-staging", "maybe"],
                     # seconds past ~9e9 overflowed a deadline's ticks: bounded by 1e7
                     ["--request-timeout-s", "1e10"], ["--http-keep-alive-s", "1e300"]]:
            p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=30)
            self.assertEqual(p.returncode, EXIT["usage"], (args, p.stderr))
        p = subprocess.run([BIN, "--control-timeout-s", "1e10"], capture_output=True, text=True, timeout=30)  # a configuration check: 10
        self.assertEqual(p.returncode, 10, p.stderr)
        self.assertIn("--control-timeout-s must be > 0 and <= 1e7 seconds", p.stderr)
        p = subprocess.run([BIN, "--help"], capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 0)
        self.assertIn("Exit codes", p.stdout)

    def test_a_peer_that_drips_or_garbles_its_answer_is_not_a_success_and_never_hangs(self):
        """cpp-httplib's read timeout restarts with every byte: a peer answering one byte a second
        held `fdctl --url ... --timeout 3 status` (and --fleet) forever; a 200 whose body is not
        JSON counted as success, so a fleet update committed on the real members (probes)."""
        with MisbehavingPeer("drip") as peer:
            url = f"http://127.0.0.1:{peer.port}"
            t0 = time.monotonic()
            p = subprocess.run([FDCTL, "--url", url, "--timeout", "1", "status"], capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, EXIT["timeout"], p.stderr)
            self.assertLess(time.monotonic() - t0, 1 + 5 + 2)
            self.assertIn("no complete answer", p.stderr)
            p = subprocess.run([FDCTL, "--hosts", url, "--timeout", "1", "--json", "status"], capture_output=True, text=True, timeout=60)
            self.assertEqual(json.loads(p.stdout)["results"][0]["exit_code"], EXIT["timeout"], p.stdout)
        with MisbehavingPeer("garbage") as peer:
            url = f"http://127.0.0.1:{peer.port}"
            for args in (["--url", url, "pause"], ["--hosts", url, "pause"]):
                p = subprocess.run([FDCTL, *args], capture_output=True, text=True, timeout=60)
                self.assertEqual(p.returncode, EXIT["unreachable"], (args, p.stderr))
                self.assertIn("not JSON", p.stderr)

    def test_url_and_port_are_checked_before_any_call(self):
        """`--url http://HOST:PORT/` (a trailing slash) was "connection refused" against a running
        daemon, `--url ftp://x` an internal error (exit 70), `--port 70000` / `-1` "unreachable"
        (a probe): a trailing '/' is dropped; a path, a query, another scheme, and a port outside
        0..65535 are usage errors (exit 2). Port 0 stays valid: --fleet calls pass it to name no
        local daemon."""
        with Daemon() as d:
            p = subprocess.run([FDCTL, "--url", f"http://127.0.0.1:{d.port}/", "status"], capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 0, p.stderr)
        host = f"127.0.0.1:{free_port()}"
        for args in (["--url", "ftp://x"], ["--url", "notaurl"], ["--url", "http://127.0.0.1:1/v1"], ["--url", ""],
                     ["--url", "http://h:1?x=1"], ["--port", "70000"], ["--port", "-1"],
                     # were "connection refused" (exit 8), the fleet ones ignored the option (probes)
                     ["--url", "http://127.0.0.1:99999"], ["--url", "http://127.0.0.1:abc"], ["--url", "http://127.0.0.1:0"],
                     ["--hosts", host, "--transport", "shm"], ["--hosts", host, "--url", f"http://{host}"],
                     ["--timeout", "0x10"], ["--timeout", " 5"], ["--timeout", "inf"]):
            with self.subTest(args):
                p = subprocess.run([FDCTL, *args, "status"], capture_output=True, text=True, timeout=60)
                self.assertEqual(p.returncode, 2, (args, p.stderr))

    def test_a_json_service_that_is_not_fdrollout_is_not_a_success(self):
        """A 2xx JSON answer without fdrollout's fields (`200 {}`) counted as success for pause,
        update-weights, commit-weights (and a fleet update), and status exited 70 with a JSON
        type error (a probe): each is "not an fdrollout daemon", exit 8, as a non-JSON 200 is."""
        with MisbehavingPeer("json") as peer:
            url = f"http://127.0.0.1:{peer.port}"
            for args in (["pause"], ["update-weights", "--version", "v9"], ["commit-weights"], ["is-paused"], ["status"],
                         ["wait", "--until", "serving", "--timeout", "0.5"]):
                with self.subTest(args):
                    p = subprocess.run([FDCTL, "--url", url, *args], capture_output=True, text=True, timeout=60)
                    if args[0] == "wait":  # every poll is "not yet": it times out naming no state
                        self.assertEqual(p.returncode, EXIT["timeout"], p.stderr)
                        continue
                    self.assertEqual(p.returncode, EXIT["unreachable"], p.stderr)
                    self.assertIn("not an fdrollout", p.stderr)
            p = subprocess.run([FDCTL, "--hosts", url, "update-weights", "--version", "v9"], capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, EXIT["unreachable"], p.stderr)

    def test_status_over_v1_while_draining_is_the_shm_answer(self):
        """After SIGTERM /health answers 503 (for load balancers) with its usual body: `fdctl
        --transport v1 status` exited 70 printing "HTTP 503: {...}" where shm printed
        state=draining and exited 0 (a probe)."""
        d = Daemon("--shutdown-grace-s", "60", env={"FD_DEBUG_STEP_DELAY_MS": "50"})
        try:
            threading.Thread(target=lambda: self._ignore_errors(d.post, "/v1/completions",
                                                                {"prompt": "Once", "max_tokens": 400, "ignore_eos": True}),
                             daemon=True).start()
            wait_until(lambda: d.get("/health")[1]["num_requests_running"] == 1, 30, "the request running")
            d.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: d.get("/health", timeout=5)[1]["state"] == "draining", 30, "draining in /health")
            for t in ("shm", "v1"):
                rc, out, err = fdctl(d.port, "--transport", t, "status")
                self.assertEqual(rc, 0, (t, err))
                self.assertTrue(out.startswith("state=draining "), (t, out))
                rc, out, err = fdctl(d.port, "--transport", t, "--json", "status")
                self.assertEqual((rc, json.loads(out)["state"]), (0, "draining"), (t, err))
        finally:
            d.stop(signal.SIGKILL)
            d.__exit__(None)

    @staticmethod
    def _ignore_errors(fn, *args):
        try:
            fn(*args)
        except OSError:
            pass

    def test_daemon_killed_mid_call_over_v1_is_unreachable_at_once(self):
        """SIGKILL while `fdctl --transport v1 pause` waits: the connection closes at once, yet
        fdctl said exit 7 "no answer ... within --timeout + 5 s" after 0.15 s (a probe). It is
        exit 8 (as over shm), saying the daemon closed the connection and the outcome is unknown."""
        d = Daemon("--dynamic-load-weight", env={"FD_DEBUG_CONTROL_DELAY_MS": "5000"})
        try:
            p = subprocess.Popen([FDCTL, "--port", str(d.port), "--transport", "v1", "--timeout", "30", "pause"],
                                 stderr=subprocess.PIPE, text=True)
            wait_control_in_flight(d, "pause")
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
            _, err = p.communicate(timeout=40)
            self.assertEqual(p.returncode, EXIT["unreachable"], err)
            self.assertLess(time.monotonic() - t0, 3)
            self.assertIn("closed the connection", err)
            self.assertIn("outcome is unknown", err)
        finally:
            d.__exit__(None)
            with contextlib.suppress(OSError):
                os.unlink(SHM.format(d.port))

    def test_json_output_is_one_json_object_on_fdctls_own_errors_too(self):
        """With --json, errors fdctl finds itself (usage, no daemon, a bad checkpoint) printed
        nothing on stdout (a probe): a script reading --json got no object. Now stdout holds the
        daemon's control-error shape plus the exit code."""
        port = free_port()
        cases = [(["--port", str(port), "--json", "pause"], EXIT["unreachable"], "unreachable"),
                 (["--json", "sleep", "--tags", "bogus"], 2, "usage"),
                 (["--json", "--no-such-flag", "status"], 2, "usage"),
                 (["--json", "model-info", "--model", os.path.join(tempfile.gettempdir(), "no-such-model")], 5, "invalid_checkpoint"),
                 # these printed nothing on stdout (a probe): a wait that timed out, an unknown
                 # subcommand, a subcommand --hosts does not run
                 (["--port", str(port), "--json", "wait", "--until", "serving", "--timeout", "0.3"], EXIT["timeout"], "timeout"),
                 (["--json", "frobnicate"], 2, "usage"),
                 (["--json", "--hosts", f"127.0.0.1:{port}", "flush-cache"], 2, "usage"),
                 # a global option's own check failed before --json was stored: CLI11's text only (a probe)
                 (["--json", "--port", str(port), "--timeout", "0", "status"], 2, "usage"),
                 (["--json", "--port", "99999", "status"], 2, "usage"),
                 (["--json", "--transport", "http", "status"], 2, "usage")]
        for args, rc, etype in cases:
            with self.subTest(args):
                p = subprocess.run([FDCTL, *args], capture_output=True, text=True, timeout=60)
                self.assertEqual(p.returncode, rc, p.stderr)
                j = json.loads(p.stdout)
                self.assertEqual((j["status"], j["error"]["type"], j["exit_code"]), ("error", etype, rc), j)
                self.assertIn(j["error"]["message"], p.stderr)

    def test_no_daemon_is_unreachable_within_a_second(self):
        port = free_port()
        for transport in ["shm", "v1"]:
            t0 = time.time()
            rc, _, err = fdctl(port, "--transport", transport, "--timeout", "30", "pause")
            self.assertEqual(rc, EXIT["unreachable"], err)
            self.assertLess(time.time() - t0, 1.0)
        rc, _, _ = fdctl(port, "wait", "--until", "serving", "--timeout", "0.3")
        self.assertEqual(rc, EXIT["timeout"])

    def test_block_is_private_and_removed_on_exit(self):
        with Daemon() as d:
            st = os.stat(SHM.format(d.port))
            self.assertEqual(stat.S_IMODE(st.st_mode), 0o600)
            self.assertEqual(st.st_uid, os.getuid())
            port = d.port
        self.assertFalse(os.path.exists(SHM.format(port)))

    def test_foreign_or_mismatched_blocks_are_refused(self):
        port = free_port()
        path = SHM.format(port)
        try:
            with open(path, "wb") as f:
                f.write(b"NOTFDROL" + b"\0" * 40000)
            rc, _, err = fdctl(port, "status")  # mode 0644 (umask): refused before it is read at all
            self.assertEqual(rc, 13, err)
            self.assertIn("mode 0644", err)
            os.chmod(path, 0o600)
            rc, _, err = fdctl(port, "status")
            self.assertEqual(rc, 10, err)
            self.assertIn("another magic", err)
            with open(path, "r+b") as f:  # right magic, wrong ABI version
                f.write((0x42434C4C4F524446).to_bytes(8, "little") + (99).to_bytes(4, "little"))
            rc, _, err = fdctl(port, "status")
            self.assertIn("ABI version 99", err)
            # a daemon reclaims a block nobody alive owns
            with Daemon(env={}, wait=True):
                pass
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def test_daemon_killed_while_fdctl_waits_then_restarted(self):
        d = Daemon("--dynamic-load-weight", env={"FD_DEBUG_CONTROL_DELAY_MS": "4000"})
        try:
            p = subprocess.Popen([FDCTL, "--port", str(d.port), "--timeout", "10", "pause"], stderr=subprocess.PIPE, text=True)
            time.sleep(0.5)
            t0 = time.time()
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
            _, err = p.communicate(timeout=12)
            self.assertIn(p.returncode, (EXIT["unreachable"], EXIT["timeout"]), err)
            self.assertLess(time.time() - t0, 10)
            self.assertTrue(os.path.exists(SHM.format(d.port)))  # stale block left behind
            port = d.port
        finally:
            d.__exit__(None)
        with Daemon(env={}):  # a new daemon on another port is unaffected
            pass
        import fdtest
        orig = fdtest.free_port
        fdtest.free_port = lambda: port
        try:
            with Daemon() as restarted:  # same port: the stale block is reclaimed
                self.assertEqual(restarted.port, port)
                rc, out, _ = fdctl(port, "is-paused")
                self.assertEqual((rc, out.strip()), (0, "false"))
        finally:
            fdtest.free_port = orig

    def test_fdctl_killed_while_holding_the_mailbox(self):
        with Daemon("--dynamic-load-weight", env={"FD_DEBUG_CONTROL_DELAY_MS": "6000"}) as d:
            p = subprocess.Popen([FDCTL, "--port", str(d.port), "pause"])
            # Killed once its pause runs (posted, answer not yet written), not after a fixed time:
            # under load fdctl may not even have posted it 0.3 s after its start.
            wait_control_in_flight(d, "pause")
            self.assertIsNone(p.poll())  # still waiting for the answer: it holds the mailbox lock
            p.send_signal(signal.SIGKILL)
            p.wait()
            t0 = time.time()
            # Another call takes another mailbox slot (answered at once, mid-pause: not behind the
            # dead client's pause in its slot, as a probe saw), and the dead client's pause still happens.
            rc, out, err = fdctl(d.port, "--timeout", "2", "is-paused")
            self.assertEqual((rc, out.strip()), (0, "false"), err)
            rc, _, err = fdctl(d.port, "--timeout", "2", "status")
            self.assertEqual(rc, 0, err)
            rc, _, err = fdctl(d.port, "--timeout", "10", "wait", "--until", "paused")
            self.assertEqual(rc, 0, err)
            rc, out, err = fdctl(d.port, "--timeout", "10", "is-paused")
            self.assertEqual((rc, out.strip()), (0, "true"), err)
            self.assertLess(time.time() - t0, 10)
            # The dead client's slot is taken over: four calls at once still all get a slot.
            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                for rc, _, err in ex.map(lambda _: fdctl(d.port, "--timeout", "10", "status"), range(4)):
                    self.assertEqual(rc, 0, err)

    def test_a_long_call_does_not_hold_up_status_is_paused_or_another_command(self):
        """The block has several mailbox slots: while one fdctl's sleep runs (stretched to 8 s),
        status, is-paused and wait answer over shm at once, as over HTTP (ABI 3 had one mailbox:
        they waited for the lock and exited 7)."""
        with Daemon("--dynamic-load-weight", env={"FD_DEBUG_CONTROL_DELAY_MS": "8000"}) as d:
            p = subprocess.Popen([FDCTL, "--port", str(d.port), "--timeout", "30", "sleep"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            wait_control_in_flight(d, "sleep")
            t0 = time.time()
            rc, out, err = fdctl(d.port, "--timeout", "3", "status")
            self.assertEqual(rc, 0, err)
            self.assertIn("state=serving", out)  # the sleep has not taken effect yet
            rc, out, err = fdctl(d.port, "--timeout", "3", "is-paused")
            self.assertEqual((rc, out.strip()), (0, "false"), err)
            rc, out, err = fdctl(d.port, "--timeout", "3", "--json", "status")
            self.assertEqual(json.loads(out)["control_in_flight"], "sleep", err)
            self.assertLess(time.time() - t0, 3)
            out, err = p.communicate(timeout=30)
            self.assertEqual(p.returncode, 0, err)
            rc, out, err = fdctl(d.port, "--timeout", "3", "wait", "--until", "sleeping")
            self.assertEqual(rc, 0, err)

    def test_eight_concurrent_calls_are_all_answered(self):
        with Daemon("--dynamic-load-weight") as d:
            results = [None] * 8
            cmds = [["pause"], ["is-paused"], ["status"], ["resume"], ["is-paused"], ["pause"], ["status"], ["resume"]]

            def run(i):
                results[i] = fdctl(d.port, "--json", "--timeout", "30", *cmds[i])

            threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            for (rc, out, err), cmd in zip(results, cmds):
                self.assertEqual(rc, 0, (cmd, err))
                j = json.loads(out)
                if cmd[0] in ("pause", "resume"):
                    self.assertEqual(j["result"]["is_paused"], cmd[0] == "pause")  # its own answer, not another's
                elif cmd[0] == "is-paused":
                    self.assertIn("is_paused", j)
                else:
                    self.assertIn("state", j)
            _, m = d.get("/metrics")
            self.assertIn('fdrollout_control_ops_total{op="pause"} 2', m)
            self.assertIn('fdrollout_control_ops_total{op="resume"} 2', m)

    def test_rl_loop_example_script(self):
        src = copy_checkpoint(STORIES, os.path.join(self.tmp, "rl"))
        steps = {}
        for step in (1, 2):
            steps[step] = perturbed(STORIES, os.path.join(self.tmp, f"step{step}"), seed=100 + step)
        train = f"cp {self.tmp}/step$STEP/model.safetensors {src}/model.safetensors"
        with Daemon("--dynamic-load-weight", model=src) as d:
            p = subprocess.run(["bash", os.path.join(REPO, "scripts", "rl_loop_example.sh"), "--port", str(d.port), "--rounds", "2",
                                "--train-cmd", train], capture_output=True, text=True, timeout=120, env={**os.environ, "FDCTL": FDCTL})
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("round 1: rollout of 4 completions from weight_version 0", p.stdout)
            self.assertIn("round 2: rollout of 4 completions from weight_version step-1", p.stdout)
            self.assertIn("round 2: now serving step-2", p.stdout)
            got = d.complete(prompt="Once upon a time", max_tokens=30, temperature=0)
            self.assertEqual(got["weight_version"], "step-2")
        with fresh_daemon(steps[2]) as fresh:
            want = fresh.complete(prompt="Once upon a time", max_tokens=30, temperature=0)
        self.assertEqual(got["choices"][0]["token_ids"], want["choices"][0]["token_ids"])
        # a broken trainer step: the script fails with fdctl's code and the old weights keep serving
        with Daemon("--dynamic-load-weight", model=src) as d:
            p = subprocess.run(["bash", os.path.join(REPO, "scripts", "rl_loop_example.sh"), "--port", str(d.port), "--rounds", "1",
                                "--train-cmd", f"truncate -s 1000 {src}/model.safetensors"],
                               capture_output=True, text=True, timeout=120, env={**os.environ, "FDCTL": FDCTL})
            self.assertEqual(p.returncode, EXIT["invalid_checkpoint"], p.stderr)
            self.assertIn("previous weights keep serving", p.stderr)
            self.assertEqual(d.complete(prompt="Once upon a time", max_tokens=30, temperature=0)["choices"][0]["token_ids"],
                             want["choices"][0]["token_ids"])

    def test_cron_maintenance_script(self):
        with Daemon("--dynamic-load-weight") as d:
            p = subprocess.run(["bash", os.path.join(REPO, "scripts", "cron_maintenance.sh"), "--port", str(d.port)],
                               capture_output=True, text=True, timeout=120, env={**os.environ, "FDCTL": FDCTL})
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertRegex(p.stdout, r"^\d{4}-\d\d-\d\dT\S+Z fdrollout:\d+ OK sleep/wakeup: asleep: kv_cache,weight; freed kv_cache=40.0 MiB weight=1.0 MiB; rss \S+ MiB -> \S+ MiB; now state=serving")
            self.assertEqual(d.complete(prompt="Lily and Tom", max_tokens=60, temperature=0)["choices"][0]["token_ids"], REF["Lily and Tom"]["ids"])
        with Daemon() as plain:  # without --dynamic-load-weight the sleep fails and the log says so
            p = subprocess.run(["bash", os.path.join(REPO, "scripts", "cron_maintenance.sh"), "--port", str(plain.port)],
                               capture_output=True, text=True, timeout=120, env={**os.environ, "FDCTL": FDCTL})
            self.assertEqual(p.returncode, EXIT["not_found"])
            self.assertIn("FAIL sleep (exit 3)", p.stdout)


if __name__ == "__main__":
    unittest.main()
