"""The weight-stream wire's Python side (docs/weight_streams.md "Wire"): frames, connections and
scatter-gather sends, shared by WeightStream (fdrollout.weight_stream) and the landing sender
(fdrollout.lander)."""
import json
import select
import socket
import struct

import numpy as np

from .client import FdRolloutError

_MAGIC = b"FDW1"


def _frame(header, nbytes=0):
    h = json.dumps({**header, "nbytes": nbytes} if nbytes or "name" in header else header).encode()
    return _MAGIC + struct.pack("<I", len(h)) + h


def _bytes_of(a):
    """A flat byte view of numpy array `a` (copied only if it is not contiguous)."""
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _send_all(sock, views, iov_max=512):
    """Send every buffer of `views` (bytes or byte memoryviews) in order with few sendmsg calls
    (scatter-gather: one syscall for many small frames, instead of one each); raises as sendall."""
    views = [memoryview(v).cast("B") for v in views]
    i = 0
    while i < len(views):
        n = sock.sendmsg(views[i:i + iov_max])
        while n > 0:  # drop what went out; a partly sent buffer keeps its tail
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i], n = views[i][n:], 0
        while i < len(views) and len(views[i]) == 0:
            i += 1


def _connect(host, port, timeout, what):
    """A TCP connection to the daemon's transport `what`, with TCP_NODELAY.
    Errors  FdRolloutError (status 0, "unreachable") naming `what` and the address: a bare
            ConnectionRefusedError / OSError before (a probe)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    except OSError as e:
        raise FdRolloutError(0, "unreachable", f"{what}: cannot connect to {host}:{port}: {e}") from e


def _transport_error(e, what):
    """OSError / TimeoutError of the transport as FdRolloutError (status 0): "timeout" when a wait
    ran out, else "unreachable"."""
    if isinstance(e, FdRolloutError):
        return e
    return FdRolloutError(0, "timeout" if isinstance(e, TimeoutError) else "unreachable", f"{what}: {e}")


def _open(sock):
    """False when the daemon closed or reset the connection (never blocks)."""
    p = select.poll()
    p.register(sock, select.POLLRDHUP)
    return not any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in p.poll(0))
