// KV store into paged blocks (see fd/kernels/cuda_ops.h): one block per token copies its K and V
// rows, K transposed within its block ([n_kv_heads * head_dim, block_size]), as kernels::kv_store.
#include "cuda_common.cuh"
#include "fd/kernels/cuda_ops.h"

namespace fd::kernels::cuda {

namespace {

__global__ void kv_store_kernel(float * k, float * v, const float * k_new, const float * v_new, const int64_t * slots,
                                int64_t row, int64_t bs) {
    const int64_t t = blockIdx.x;
    float *       kd = k + slots[t] / bs * bs * row + slots[t] % bs;
    float *       vd = v + slots[t] * row;
    for (int64_t j = threadIdx.x; j < row; j += blockDim.x) {
        kd[j * bs] = k_new[t * row + j];
        vd[j] = v_new[t * row + j];
    }
}

}  // namespace

void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots, int64_t n_tokens,
              cudaStream_t stream) {
    const int64_t row = static_cast<int64_t>(kv.n_kv_heads) * kv.head_dim;
    if (n_tokens <= 0 || row <= 0 || kv.block_size <= 0) { return; }
    kv_store_kernel<<<static_cast<unsigned>(n_tokens), 256, 0, stream>>>(kv.k, kv.v, k_new, v_new, slots, row,
                                                                          kv.block_size);
    check_launch("kv_store");
}

}  // namespace fd::kernels::cuda
