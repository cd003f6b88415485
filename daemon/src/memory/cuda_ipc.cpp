// CUDA IPC copy-in for the `ipc` weight source (see fd/memory/cuda_ipc.h). The CUDA runtime
// calls are compiled only when the build has CUDA (FD_WITH_CUDA); tested where a GPU exists.
#include "fd/memory/cuda_ipc.h"

#include "fd/status.h"

#include <cstring>

#if FD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace fd::memory {

#if FD_WITH_CUDA

namespace {

int device_count(cudaError_t * err) {
    int n = 0;
    *err = cudaGetDeviceCount(&n);
    return *err == cudaSuccess ? n : 0;
}

}  // namespace

bool cuda_ipc_available() {
    cudaError_t err;
    return device_count(&err) > 0;
}

std::string cuda_ipc_unavailable_reason() {
    cudaError_t err;
    if (device_count(&err) > 0) { return ""; }
    return err == cudaSuccess ? "no CUDA device is visible" : std::string("CUDA runtime: ") + cudaGetErrorString(err);
}

void cuda_ipc_copy_to_host(const uint8_t * handle, uint64_t offset, uint64_t nbytes, void * dst, const std::string & what) {
    if (!cuda_ipc_available()) {
        fail(Errc::source_unavailable, "{}: is a CUDA IPC handle, but {}", what, cuda_ipc_unavailable_reason());
    }
    cudaIpcMemHandle_t h;
    static_assert(sizeof h == 64, "cudaIpcMemHandle_t is 64 bytes in fd/shm/ipc_weights.h");
    std::memcpy(&h, handle, sizeof h);
    void * base = nullptr;
    cudaError_t err = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
        fail(Errc::source_unavailable, "{}: cannot open the CUDA IPC handle ({}): did the publishing process exit?", what,
             cudaGetErrorString(err));
    }
    err = cudaMemcpy(dst, static_cast<const char *>(base) + offset, nbytes, cudaMemcpyDeviceToHost);
    const cudaError_t close_err = cudaIpcCloseMemHandle(base);
    if (err != cudaSuccess || close_err != cudaSuccess) {
        fail(Errc::source_unavailable, "{}: copying {} bytes from the CUDA IPC allocation failed: {}", what, nbytes,
             cudaGetErrorString(err != cudaSuccess ? err : close_err));
    }
}

CudaIpcOpened::~CudaIpcOpened() {
    for (auto & [h, p] : open_) { cudaIpcCloseMemHandle(p); }
}

const void * CudaIpcOpened::base(const uint8_t * handle, const std::string & what) {
    std::array<uint8_t, 64> key{};
    std::memcpy(key.data(), handle, key.size());
    if (auto it = open_.find(key); it != open_.end()) { return it->second; }
    if (!cuda_ipc_available()) {
        fail(Errc::source_unavailable, "{}: is a CUDA IPC handle, but {}", what, cuda_ipc_unavailable_reason());
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle, sizeof h);
    void * p = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
        fail(Errc::source_unavailable, "{}: cannot open the CUDA IPC handle ({}): did the publishing process exit?", what,
             cudaGetErrorString(err));
    }
    open_.emplace(key, p);
    return p;
}

void cuda_copy(void * dst, const void * src, uint64_t nbytes, const std::string & what) {
    const cudaError_t err = cudaMemcpy(dst, src, nbytes, cudaMemcpyDefault);
    if (err != cudaSuccess) {
        fail(Errc::source_unavailable, "{}: copying {} bytes from the CUDA IPC allocation failed: {}", what, nbytes,
             cudaGetErrorString(err));
    }
}

#else

CudaIpcOpened::~CudaIpcOpened() = default;

const void * CudaIpcOpened::base(const uint8_t *, const std::string & what) {
    fail(Errc::source_unavailable, "{}: is a CUDA IPC handle, but {}", what, cuda_ipc_unavailable_reason());
}

void cuda_copy(void *, const void *, uint64_t, const std::string & what) {
    fail(Errc::source_unavailable, "{}: is a CUDA IPC tensor, but {}", what, cuda_ipc_unavailable_reason());
}

bool cuda_ipc_available() { return false; }

std::string cuda_ipc_unavailable_reason() {
    return "this fdrollout was built without CUDA (configure with -DFD_WITH_CUDA=ON where a CUDA toolkit is installed)";
}

void cuda_ipc_copy_to_host(const uint8_t *, uint64_t, uint64_t, void *, const std::string & what) {
    fail(Errc::source_unavailable, "{}: is a CUDA IPC handle, but {}", what, cuda_ipc_unavailable_reason());
}

#endif

}  // namespace fd::memory
