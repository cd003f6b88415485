// Helpers of the GPU tests: device buffers and CUDA error checks.
#pragma once

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

namespace fd::gputest {

#define FD_CUDA_REQUIRE(call)                                                                           \
    do {                                                                                                \
        const cudaError_t fd_err_ = (call);                                                             \
        REQUIRE_MESSAGE(fd_err_ == cudaSuccess, #call, ": ", cudaGetErrorString(fd_err_));              \
    } while (0)

/// A device copy of a host vector (or n zeroed elements), freed on scope exit.
template <typename T>
class DevBuf {
public:
    explicit DevBuf(size_t n) : n_(n) {
        FD_CUDA_REQUIRE(cudaMalloc(reinterpret_cast<void **>(&p_), sizeof(T) * (n ? n : 1)));
        FD_CUDA_REQUIRE(cudaMemset(p_, 0, sizeof(T) * (n ? n : 1)));
    }
    explicit DevBuf(const std::vector<T> & h) : DevBuf(h.size()) { upload(h); }
    ~DevBuf() { cudaFree(p_); }
    DevBuf(const DevBuf &)             = delete;
    DevBuf & operator=(const DevBuf &) = delete;
    void upload(const std::vector<T> & h) {
        REQUIRE(h.size() == n_);
        FD_CUDA_REQUIRE(cudaMemcpy(p_, h.data(), sizeof(T) * n_, cudaMemcpyHostToDevice));
    }
    /// Synchronizes the device (catches errors of the kernels before it) and copies back.
    std::vector<T> download() const {
        FD_CUDA_REQUIRE(cudaDeviceSynchronize());
        std::vector<T> h(n_);
        FD_CUDA_REQUIRE(cudaMemcpy(h.data(), p_, sizeof(T) * n_, cudaMemcpyDeviceToHost));
        return h;
    }
    T *    get() const { return p_; }
    size_t size() const { return n_; }

private:
    T *    p_ = nullptr;
    size_t n_ = 0;
};

}  // namespace fd::gputest
