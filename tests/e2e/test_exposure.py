"""Exposure (issue 12, defect 9): a daemon reachable from other machines needs a key, and the
weight-control routes can have their own key. `--host` other than loopback without `--api-key`
refuses to start (exit 10) unless `--allow-unauthenticated` (then a loud warning); with
`--control-api-key`, the control routes (V1 and legacy) accept that key only and the completions
key (`--api-key`) opens generation only; /health and /metrics stay open."""
import os
import subprocess
import unittest

from fdtest import BIN, STORIES, Daemon, fdctl, free_port, wait_until

EXIT_INVALID_ARGUMENT, EXIT_UNAUTHORIZED = 10, 9
GOOD = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


class Exposure(unittest.TestCase):
    def test_a_non_loopback_host_without_a_key_refuses_to_start(self):
        for host in ("0.0.0.0", "::"):
            with self.subTest(host):
                p = subprocess.run([BIN, "--model", STORIES, "--host", host, "--port", str(free_port())],
                                   capture_output=True, text=True, timeout=60)
                self.assertEqual(p.returncode, EXIT_INVALID_ARGUMENT, p.stderr)
                self.assertIn("--api-key", p.stderr)
                self.assertIn("--allow-unauthenticated", p.stderr)
        # FD_HOST counts the same as --host.
        p = subprocess.run([BIN, "--model", STORIES, "--port", str(free_port())], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "FD_HOST": "0.0.0.0"})
        self.assertEqual(p.returncode, EXIT_INVALID_ARGUMENT, p.stderr)

    def test_allow_unauthenticated_starts_with_a_loud_warning(self):
        with Daemon("--host", "0.0.0.0", "--allow-unauthenticated") as d:
            self.assertEqual(d.post("/v1/completions", GOOD)[0], 200)
            out = d.output()
        self.assertIn("WITHOUT an API key", out)
        self.assertIn("REPLACE THE WEIGHTS", out)

    def test_an_ipv6_address_is_logged_bracketed(self):
        """The start-up line said "listening on http://::1:PORT", not a URL a client can use."""
        d = Daemon("--host", "::1", wait=False)
        try:
            wait_until(lambda: "listening on" in d.output() or d.proc.poll() is not None, 60, "the listening line")
            self.assertIn(f"listening on http://[::1]:{d.port}\n", d.output())
        finally:
            d.__exit__(None)

    def test_a_key_makes_a_non_loopback_host_start(self):
        with Daemon("--host", "0.0.0.0", "--api-key", "k1") as d:
            self.assertEqual(d.post("/v1/completions", GOOD)[0], 401)
            self.assertEqual(d.post("/v1/completions", GOOD, headers=bearer("k1"))[0], 200)
            self.assertNotIn("WITHOUT an API key", d.output())

    def test_the_control_key_guards_the_control_routes_separately(self):
        with Daemon("--api-key", "gen", "--control-api-key", "ctl", "--dynamic-load-weight") as d:
            # generation and models: the completions key only
            self.assertEqual(d.post("/v1/completions", GOOD, headers=bearer("gen"))[0], 200)
            self.assertEqual(d.post("/v1/completions", GOOD, headers=bearer("ctl"))[0], 401)
            self.assertEqual(d.get("/v1/models", headers=bearer("gen"))[0], 200)
            # control routes, V1 and legacy: the control key only
            for method, path in [("POST", "/v1/pause"), ("GET", "/v1/is_paused"), ("POST", "/v1/resume"),
                                 ("POST", "/v1/update_weights"), ("GET", "/clear_load_weight"), ("GET", "/update_model_weight")]:
                with self.subTest(path):
                    for headers in ({}, bearer("gen"), bearer("ctl-wrong")):
                        status, j = d.request(method, path, headers=headers)
                        self.assertEqual(status, 401, (path, headers, j))
                        self.assertEqual(j["error"]["type"], "unauthorized")
            self.assertEqual(d.post("/v1/pause", headers=bearer("ctl"))[0], 200)
            self.assertTrue(d.get("/v1/is_paused", headers=bearer("ctl"))[1]["is_paused"])
            self.assertEqual(d.post("/v1/resume", headers=bearer("ctl"))[0], 200)
            # open: health and metrics
            self.assertEqual(d.get("/health")[0], 200)
            self.assertEqual(d.get("/metrics")[0], 200)
            # fdctl over HTTP: FD_CONTROL_API_KEY is the key it sends; the completions key is refused
            rc, out, err = fdctl(d.port, "--transport", "v1", "pause", env={"FD_CONTROL_API_KEY": "ctl", "FD_API_KEY": "gen"})
            self.assertEqual(rc, 0, err)
            rc, out, err = fdctl(d.port, "--transport", "v1", "--api-key", "gen", "resume")
            self.assertEqual(rc, EXIT_UNAUTHORIZED, err)
            # the shm transport has no key: its guard is the 0600 block of the daemon's user
            self.assertEqual(fdctl(d.port, "--transport", "shm", "resume")[0], 0)

    def test_without_a_control_key_the_api_key_guards_the_control_routes(self):
        with Daemon("--api-key", "gen") as d:
            self.assertEqual(d.post("/v1/pause")[0], 401)
            self.assertEqual(d.post("/v1/pause", headers=bearer("gen"))[0], 200)
            self.assertEqual(d.post("/v1/resume", headers=bearer("gen"))[0], 200)


if __name__ == "__main__":
    unittest.main()
