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
import os
import socket
import threading
import time
import urllib.parse

# Grace on the socket past the daemon's own deadline: its 504 answer must have time to arrive.
_SOCKET_GRACE_S = 5.0
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


class Client:
    """One daemon. `url`: "http://host:port" (or "host:port"); `api_key`: sent as a Bearer token
    (the daemon's --api-key); `timeout`: seconds, the deadline of each control call."""

    def __init__(self, url="http://127.0.0.1:8000", api_key=None, timeout=900.0):
        if "://" not in url:
            url = "http://" + url
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"url {url!r}: expected http://host:port")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout {timeout!r} must be > 0 seconds")
        self.url = f"http://{u.hostname}:{u.port or 80}"
        self.host, self.port = u.hostname, u.port or 80
        self.api_key, self.timeout = api_key, float(timeout)
        self._stream_transport = None  # the weight-stream transport kept after a commit (fdrollout.weight_stream)

    def __repr__(self):
        return f"Client({self.url!r})"

    # -- transport ---------------------------------------------------------------------------

    def request(self, method, path, body=None, query=None, timeout=None):
        """One HTTP call; returns the decoded JSON body of a 2xx answer, raises FdRolloutError
        otherwise. `query`: dict of parameters (None values left out)."""
        timeout = self.timeout if timeout is None else float(timeout)
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
        limit = timeout + _SOCKET_GRACE_S
        conn = http.client.HTTPConnection(self.host, self.port, timeout=limit)
        # The socket timeout restarts with every byte: a peer that answers one byte a second would
        # hold the call forever. A timer shuts the socket at the limit, so the whole call is bounded.
        expired = threading.Event()

        def give_up():
            expired.set()
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(limit, give_up)
        timer.daemon = True
        timer.start()
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            if expired.is_set():
                raise OSError("the connection was shut at the time limit")
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set():
                raise FdRolloutError(0, "unreachable", f"{method} {path}: no complete answer within {limit:g} s (the peer kept the "
                                                       "connection open without finishing its answer)", url=self.url) from e
            raise FdRolloutError(0, "unreachable", f"{method} {path}: {e}", url=self.url) from e
        finally:
            timer.cancel()
            conn.close()
        try:
            j = json.loads(raw) if raw else None
        except ValueError:
            j = None
        if 200 <= resp.status < 300:
            if raw and j is None:  # not an fdrollout answer (a proxy's page, another service): never a success
                raise FdRolloutError(0, "unreachable", f"{method} {path}: HTTP {resp.status} with a body that is not JSON "
                                                       f"({raw[:60]!r}): not an fdrollout daemon at that URL?", url=self.url)
            return j
        err = (j or {}).get("error") if isinstance(j, dict) else None
        if isinstance(err, dict):
            raise FdRolloutError(resp.status, err.get("type", "error"), err.get("message", ""), j, self.url)
        msg = (j or {}).get("msg") if isinstance(j, dict) else None  # the legacy routes' {"msg"}
        raise FdRolloutError(resp.status, "error", msg or raw.decode(errors="replace")[:500], j, self.url)

    def _control(self, path, body=None, query=None, timeout=None):
        j = self.request("POST", path, body=body, query=query, timeout=timeout)
        return j.get("result", j) if isinstance(j, dict) else j

    # -- state ---------------------------------------------------------------------------------

    def health(self):
        """GET /health: state, weight_version, staged_weight_version, sleeping_tags, ranks, ..."""
        return self.request("GET", "/health")

    def weight_version(self):
        """The version of the weights being served (a string)."""
        return self.health()["weight_version"]

    def is_paused(self):
        return bool(self.request("GET", "/v1/is_paused")["is_paused"])

    def wait(self, until="serving", timeout=60.0, poll_s=0.05):
        """Poll /health until its `state` is `until` (serving, paused, sleeping); returns the
        health body. Raises FdRolloutError type "timeout" after `timeout` seconds."""
        if until not in _STATES:
            raise ValueError(f"until {until!r}: one of {', '.join(_STATES)}")
        end = time.monotonic() + timeout
        while True:
            h = self.request("GET", "/health", timeout=min(self.timeout, max(timeout, 1.0)))
            if h.get("state") == until:
                return h
            if time.monotonic() >= end:
                raise FdRolloutError(0, "timeout", f"state is {h.get('state')!r}, not {until!r}, after {timeout:g} s",
                                     h, self.url)
            time.sleep(poll_s)

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
        ranks, full updates with a version); "auto" = land where the daemon can, else as usual."""
        from .weight_stream import WeightStream
        return WeightStream(self, version, base_version=base_version, bucket_bytes=bucket_bytes, timeout=timeout, backend=backend,
                            device=device, land=land)

    # -- generation (a convenience for trainers and tests) --------------------------------------

    def completions(self, prompt, **fields):
        """POST /v1/completions with `prompt` (text or token ids) and any OpenAI/vLLM fields;
        returns the whole body (choices, usage, weight_version)."""
        return self.request("POST", "/v1/completions", body={"prompt": prompt, **fields})
