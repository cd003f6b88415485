"""`Client`: every weight-control call of one fdrollout daemon over its V1 HTTP API (stdlib only).

    from fdrollout import Client
    c = Client("http://127.0.0.1:8000", api_key=None, timeout=900)
    c.pause()                              # or c.pause(mode="keep") / c.pause(mode="wait")
    c.update_weights(version="step-42")    # all-or-nothing on every rank; stays paused
    c.resume()
    c.sleep(["weight", "kv_cache"]); ...; c.wakeup()
    c.stage_weights("step-43"); c.commit_weights("step-43")   # two-phase (or c.drop_staged_weights())

Each call returns the `result` object of the daemon's answer (a dict: docs/weight_control.md
lists its fields per route). A 4xx/5xx answer raises `FdRolloutError` carrying the HTTP status,
the error `type` from the daemon's error table (`wrong_state`, `invalid_checkpoint`,
`rank_failed`, `timeout`, ...) and its message; a daemon that cannot be reached raises
`FdRolloutError` with type `unreachable`. Nothing is retried behind the caller's back.

Deadlines: every call sends `X-Request-Timeout` and `X-Request-Deadline` (now + `timeout`; the
daemon withdraws a command it has not started by then, answering 504 `timeout` "nothing
changed", even one that sat in the socket while the daemon was stopped) and waits on the socket
at most `timeout + 5` seconds, so a daemon that died or stopped mid-call raises
instead of hanging the trainer.
"""
import http.client
import json
import math
import numbers
import os
import socket
import threading
import time
import urllib.parse

from . import watchdog

# Grace on the socket past the daemon's own deadline: its 504 answer must have time to arrive.
_SOCKET_GRACE_S = 5.0
# fdctl's --timeout bound (fd::kMaxWaitS): past it the clocks' tick counts overflow, and
# the watchdog's / socket timeouts raise inside the call (a probe: 1e12 and inf did).
_MAX_TIMEOUT_S = 1e7
_TAGS = ("weight", "kv_cache")
_PAUSE_MODES = ("abort", "wait", "keep")
_STATES = ("serving", "paused", "sleeping")


class FdRolloutError(Exception):
    """An error answer of the daemon (or no answer at all).

    status  -- the HTTP status (0 when the daemon could not be reached or did not answer)
    type    -- the daemon's error type (docs/weight_control.md's table), or "unreachable"
    message -- the daemon's message
    body    -- the decoded JSON body (None when there was none)
    url     -- the daemon the call went to
    """

    def __init__(self, status, type_, message, body=None, url=None):
        super().__init__(f"{url or 'fdrollout'}: {status} {type_}: {message}")
        self.status, self.type, self.message, self.body, self.url = status, type_, message, body, url


def _tag_list(tags):
    """None -> None (the daemon's default: every tag); "a,b" or ["a", "b"] -> "a,b" (validated)."""
    if tags is None:
        return None
    items = [t.strip() for t in tags.split(",")] if isinstance(tags, str) else list(tags)
    for t in items:
        if t not in _TAGS:
            raise ValueError(f"unknown tag {t!r}: the tags are {', '.join(_TAGS)}")
    if not items:
        raise ValueError("tags is empty: pass None for every tag")
    return ",".join(items)


def _parse_url(url):
    """(host, port, "http://host:port") of a daemon url; see Client."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str like 'http://host:port', not {type(url).__name__}")
    full = url if "://" in url else "http://" + url
    u = urllib.parse.urlsplit(full)
    try:
        host, port = u.hostname, u.port or 80
    except ValueError as e:  # a port that is not a number or out of range
        raise ValueError(f"url {url!r}: {e}") from None
    if u.scheme != "http" or not host:
        raise ValueError(f"url {url!r}: expected http://host:port")
    # Dropped silently before (a probe): the calls went to the root of host:port, not where written.
    for part, value in (("a path", u.path not in ("", "/")), ("a query", u.query), ("a fragment", u.fragment),
                        ("user info", u.username is not None or u.password is not None)):
        if value:
            raise ValueError(f"url {url!r} has {part}: expected http://host:port (the daemon's routes are at its root; "
                             "pass api_key= for a key)")
    shown = f"[{host}]" if ":" in host else host  # IPv6: "http://::1:8000" named no port
    return host, port, f"http://{shown}:{port}"


def _check_timeout(timeout, name="timeout"):
    """`timeout` as a float, or TypeError / ValueError naming `name`."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, not {type(timeout).__name__}")
    t = float(timeout)
    if not (math.isfinite(t) and 0 < t <= _MAX_TIMEOUT_S):
        raise ValueError(f"{name} {timeout!r} must be a number of seconds > 0 and <= {_MAX_TIMEOUT_S:g}")
    return t


def _not_fdrollout(url, method, path, status, what):
    return FdRolloutError(0, "unreachable", f"{method} {path}: HTTP {status} {what}: not an fdrollout daemon at that URL?",
                          url=url)


class Client:
    """One daemon. `url`: "http://host:port" (or "host:port"; an IPv6 host in brackets,
    "[::1]:8000"); `api_key`: sent as a Bearer token (the daemon's --api-key); `timeout`:
    seconds, the deadline of each control call.
    Errors  TypeError when `url` is not a str or `timeout` not a number; ValueError for a url
            with a path, query, fragment or user info (fdctl refuses them too: the calls would
            go elsewhere than written), and for a timeout that is not > 0 and <= 1e7 s."""

    def __init__(self, url="http://127.0.0.1:8000", api_key=None, timeout=900.0):
        self.host, self.port, self.url = _parse_url(url)
        self.api_key, self.timeout = api_key, _check_timeout(timeout)
        self._stream_transport = None  # the weight-stream transport kept after a commit (fdrollout.weight_stream)
        self._stream_open = False  # a weight stream of this client is open (one at a time: fdrollout.weight_stream)
        self._stream_lock = threading.Lock()  # guards both: streams may be opened from several threads

    def __repr__(self):
        return f"Client({self.url!r})"

    # -- transport ---------------------------------------------------------------------------

    def request(self, method, path, body=None, query=None, timeout=None):
        """One HTTP call; returns the decoded JSON body (a dict) of a 2xx answer. `query`: dict of
        parameters (None values left out).
        Errors  FdRolloutError: the daemon's status and type for a 4xx/5xx answer; status 0, type
                "unreachable" when there is no complete answer in time, or a 2xx whose body is
                empty or not a JSON object (not an fdrollout daemon at that URL)."""
        return self._request(method, path, body, query, timeout, _SOCKET_GRACE_S, "unreachable")

    def _request(self, method, path, body, query, timeout, grace, late_type):
        """`request`, waiting at most `timeout` + `grace` s; no answer by then raises type `late_type`."""
        timeout = self.timeout if timeout is None else _check_timeout(timeout)
        if query:
            q = {k: v for k, v in query.items() if v is not None}
            if q:
                path += "?" + urllib.parse.urlencode(q, safe=",")
        # Both deadlines (the daemon takes the earlier): the absolute one also withdraws a command
        # that sat in the socket while the daemon was stopped.
        headers = {"X-Request-Timeout": f"{timeout:g}", "X-Request-Deadline": f"{time.time() + timeout:.3f}"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        limit = timeout + grace
        conn = http.client.HTTPConnection(self.host, self.port, timeout=limit)
        # The socket timeout restarts with every byte: a peer that answers one byte a second would
        # hold the call forever. The shared watchdog shuts the socket at the limit, so the whole call
        # is bounded (one thread for every call: fdrollout.watchdog).
        expired = threading.Event()

        def give_up():
            expired.set()
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = watchdog.arm(limit, give_up)
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            if expired.is_set():
                raise OSError("the connection was shut at the time limit")
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set():
                raise FdRolloutError(0, late_type, f"{method} {path}: no complete answer within {limit:g} s (the peer kept the "
                                                   "connection open without finishing its answer)", url=self.url) from e
            if isinstance(e, TimeoutError):  # socket.timeout: nothing arrived for `limit` s (a stopped daemon)
                raise FdRolloutError(0, late_type, f"{method} {path}: no answer within {limit:g} s ({e})", url=self.url) from e
            raise FdRolloutError(0, "unreachable", f"{method} {path}: {e}", url=self.url) from e
        finally:
            watchdog.disarm(timer)
            conn.close()
        try:
            j = json.loads(raw) if raw else None
        except ValueError:
            j = None
        if 200 <= resp.status < 300:
            # Not an fdrollout answer (a proxy's page, another service, vLLM's empty /health): never
            # a success. An empty one was returned as None, and callers raised a bare TypeError (a probe).
            if not raw:
                raise _not_fdrollout(self.url, method, path, resp.status, "with an empty body")
            if j is None:
                raise _not_fdrollout(self.url, method, path, resp.status, f"with a body that is not JSON ({raw[:60]!r})")
            if not isinstance(j, dict):
                raise _not_fdrollout(self.url, method, path, resp.status, f"with a JSON body that is not an object ({raw[:60]!r})")
            return j
        err = (j or {}).get("error") if isinstance(j, dict) else None
        if isinstance(err, dict):
            raise FdRolloutError(resp.status, err.get("type", "error"), err.get("message", ""), j, self.url)
        msg = (j or {}).get("msg") if isinstance(j, dict) else None  # the legacy routes' {"msg"}
        raise FdRolloutError(resp.status, "error", msg or raw.decode(errors="replace")[:500], j, self.url)

    def _control(self, path, body=None, query=None, timeout=None):
        j = self.request("POST", path, body=body, query=query, timeout=timeout)
        return j.get("result", j)

    def _field(self, path, key):
        """GET `path` and its field `key`; FdRolloutError "unreachable" when the answer lacks it
        (a bare KeyError before: a probe)."""
        j = self.request("GET", path)
        if key not in j:
            raise _not_fdrollout(self.url, "GET", path, 200, f"without {key!r}")
        return j[key]

    # -- state ---------------------------------------------------------------------------------

    def health(self):
        """GET /health: state, weight_version, staged_weight_version, sleeping_tags, ranks, ..."""
        return self.request("GET", "/health")

    def weight_version(self):
        """The version of the weights being served (a string).
        Errors  FdRolloutError (as `request`; "unreachable" when /health has no weight_version)."""
        return self._field("/health", "weight_version")

    def is_paused(self):
        """Errors  FdRolloutError (as `request`; "unreachable" when the answer has no is_paused)."""
        return bool(self._field("/v1/is_paused", "is_paused"))

    def wait(self, until="serving", timeout=60.0, poll_s=0.05):
        """Poll /health until its `state` is `until` (serving, paused, sleeping); returns the
        health body. Each poll is bounded by what is left of `timeout`, so the wait ends near
        `timeout` seconds (at most about 1 s past it) whatever the daemon does.
        Errors  FdRolloutError type "timeout" (status 0) when the state is not `until` by then,
                or the daemon did not answer a poll in time (stopped, or gone: the message says
                which); "unreachable" when a poll is refused at once (nothing listens) or the
                answer has no state. ValueError for an unknown `until` or a bad timeout."""
        if until not in _STATES:
            raise ValueError(f"until {until!r}: one of {', '.join(_STATES)}")
        timeout = _check_timeout(timeout)
        end = time.monotonic() + timeout
        while True:
            # A poll waits at most what is left (>= 1 s): with the whole call timeout + 5 s grace
            # per poll, a stopped daemon raised "unreachable" after timeout + 5 s (a probe).
            left = end - time.monotonic()
            h = self._request("GET", "/health", None, None, max(left, 1.0), 0.0, "timeout")
            if "state" not in h:
                raise _not_fdrollout(self.url, "GET", "/health", 200, "without 'state'")
            if h["state"] == until:
                return h
            if time.monotonic() >= end:
                raise FdRolloutError(0, "timeout", f"state is {h['state']!r}, not {until!r}, after {timeout:g} s",
                                     h, self.url)
            time.sleep(min(poll_s, max(end - time.monotonic(), 0.0)))

    # -- control -------------------------------------------------------------------------------

    def pause(self, mode="abort", clear_cache=None):
        """POST /v1/pause: `abort` ends requests now, `wait` drains them, `keep` freezes them with
        their KV until resume. `clear_cache=False` keeps the prefix cache (prime-rl's flag)."""
        if mode not in _PAUSE_MODES:
            raise ValueError(f"mode {mode!r}: one of {', '.join(_PAUSE_MODES)}")
        q = {"mode": mode}
        if clear_cache is not None:
            q["clear_cache"] = "true" if clear_cache else "false"
        return self._control("/v1/pause", query=q)

    def resume(self):
        return self._control("/v1/resume")

    def sleep(self, tags=None):
        """POST /v1/sleep: free `tags` ("weight", "kv_cache"; None = both); result has
        freed_bytes per tag and RSS before/after."""
        return self._control("/v1/sleep", query={"tags": _tag_list(tags)})

    def wakeup(self, tags=None):
        """POST /v1/wakeup: KV first, then weights re-read from the daemon's --load-strategy
        source; resumes on success."""
        return self._control("/v1/wakeup", query={"tags": _tag_list(tags)})

    def update_weights(self, version=None, verify_checksum=False, commit=True):
        """POST /v1/update_weights: re-read the daemon's --load-strategy source. Needs a paused
        daemon; validates every tensor on every rank before any is written (the old weights keep
        serving on any error), never resumes. `version`: the new label (else the source's);
        `commit=False`: stage only (two-phase)."""
        body = {}
        if version is not None:
            body["version"] = str(version)
        if verify_checksum:
            body["verify_checksum"] = True
        if not commit:
            body["commit"] = False
        return self._control("/v1/update_weights", body=body)

    def update_weights_from_dir(self, weight_dir, version=None):
        """prime-rl's POST /update_weights {"weight_dir"}: load the complete HF checkpoint in
        `weight_dir` (absolute; a directory the daemon's user owns) instead of the source; the
        daemon pauses (mode wait) and resumes around it. Returns {"weight_version", ...}."""
        body = {"weight_dir": os.path.abspath(weight_dir)}
        if version is not None:
            body["version"] = str(version)
        return self.request("POST", "/update_weights", body=body)

    def stage_weights(self, version, verify_checksum=False):
        """Two-phase, phase 1: fetch, validate and stage `version` on every rank; nothing serves it."""
        return self.update_weights(version=version, verify_checksum=verify_checksum, commit=False)

    def commit_weights(self, version):
        """Two-phase, phase 2: the staged `version` goes live (409 when it is not the staged one)."""
        return self._control("/v1/commit_weights", body={"version": str(version)})

    def drop_staged_weights(self):
        """Discard the staged version; result `dropped_version` (None when nothing was staged)."""
        return self._control("/v1/drop_staged_weights")

    def abort(self, request_id=None, all=False):
        """End one request (its completion id or X-Request-Id) or every request; never pauses."""
        if all == (request_id is not None):
            raise ValueError("pass either request_id or all=True")
        return self._control("/v1/abort", body={"abort_all": True} if all else {"request_id": str(request_id)})

    def weight_stream(self, version, base_version=None, bucket_bytes=64 << 20, timeout=None, backend="tcp", device=0, land=False):
        """A context manager streaming new weights into the daemon without files (SPEC §12):
        `send(name, tensor)` per training (HF) tensor; leaving the block normally commits on every
        rank (all or none; `.result` holds the answer), an exception drops the update and the
        daemon keeps serving as before. Needs --dynamic-load-weight. `bucket_bytes`: tensors are
        sent in buckets of about this size; `timeout`: seconds, bound of every wait (default the
        client's). `base_version`: a delta update against that version (`send_delta`; 409 unless
        every rank serves it). `backend`: "tcp" (CPU transport) or "nccl" (torch with CUDA: this
        process broadcasts from `device` as rank 0; fdrollout.nccl_sender). See
        fdrollout.weight_stream and docs/weight_streams.md. `land`: True = each rank receives its own
        shard from this process straight into its staging memory (one connection per rank; CPU
        ranks, a version), or with `base_version` its share of the delta (written in place at the
        finish); "auto" = land where the daemon can, else as usual.
        Errors  ValueError for a bad argument ("" as a version); FdRolloutError for what fails on the
                daemon or its transport, and 409 "wrong_state" while another stream of this
                client is open (one at a time, also across threads)."""
        from .weight_stream import WeightStream
        return WeightStream(self, version, base_version=base_version, bucket_bytes=bucket_bytes, timeout=timeout, backend=backend,
                            device=device, land=land)

    # -- generation (a convenience for trainers and tests) --------------------------------------

    def completions(self, prompt, **fields):
        """POST /v1/completions with `prompt` (text or token ids) and any OpenAI/vLLM fields;
        returns the whole body (choices, usage, weight_version)."""
        return self.request("POST", "/v1/completions", body={"prompt": prompt, **fields})
