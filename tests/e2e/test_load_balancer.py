"""A fleet behind an existing load balancer (issue #13): scripts/fleet_nginx.conf filled in for
two daemons on loopback, one rsync store feeding both. Rollout clients keep generating through
nginx while `fdctl --fleet` pauses, updates and resumes the fleet: every answer is a 200 whose
tokens equal a fresh daemon's on the weight_version it reports, or a 503 (paused, nothing
generated); afterwards every answer is on the new version. Control routes are not proxied."""
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import unittest

from fdtest import copy_checkpoint, Daemon, fdctl, free_port, GREEDY, http_request, perturbed, REPO, STORIES

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


def post(port, path, body, timeout=60):
    return http_request(port, "POST", path, body, timeout=timeout)


def probe(port, finish=None):
    """(status, token ids, weight_version) of the greedy probe through `port`; finish_reason
    appended to `finish` when given."""
    status, j = post(port, "/v1/completions", GREEDY)
    if status != 200:
        return status, None, None
    if finish is not None:
        finish.append(j["choices"][0]["finish_reason"])
    return status, j["choices"][0]["token_ids"], j["weight_version"]


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

        def stop():
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.addCleanup(stop)
        deadline = time.time() + 20
        while time.time() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                self.fail(f"nginx exited with {proc.returncode}: {log.read()}")
            try:
                if probe(port)[0] == 200:
                    return port
            except OSError:
                pass
            time.sleep(0.05)
        self.fail("nginx did not come up")

    def test_fleet_update_through_nginx(self):
        A = copy_checkpoint(STORIES, os.path.join(self.tmp, "A"))
        B = perturbed(STORIES, os.path.join(self.tmp, "B"), seed=21)
        store = os.path.join(self.tmp, "store")
        rc, _, err = fdctl(0, "publish", "--strategy", "rsync", "--from", B, "--store", store, "--version", "v2")
        self.assertEqual(rc, 0, err)
        want = {}
        with Daemon(model=B) as fresh:
            want["v2"] = probe(fresh.port)[1]
        daemons = []
        for i in range(2):
            cfg = {"source": store, "staging_dir": os.path.join(self.tmp, f"staging{i}")}
            d = Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", json.dumps(cfg), model=A)
            self.addCleanup(d.__exit__, None)
            daemons.append(d)
        old = daemons[0].get("/health")[1]["weight_version"]
        want[old] = probe(daemons[0].port)[1]
        self.assertNotEqual(want[old], want["v2"])
        port = self.start_nginx(daemons)

        # control routes are not proxied
        status, j = post(port, "/v1/pause", {})
        self.assertEqual(status, 404, j)
        self.assertFalse(daemons[0].get("/health")[1]["is_paused"])

        seen, stop = [], threading.Event()

        def client():
            while not stop.is_set():
                finish = []
                seen.append((*probe(port, finish), finish[0] if finish else None))

        threads = [threading.Thread(target=client) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.3)
            hosts = ",".join(f"127.0.0.1:{d.port}" for d in daemons)
            for args in (["pause"], ["update-weights", "--version", "v2"], ["resume"]):
                rc, out, err = fdctl(0, "--hosts", hosts, *args)
                self.assertEqual(rc, 0, (args, out, err))
            time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        statuses = {s for s, _, _, _ in seen}
        self.assertLessEqual(statuses, {200, 503}, statuses)
        for status, ids, version, finish in seen:
            if status != 200:
                continue
            # tokens always match the version reported; a request the pause cut short ends with
            # finish_reason abort and the tokens it had, a prefix of that version's output
            if finish == "abort":
                self.assertEqual(ids, want[version][:len(ids)], version)
            else:
                self.assertEqual(ids, want[version], version)
        self.assertIn(old, {v for _, _, v, _ in seen})
        self.assertIn("v2", {v for _, _, v, _ in seen})
        for _ in range(4):  # after the update: every daemon behind nginx serves v2
            self.assertEqual(probe(port)[1:], (want["v2"], "v2"))


if __name__ == "__main__":
    unittest.main()
