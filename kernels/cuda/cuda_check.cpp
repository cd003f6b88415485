// check_launch for the CUDA ops: turns a failed kernel launch into fd::Error{Errc::internal}.
#include "cuda_common.cuh"

#include "fd/status.h"

namespace fd::kernels::cuda {

void check_launch(const char * op) {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) { fail(Errc::internal, "CUDA op {}: launch failed: {}", op, cudaGetErrorString(err)); }
}

}  // namespace fd::kernels::cuda
