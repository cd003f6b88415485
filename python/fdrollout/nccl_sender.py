"""The trainer's side of the NCCL weight-stream transport (docs/weight_streams.md, "NCCL").

`WeightStream(..., backend="nccl")` uses it: this process creates the group's ncclUniqueId
(`ncclGetUniqueId`, 128 bytes, sent as 256 hex digits in `init_info`), joins as rank
0 of 2 while the daemon's receiver joins as rank 1 inside `/init_weight_transfer_engine` (no TCP
store, no torch.distributed process group), then each announced tensor is one `ncclBroadcast`
from rank 0 of exactly its payload bytes as uint8 (a delta: its indices then its values, as on
the TCP wire), in announced order.

Every wait is bounded: the group's init and each broadcast run on a helper thread joined with
the stream's timeout, so a daemon that dies makes the trainer raise `TimeoutError` instead of
hanging in NCCL (the helper thread is then abandoned; the communicator is not reused).
NCCL is called through ctypes (the libnccl.so.2 torch already loaded, else the system's): torch's
own `torch.cuda.nccl.init_rank` fails on Python 3.12 builds ("PY_SSIZE_T_CLEAN macro must be
defined for '#' formats", seen on the first GPU run), and torch.distributed would need a process
group. torch supplies the device buffers and the stream. Needs torch with CUDA and a visible
device (tests/python/test_nccl_sender.py skips otherwise).
"""
import ctypes
import glob
import os
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


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


_NCCL_UINT8 = 1  # ncclDataType_t ncclUint8


def _load_nccl(torch):
    """libnccl.so.2: the one torch loaded (dlopen finds it by soname), else one under torch's
    site-packages (nvidia/nccl/lib), else the system's. Raises RuntimeError when none loads."""
    names = ["libnccl.so.2", "libnccl.so"]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    names += sorted(glob.glob(os.path.join(site, "nvidia", "nccl", "lib", "libnccl.so*")))
    names += sorted(glob.glob("/usr/local/cuda*/lib*/libnccl.so*"))
    for n in names:
        try:
            lib = ctypes.CDLL(n)
        except OSError:
            continue
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
        lib.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]
        return lib
    raise RuntimeError("no libnccl.so.2 could be loaded (torch built without NCCL?); use backend='tcp'")


class NcclSender:
    """Rank 0 of a 2-rank NCCL group whose rank 1 is the daemon's receiver."""

    def __init__(self, device=0, timeout=900.0):
        import torch  # required for this transport only
        if not torch.cuda.is_available():
            raise RuntimeError("the nccl weight-stream backend needs torch with CUDA and a visible GPU; use backend='tcp'")
        self.torch, self.timeout = torch, float(timeout)
        self.device = torch.device("cuda", device)
        self.nccl = _load_nccl(torch)
        self.uid = _UniqueId()
        self._check(self.nccl.ncclGetUniqueId(ctypes.byref(self.uid)), "ncclGetUniqueId")
        self.comm = None

    def _check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed: NCCL error {rc} ({self.nccl.ncclGetErrorString(rc).decode()})")

    def init_info(self):
        """The `init_info` body of /init_weight_transfer_engine for this group."""
        return {"backend": "nccl", "nccl_unique_id": ctypes.string_at(ctypes.addressof(self.uid), 128).hex(),
                "rank_offset": 1, "world_size": 2, "timeout_s": self.timeout}

    def join(self):
        """Join the group as rank 0 (blocks until the daemon joined; call while the init request runs)."""
        def init():
            comm = ctypes.c_void_p()
            with self.torch.cuda.device(self.device):
                self._check(self.nccl.ncclCommInitRank(ctypes.byref(comm), 2, self.uid, 0), "ncclCommInitRank")
            return comm
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
                stream = torch.cuda.current_stream(self.device)
                ptr = ctypes.c_void_p(payload.data_ptr())
                self._check(self.nccl.ncclBroadcast(ptr, ptr, payload.numel(), _NCCL_UINT8, 0, self.comm,
                                                    ctypes.c_void_p(stream.cuda_stream)), "ncclBroadcast")
                stream.synchronize()

        _bounded(bcast, self.timeout, "broadcast")
        return payload.numel()
