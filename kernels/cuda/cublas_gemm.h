// The --no-batch-invariant linear: cuBLAS's heuristic SGEMM (its split of k may depend on the
// row count, so a row's result may depend on the batch). libcublas is opened with dlopen on first
// use, so fdrollout does not link it and starts where it is absent (the fixed-order kernel then
// serves). F32 weights without bias only; the caller falls back to cuda::linear otherwise.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fd::kernels::cuda {

class HeuristicGemm {
public:
    HeuristicGemm() = default;
    ~HeuristicGemm();
    HeuristicGemm(const HeuristicGemm &) = delete;
    HeuristicGemm & operator=(const HeuristicGemm &) = delete;

    /// out = x · wᵀ on `stream` when cuBLAS could be loaded; false (nothing enqueued) otherwise.
    /// Shapes  out [n_rows, n_out] f32;  x [n_rows, n_in] f32;  w [n_out, n_in] f32 (device).
    /// Errors  fd::Error{internal} when the cuBLAS call fails.
    bool sgemm(float * out, const float * x, const float * w, int64_t n_rows, int64_t n_out, int64_t n_in, cudaStream_t stream);

private:
    bool   tried_  = false;
    void * lib_    = nullptr;
    void * handle_ = nullptr;  // cublasHandle_t
};

}  // namespace fd::kernels::cuda
