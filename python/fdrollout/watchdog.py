"""One shared timer thread for the client's call deadlines (fdrollout.client): `arm(seconds, fn)`
runs fn() on that thread once `seconds` have passed unless `disarm(token)` came first.

A `threading.Timer` per HTTP call started (and switched to) a thread per call: 0.2-1 ms of every
call on a 2-vCPU guest, a fifth of a small weight stream's fixed cost (issue 25). Here one daemon
thread sleeps until the earliest deadline. After a fork the child starts its own thread at its
first arm (the parent's does not exist there)."""
import heapq
import itertools
import os
import threading
import time

_cond = threading.Condition(threading.Lock())
_heap = []   # (deadline on time.monotonic(), token); disarmed tokens stay until compacted or due
_live = {}   # token -> fn, for the armed ones
_tokens = itertools.count()
_owner_pid = None  # the process whose thread serves _heap


def _run():
    with _cond:
        while True:
            if not _heap:
                _cond.wait()
                continue
            deadline, token = _heap[0]
            if token not in _live:  # disarmed
                heapq.heappop(_heap)
                continue
            now = time.monotonic()
            if deadline > now:
                _cond.wait(deadline - now)
                continue
            heapq.heappop(_heap)
            fn = _live.pop(token)
            _cond.release()
            try:
                fn()
            except Exception:  # noqa: BLE001 - a deadline's action must never end the thread
                pass
            finally:
                _cond.acquire()


def _reset_after_fork():
    global _cond, _owner_pid
    _cond = threading.Condition(threading.Lock())
    _heap.clear()
    _live.clear()
    _owner_pid = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def arm(seconds, fn):
    """Run fn() (on the watchdog thread; it must not block) once `seconds` have passed; returns
    the token disarm() takes."""
    global _owner_pid
    with _cond:
        if _owner_pid != os.getpid():
            threading.Thread(target=_run, name="fdrollout-watchdog", daemon=True).start()
            _owner_pid = os.getpid()
        token = next(_tokens)
        _live[token] = fn
        heapq.heappush(_heap, (time.monotonic() + seconds, token))
        if len(_heap) > 2 * len(_live) + 64:  # many disarmed entries far from due: drop them
            _heap[:] = [e for e in _heap if e[1] in _live]
            heapq.heapify(_heap)
        if _heap[0][1] == token:
            _cond.notify()
        return token


def disarm(token):
    """fn of arm()'s `token` will not run (no-op once it ran)."""
    with _cond:
        _live.pop(token, None)
