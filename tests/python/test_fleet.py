"""fdrollout.Fleet (python/fdrollout/fleet.py) against three real daemons: parallel control, the
all-or-nothing fleet update (committed everywhere, or dropped everywhere when one member cannot
stage, with each member still serving its old version, checked against a fresh daemon), a
member that is down, and the fleet file format."""
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from fdtest import STORIES, Daemon, copy_checkpoint, free_port, fresh_daemon, greedy, perturbed  # noqa: E402
from fdrollout import FdRolloutError, Fleet, FleetError, read_fleet_file  # noqa: E402
from fleet_fakes import serve_fake  # noqa: E402


class FleetCommitPhase(unittest.TestCase):
    """A probe: when no commit answered OK, Fleet said "none" without dropping the staged copies,
    and said "none" even when a member whose commit went unanswered serves the new version
    (fdctl's exit 21). Now as fdctl: "none" (and dropped everywhere) only when every member
    answered and none serves it; else "some"."""

    def members(self, *specs):
        log = []
        urls = [serve_fake(self, commit_status=c, health_version=v, commit_delay=delay, log=log) for c, v, delay in specs]
        return urls, log

    def test_every_commit_refused_drops_everywhere(self):
        urls, log = self.members((409, "old", 0), (409, "old", 0))
        with self.assertRaises(FleetError) as e:
            Fleet(urls, timeout=5).update_weights("v3")
        self.assertEqual(e.exception.committed, "none")
        self.assertEqual(log.count("/v1/drop_staged_weights"), 2)

    def test_an_unanswered_commit_that_took_is_some(self):
        urls, log = self.members((0, "v3", 1.5), (409, "old", 0))
        with self.assertRaises(FleetError) as e:
            Fleet(urls, timeout=0.5).update_weights("v3")
        self.assertEqual(e.exception.committed, "some")
        self.assertEqual(sorted(e.exception.serving.values()), ["old", "v3"])
        self.assertNotIn("/v1/drop_staged_weights", log)


class FleetRollback(unittest.TestCase):
    """A probe: a failed stage on a fleet split before the update said committed="none" ("every
    member keeps its old version"); a member whose stage failed and whose drop failed too kept
    only the stage error (nothing said a copy may be left staged); the rollback dropped where the
    stage was refused (a 409 may mean a trainer's version is staged there) or never connected.
    Now as fdctl: "some" when versions differ afterwards, `not_dropped`, and drops only where this
    update may have staged (staged, no answer, 504)."""

    def test_a_split_fleet_is_some(self):
        urls = [serve_fake(self, stage_status=422, health_version="300"), serve_fake(self, health_version="200")]
        with self.assertRaises(FleetError) as e:
            Fleet(urls, timeout=5).update_weights("300")
        self.assertEqual(e.exception.committed, "some")
        self.assertEqual(e.exception.serving, {"http://" + urls[0]: "300", "http://" + urls[1]: "200"})

    def test_every_commit_refused_on_a_split_fleet_is_some(self):
        log = []
        urls = [serve_fake(self, commit_status=409, health_version=v, log=log) for v in ("old", "older")]
        with self.assertRaises(FleetError) as e:
            Fleet(urls, timeout=5).update_weights("v3")
        self.assertEqual(e.exception.committed, "some")
        self.assertEqual(log.count("/v1/drop_staged_weights"), 2)

    def test_drops_only_where_this_update_may_have_staged(self):
        drops = []
        ok = serve_fake(self, drops=drops)
        refused = serve_fake(self, stage_status=409, drops=drops)
        late = serve_fake(self, stage_status=504, drops=drops)
        dead = f"127.0.0.1:{free_port()}"
        with self.assertRaises(FleetError) as e:
            Fleet([ok, refused, late, dead], timeout=5).update_weights("v3")
        self.assertEqual(sorted(drops), sorted(int(u.rsplit(":", 1)[1]) for u in (ok, late)))
        self.assertEqual(getattr(e.exception, "not_dropped", None), [])  # no drop tried on the dead member either
        self.assertEqual(e.exception.committed, "none")

    def test_a_copy_that_could_not_be_dropped_is_named(self):
        late = serve_fake(self, stage_status=504, drop_status=503)
        with self.assertRaises(FleetError) as e:
            Fleet([serve_fake(self), late], timeout=5).update_weights("v3")
        self.assertEqual(e.exception.results["http://" + late].status, 504)  # the stage's error stays its result
        self.assertEqual(getattr(e.exception, "not_dropped", None), ["http://" + late])
        self.assertIn(f"could not be dropped on http://{late}", str(e.exception))


class FleetOddMember(unittest.TestCase):
    """A probe: a member answering /health 200 with an empty body made Fleet.update_weights raise
    a bare TypeError after the commits (from the versions read after them), with no record of
    which member committed. Now that member's version is unknown and the update is "some"."""

    def test_a_member_that_is_not_fdrollout_after_the_commits(self):
        tmp = tempfile.mkdtemp(prefix="fd-pyfleet-odd-")
        self.addCleanup(shutil.rmtree, tmp, True)
        with Daemon("--dynamic-load-weight", model=copy_checkpoint(STORIES, os.path.join(tmp, "m"))) as d:
            odd, real = serve_fake(self, odd=True), f"127.0.0.1:{d.port}"
            f = Fleet([odd, real], timeout=30)
            f.pause()
            with self.assertRaises(FleetError) as e:
                f.update_weights("odd-1")
            self.assertEqual(e.exception.committed, "some")
            self.assertEqual(e.exception.serving, {"http://" + odd: None, "http://" + real: "odd-1"})
            self.assertEqual(e.exception.results["http://" + real]["version"], "odd-1")
            self.assertEqual(e.exception.results["http://" + odd], {})
            vs = f.weight_versions()
            self.assertEqual(vs["http://" + real], "odd-1")
            self.assertIsInstance(vs["http://" + odd], FdRolloutError)
            self.assertEqual(vs["http://" + odd].type, "unreachable")
            d.post("/v1/resume")
            self.assertEqual(greedy(d)[2], "odd-1")


class FleetUpdate(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd-pyfleet-")
        cls.new = perturbed(STORIES, os.path.join(cls.tmp, "new"))
        with fresh_daemon(cls.new) as ref:
            cls.ref_new = greedy(ref)[:2]
        with fresh_daemon(STORIES) as ref:
            cls.ref_old = greedy(ref)[:2]
        cls.models = [copy_checkpoint(STORIES, os.path.join(cls.tmp, f"m{i}")) for i in range(3)]
        cls.daemons = [Daemon("--dynamic-load-weight", model=m) for m in cls.models]
        cls.urls = [f"127.0.0.1:{d.port}" for d in cls.daemons]

    @classmethod
    def tearDownClass(cls):
        for d in cls.daemons:
            d.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def put(self, i, src):
        shutil.copyfile(os.path.join(src, "model.safetensors"), os.path.join(self.models[i], "model.safetensors"))

    def test_1_update_everywhere(self):
        f = Fleet(self.urls, timeout=60)
        self.assertEqual(set(f.pause()), set("http://" + u for u in self.urls))
        for i in range(3):
            self.put(i, self.new)
        res = f.update_weights("b")
        self.assertEqual({r["version"] for r in res.values()}, {"b"})
        f.resume()
        for d in self.daemons:
            self.assertEqual(greedy(d), (*self.ref_new, "b"))

    def test_2_one_member_cannot_stage_nothing_commits(self):
        f = Fleet(self.urls, timeout=60)
        f.pause()
        for i in range(3):
            self.put(i, STORIES)
        with open(os.path.join(self.models[1], "model.safetensors"), "r+b") as fh:
            fh.truncate(1000)  # member 1's checkpoint is broken: it cannot stage
        with self.assertRaises(FleetError) as e:
            f.update_weights("c")
        self.assertEqual(e.exception.committed, "none")
        self.assertEqual(set(e.exception.serving.values()), {"b"})
        bad = e.exception.results["http://" + self.urls[1]]
        self.assertIsInstance(bad, FdRolloutError)
        self.assertEqual(bad.type, "invalid_checkpoint")
        for url in f.members:
            self.assertIsNone(url.health()["staged_weight_version"], f"{url}: the staged copy was dropped")
        f.resume()
        for d in self.daemons:
            self.assertEqual(greedy(d), (*self.ref_new, "b"), "every member keeps serving its old version")

    def test_3_member_down(self):
        f = Fleet(self.urls + [f"127.0.0.1:{free_port()}"], timeout=10)
        with self.assertRaises(FleetError) as e:
            f.pause()
        down = [r for r in e.exception.results.values() if isinstance(r, Exception)]
        self.assertEqual([r.type for r in down], ["unreachable"])
        with self.assertRaises(FleetError) as e:
            f.update_weights("d")
        self.assertEqual(e.exception.committed, "none")
        Fleet(self.urls).resume()
        for d in self.daemons:
            self.assertEqual(greedy(d)[2], "b")

    def test_fleet_file(self):
        path = os.path.join(self.tmp, "fleet.txt")
        with open(path, "w") as fh:
            fh.write("# rollout fleet\n127.0.0.1:8001\n\nhttp://127.0.0.1:8002  # second\n")
        self.assertEqual(read_fleet_file(path), ["127.0.0.1:8001", "http://127.0.0.1:8002"])
        with self.assertRaises(ValueError):
            Fleet(["127.0.0.1:8001", "http://127.0.0.1:8001"])
        with self.assertRaises(ValueError):
            Fleet([])


if __name__ == "__main__":
    unittest.main()
