"""The trainer's side of the NCCL weight-stream transport (docs/weight_streams.md, "NCCL").

`WeightStream(..., backend="nccl")` uses it: this process creates the group's ncclUniqueId
(`torch.cuda.nccl.unique_id()`, 128 bytes, sent as 256 hex digits in `init_info`), joins as rank
0 of 2 while the daemon's receiver joins as rank 1 inside `/init_weight_transfer_engine` (no TCP
store, no torch.distributed process group), then each announced tensor is one `ncclBroadcast`
from rank 0 of exactly its payload bytes as uint8 (a delta: its indices then its values, as on
the TCP wire), in announced order.

Every wait is bounded: the group's init and each broadcast run on a helper thread joined with
the stream's timeout, so a daemon that dies makes the trainer raise `TimeoutError` instead of
hanging in NCCL (the helper thread is then abandoned; the communicator is not reused).
Needs torch with CUDA and a visible device; written and compiled against torch 1.13's
`torch.cuda.nccl` API, run only where a GPU is lent (tests/python/test_nccl_sender.py skips
otherwise).
"""
import threading


def _bounded(fn, timeout, what):
    """Run fn() on a helper thread; its result, its exception, or TimeoutError after `timeout` s."""
    out, err = {}, []

    def run():
        try:
            out["r"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            err.append(e)

    th = threading.Thread(target=run, daemon=True, name=f"fdrollout-nccl-{what}")
    th.start()
    th.join(timeout)
    if th.is_alive():
        raise TimeoutError(f"NCCL {what} did not finish within {timeout:g} s (is the daemon alive?)")
    if err:
        raise err[0]
    return out.get("r")


class NcclSender:
    """Rank 0 of a 2-rank NCCL group whose rank 1 is the daemon's receiver."""

    def __init__(self, device=0, timeout=900.0):
        import torch  # required for this transport only
        if not torch.cuda.is_available():
            raise RuntimeError("the nccl weight-stream backend needs torch with CUDA and a visible GPU; use backend='tcp'")
        if not hasattr(torch._C, "_nccl_unique_id"):
            raise RuntimeError("this torch was built without NCCL (torch.cuda.nccl); use backend='tcp'")
        self.torch, self.timeout = torch, float(timeout)
        self.device = torch.device("cuda", device)
        self.uid = torch.cuda.nccl.unique_id()
        if len(self.uid) != 128:
            raise RuntimeError(f"torch.cuda.nccl.unique_id() gave {len(self.uid)} bytes, not 128")
        self.comm = None

    def init_info(self):
        """The `init_info` body of /init_weight_transfer_engine for this group."""
        return {"backend": "nccl", "nccl_unique_id": self.uid.hex(), "rank_offset": 1, "world_size": 2, "timeout_s": self.timeout}

    def join(self):
        """Join the group as rank 0 (blocks until the daemon joined; call while the init request runs)."""
        def init():
            with self.torch.cuda.device(self.device):
                return self.torch.cuda.nccl.init_rank(2, self.uid, 0)
        self.comm = _bounded(init, self.timeout, "group init")

    def _as_bytes(self, a):
        torch = self.torch
        if not isinstance(a, torch.Tensor):
            a = torch.from_numpy(a)
        return a.detach().contiguous().reshape(-1).view(torch.uint8).to(self.device, non_blocking=False)

    def send(self, parts):
        """Broadcast one tensor's payload: the parts (numpy arrays or torch tensors) back to back."""
        torch = self.torch
        if self.comm is None:
            raise RuntimeError("NcclSender.send before join()")
        payload = torch.cat([self._as_bytes(p) for p in parts]) if len(parts) > 1 else self._as_bytes(parts[0])

        def bcast():
            with torch.cuda.device(self.device):
                torch.cuda.nccl.broadcast([payload], root=0, comms=[self.comm])
                torch.cuda.synchronize(self.device)

        _bounded(bcast, self.timeout, "broadcast")
        return payload.numel()
