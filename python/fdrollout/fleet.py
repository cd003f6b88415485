"""`Fleet`: the same control calls on several daemons at once, and the all-or-nothing fleet
update that `fdctl --fleet FILE update-weights` runs (docs/weight_control.md, SPEC §9).

    from fdrollout import Fleet
    f = Fleet(["10.0.0.1:8000", "10.0.0.2:8000"], api_key=KEY, timeout=120)   # or Fleet.from_file(path)
    f.pause()
    f.update_weights("step-43")      # staged everywhere, then committed everywhere -- or dropped everywhere
    f.resume()

Each member is called from its own thread and bounded by `timeout`. A call that fails on some
members raises `FleetError` whose `results` maps every member's url to its result (a dict) or
its `FdRolloutError`; nothing is retried.

`update_weights(version)`: stage `version` on every member; only if every member staged it,
commit it on every member, else drop it where this update may have staged it (staged, or no
answer: not where the stage was refused or never reached the member, as fdctl): every member
keeps its old version, `FleetError.committed` is "none", fdctl's exit 20. If every commit is
refused by a member that answered and none serves `version`, the staged copies are dropped
everywhere and `committed` is "none" too. Otherwise, if some commits fail or go unanswered (one
may have happened) or the members do not all report `version` afterwards, `committed` is "some"
(fdctl's exit 21) and `serving` says which member serves what; "some" also when nothing was
committed but the members that answered serve different versions (a fleet split before the
update). `FleetError.not_dropped` lists the members where a staged copy (never served) may be
left because its drop failed: call drop_staged_weights there.
"""
import concurrent.futures

from .client import Client, FdRolloutError


class FleetError(Exception):
    """results: {url: result dict | the exception (FdRolloutError, or whatever else the member's
    call raised)}; committed: None (not an update), "none" or
    "some"; serving: {url: weight_version or None when unknown} after an update; not_dropped:
    [url] where the update's staged copy may be left (its drop failed)."""

    def __init__(self, what, results, committed=None, serving=None, not_dropped=()):
        failed = {u: r for u, r in results.items() if isinstance(r, Exception)}
        lines = [f"{u}: {r.type}: {r.message}" if isinstance(r, FdRolloutError) else f"{u}: {type(r).__name__}: {r}" for u, r in failed.items()]
        left = (f"; the staged copy (never served) could not be dropped on {', '.join(not_dropped)}: call drop_staged_weights "
                "there once it answers") if not_dropped else ""
        super().__init__(f"{what}: {len(failed)} of {len(results)} member(s) failed" + ("; " if lines else "") + "; ".join(lines) + left)
        self.results, self.committed, self.serving, self.not_dropped = results, committed, serving or {}, list(not_dropped)


def any_failed(results):
    return any(isinstance(r, Exception) for r in results.values())


def all_failed(results):
    return all(isinstance(r, Exception) for r in results.values())


def may_have_staged(r):
    """Whether a stage whose result is `r` may have left its copy staged (fdctl's rule): it staged,
    or its outcome is unknown (no answer; 504: the daemon stopped waiting for its ranks). Not after
    a refusal (another error answer; a 409 may mean another version is staged there, which the
    rollback dropped: a probe) nor when the connection was refused (the call never arrived)."""
    if not isinstance(r, Exception):
        return True
    status = getattr(r, "status", None)
    if status == 0:
        return not isinstance(r.__cause__, ConnectionRefusedError)
    return status == 504 or status is None  # None: not an FdRolloutError, its outcome is unknown


def committed_if_nothing_was(serving):
    """"none" when the members that answered serve one version, else "some" (the fleet is split:
    a probe saw "none", "every member keeps its old version", on a fleet split before the update)."""
    return "some" if len({v for v in serving.values() if v is not None}) > 1 else "none"


def read_fleet_file(path):
    """One `host:port` or `http://host:port` per line; `#` starts a comment (fdctl's --fleet)."""
    urls = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                urls.append(line)
    if not urls:
        raise ValueError(f"{path}: no members")
    return urls


class Fleet:
    """Several daemons. `urls`: a list (or other iterable) of urls or `Client`s.
    Errors  TypeError for a single str (pass a list: its characters were taken as members, a
            probe), ValueError for no member or one listed twice (and as Client for each url)."""

    def __init__(self, urls, api_key=None, timeout=900.0):
        if isinstance(urls, (str, bytes)):
            raise TypeError(f"Fleet takes a list of urls, not one {type(urls).__name__}: Fleet([{urls!r}])")
        self.members = [u if isinstance(u, Client) else Client(u, api_key=api_key, timeout=timeout) for u in urls]
        if not self.members:
            raise ValueError("a fleet needs at least one member")
        seen = set()
        for m in self.members:
            if m.url in seen:
                raise ValueError(f"{m.url} is listed twice")
            seen.add(m.url)

    @classmethod
    def from_file(cls, path, **kw):
        return cls(read_fleet_file(path), **kw)

    def __repr__(self):
        return f"Fleet({[m.url for m in self.members]!r})"

    def map(self, fn, members=None):
        """fn(client) on every member (or those of `members`) in parallel -> {url: result or the
        exception it raised}. Any exception is that member's failure, never raised from here: one
        that escaped (a bare TypeError of a member's odd answer, a probe) hid which members had committed."""
        members = self.members if members is None else members
        if not members:
            return {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(members)) as ex:
            futs = {m.url: ex.submit(fn, m) for m in members}
        out = {}
        for url, fut in futs.items():
            try:
                out[url] = fut.result()
            except Exception as e:  # noqa: BLE001 - recorded as the member's result
                out[url] = e
        return out

    def _all(self, what, fn):
        res = self.map(fn)
        if any_failed(res):
            raise FleetError(what, res)
        return res

    def pause(self, mode="abort", clear_cache=None):
        return self._all("pause", lambda c: c.pause(mode=mode, clear_cache=clear_cache))

    def resume(self):
        return self._all("resume", lambda c: c.resume())

    def sleep(self, tags=None):
        return self._all("sleep", lambda c: c.sleep(tags))

    def wakeup(self, tags=None):
        return self._all("wakeup", lambda c: c.wakeup(tags))

    def health(self):
        return self._all("health", lambda c: c.health())

    def weight_versions(self):
        """{url: weight_version, or the exception when the member did not answer}."""
        return self.map(lambda c: c.weight_version())

    def _serving(self):
        """{url: weight_version, None when the member did not answer}."""
        return {u: (None if isinstance(v, Exception) else v) for u, v in self.weight_versions().items()}

    def abort(self, request_id=None, all=False):
        """Ask every member; a member that does not run `request_id` answers 404 (not an error
        here when another member aborted it). Raises FleetError when a member did not answer or
        no member runs it."""
        res = self.map(lambda c: c.abort(request_id=request_id, all=all))
        unanswered = any(isinstance(r, Exception) and not (isinstance(r, FdRolloutError) and r.status == 404)
                         for r in res.values())
        nobody_ran_it = not all and all_failed(res)
        if unanswered or nobody_ran_it:
            raise FleetError("abort", res)
        return res

    def update_weights(self, version, verify_checksum=False):
        """All-or-nothing across the fleet (module docstring). Every member must be paused."""
        version = str(version)
        staged = self.map(lambda c: c.stage_weights(version, verify_checksum=verify_checksum))
        if any_failed(staged):
            dropped = self.map(lambda c: c.drop_staged_weights(), [m for m in self.members if may_have_staged(staged[m.url])])
            serving = self._serving()
            # A stage error stays the member's result; a failed drop there is named in not_dropped
            # (it was hidden behind the stage error: a probe).
            results = {u: staged[u] if isinstance(staged[u], Exception) or u not in dropped else dropped[u] for u in staged}
            not_dropped = [u for u, r in dropped.items() if isinstance(r, Exception)]
            raise FleetError(f"update_weights {version}: not staged everywhere, dropped where staged", results,
                             committed_if_nothing_was(serving), serving, not_dropped)
        committed = self.map(lambda c: c.commit_weights(version))
        serving = self._serving()
        if any_failed(committed) or any(v != version for v in serving.values()):
            n_ok = sum(1 for r in committed.values() if not isinstance(r, Exception))
            # As fdctl: "none" only when every member answered and none serves `version` (then
            # the staged copies are dropped); a commit without an answer may have happened.
            any_new = n_ok > 0 or any(v == version for v in serving.values())
            any_unsure = any(v is None for v in serving.values()) or any(  # no answer (status 0: unreachable)
                isinstance(r, Exception) and getattr(r, "status", 0) == 0 for r in committed.values())
            if not any_new and not any_unsure:
                dropped = self.map(lambda c: c.drop_staged_weights())
                results = {u: committed[u] if isinstance(committed[u], Exception) else dropped[u] for u in committed}
                not_dropped = [u for u, r in dropped.items() if isinstance(r, Exception)]
                raise FleetError(f"update_weights {version}: no member committed, dropped", results,
                                 committed_if_nothing_was(serving), serving, not_dropped)
            raise FleetError(f"update_weights {version}: committed on {n_ok} of {len(committed)} member(s)", committed, "some", serving)
        return committed
