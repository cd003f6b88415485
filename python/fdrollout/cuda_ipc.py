"""CUDA IPC handles of a trainer's torch CUDA tensors, for the `ipc` weight record
(`publish_ipc`, shm/include/fd/shm/ipc_weights.h location kIpcCudaIpc; docs/weight_sources.md).

A trainer on the same GPU as the rollout (the colocated RL loop) cannot use NCCL to hand its
weights over: NCCL refuses two ranks of one communicator on one device ("Duplicate GPU detected",
seen on the first GPU run). CUDA IPC can: the record carries, per tensor, the
`cudaIpcMemHandle_t` of the allocation holding it and the byte offset inside it, and the rollout
copies device to device (a CUDA rank) or device to host (a CPU rank).

Only the CUDA driver API is used, through ctypes (`cuMemGetAddressRange_v2` for the allocation's
base, `cuIpcGetMemHandle`), not torch internals; torch supplies the tensors and the device
synchronisation. The tensors must stay alive and unchanged until the rollout's update_weights
returned (it copies them; the trainer may then free or overwrite them). torch's caching
allocator with `expandable_segments:True` allocates through cuMemCreate, whose memory has no
legacy IPC handle: such a tensor raises naming it.
"""
import ctypes

from . import safetensors_np

_HANDLE = ctypes.c_char * 64  # CUipcMemHandle
_driver = None


def _cuda():
    """libcuda.so.1 with the two calls' signatures (loaded once). Raises RuntimeError without it."""
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"CUDA IPC needs the CUDA driver (libcuda.so.1): {e}") from None
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_HANDLE), ctypes.c_uint64]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _driver = lib
    return _driver


def _check(lib, rc, what):
    if rc != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what}: CUDA driver error {rc} ({(msg.value or b'?').decode()})")


def is_cuda_tensor(value):
    """True for a torch tensor on a CUDA device (without importing torch)."""
    return safetensors_np.is_torch(value) and bool(value.is_cuda)


DTYPE_TAGS = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}


def ipc_handle(name, t):
    """(handle: 64 bytes, offset: bytes into the allocation, nbytes, dtype tag, shape) of the torch
    CUDA tensor `t` named `name`. Waits for the device's queued work first, so the rollout reads
    what the trainer's kernels wrote.
    Raises ValueError (not contiguous; a dtype the record cannot carry) or RuntimeError (no
    driver; no IPC handle for this memory) naming the tensor."""
    import torch
    tag = DTYPE_TAGS.get(str(t.dtype))
    if tag is None:
        raise ValueError(f"{name}: dtype {t.dtype} cannot be published (float32, bfloat16, float16)")
    if not t.is_contiguous():
        raise ValueError(f"{name}: a CUDA tensor must be contiguous to be published by IPC (call .contiguous() and keep the result alive)")
    if t.numel() == 0:
        raise ValueError(f"{name}: an empty CUDA tensor has no memory to share")
    lib = _cuda()
    torch.cuda.synchronize(t.device)
    with torch.cuda.device(t.device):
        ptr = t.data_ptr()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(lib, lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)),
               f"{name}: cuMemGetAddressRange")
        h = _HANDLE()
        _check(lib, lib.cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(base.value)),
               f"{name}: cuIpcGetMemHandle (memory from cuMemCreate, e.g. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, has no IPC handle)")
    nbytes = t.numel() * t.element_size()
    if ptr - base.value + nbytes > size.value:
        raise RuntimeError(f"{name}: the tensor runs past its allocation ({ptr - base.value} + {nbytes} > {size.value} bytes)")
    return bytes(h), ptr - base.value, nbytes, tag, list(t.shape)
