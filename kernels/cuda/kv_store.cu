// KV store into paged blocks (see fd/kernels/cuda_ops.h): one block per token copies its K and V rows.
#include "cuda_common.cuh"
#include "fd/kernels/cuda_ops.h"

namespace fd::kernels::cuda {

namespace {

__global__ void kv_store_kernel(float * k, float * v, const float * k_new, const float * v_new, const int64_t * slots,
                                int64_t row) {
    const int64_t t = blockIdx.x;
    float *       kd = k + slots[t] * row;
    float *       vd = v + slots[t] * row;
    for (int64_t j = threadIdx.x; j < row; j += blockDim.x) {
        kd[j] = k_new[t * row + j];
        vd[j] = v_new[t * row + j];
    }
}

}  // namespace

void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots, int64_t n_tokens,
              cudaStream_t stream) {
    const int64_t row = static_cast<int64_t>(kv.n_kv_heads) * kv.head_dim;
    if (n_tokens <= 0 || row <= 0) { return; }
    kv_store_kernel<<<static_cast<unsigned>(n_tokens), 256, 0, stream>>>(kv.k, kv.v, k_new, v_new, slots, row);
    check_launch("kv_store");
}

}  // namespace fd::kernels::cuda
