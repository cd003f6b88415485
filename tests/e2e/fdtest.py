"""Shared helpers for fdrollout end-to-end tests: start the real daemon on a free loopback port,
talk HTTP to it (stdlib only), and clean up.

Environment (set by CTest): FDROLLOUT_BIN (daemon binary), FD_REPO (repo root).
"""
import atexit
import contextlib
import http.client
import json
import os
import signal
import shutil
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.environ.get("FD_REPO", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
BIN = os.environ.get("FDROLLOUT_BIN", os.path.join(REPO, "build", "fdrollout"))
FDCTL = os.environ.get("FDCTL_BIN", os.path.join(os.path.dirname(BIN), "fdctl"))
PYTHON = os.environ.get("FD_PYTHON", "/usr/bin/python3")
sys.path.insert(0, os.path.join(REPO, "scripts"))  # safetensors_np for the tests

STORIES = os.path.join(REPO, "models", "stories260K")

# Reference greedy outputs of llama2.c run.c (models/stories260K/README.md).
REF = {
    "Once upon a time": {
        "prompt_ids": [1, 403, 407, 261, 378],
        "ids": [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419, 292,
                411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426,
                338, 391, 266, 267, 337, 335, 312, 432, 398, 312, 286, 267, 414, 270, 333, 415, 426, 13, 438, 310],
        "text": "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
                "she saw a big, red ball. She wanted to play with it, but it was too high.\nLily",
    },
    "Lily and Tom": {
        "prompt_ids": [1, 317, 269, 274, 287],
        "ids": [382, 276, 337, 299, 322, 265, 282, 295, 433, 426, 342, 397, 355, 267, 337, 335, 265, 315, 267, 422,
                419, 269, 352, 379, 261, 420, 277, 264, 265, 282, 295, 433, 426, 342, 394, 261, 370, 268, 414, 444,
                335, 261, 370, 268, 414, 444, 426, 342, 391, 266, 267, 337, 335, 265, 268, 414, 444, 426, 13, 436],
        "text": "Lily and Tom were playing in the park. They liked to play with their toys and run around the park. "
                "They saw a big box with a big box. They wanted to play with the box.\n\"",
    },
}


# The greedy probe the weight tests compare daemons with: ids, logprobs and weight_version.
GREEDY = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "logprobs": 2}


class Logprobs(list):
    """Token logprobs. Equal to another list when every value is within LOGPROB_TOL of it: 0 (bit
    for bit) at tensor-parallel size 1, 1e-4 when this run's daemons are tp > 1 and the reference
    is a fresh tp=1 daemon (issue #9: greedy tokens equal, logprobs within 1e-4 of tp=1)."""

    def __eq__(self, other):
        if not isinstance(other, list) or len(self) != len(other):
            return False
        if LOGPROB_TOL == 0:
            return list.__eq__(self, other)
        return all(a == b or (a is not None and b is not None and abs(a - b) <= LOGPROB_TOL) for a, b in zip(self, other))

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = None


def greedy(d, **kw):
    """(token ids, token logprobs, weight_version) of GREEDY (overridden by kw) on daemon d."""
    j = d.complete(**{**GREEDY, **kw})
    c = j["choices"][0]
    return c["token_ids"], Logprobs(c["logprobs"]["token_logprobs"]), j["weight_version"]


def read_json(path):
    with open(path) as f:
        return json.load(f)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


_LOG_DIR = []


def log_dir():
    """This test process's private dir for daemon logs, removed at exit (tests leave nothing in
    the temp dir); FD_KEEP_TEST_LOGS=1 keeps it and says where."""
    if not _LOG_DIR:
        _LOG_DIR.append(tempfile.mkdtemp(prefix="fdtest-logs-"))
        if os.environ.get("FD_KEEP_TEST_LOGS") == "1":
            atexit.register(lambda: print(f"fdtest: daemon logs kept in {_LOG_DIR[0]}", file=sys.stderr))
        else:
            atexit.register(shutil.rmtree, _LOG_DIR[0], True)
    return _LOG_DIR[0]


class MisbehavingPeer:
    """An HTTP peer that is not a healthy fdrollout, on a free port, for the clients' bounds:
    mode "drip" answers the headers of a 1 MB body then one byte a second (a per-read socket
    timeout never fires), "garbage" answers HTTP 200 with a body that is not JSON, "json" answers
    HTTP 200 `{}` (JSON, but not fdrollout's)."""

    def __init__(self, mode):
        import socket as _socket
        self.mode, self.port = mode, free_port()
        self.sock = _socket.socket()
        self.sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(16)
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(c,), daemon=True).start()

    def _answer(self, c):
        try:
            c.recv(65536)
            if self.mode in ("garbage", "json"):
                body = b"{oops" if self.mode == "garbage" else b"{}"
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                return
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
            while not self.stop.is_set():
                c.sendall(b" ")
                time.sleep(1)
        except OSError:
            pass
        finally:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.sock.close()


def free_port():
    """A port free now, below the kernel's ephemeral range (32768-60999 by default): a port the
    kernel handed out (bind to 0) could be handed out again to the daemon's own TCP store or an
    outgoing connection before the daemon binds it (a fresh clone's rank_liveness hit that once)."""
    lo = 32768
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Extra daemon flags for a whole test run: CTest runs some scripts a second time with
# FD_TEST_DAEMON_ARGS="--distributed-executor-backend mp" (the same tests over rank processes).
EXTRA_ARGS = os.environ.get("FD_TEST_DAEMON_ARGS", "").split()


def torch_and_gpus():
    """(the torch module, or None where it cannot be imported; the CUDA devices it sees: 0
    without torch, without CUDA in it, or without a visible GPU)."""
    try:
        import torch
    except ImportError:
        return None, 0
    return torch, (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def cudart():
    """The CUDA runtime library (ctypes), or None where none is installed."""
    import ctypes
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def cuda_device_count():
    """cudaGetDeviceCount; 0 with no runtime, no driver or no device."""
    import ctypes
    rt = cudart()
    n = ctypes.c_int(0)
    return n.value if rt is not None and rt.cudaGetDeviceCount(ctypes.byref(n)) == 0 else 0


# A run over --device cuda (label gpu) where no GPU is visible: Skipped (77), never Passed.
if "--device" in EXTRA_ARGS and EXTRA_ARGS[EXTRA_ARGS.index("--device") + 1:][:1] == ["cuda"] and cuda_device_count() == 0:
    print("FD_TEST_DAEMON_ARGS asks for --device cuda and no CUDA device is visible: skipped")
    sys.exit(77)
MP = "mp" in EXTRA_ARGS
# The tensor-parallel size of this run's daemons (FD_TEST_DAEMON_ARGS "--tensor-parallel-size N").
TP = int(EXTRA_ARGS[EXTRA_ARGS.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in EXTRA_ARGS else 1
LOGPROB_TOL = 1e-4 if TP > 1 else 0.0


def children(pid):
    """Pids of the direct children of pid."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def stop_process(pid, timeout=10):
    """SIGSTOP pid and wait until every one of its threads is stopped. kill() only queues the
    signal: a thread running on another core can still answer a request for a moment after it,
    so a test that relies on the process being stopped must wait for this."""
    os.kill(pid, signal.SIGSTOP)

    def all_stopped():
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                        return False
        except FileNotFoundError:
            return False
        return True
    wait_until(all_stopped, timeout, f"every thread of {pid} stopped")


def kill_when_sent(tc, p, check=None):
    """A trainer subprocess `p` (stdout piped, text) that prints "SENT" once it has sent what it
    was to send: assert that line (TestCase `tc`), run check() while it lives, then SIGKILL and
    reap it (killed and reaped whatever happens). Returns time.monotonic() just before the kill."""
    try:
        tc.assertEqual(p.stdout.readline().strip(), "SENT")
        if check is not None:
            check()
        t_kill = time.monotonic()
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        return t_kill
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()


def http_request(port, method, path, body=None, timeout=120, raw=None, headers=None):
    """(status, JSON body or text) of one request to 127.0.0.1:`port`; `body` is sent as JSON,
    `raw` as is."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        text = resp.read().decode()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text
    finally:
        conn.close()


class Daemon:
    """One fdrollout process on 127.0.0.1:<free port>. Use as a context manager."""

    def __init__(self, *args, model=STORIES, env=None, wait=True, timeout=60, bin=BIN, port=None, extra=True, cwd=None):
        """model=None: no --model flag (the binary's default model); port=None: a free one.
        extra=False: without FD_TEST_DAEMON_ARGS; cwd: the daemon's working directory (else ours)."""
        self.port = port or free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="fdrollout-", suffix=".log", delete=False, dir=log_dir())
        cmd = [bin, *(["--model", model] if model is not None else []), "--port", str(self.port), "--log-level", "info",
               *(EXTRA_ARGS if extra else []), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd)
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fdrollout exited with {self.proc.returncode}:\n{self.output()}")
            try:
                status, _ = self.get("/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"fdrollout not ready after {timeout}s:\n{self.output()}")

    def rank_pids(self):
        """The daemon's rank processes (mp executor), in rank order of spawn; [] for uni."""
        return [c for c in children(self.proc.pid) if b"--fd-rank-process" in cmdline(c)]

    def rss(self):
        """Resident bytes of the daemon and its rank processes."""
        return rss_bytes(self.proc.pid) + sum(rss_bytes(p) for p in self.rank_pids())

    def output(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def request(self, method, path, body=None, timeout=120, raw=None, headers=None):
        return http_request(self.port, method, path, body, timeout=timeout, raw=raw, headers=headers)

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, body=None, **kw):
        return self.request("POST", path, body, **kw)

    def complete(self, **body):
        status, j = self.post("/v1/completions", body)
        assert status == 200, (status, j)
        return j

    def stream(self, timeout=120, **body):
        """POST a streaming completion; returns (chunks, saw_done)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, (resp.status, resp.read())
            chunks, done = [], False
            for line in resp.read().decode().split("\n"):
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    done = True
                else:
                    chunks.append(json.loads(payload))
            return chunks, done
        finally:
            conn.close()

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


def wait_until(cond, timeout, what):
    """Poll cond() every 10 ms until it returns a true value (returned) or `timeout` seconds pass
    (AssertionError naming `what`). Tests wait on an observable condition with a deadline, never on
    a fixed sleep: under load (2 cores, other builds) a sleep is never long enough."""
    deadline = time.time() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.01)


def wait_control_in_flight(d, op, timeout=30):
    """Wait until daemon d's engine runs control operation `op` (/health control_in_flight), e.g.
    a pause stretched by FD_DEBUG_CONTROL_DELAY_MS: the command has reached the engine."""
    wait_until(lambda: d.get("/health", timeout=timeout)[1]["control_in_flight"] == op, timeout, f"{op} in flight on port {d.port}")


def device_args(extra=EXTRA_ARGS):
    """The --device flag of FD_TEST_DAEMON_ARGS (["--device", "cuda"]), or [] when it names none."""
    for i, a in enumerate(extra):
        if a == "--device" and i + 1 < len(extra):
            return ["--device", extra[i + 1]]
        if a.startswith("--device="):
            return [a]
    return []


class StreamChecks:
    """Mixin of the weight-stream suites (tests/python, tests/e2e): a unittest.TestCase with self.d
    (a Daemon), self.c (an fdrollout Client) and cls.tmp (removed at the end)."""

    @classmethod
    def perturbed_stories(cls, prefix, *daemon_args, old_ref=True):
        """cls.tmp (a fresh dir), cls.new (stories260K perturbed), cls.tensors (its weights),
        cls.base (stories260K's) and the references: cls.ref_new (and cls.ref_old when `old_ref`),
        the greedy (ids, logprobs) of fresh daemons started with `daemon_args` on those weights."""
        import safetensors_np
        cls.tmp = tempfile.mkdtemp(prefix=prefix)
        cls.new = os.path.join(cls.tmp, "new")
        perturbed(STORIES, cls.new)
        cls.tensors = safetensors_np.load_file(os.path.join(cls.new, "model.safetensors"))
        cls.base = safetensors_np.load_file(os.path.join(STORIES, "model.safetensors"))
        with fresh_daemon(cls.new, *daemon_args) as ref:
            cls.ref_new = greedy(ref)[:2]
        if old_ref:
            with fresh_daemon(STORIES, *daemon_args) as ref:
                cls.ref_old = greedy(ref)[:2]

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def stream(self, version, tensors, **kw):
        """Every tensor of `tensors` ({name: array}) streamed in name order as `version`; the finish's answer."""
        with self.c.weight_stream(version, **kw) as ws:
            for name in sorted(tensors):
                ws.send(name, tensors[name])
        return ws.result

    def assert_serving(self, ref, version):
        """Greedy on self.d is `ref` (token ids, logprobs) labelled `version`, and it serves."""
        self.assertEqual(greedy(self.d), (*ref, version))
        self.assertEqual(self.c.health()["state"], "serving")

    def bad(self, status, type_, words, tensors, **kw):
        """self.stream("bad", tensors, **kw) fails with (status, type_) naming every one of
        `words`, and changes nothing: same label, still serving. Returns the error."""
        from fdrollout import FdRolloutError
        before = self.c.weight_version()
        with self.assertRaises(FdRolloutError) as e:
            self.stream("bad", tensors, **kw)
        self.assertEqual((e.exception.status, e.exception.type), (status, type_), e.exception.message)
        for w in words:
            self.assertIn(w, e.exception.message)
        self.assertEqual(self.c.weight_version(), before, "a failed update changes nothing")
        self.assertEqual(self.c.health()["state"], "serving")
        return e.exception


def fresh_daemon(model=STORIES, *args, **kw):
    """The reference the weight tests compare against: a fresh daemon on `model` at
    tensor-parallel size 1, in process (without FD_TEST_DAEMON_ARGS), whatever this run's tp, on
    the run's device (FD_TEST_DAEMON_ARGS's --device, unless args name one): a CUDA daemon's
    weights are compared bitwise with a CUDA reference, not with the CPU's sums."""
    dev = [] if any(a == "--device" or a.startswith("--device=") for a in args) else device_args()
    return Daemon(*dev, *args, model=model, extra=False, **kw)


def fdctl(port, *args, timeout=60, env=None):
    """Run fdctl; returns (exit code, stdout, stderr)."""
    p = subprocess.run([FDCTL, "--port", str(port), *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    return p.returncode, p.stdout, p.stderr


def merge_stream(chunks):
    """Fold SSE chunks into {choice index: {text, token_ids, finish_reason, prompt_token_ids, logprobs}}."""
    out = {}
    for c in chunks:
        for ch in c.get("choices", []):
            acc = out.setdefault(ch["index"], {"text": "", "token_ids": [], "finish_reason": None,
                                               "prompt_token_ids": None, "token_logprobs": []})
            acc["text"] += ch.get("text", "")
            acc["token_ids"] += ch.get("token_ids", [])
            if ch.get("finish_reason"):
                acc["finish_reason"] = ch["finish_reason"]
            if ch.get("prompt_token_ids") is not None:
                acc["prompt_token_ids"] = ch["prompt_token_ids"]
            if ch.get("logprobs"):
                acc["token_logprobs"] += ch["logprobs"]["token_logprobs"]
    return out


def make_checkpoint(out_dir, *args):
    """Run scripts/make_random_checkpoint.py into out_dir."""
    subprocess.run([PYTHON, os.path.join(REPO, "scripts", "make_random_checkpoint.py"), "--out", out_dir, *args],
                   check=True, stdout=subprocess.DEVNULL)
    return out_dir


def rss_bytes(pid):
    """VmRSS of a process, in bytes (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def copy_checkpoint(src, dst):
    """Copy a checkpoint dir (files only) to dst, writable."""
    import shutil
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(dst, name))
    return dst


def rewrite_tensors(dir_, mutate, dtype=None):
    """Load dir_/model.safetensors, let mutate(dict) change it in place, write it back."""
    import safetensors_np
    path = os.path.join(dir_, "model.safetensors")
    t = safetensors_np.load_file(path)
    mutate(t)
    safetensors_np.save_file(t, path, dtype=dtype)
    return dir_


def perturbed(src, dst, seed=1, scale=0.05):
    """dst = src with every float tensor perturbed by N(0, scale * std) noise (same names, shapes, dtypes)."""
    import numpy as np
    rng = np.random.default_rng(seed)

    def mutate(t):
        for k, v in t.items():
            t[k] = (v + rng.normal(0, scale * (float(v.std()) + 1e-3), v.shape)).astype(v.dtype)

    return rewrite_tensors(copy_checkpoint(src, dst), mutate)


class OtherUser:
    """A real local user created for one test (useradd) and removed after (userdel): the
    'another local user' of SPEC §8.6. Raises unittest.SkipTest, saying why, unless run as root."""

    def __init__(self):
        import unittest
        if os.geteuid() != 0:
            raise unittest.SkipTest("needs root to create another local user (useradd); run the suite as root")
        self.name = f"fdt{os.getpid()}"
        subprocess.run(["userdel", self.name], capture_output=True)  # a leftover of a killed run
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", self.name],
                       check=True, capture_output=True)
        import pwd
        pw = pwd.getpwnam(self.name)
        self.uid, self.gid = pw.pw_uid, pw.pw_gid

    def run(self, *cmd, **kw):
        """Run cmd as this user (setpriv: no root groups, no capabilities); returns CompletedProcess."""
        return subprocess.run(["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", *cmd],
                              capture_output=True, text=True, timeout=kw.pop("timeout", 60), **kw)

    def close(self):
        subprocess.run(["userdel", self.name], capture_output=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- helpers shared by the reference-comparing tests ----

def prompt_ids(n=40, seed=11):
    """A random prompt: BOS (1) then n - 1 ids in [3, 512), from numpy's default_rng(seed)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return [1] + [int(x) for x in rng.integers(3, 512, n - 1)]


def log_softmax(x):
    """log softmax of a logits row, in float64."""
    import numpy as np
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())

def in_parallel(fn, items, timeout=300):
    """[fn(item) for item in items], every call on its own thread at once (each joined within timeout s)."""
    out = [None] * len(items)

    def worker(i):
        out[i] = fn(items[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


def run_concurrently(d, reqs):
    """[[(token_ids, logprobs object)] per choice] per request, all requests in flight at once."""
    def answer(body):
        j = d.complete(**body)
        return [(c["token_ids"], c["logprobs"]) for c in sorted(j["choices"], key=lambda c: c["index"])]
    return in_parallel(answer, reqs)


def spec_by_version(d):
    """{weight_version: [drafts, proposed, accepted]} of speculative decoding, from /metrics."""
    out = {}
    for line in d.get("/metrics")[1].splitlines():
        for i, fam in enumerate(("fdrollout_spec_decode_num_drafts_total", "fdrollout_spec_decode_num_draft_tokens_total",
                                 "fdrollout_spec_decode_num_accepted_tokens_total")):
            if line.startswith(fam + "{"):
                v = line.split('weight_version="', 1)[1].split('"', 1)[0]
                out.setdefault(v, [0, 0, 0])[i] = float(line.rsplit(" ", 1)[1])
    return out
