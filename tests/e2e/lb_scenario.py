"""The load-balancer scenario shared by test_load_balancer.py (nginx) and test_haproxy.py: two
daemons on loopback fed by one rsync store, a balancer in front (started by the caller's
`start(daemons) -> port`), rollout clients generating through it while `fdctl --hosts` pauses,
updates and resumes the fleet. Every answer is a 200 whose tokens equal a fresh daemon's on the
weight_version it reports (a request the pause cut short: a prefix of them), or a 503 (paused,
nothing generated); afterwards every answer is on the new version. Control routes are not
proxied."""
import json
import os
import subprocess
import threading
import time

from fdtest import copy_checkpoint, Daemon, fdctl, GREEDY, http_request, perturbed, STORIES


def post(port, path, body, timeout=60, headers=None):
    return http_request(port, "POST", path, body, timeout=timeout, headers=headers)


def probe(port, finish=None):
    """(status, token ids, weight_version) of the greedy probe through `port`; finish_reason
    appended to `finish` when given."""
    status, j = post(port, "/v1/completions", GREEDY)
    if status != 200:
        return status, None, None
    if finish is not None:
        finish.append(j["choices"][0]["finish_reason"])
    return status, j["choices"][0]["token_ids"], j["weight_version"]


def wait_up(tc, proc, port, log, name):
    """Stops `proc` when `tc` cleans up (SIGTERM, then SIGKILL after 10 s); waits until the balancer
    on `port` serves the probe; fails the test if `proc` exits first."""

    def stop():
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    tc.addCleanup(stop)
    deadline = time.time() + 20
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tc.fail(f"{name} exited with {proc.returncode}: {log.read()}")
        try:
            if probe(port)[0] == 200:
                return port
        except OSError:
            pass
        time.sleep(0.05)
    tc.fail(f"{name} did not come up")


def fleet_update_through(tc, tmp, start, env=None):
    """Run the scenario (see the module doc) with the balancer `start(daemons)` returns the port of;
    `env`: extra environment of the two daemons. Returns (daemons, balancer port)."""
    A = copy_checkpoint(STORIES, os.path.join(tmp, "A"))
    B = perturbed(STORIES, os.path.join(tmp, "B"), seed=21)
    store = os.path.join(tmp, "store")
    rc, _, err = fdctl(0, "publish", "--strategy", "rsync", "--from", B, "--store", store, "--version", "v2")
    tc.assertEqual(rc, 0, err)
    want = {}
    with Daemon(model=B) as fresh:
        want["v2"] = probe(fresh.port)[1]
    daemons = []
    for i in range(2):
        cfg = {"source": store, "staging_dir": os.path.join(tmp, f"staging{i}")}
        d = Daemon("--dynamic-load-weight", "--load-strategy", "rsync", "--rsync-config", json.dumps(cfg), model=A, env=env)
        tc.addCleanup(d.__exit__, None)
        daemons.append(d)
    old = daemons[0].get("/health")[1]["weight_version"]
    want[old] = probe(daemons[0].port)[1]
    tc.assertNotEqual(want[old], want["v2"])
    port = start(daemons)

    # control routes are not proxied (the vLLM / SGLang aliases and aborts neither)
    for path in ("/v1/pause", "/pause", "/v1/abort", "/abort_requests", "/v1/update_weights"):
        status, j = post(port, path, {})
        tc.assertEqual(status, 404, (path, j))
    tc.assertFalse(daemons[0].get("/health")[1]["is_paused"])

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
            tc.assertEqual(rc, 0, (args, out, err))
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    statuses = {s for s, _, _, _ in seen}
    tc.assertLessEqual(statuses, {200, 503}, statuses)
    for status, ids, version, finish in seen:
        if status != 200:
            continue
        # tokens always match the version reported; a request the pause cut short ends with
        # finish_reason abort and the tokens it had, a prefix of that version's output
        if finish == "abort":
            tc.assertEqual(ids, want[version][:len(ids)], version)
        else:
            tc.assertEqual(ids, want[version], version)
    tc.assertIn(old, {v for _, _, v, _ in seen})
    tc.assertIn("v2", {v for _, _, v, _ in seen})
    for _ in range(4):  # after the update: every daemon behind the balancer serves v2
        tc.assertEqual(probe(port)[1:], (want["v2"], "v2"))
    return daemons, port
