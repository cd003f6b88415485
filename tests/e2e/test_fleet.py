"""fdctl --fleet / --hosts (issue #13): three daemons on loopback, each fed from an rsync store
(local path). A fleet update-weights where one daemon's copy of the version is corrupt leaves
all three on the old version (staged everywhere else, then dropped everywhere); a good version
then lands on all three, and every daemon's greedy output equals a fresh daemon's on it.
Per-host results (text and --json) and the documented exit codes for partial failure; `fdctl
wait --until` on a fleet (FleetWait); the update's exit codes in every partial-failure case (issue #29, FleetFaults)."""
import json
import os
import shutil
import tempfile
import unittest

from fdtest import copy_checkpoint, Daemon, fdctl, free_port, greedy, perturbed, STORIES
from fleet_fakes import serve_fake


def publish(src, store, version):
    rc, out, err = fdctl(0, "publish", "--strategy", "rsync", "--from", src, "--store", store, "--version", version)
    assert rc == 0, (rc, out, err)


class Fleet(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-fleet-")
        A = copy_checkpoint(STORIES, os.path.join(cls.tmp, "A"))
        B = perturbed(STORIES, os.path.join(cls.tmp, "B"), seed=7)
        C = perturbed(STORIES, os.path.join(cls.tmp, "C"), seed=9)
        cls.A = A
        good, bad = os.path.join(cls.tmp, "store-good"), os.path.join(cls.tmp, "store-bad")
        for store in (good, bad):
            publish(B, store, "v2")
            publish(C, store, "v3")
        st = os.path.join(bad, "v2", "model.safetensors")
        os.truncate(st, os.path.getsize(st) - 4)  # this daemon's copy of v2 is corrupt
        cls.out = {}
        for name, model in (("A", A), ("B", B), ("C", C)):
            with Daemon(model=model) as fresh:
                cls.out[name] = greedy(fresh)[:2]
        assert len({str(v[0]) for v in cls.out.values()}) == 3
        cls.daemons = []
        for i, store in enumerate((good, good, bad)):
            cfg = {"source": store, "staging_dir": os.path.join(cls.tmp, f"staging{i}")}
            cls.daemons.append(Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", json.dumps(cfg),
                                      model=A))
        cls.hosts = ",".join(f"127.0.0.1:{d.port}" for d in cls.daemons)
        cls.fleet_file = os.path.join(cls.tmp, "fleet.txt")
        with open(cls.fleet_file, "w") as f:
            f.write("# the rollout fleet\n" + "\n".join(f"http://127.0.0.1:{d.port}/" for d in cls.daemons) + "\n\n")

    @classmethod
    def tearDownClass(cls):
        for d in cls.daemons:
            d.__exit__(None)
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def fleet(self, *args):
        return fdctl(0, "--hosts", self.hosts, *args)

    def versions(self):
        return [(d.get("/health")[1]["weight_version"], d.get("/health")[1]["staged_weight_version"]) for d in self.daemons]

    def test_fleet_update_is_all_or_nothing(self):
        start = self.versions()
        self.assertEqual(len(set(start)), 1)
        # not paused: every host refuses alike -> that code (4 wrong_state), nothing changes
        rc, out, err = self.fleet("update-weights", "--version", "v3")
        self.assertEqual(rc, 4, err)
        self.assertEqual(self.versions(), start)
        rc, out, err = fdctl(0, "--fleet", self.fleet_file, "pause")
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.count(": ok"), 3, out)
        # v2 is corrupt on the third daemon: staged on two, dropped everywhere, all keep the old version
        rc, out, err = self.fleet("--json", "update-weights", "--version", "v2")
        self.assertEqual(rc, 20, err)
        rep = json.loads(out)
        self.assertFalse(rep["ok"])
        self.assertEqual([h["ok"] for h in rep["stage"]], [True, True, False])
        self.assertEqual(rep["stage"][2]["body"]["error"]["type"], "invalid_checkpoint")
        self.assertEqual([h["ok"] for h in rep["drop"]], [True, True])  # not on the third: its stage was refused (422)
        self.assertNotIn("commit", rep)
        self.assertEqual(self.versions(), start)
        self.assertEqual(self.fleet("resume")[0], 0)
        for d in self.daemons:
            self.assertEqual(greedy(d)[:2], self.out["A"])
        # a good version lands everywhere, and the command checks it
        self.assertEqual(self.fleet("pause")[0], 0)
        rc, out, err = self.fleet("update-weights", "--version", "v3")
        self.assertEqual(rc, 0, err)
        self.assertIn("serves weight_version v3", out)
        self.assertEqual(out.count("commit: ok"), 3, out)
        self.assertEqual(self.versions(), [("v3", None)] * 3)
        rc, out, err = fdctl(0, "--fleet", self.fleet_file, "--json", "resume")
        self.assertEqual(rc, 0, err)
        self.assertEqual([r["ok"] for r in json.loads(out)["results"]], [True] * 3)
        for d in self.daemons:
            out = greedy(d)
            self.assertEqual(out[:2], self.out["C"])
            self.assertEqual(out[2], "v3")

    def test_a_commit_that_fails_on_one_host_is_reported_inconsistent(self):
        def serve(commit_status, health_version):
            return serve_fake(self, commit_status=commit_status, health_version=health_version)

        good = serve(200, "v3")  # stages, commits, reports v3
        for bad, seen in ((serve(409, "old"), "old"), (serve(200, "other"), "other")):
            rc, out, err = fdctl(0, "--hosts", f"{good},{bad}", "--json", "update-weights", "--version", "v3")
            self.assertEqual(rc, 21, (out, err))
            rep = json.loads(out)
            self.assertIn("INCONSISTENT", rep["outcome"])
            self.assertEqual([h["ok"] for h in rep["stage"]], [True, True])
            self.assertEqual(rep["weight_versions"], {f"http://{good}": "v3", f"http://{bad}": seen})

    def test_partial_failure_exit_codes(self):
        dead = f"127.0.0.1:{free_port()}"
        rc, out, err = fdctl(0, "--hosts", f"{self.hosts},{dead}", "--timeout", "5", "--json", "is-paused")
        self.assertEqual(rc, 20, err)
        res = json.loads(out)["results"]
        self.assertEqual([r["ok"] for r in res], [True, True, True, False])
        self.assertEqual(res[3]["exit_code"], 8)
        self.assertIn("3 of 4 hosts", err)
        rc, out, err = fdctl(0, "--hosts", dead, "--timeout", "5", "status")
        self.assertEqual(rc, 8, err)  # every host failed alike: that failure's code
        for bad in (["--hosts", f"{dead},{dead}", "pause"], ["--hosts", "nohostport", "pause"],
                    ["--hosts", self.hosts, "update-weights"], ["--fleet", os.path.join(self.tmp, "missing"), "pause"]):
            rc, _, err = fdctl(0, *bad)
            self.assertEqual(rc, 2, (bad, err))


class FleetWait(unittest.TestCase):
    def test_wait_on_a_fleet(self):
        with Daemon() as a, Daemon() as b:
            hosts = f"127.0.0.1:{a.port},127.0.0.1:{b.port}"
            self.assertEqual(a.post("/v1/pause")[0], 200)
            rc, out, err = fdctl(0, "--hosts", hosts, "--timeout", "0.5", "--json", "wait", "--until", "paused")
            self.assertEqual(rc, 20, (out, err))  # one host paused, the other timed out: partial
            res = {r["host"]: r for r in json.loads(out)["results"]}
            self.assertTrue(res[f"http://127.0.0.1:{a.port}"]["ok"])
            self.assertEqual(res[f"http://127.0.0.1:{b.port}"]["exit_code"], 7)
            self.assertEqual(b.post("/v1/pause")[0], 200)
            rc, out, err = fdctl(0, "--hosts", hosts, "--timeout", "5", "wait", "--until", "paused")
            self.assertEqual(rc, 0, err)
            self.assertEqual(out.count("wait: ok  state=paused"), 2, out)
            rc, out, err = fdctl(0, "--hosts", hosts, "--timeout", "0.5", "wait", "--until", "serving")
            self.assertEqual(rc, 7, err)  # every host timed out alike


class FleetFaults(unittest.TestCase):
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

    def fake(self, commit_status, health_version, drops):
        return serve_fake(self, commit_status=commit_status, health_version=health_version, drops=drops)

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


class FleetSplit(unittest.TestCase):
    """A probe's fleet defects: an update of a fleet already split (one host committed 300, the
    other only staged it) exited 20 "every host keeps its old version" and its rollback dropped the
    other host's staged 300 (refused with 409 because it was staged there); a rollback dropped on
    hosts whose stage was refused or never connected; commit-weights without --version committed
    what each host had staged; `--hosts ""` ran on the local daemon; stage-weights' lines said
    update_weights; the stage-twice hint named HTTP routes."""

    def fake(self, **kw):
        return serve_fake(self, **kw)

    def test_an_update_of_a_split_fleet_is_21_and_keeps_a_staged_copy(self):
        with Daemon("--dynamic-load-weight", extra=False) as a, Daemon("--dynamic-load-weight", extra=False) as b:
            hosts = f"127.0.0.1:{a.port},127.0.0.1:{b.port}"
            ha, hb = f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{b.port}"
            self.assertEqual(fdctl(0, "--hosts", hosts, "pause")[0], 0)
            rc, stage_out, err = fdctl(0, "--hosts", hosts, "stage-weights", "--version", "300")
            self.assertEqual(rc, 0, err)
            self.assertEqual(fdctl(0, "--hosts", hosts.split(",")[0], "commit-weights", "--version", "300")[0], 0)
            rc, out, err = fdctl(0, "--hosts", hosts, "--json", "update-weights", "--version", "300")
            self.assertEqual(rc, 21, (out, err))
            rep = json.loads(out)
            self.assertEqual(rep["weight_versions"], {ha: "300", hb: "0"})
            self.assertEqual(rep["stage"][1]["http_status"], 409)
            self.assertNotIn(hb, [h["host"] for h in rep["drop"]])  # refused: the copy there is not this update's
            self.assertIn(f"serving 300: {ha}; not serving it: {hb} (0)", rep["outcome"])
            self.assertEqual(b.get("/health")[1]["staged_weight_version"], "300")
            self.assertIsNone(a.get("/health")[1]["staged_weight_version"])
            rc, out, err = fdctl(0, "--hosts", hosts, "update-weights", "--version", "300")
            self.assertEqual(rc, 21, (out, err))
            self.assertIn("run `fdctl commit-weights` or `fdctl drop-staged-weights` first", err)
            self.assertEqual(stage_out.count("stage_weights: ok  staged weight_version 300"), 2, stage_out)

    def test_every_commit_refused_on_a_split_fleet_is_21(self):
        drops = []
        hosts = [self.fake(commit_status=409, health_version=v, drops=drops) for v in ("old", "older")]
        rc, out, err = fdctl(0, "--hosts", ",".join(hosts), "--timeout", "5", "--json", "update-weights", "--version", "v3")
        self.assertEqual(rc, 21, (out, err))
        self.assertIn("this update committed nothing, but the hosts serve different versions", json.loads(out)["outcome"])
        self.assertEqual(len(drops), 2)

    def test_the_rollback_drops_only_where_this_update_may_have_staged(self):
        drops = []
        ok = self.fake(health_version="old", drops=drops)
        refused = self.fake(stage_status=409, health_version="old", drops=drops)
        late = self.fake(stage_status=504, drop_status=503, health_version="old", drops=drops)
        dead = f"127.0.0.1:{free_port()}"
        rc, out, err = fdctl(0, "--hosts", ",".join([ok, refused, late, dead]), "--timeout", "5", "--json", "update-weights",
                             "--version", "v3")
        self.assertEqual(rc, 20, (out, err))
        rep = json.loads(out)
        self.assertEqual([h["host"] for h in rep["drop"]], [f"http://{ok}", f"http://{late}"])
        self.assertEqual(sorted(drops), sorted(int(h.rsplit(":", 1)[1]) for h in (ok, late)))
        self.assertIn(f"could not be dropped on http://{late} (exit 14)", rep["outcome"])
        self.assertNotIn(dead, rep["outcome"].split("could not be dropped")[1])

    def test_a_fleet_commit_needs_a_version(self):
        log = []
        hosts = ",".join(self.fake(log=log) for _ in range(2))
        rc, out, err = fdctl(0, "--hosts", hosts, "commit-weights")
        self.assertEqual(rc, 2, (out, err))
        self.assertIn("a fleet commit-weights needs --version", err)
        self.assertEqual(log, [])

    def test_an_empty_fleet_option_is_an_empty_fleet(self):
        log = []
        port = int(self.fake(log=log).rsplit(":", 1)[1])  # the "local" daemon an empty --hosts fell back to
        for opt in ("--hosts", "--fleet"):
            rc, out, err = fdctl(port, "--transport", "v1", opt, "", "pause")
            self.assertEqual(rc, 2, (opt, out, err))
            self.assertIn("the fleet is empty", err)
        self.assertEqual(log, [])


if __name__ == "__main__":
    unittest.main()
