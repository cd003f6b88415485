// KV store into paged blocks (see fd/kernels/cuda_ops.h): one block per token copies its K and V
// rows, K transposed within its block ([n_kv_heads * head_dim, block_size]), as kernels::kv_store
// (f32 pools, or bf16 pools rounded to nearest even).
#include "cuda_common.cuh"
#include "fd/kernels/cuda_ops.h"

namespace fd::kernels::cuda {

namespace {

/// f32 -> the pool's element: f32 as is, bf16 (uint16_t bits) rounded to nearest even
/// (kernels::f32_to_bf16_rne's rule).
__device__ __forceinline__ void put(float * d, float x) { *d = x; }
__device__ __forceinline__ void put(uint16_t * d, float x) {
    const uint32_t u = __float_as_uint(x);
    *d = (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((u >> 16) | 0x0040u)
                                         : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <typename T>
__global__ void kv_store_kernel(T * k, T * v, const float * k_new, const float * v_new, const int64_t * slots,
                                int64_t row, int64_t bs) {
    const int64_t t = blockIdx.x;
    T *           kd = k + slots[t] / bs * bs * row + slots[t] % bs;
    T *           vd = v + slots[t] * row;
    for (int64_t j = threadIdx.x; j < row; j += blockDim.x) {
        put(kd + j * bs, k_new[t * row + j]);
        put(vd + j, v_new[t * row + j]);
    }
}

}  // namespace

void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots, int64_t n_tokens,
              cudaStream_t stream) {
    const int64_t row = static_cast<int64_t>(kv.n_kv_heads) * kv.head_dim;
    if (n_tokens <= 0 || row <= 0 || kv.block_size <= 0) { return; }
    const auto grid = static_cast<unsigned>(n_tokens);
    if (kv.dtype == WType::bf16) {
        kv_store_kernel<<<grid, 256, 0, stream>>>(static_cast<uint16_t *>(kv.k), static_cast<uint16_t *>(kv.v), k_new, v_new,
                                                  slots, row, kv.block_size);
    } else {
        kv_store_kernel<<<grid, 256, 0, stream>>>(static_cast<float *>(kv.k), static_cast<float *>(kv.v), k_new, v_new, slots,
                                                  row, kv.block_size);
    }
    check_launch("kv_store");
}

}  // namespace fd::kernels::cuda
