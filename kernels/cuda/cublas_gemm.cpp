// HeuristicGemm (see cublas_gemm.h): cuBLAS through dlopen.
#include "cublas_gemm.h"

#include "fd/log.h"
#include "fd/status.h"

#include <cublas_api.h>
#include <dlfcn.h>

#include <climits>

namespace fd::kernels::cuda {

namespace {

using CreateFn  = cublasStatus_t (*)(cublasHandle_t *);
using DestroyFn = cublasStatus_t (*)(cublasHandle_t);
using StreamFn  = cublasStatus_t (*)(cublasHandle_t, cudaStream_t);
using SgemmFn   = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const float *,
                                   const float *, int, const float *, int, const float *, float *, int);

template <typename F>
F sym(void * lib, const char * name) {
    return reinterpret_cast<F>(dlsym(lib, name));
}

}  // namespace

HeuristicGemm::~HeuristicGemm() {
    if (handle_) {
        if (auto destroy = sym<DestroyFn>(lib_, "cublasDestroy_v2")) { destroy(static_cast<cublasHandle_t>(handle_)); }
    }
    if (lib_) { dlclose(lib_); }
}

bool HeuristicGemm::sgemm(float * out, const float * x, const float * w, int64_t n_rows, int64_t n_out, int64_t n_in,
                          cudaStream_t stream) {
    if (!tried_) {
        tried_ = true;
        for (const char * name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
            if ((lib_ = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) { break; }
        }
        auto create = lib_ ? sym<CreateFn>(lib_, "cublasCreate_v2") : nullptr;
        cublasHandle_t h = nullptr;
        if (!create || create(&h) != CUBLAS_STATUS_SUCCESS) {
            log::get("kernels")->warn("--no-batch-invariant: cuBLAS could not be loaded; the batch-invariant linear serves");
            h = nullptr;
        }
        handle_ = h;
    }
    if (!handle_ || n_rows > INT_MAX || n_out > INT_MAX || n_in > INT_MAX) { return false; }
    auto set_stream = sym<StreamFn>(lib_, "cublasSetStream_v2");
    auto gemm       = sym<SgemmFn>(lib_, "cublasSgemm_v2");
    if (!set_stream || !gemm) { return false; }
    auto * h = static_cast<cublasHandle_t>(handle_);
    const float one = 1.0f, zero = 0.0f;
    // Row-major out [n_rows, n_out] is column-major outᵀ [n_out, n_rows] = w (col-major [n_in, n_out], transposed) · xᵀ.
    if (set_stream(h, stream) != CUBLAS_STATUS_SUCCESS ||
        gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n_out), static_cast<int>(n_rows), static_cast<int>(n_in), &one, w,
             static_cast<int>(n_in), x, static_cast<int>(n_in), &zero, out, static_cast<int>(n_out)) != CUBLAS_STATUS_SUCCESS) {
        fail(Errc::internal, "CUDA backend: cublasSgemm ({} x {} x {}) failed", n_rows, n_out, n_in);
    }
    return true;
}

}  // namespace fd::kernels::cuda
