// fd/memory/cuda_ipc.h — reading tensors a trainer published as CUDA IPC handles (the `ipc`
// strategy's GPU form, fd/shm/ipc_weights.h location kIpcCudaIpc).
//
// Compiled against the CUDA runtime when the build has CUDA (FD_WITH_CUDA, the default when
// CMake finds a CUDA toolkit); otherwise every call reports that this build has no CUDA.
// A handle can only be opened in a process other than the one that exported it.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>

namespace fd::memory {

/// True when this build has CUDA and the runtime sees at least one device.
bool cuda_ipc_available();

/// Why cuda_ipc_available() is false ("" when it is true), for error messages.
std::string cuda_ipc_unavailable_reason();

/// Copy bytes [offset, offset + nbytes) of the device allocation named by `handle` (a
/// cudaIpcMemHandle_t, 64 bytes) into host memory `dst` [nbytes], then close the handle.
/// Errors  fd::Error{source_unavailable} naming `what`: no CUDA, no device, the handle cannot
///         be opened (its exporting process exited?) or the copy fails.
void cuda_ipc_copy_to_host(const uint8_t * handle, uint64_t offset, uint64_t nbytes, void * dst, const std::string & what);

/// CUDA IPC allocations opened for one weight fill: each handle opened once (the first base()
/// call), all closed on destruction. Used by one thread at a time (fill_weights locks it).
class CudaIpcOpened {
public:
    CudaIpcOpened() = default;
    ~CudaIpcOpened();
    CudaIpcOpened(const CudaIpcOpened &) = delete;
    CudaIpcOpened & operator=(const CudaIpcOpened &) = delete;
    /// The device address of the allocation `handle` (64 bytes) names in this process.
    /// Errors  fd::Error{source_unavailable} naming `what`, as cuda_ipc_copy_to_host.
    const void * base(const uint8_t * handle, const std::string & what);

private:
    std::map<std::array<uint8_t, 64>, void *> open_;
};

/// Copy `nbytes` from device address `src` to `dst` (device or host memory: cudaMemcpyDefault)
/// and wait. Device to device when `dst` is device memory: the ipc strategy on a CUDA rank.
/// Errors  fd::Error{source_unavailable} naming `what` when the copy fails (or no CUDA).
void cuda_copy(void * dst, const void * src, uint64_t nbytes, const std::string & what);

}  // namespace fd::memory
