"""A fleet behind an existing load balancer (issue #13): scripts/fleet_nginx.conf filled in for
two daemons on loopback, one rsync store feeding both. Rollout clients keep generating through
nginx while `fdctl --fleet` pauses, updates and resumes the fleet: every answer is a 200 whose
tokens equal a fresh daemon's on the weight_version it reports, or a 503 (paused, nothing
generated); afterwards every answer is on the new version. Control routes are not proxied.
(The scenario: lb_scenario.py; the same with HAProxy: test_haproxy.py.)"""
import os
import shutil
import subprocess
import tempfile
import unittest

from fdtest import free_port, REPO
from lb_scenario import fleet_update_through, wait_up

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


@unittest.skipUnless(NGINX, "nginx not installed (scripts/install_deps.sh installs nginx-light)")
class LoadBalancer(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="fd-lb-")
        os.chmod(self.tmp, 0o755)  # nginx workers run as another user
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def start_nginx(self, daemons):
        prefix = os.path.join(self.tmp, "nginx")
        os.makedirs(os.path.join(prefix, "logs"))
        os.chmod(prefix, 0o755)
        port = free_port()
        with open(os.path.join(REPO, "scripts", "fleet_nginx.conf")) as f:
            conf = f.read()
        conf = (conf.replace("@PREFIX@", prefix).replace("@LISTEN@", f"127.0.0.1:{port}")
                .replace("@SERVERS@", "\n        ".join(f"server 127.0.0.1:{d.port} max_fails=0;" for d in daemons)))
        path = os.path.join(prefix, "fleet.conf")
        with open(path, "w") as f:
            f.write(conf)
        log = open(os.path.join(prefix, "stderr.log"), "w+")
        self.addCleanup(log.close)
        proc = subprocess.Popen([NGINX, "-p", prefix, "-c", path, "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=log)
        return wait_up(self, proc, port, log, "nginx")

    def test_fleet_update_through_nginx(self):
        fleet_update_through(self, self.tmp, self.start_nginx)


if __name__ == "__main__":
    unittest.main()
