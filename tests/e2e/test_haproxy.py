"""The fleet behind HAProxy (issue #13): scripts/fleet_haproxy.cfg filled in for two daemons on
loopback, one rsync store feeding both, and the scenario of lb_scenario.py (the nginx test's):
rollout clients keep generating through HAProxy while `fdctl --hosts` pauses, updates and resumes
the fleet; every answer is a 200 on the tokens of the version it reports or a 503; afterwards
all on the new version; control routes are not proxied. Also: the config passes `haproxy -c`,
and a stream through HAProxy keeps the client's X-Request-Id, so `fdctl --hosts ... abort ID`
finds and ends it on its daemon.

Exits 77 (CTest: Skipped) only when haproxy is not installed (scripts/install_deps.sh installs it)."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from fdtest import fdctl, free_port, REPO
from lb_scenario import fleet_update_through, wait_up
from test_abort import Stream

HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)


class HAProxy(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="fd-haproxy-")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def config(self, daemons, port):
        with open(os.path.join(REPO, "scripts", "fleet_haproxy.cfg")) as f:
            conf = f.read()
        conf = (conf.replace("@PREFIX@", self.tmp).replace("@LISTEN@", f"127.0.0.1:{port}")
                .replace("@SERVERS@", "\n    ".join(f"server d{i} 127.0.0.1:{d.port} check" for i, d in enumerate(daemons))))
        path = os.path.join(self.tmp, "fleet.cfg")
        with open(path, "w") as f:
            f.write(conf)
        return path

    def start_haproxy(self, daemons):
        port = free_port()
        path = self.config(daemons, port)
        check = subprocess.run([HAPROXY, "-c", "-f", path], capture_output=True, text=True)
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
        log = open(os.path.join(self.tmp, "stderr.log"), "w+")
        self.addCleanup(log.close)
        proc = subprocess.Popen([HAPROXY, "-f", path, "-db"], stdout=log, stderr=log)
        return wait_up(self, proc, port, log, "haproxy")

    def test_fleet_update_through_haproxy(self):
        daemons, port = fleet_update_through(self, self.tmp, self.start_haproxy, env={"FD_DEBUG_STEP_DELAY_MS": "5"})
        # A stream flows through HAProxy chunk by chunk with the client's X-Request-Id, so
        # `fdctl --hosts ... abort ID` (the control route is not proxied) finds it on its daemon.
        s = Stream(port, headers={"X-Request-Id": "rollout-lb-1"})
        hosts = ",".join(f"127.0.0.1:{d.port}" for d in daemons)
        rc, out, err = fdctl(0, "--hosts", hosts, "abort", "rollout-lb-1")
        self.assertEqual(rc, 0, (out, err))
        self.assertIn("aborted 1 choice(s)", out)
        finish, tokens = s.finish()
        self.assertEqual(finish, "abort")
        self.assertLess(len(tokens), 150)

if __name__ == "__main__":
    if not HAPROXY:
        print("skipped: haproxy not installed (scripts/install_deps.sh installs it)")
        sys.exit(77)  # CTest SKIP_RETURN_CODE: reported as Skipped, not Passed
    unittest.main()
