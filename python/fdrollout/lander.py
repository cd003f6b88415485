"""A landed update's sender (docs/weight_streams.md "Landing" and "Landed deltas"): one connection
and one sending thread per rank, carrying exactly the parts (or, for a delta, the (indices,
values) frames) that rank listed in the start answer. Used by WeightStream(land=True)."""
import queue
import socket
import struct
import threading

import numpy as np

from .client import FdRolloutError
from .stream_wire import _bytes_of, _connect, _frame, _send_all, _transport_error

_DELTA_FRAME, _DELTA_IDX64, _DELTA_END = 1 << 63, 1 << 62, (1 << 64) - 1  # a delta landing's header flags (fd/stream/landing.h)


class _Lander:
    """A landed update's side of the ranks (docs/weight_streams.md "Landing"): one connection per
    rank, each with its own sending thread, carrying frames (u64 LE offset, u64 LE nbytes, payload)
    of exactly the parts that rank listed in the start answer; a row range goes out as a view of
    the tensor, a column slice is gathered into one buffer by that rank's thread (one numpy copy
    in C, where a view per row costs a Python call each)."""

    def __init__(self, ranks, default_host, timeout):
        self.timeout, self.errors, self.socks, self.queues, self.threads = timeout, [], [], [], []
        self.delta = bool(ranks) and ranks[0].get("mode") == "delta"  # a delta landing: (indices, values) frames, then an end frame
        self.frames = [0] * len(ranks)  # delta frames queued per rank (the end frame counts them)
        self.plan = {}  # hf name -> [(rank index, part)], part = [name, offset, nbytes, dtype, dim, src0, n, hf_shape]
        try:
            for i, r in enumerate(ranks):
                for part in r["parts"]:
                    self.plan.setdefault(part[0], []).append((i, part))
                host = r.get("host") or default_host
                if host in ("0.0.0.0", "::", ""):
                    host = default_host
                sock = _connect(host, int(r["port"]), timeout, f"rank {i}'s landing connection")
                self.socks.append(sock)
                try:
                    sock.sendall(_frame({"token": r["token"]}))
                except OSError as e:
                    raise _transport_error(e, f"rank {i}'s landing connection (hello)") from e
                q = queue.Queue(maxsize=256)
                th = threading.Thread(target=self._run, args=(sock, q), daemon=True)
                th.start()
                self.queues.append(q)
                self.threads.append(th)
        except BaseException:
            self.close()
            raise

    def _run(self, sock, q):
        while True:
            item = q.get()
            if item is None:
                q.task_done()
                return
            if self.errors:
                q.task_done()
                continue  # drain: the stream failed
            try:
                header, parts = item
                _send_all(sock, [header] + [_bytes_of(p) for p in parts])  # a column slice is gathered here, on this rank's thread
            except (OSError, TimeoutError) as e:
                self.errors.append(e)
            finally:
                q.task_done()

    def _raise_error(self):
        if self.errors:
            raise _transport_error(self.errors[0], "sending to a rank's landing connection") from self.errors[0]

    def send(self, name, a):
        """Queue every rank's parts of `a` (already in the parts' dtype); returns the bytes.
        Errors  FdRolloutError when a rank's connection broke, or its queue stayed full for the timeout."""
        self._raise_error()
        total = 0
        for i, (_, offset, nbytes, _dtype, dim, src0, n, hf_shape) in self.plan[name]:
            if list(a.shape) != list(hf_shape):
                raise ValueError(f"{name}: shape {list(a.shape)} where the model has {list(hf_shape)}")
            part = a[src0:src0 + n] if dim == 0 else a[:, src0:src0 + n]
            if part.nbytes != nbytes:
                raise ValueError(f"{name}: {part.nbytes} bytes for a part of {nbytes}")
            try:
                self.queues[i].put((struct.pack("<QQ", offset, nbytes), [part]), timeout=self.timeout)
            except queue.Full:
                raise FdRolloutError(0, "timeout", f"{name}: rank {i} did not take its parts within {self.timeout:g} s") from None
            total += nbytes
        return total

    def send_delta(self, name, idx, v, url):
        """Queue the delta frames of `name` (idx [n] int32/int64 flat indices into the training
        tensor, sorted and unique; v [n] in the parts' dtype): a row part gets the indices in its
        rows (slices, found by binary search), a column part all of them (the rank keeps its
        columns). Returns the bytes queued.
        Errors  FdRolloutError 400 when the indices cannot be sorted (they do not split into the
                parts' row ranges in order; the ranks check each frame's order and range); as send."""
        self._raise_error()
        if idx.size == 0:
            return 0
        flag = _DELTA_FRAME | (_DELTA_IDX64 if idx.dtype == np.int64 else 0)
        parts = self.plan[name]
        hf_shape = parts[0][1][7]
        cols = int(hf_shape[1]) if len(hf_shape) == 2 else 1
        rows = sorted({(p[5], p[6]) for _, p in parts if p[4] == 0})
        cut = {}
        if rows:  # each index goes to the one row range holding it, in order (the ranks check each frame's order and range)
            edges = [r0 * cols for r0, _ in rows] + [(rows[-1][0] + rows[-1][1]) * cols]
            b = np.searchsorted(idx, _edges_like(idx, edges))
            tiled = rows[0][0] == 0 and rows[-1][0] + rows[-1][1] == hf_shape[0] and all(
                rows[k][0] + rows[k][1] == rows[k + 1][0] for k in range(len(rows) - 1))
            if (tiled and (b[0] != 0 or b[-1] != idx.size)) or any(b[k] > b[k + 1] for k in range(len(rows))):
                raise FdRolloutError(400, "invalid_argument", f"{name}: delta indices must be sorted, unique and inside the tensor's "
                                     f"{int(np.prod(hf_shape))} elements", url=url)
            cut = {r: (int(b[k]), int(b[k + 1])) for k, r in enumerate(rows)}
        total = 0
        for i, (_, offset, _nb, _dtype, dim, src0, n, _shape) in parts:
            lo, hi = cut[(src0, n)] if dim == 0 else (0, idx.size)
            if hi <= lo:
                continue
            ii, vv = idx[lo:hi], v[lo:hi]
            try:
                self.queues[i].put((struct.pack("<QQ", offset | flag, hi - lo), [ii, vv]), timeout=self.timeout)
            except queue.Full:
                raise FdRolloutError(0, "timeout", f"{name}: rank {i} did not take its parts within {self.timeout:g} s") from None
            self.frames[i] += 1
            total += ii.nbytes + vv.nbytes
        return total

    def drain(self):
        """Wait (at most the timeout) until every part queued so far went out on its socket.
        Errors  FdRolloutError ("timeout" when a rank did not take its parts in time)."""
        for q in self.queues:
            with q.all_tasks_done:
                if not q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, self.timeout):
                    raise FdRolloutError(0, "timeout", f"a rank did not take its parts within {self.timeout:g} s")
        self._raise_error()

    def finish(self):
        """Wait until every queued part went out, then shut the connections' sending side (a rank
        missing a part then fails at once instead of at its deadline).
        Errors  FdRolloutError ("timeout" when a rank did not take its parts in time)."""
        try:
            for i, q in enumerate(self.queues):
                if self.delta:  # the end frame: how many delta frames this rank should have
                    q.put((struct.pack("<QQ", _DELTA_END, self.frames[i]), []), timeout=self.timeout)
                q.put(None, timeout=self.timeout)
        except queue.Full:
            raise FdRolloutError(0, "timeout", f"a rank did not take its parts within {self.timeout:g} s") from None
        for th in self.threads:
            th.join(self.timeout)
            if th.is_alive():
                raise FdRolloutError(0, "timeout", f"a rank did not take its parts within {self.timeout:g} s")
        self._raise_error()
        try:
            for sock in self.socks:
                sock.shutdown(socket.SHUT_WR)
        except OSError as e:
            raise _transport_error(e, "shutting a rank's landing connection") from e

    def close(self):
        for sock in self.socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a sending thread blocked on a full socket (close alone does not)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass
        for q in self.queues:
            try:
                q.put_nowait(None)
            except Exception:  # noqa: BLE001 - a full queue: its thread ends on the closed socket
                pass
        self.socks = []


def _edges_like(idx, edges):
    """`edges` as an array of idx's dtype (searchsorted of another dtype would copy idx first),
    clipped to an int32's range for int32 indices."""
    e = np.asarray(edges, dtype=np.int64)
    if idx.dtype == np.int32:
        e = np.minimum(e, 2**31 - 1)
    return e.astype(idx.dtype)
