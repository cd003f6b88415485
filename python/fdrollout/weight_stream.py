"""`WeightStream`: push new weights into a running daemon without files (SPEC §12).

    with client.weight_stream("step-42") as ws:      # init transport, start the update
        for name, tensor in model.state_dict().items():
            ws.send(name, tensor)                    # numpy array, or a torch tensor (CPU or not)
    # leaving the block normally: finish -> staged on every rank, committed on all or none;
    # ws.result = {"weight_version": "step-42", "bytes", "n_tensors", "ranks"}
    # an exception inside the block: the update is aborted, the daemon keeps serving as before.

Wire (docs/weight_streams.md): the daemon's `/init_weight_transfer_engine` answers a TCP port
and a one-time token; this side connects, sends the token as a hello frame, then every bucket is
one `/update_weights {"update_info": {names, dtype_names, shapes}}` call answered once the
tensors that follow on the socket, one frame each (b"FDW1", u32 LE header length, JSON header
{"name", "dtype", "shape", "nbytes"}, then the raw little-endian bytes), arrived. Tensors are
sent in the daemon's dtype for that name: float arrays of another float dtype are cast (f32 →
BF16 rounds to nearest even); pass `dtype=` to send the bytes as they are.

Delta updates: `client.weight_stream("step-43", base_version="step-42")` opens an update against
the version every rank serves (409 otherwise); `send_delta(name, indices, values)` sends only the
changed elements of a tensor (flat int64/int32 indices into the HF tensor, sorted and unique, and
their new values), applied by the daemon to a copy of the base's tensor; `send` still sends a
tensor in full, and tensors not sent keep the base's bytes. The commit is all-or-nothing as for a
full update and the served weights equal (bitwise) a full update of the same weights. A delta
frame's header adds {"n_indices", "index_dtype"}; its payload is the indices then the values.
`changed_elements(old, new)` gives the (indices, values) of a tensor's changed elements. With
`land=True` a delta goes to each rank straight (docs/weight_streams.md "Landed deltas"): a row part
gets the slice of the sorted indices inside its rows, a column part the whole tensor's delta; each
rank checks and keeps its frames, and the finish writes them in place on every rank or none.

Every wait is bounded: the socket and each HTTP call time out after `timeout` seconds (a dead or
stopped daemon raises), and the daemon drops an update that gets nothing for its timeout.

The transport is opened once, as vLLM's protocol does (init, then start/update/finish per step):
after a commit the client keeps the connection (or NCCL group), and its next `weight_stream` with
the same backend, device and timeout skips `/init_weight_transfer_engine`; a stream that fails
closes it, and one the daemon closed meanwhile is opened anew (start is retried once). One stream
per Client is open at a time: another opened meanwhile (a thread) is an FdRolloutError 409.
numpy only; torch tensors are accepted (via .numpy()) but torch is never imported.
"""
import contextlib
import threading

import numpy as np

from .client import FdRolloutError
from .lander import _Lander, _edges_like
from .safetensors_np import _f32_to_bf16_bits, is_torch
from .stream_wire import _bytes_of, _connect, _frame, _open, _send_all, _transport_error

_NP_TAGS = {np.dtype("float32"): "F32", np.dtype("float16"): "F16"}
_CAST = {"F32": np.float32, "F16": np.float16}


def _to_numpy(t):
    """A numpy array (C-contiguous) and its safetensors tag ("BF16" for torch bfloat16 bits)."""
    if is_torch(t):
        t = t.detach().cpu().contiguous()
        if str(t.dtype) == "torch.bfloat16":
            import torch  # present: t is a torch tensor
            return np.ascontiguousarray(t.view(torch.int16).numpy().view(np.uint16)), "BF16"
        t = t.numpy()
    a = np.ascontiguousarray(t)
    return a, _NP_TAGS.get(a.dtype)


class WeightStream:
    """One update of one daemon. Use through `Client.weight_stream(...)`.
    Errors  ValueError for a bad argument (an empty version or base_version: "" is not a label;
            pass None for the fingerprint label), before any call; FdRolloutError for whatever
            fails on the daemon or its transport (status 0, "unreachable" / "timeout", when the
            transport cannot be reached, breaks or a wait runs out)."""

    def __init__(self, client, version, base_version=None, bucket_bytes=64 << 20, timeout=None, backend="tcp", device=0, land=False):
        # "" committed under a fingerprint label (taken as None), where update_weights(version="")
        # is a 400 (a probe): refused here, before any call.
        for what, v in (("version", version), ("base_version", base_version)):
            if v is not None and str(v) == "":
                raise ValueError(f"{what} '' is not a label: pass a non-empty one, or None" +
                                 (" (the fingerprint label fp-...)" if what == "version" else ""))
        if backend not in ("tcp", "nccl"):
            raise ValueError(f"backend must be 'tcp' or 'nccl', not {backend!r}")
        if land not in (True, False, "auto"):
            raise ValueError(f"land must be True, False or 'auto', not {land!r}")
        if land and (backend != "tcp" or version is None):
            if land is True:
                raise ValueError("land=True needs backend 'tcp' and a version (no file holds landed bytes to name them by)")
            land = False
        self.land, self._lander = land, None
        self._serving_at_start = None  # the weight_version serving when the update started (its answer says)
        self._holds = False  # this stream holds its client's one open stream (_take_kept_transport)
        self._open_block = False  # inside the `with` block: send / send_delta / flush allowed
        self.backend, self.device, self._nccl = backend, device, None
        self.client, self.version = client, (None if version is None else str(version))
        self.base_version = None if base_version is None else str(base_version)
        self.bucket_bytes = int(bucket_bytes)
        self.timeout = float(timeout or client.timeout)
        self.sock, self.expected, self.result = None, {}, None
        self._pending, self._pending_bytes = [], 0
        self.bytes_sent = 0

    # -- context manager -----------------------------------------------------------------------

    def _init_nccl(self):
        """NCCL: the init request and this side's join of the group run together (each waits for
        the other); both bounded by the timeout."""
        from .nccl_sender import NcclSender
        self._nccl = NcclSender(self.device, self.timeout)
        answer, error = {}, []

        def call():
            try:
                answer["r"] = self.client.request("POST", "/init_weight_transfer_engine", body={"init_info": self._nccl.init_info()},
                                                  timeout=self.timeout)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                error.append(e)

        th = threading.Thread(target=call, daemon=True)
        th.start()
        try:
            self._nccl.join()
        finally:
            th.join(self.timeout + 10)
        if error:
            raise error[0]
        return answer["r"]

    def _open_transport(self):
        """/init_weight_transfer_engine and this side's end of the transport (tcp: connect and say
        hello; nccl: join the group)."""
        c = self.client
        if self.backend == "nccl":
            info = self._init_nccl()
        else:
            info = c.request("POST", "/init_weight_transfer_engine", body={"init_info": {"backend": "tcp", "timeout_s": self.timeout}},
                             timeout=self.timeout)
        self.expected = {t["name"]: (t["dtype"], tuple(t["shape"])) for t in info.get("tensors", [])}
        # A stacked expert tensor's per-expert views (in file order): accepted in its place, and
        # the names send_delta takes; the third field names the stacked tensor holding the view.
        for t in info.get("expert_tensors", []):
            self.expected.setdefault(t["name"], (t["dtype"], tuple(t["shape"]), t["in"]))
        if self.backend == "tcp":
            host = info.get("host") or c.host
            if host in ("0.0.0.0", "::", ""):
                host = c.host
            self.sock = _connect(host, int(info["port"]), self.timeout, "the weight-stream transport")
            try:
                self.sock.sendall(_frame({"token": info["token"]}))
            except OSError as e:
                raise _transport_error(e, "the weight-stream transport's hello") from e

    def _key(self):
        return (self.backend, self.device, self.timeout)

    def _take_kept_transport(self):
        """Mark the client's stream open and take the transport it kept from its last committed
        stream: True when it has the same backend, device and timeout and (tcp) the daemon has not
        closed it; else False (closed).
        Errors  FdRolloutError 409 "wrong_state" while another stream of this client is open."""
        # One stream per Client at a time, checked and taken together: two streams on one Client
        # (threads) took the same kept socket and the loser's close broke the winner's stream, and
        # one's init replaced the transport of the other's open update (a probe). The daemon holds
        # one open update anyway: the second is told so at once, as the daemon's 409 would.
        with self.client._stream_lock:
            if self.client._stream_open:
                raise FdRolloutError(409, "wrong_state", "another weight stream of this Client is open (one at a time: wait "
                                                         "for its `with` block to end, or use a Client per thread)", url=self.client.url)
            self.client._stream_open, self._holds = True, True
            kept, self.client._stream_transport = self.client._stream_transport, None
        if kept is None:
            return False
        key, sock, nccl, expected = kept
        if key == self._key() and (sock is None or _open(sock)):
            self.sock, self._nccl, self.expected = sock, nccl, expected
            return True
        if sock is not None:
            sock.close()
        return False

    def __enter__(self):
        # vLLM's protocol inits the transport once and runs start/update/finish per step: the
        # transport of the client's last committed stream is used again (no init, no new
        # connection or NCCL group). If the daemon dropped it meanwhile (another trainer's init,
        # a failed update, a restart), start fails and the transport is opened anew once.
        reused = self._take_kept_transport()
        body = {"version": self.version} if self.version is not None else {}
        if self.base_version is not None:
            body["base_version"] = self.base_version
        if self.land:
            body["land"] = True
        try:
            if not reused:
                self._open_transport()
            try:
                started = self.client.request("POST", "/start_weight_update", body=body, timeout=self.timeout)
            except FdRolloutError as e:
                if not reused and not (self.land == "auto" and e.status == 409):
                    raise
                if self.land == "auto" and e.status == 409:  # the ranks cannot land (CUDA ranks, ...): through the daemon
                    self.land = False
                    body.pop("land", None)
                self._close_transport()
                self._open_transport()
                started = self.client.request("POST", "/start_weight_update", body=body, timeout=self.timeout)
            self._serving_at_start = started.get("weight_version")
            if self.land:
                self._lander = _Lander(started["land"], self.client.host, self.timeout)
        except BaseException:
            self._close()
            raise
        self._open_block = True
        return self

    def _release(self):
        """The client may open its next stream (once: only the stream that held it releases it)."""
        with self.client._stream_lock:
            if self._holds:
                self.client._stream_open, self._holds = False, False

    def __exit__(self, exc_type, exc, tb):
        committed = False
        try:
            if exc_type is None:
                self.flush()
                if self._lander is not None:  # every part sent and the connections shut: the ranks check they have them all
                    with self._landing_io():
                        self._lander.finish()
                body = {"version": self.version} if self.version is not None else {}
                self.result = self.client.request("POST", "/finish_weight_update", body=body, timeout=self.timeout)
                committed = True
            else:
                self.abort()
        finally:
            self._open_block = False
            if self._lander is not None:  # after the finish answered: the ranks have every byte
                self._lander.close()
                self._lander = None
            if committed:  # the daemon keeps the transport after a commit: so does the client, for its next stream
                with self.client._stream_lock:
                    self.client._stream_transport = (self._key(), self.sock, self._nccl, self.expected)
                self.sock, self._nccl = None, None
            else:  # a dropped update closes the daemon's end
                self._close_transport()
            self._release()
        return False

    # -- sending -------------------------------------------------------------------------------

    def _check_open(self, name):
        if not self._open_block:
            raise RuntimeError(f"{name}: this weight stream is closed (its `with` block ended, committed or dropped); "
                               "open a new one with Client.weight_stream(...)")

    def send(self, name, tensor, dtype=None):
        """Queue `tensor` under its training (HF) name; a full bucket goes out at once. The names
        are those of --model's checkpoint (the init answer's `tensors`: stacked expert tensors as
        stored, [E, 2I, H] / [E, H, I]) or, for a stacked one, its per-expert views (`expert_tensors`).
        `dtype` ("F32", "F16", "BF16"): send the array's bytes as that dtype (BF16: uint16 bits).
        Errors  RuntimeError outside the stream's `with` block."""
        self._check_open(name)
        if self._lander is not None and name not in self._lander.plan:
            views = self._expert_views(name)
            if views:  # a stacked expert tensor [E, R, C]: the ranks' parts name its per-expert views, rows one after another
                flat, r = tensor.reshape(-1, tensor.shape[-1]), 0
                for n, rows in views:
                    self.send(n, flat[r:r + rows], dtype)
                    r += rows
                return
        a, tag = _to_numpy(tensor)
        if self._lander is not None and self._lander.delta:  # a delta landing: the tensor in full as a dense delta
            want = self.expected.get(name)
            if want is None:
                raise KeyError(f"{name}: not a tensor of the model (the init answer lists them)")
            if tuple(a.shape) != tuple(want[1]):  # a probe: a [64, 100] array filled 6400 elements of a [64, 172] tensor
                raise ValueError(f"{name}: shape {list(a.shape)} where the model has {list(want[1])}")
            flat = a.reshape(-1)
            self.send_delta(name, np.arange(flat.size, dtype=np.int32 if flat.size < 2**31 else np.int64), flat, dtype)
            return
        if self._lander is not None:
            if name not in self._lander.plan and name in self.expected:
                return  # a tensor no rank reads (a tied lm_head, rotary inv_freq): the daemon path ignores it too
            if name not in self._lander.plan:
                raise KeyError(f"{name}: not a tensor of the model (the init answer lists them)")
            a, tag = self._cast(name, a, tag, dtype, want=self._lander.plan[name][0][1][3])
            with self._landing_io():
                self.bytes_sent += self._lander.send(name, a)
            return
        a, tag = self._cast(name, a, tag, dtype)
        if tag is None:
            raise TypeError(f"{name}: cannot send a {a.dtype} array; pass dtype= (F32, F16 or BF16)")
        self._queue((name, tag, a, None, a.nbytes))

    @contextlib.contextmanager
    def _landing_io(self):
        """Around the landing sender's calls: a broken landing connection (status 0) is raised
        with what the daemon's /health says of it (a rank closes its landing when a weight sleep,
        another update or a failure stops it; the trainer saw only "Broken pipe")."""
        try:
            yield
        except FdRolloutError as e:
            if e.status != 0 or e.type != "unreachable":
                raise
            raise FdRolloutError(0, e.type, f"{e.message}; {self._daemon_side()}", url=self.client.url) from e

    def _daemon_side(self):
        """What /health says that stops a landing (asked once, bounded; never raises)."""
        try:
            h = self.client.request("GET", "/health", timeout=min(self.timeout, 5.0))
        except FdRolloutError as e:
            if not isinstance(e.body, dict) or "weight_version" not in e.body:  # a degraded daemon's /health is a 503 with its body
                return f"the daemon did not answer /health either ({e.message}): it or a rank may have died"
            h = e.body
        why = []
        if "weight" in (h.get("sleeping_tags") or []):
            why.append("the weights went to sleep (a weight sleep stops an open landing)")
        if h.get("degraded_ranks"):
            why.append(f"rank(s) {h['degraded_ranks']} failed")
        before = self.base_version if self.base_version is not None else self._serving_at_start
        stream = h.get("weight_stream") or {}
        if before is not None and h.get("weight_version") != before:
            why.append(f"the ranks were updated to weight_version {h.get('weight_version')!r} meanwhile (an update stops an open landing)")
        elif self.base_version is not None and "serving_stream_version" in stream and stream["serving_stream_version"] is None:
            why.append(f"the base {self.base_version!r} no longer serves: an update loaded other bytes under its label (an update stops an "
                       "open landing)")
        if h.get("staged_weight_version"):
            why.append(f"a two-phase update staged {h['staged_weight_version']!r} over the landing")
        for what in (h.get("last_control_error"), stream.get("last_error")):
            if what:
                why.append(what)
        return "the daemon: " + ("; ".join(why) if why else f"serving weight_version {h.get('weight_version')!r}; /health shows no reason "
                                 "(a weight sleep and wakeup, or an update under the same label, since the start would not show)")

    def _expert_views(self, name):
        """[(view name, its rows)] of the stacked expert tensor `name`, in its row order (the init
        answer's expert_tensors); [] for any other name."""
        return [(n, v[1][0]) for n, v in self.expected.items() if len(v) > 2 and v[2] == name]

    def _cast(self, name, a, tag, dtype, want=None):
        want = want or self.expected.get(name, (None,))[0]
        if dtype == "BF16" and a.dtype == np.uint16:  # bf16 bits (changed_elements' of numpy ones): widened below as torch's
            tag = "BF16"
        elif dtype is not None:
            return a, dtype
        if want not in (None, "BF16") and tag == "BF16" and a.dtype == np.uint16:  # torch bfloat16 bits: widened exactly
            a, tag = (a.astype(np.uint32) << 16).view(np.float32), "F32"
        if want is not None and tag != want and a.dtype.kind == "f":
            if want == "BF16":
                return np.ascontiguousarray(_f32_to_bf16_bits(a.astype(np.float32)).reshape(a.shape)), "BF16"
            return np.ascontiguousarray(a.astype(_CAST[want])), want
        return a, tag

    def send_delta(self, name, indices, values, dtype=None, narrow=True):
        """Queue a delta of the tensor `name` against the stream's base_version: `indices` [n] flat
        element indices into the HF tensor (int64 or int32; sorted, unique, in range: the daemon
        checks and answers 400 naming the tensor), `values` [n] their new values (cast to the
        rollout's dtype as in `send`). The tensor's shape is the one the daemon holds. int64
        indices that all fit an int32 go out as int32 (a third fewer bytes at f32) unless
        `narrow` is False."""
        self._check_open(name)
        if self.base_version is None:
            raise ValueError(f"{name}: send_delta needs weight_stream(..., base_version=...)")
        if name not in self.expected:
            raise KeyError(f"{name}: not a tensor of the model (the init answer lists them)")
        idx, _ = _to_numpy(indices)
        if idx.dtype not in (np.dtype("int64"), np.dtype("int32")):
            raise TypeError(f"{name}: delta indices must be int64 or int32, got {idx.dtype}")
        v, tag = _to_numpy(values)
        v, tag = self._cast(name, v, tag, dtype)
        if tag is None:
            raise TypeError(f"{name}: cannot send {v.dtype} values; pass dtype= (F32, F16 or BF16)")
        idx, v = idx.reshape(-1), v.reshape(-1)
        if idx.size != v.size:
            raise ValueError(f"{name}: {idx.size} indices but {v.size} values")
        if self._lander is not None:
            self._send_delta_landed(name, idx, v, tag, dtype)
            return
        if narrow and idx.dtype == np.int64 and idx.size and -2**31 <= int(idx.min()) and int(idx.max()) < 2**31:
            idx = idx.astype(np.int32)
        if idx.size != v.size:
            raise ValueError(f"{name}: {idx.size} indices but {v.size} values")
        delta = {"n_indices": int(idx.size), "index_dtype": "I64" if idx.dtype == np.int64 else "I32"}
        shape = list(self.expected[name][1])
        self._queue((name, tag, (idx, v), (delta, shape), idx.nbytes + v.nbytes))

    def _send_delta_landed(self, name, idx, v, tag, dtype):
        """send_delta on a delta landing: frames straight to the ranks (docs/weight_streams.md
        "Landed deltas"); a stacked expert tensor's delta goes out as its per-expert views'."""
        plan = self._lander.plan
        if name not in plan:
            views = self._expert_views(name)
            if views:  # [E, R, C] stacked: expert e's rows are its view's, one after another
                cols = int(np.prod(self.expected[name][1][2:])) if len(self.expected[name][1]) > 2 else 1
                edges = np.cumsum([0] + [rows * cols for _, rows in views])
                cut = np.searchsorted(idx, _edges_like(idx, edges))
                if cut[0] != 0 or cut[-1] != idx.size:
                    raise FdRolloutError(400, "invalid_argument", f"{name}: delta indices must be sorted, unique and inside the tensor",
                                         url=self.client.url)
                for k, (view, _) in enumerate(views):
                    lo, hi = int(cut[k]), int(cut[k + 1])
                    if hi > lo:
                        self._send_delta_landed(view, idx[lo:hi] - idx.dtype.type(edges[k]), v[lo:hi], tag, dtype)
                return
            if name in self.expected:
                return  # a tensor no rank reads (a tied lm_head, rotary inv_freq): the daemon path ignores it too
            raise KeyError(f"{name}: not a tensor of the model (the init answer lists them)")
        v, tag = self._cast(name, v, tag, dtype, want=plan[name][0][1][3])
        with self._landing_io():
            self.bytes_sent += self._lander.send_delta(name, idx, v, self.client.url)

    def _queue(self, item):
        self._pending.append(item)
        self._pending_bytes += item[4]
        if self._pending_bytes >= self.bucket_bytes:
            self.flush()

    def flush(self):
        """Send the queued tensors as one bucket; returns the daemon's answer (None if none queued).
        A landed update: wait until every part sent so far left for its rank (returns None).
        Errors  RuntimeError outside the stream's `with` block."""
        self._check_open("flush")
        if self._lander is not None:
            with self._landing_io():
                self._lander.drain()
            return None
        if not self._pending:
            return None
        bucket, self._pending, self._pending_bytes = self._pending, [], 0
        info = {"names": [b[0] for b in bucket], "dtype_names": [b[1] for b in bucket],
                "shapes": [b[3][1] if b[3] else list(b[2].shape) for b in bucket]}
        if any(b[3] for b in bucket):
            info["deltas"] = [b[3][0] if b[3] else None for b in bucket]
        answer, error = {}, []

        def call():
            try:
                answer["r"] = self.client.request("POST", "/update_weights", body={"update_info": info}, timeout=self.timeout)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                error.append(e)

        th = threading.Thread(target=call, daemon=True)
        th.start()
        send_error = None
        try:
            views = []  # tcp: the bucket's frames and payloads, gathered into few sendmsg calls
            for name, tag, a, delta, nbytes in bucket:
                if self._nccl is not None:  # one broadcast per tensor: its payload, no frame
                    self._nccl.send(list(a) if delta is not None else [a])
                elif delta is None:
                    views += [_frame({"name": name, "dtype": tag, "shape": list(a.shape)}, nbytes), _bytes_of(a)]
                else:
                    views += [_frame({"name": name, "dtype": tag, "shape": delta[1], **delta[0]}, nbytes)]
                    views += [_bytes_of(part) for part in a]
                if self._nccl is not None:
                    self.bytes_sent += nbytes
            if views:
                _send_all(self.sock, views)
                self.bytes_sent += sum(b[4] for b in bucket)
        except (OSError, TimeoutError, RuntimeError) as e:  # the daemon refused the bucket and closed the stream, or died
            send_error = e
        th.join(self.timeout + 10)
        if error:
            raise error[0]
        if send_error is not None:
            raise _transport_error(send_error, f"sending a bucket of {len(bucket)} tensor(s) on the weight-stream transport") from send_error
        if th.is_alive():
            raise FdRolloutError(0, "timeout", f"POST /update_weights: no answer within {self.timeout + 10:g} s", url=self.client.url)
        return answer.get("r")

    def abort(self):
        """Drop the update on the daemon (the serving weights stay); errors are ignored."""
        self._pending, self._pending_bytes = [], 0
        try:
            self.client.request("POST", "/abort_weight_update", body={}, timeout=min(self.timeout, 30.0))
        except Exception:  # noqa: BLE001 - the daemon may be gone; it drops the update by itself then
            pass

    def _close(self):
        """Close this stream's transport and end the stream on this side (its client may open the next)."""
        try:
            self._close_transport()
        finally:
            self._release()

    def _close_transport(self):
        if self._lander is not None:
            self._lander.close()
            self._lander = None
        self._nccl = None  # the communicator lives until the next init on the daemon's side
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None


def changed_elements(old, new):
    """(indices, values) of the elements where `new` differs from `old` bitwise (same shape and
    dtype; numpy arrays or CPU torch tensors): indices [n] flat, sorted, int32 (int64 for a tensor of
    2**31 elements or more); values [n] of new,
    a numpy array, or for torch bfloat16 inputs a CPU torch bfloat16 tensor (numpy has none: their
    uint16 bits were refused by send_delta, a probe), which send_delta sends as BF16, widened
    exactly to F32 for an F32 model as `send` does. A NaN that stays NaN with the same bits is
    unchanged; +0.0 → -0.0 is a change.
    Errors  ValueError when the shapes or dtypes differ."""
    a, tag_a = _to_numpy(old)
    b, tag_b = _to_numpy(new)
    if a.shape != b.shape or a.dtype != b.dtype or tag_a != tag_b:
        raise ValueError(f"changed_elements: {a.shape} {tag_a or a.dtype} vs {b.shape} {tag_b or b.dtype}")
    bits = np.dtype(f"u{a.dtype.itemsize}")
    fa, fb = a.reshape(-1).view(bits), b.reshape(-1).view(bits)
    idx = np.flatnonzero(fa != fb).astype(np.int32 if fa.size < 2**31 else np.int64)
    if tag_b == "BF16" and is_torch(new):
        import torch  # present: new is a torch tensor
        return idx, torch.from_numpy(b.reshape(-1)[idx].view(np.int16)).view(torch.bfloat16)
    return idx, b.reshape(-1)[idx]
