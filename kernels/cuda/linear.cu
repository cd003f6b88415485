// out = x · Wᵀ (+ bias), batch-invariant tiled GEMM (see fd/kernels/cuda_ops.h).
//
// Block: 64 rows x 64 outputs, 256 threads; thread (tx, ty) = (tid % 16, tid / 16) owns rows
// r0 + ty + 16a and outputs o0 + tx + 16c (a, c < 4). k is walked in tiles of 32 staged in
// shared memory (x as f32, W widened to f32; positions past n_rows / n_out / n_in staged as 0).
// Every output is ONE accumulator: acc = fmaf(x[r, k], W[o, k], acc) for k = 0, 1, ... n_in - 1,
// then acc + bias[o]. Tiling only decides who computes an output, never how, so the result of a
// row is bitwise independent of n_rows and of the other rows (the tests check rows 1..96).
//
// Few rows (decode, n_rows <= 64): linear_skinny_kernel computes the SAME chains (k ascending,
// the same zero-padded tail up to a multiple of 32) with n_out / 32 x n_rows / R blocks: one warp
// per 32 outputs x R rows, W and x tiles brought in by cp.async through a 4-stage ring, each lane
// one output. On an H200 (stop 44) the tiled kernel alone gave B=1 decode of a 1.1B bf16 model
// 36 tok/s (weights at 0.015 of memcpy: n_out / 64 blocks, each staging 64 rows of x for one);
// with this one, 305 tok/s (0.19). What bounds it now is one warp's instruction stream per k
// (ncu: ~16 us for any K=2048 projection; the FMA chain's floor is ~4 us): 8 bf16 unpacks, 3
// loads and 8 FMAs per 8 k. Both kernels give a row the same bits, so the switch keeps batch
// invariance (the test's n_rows 1..96 cross it).
#include "cuda_common.cuh"
#include "fd/kernels/cuda_ops.h"

namespace fd::kernels::cuda {

namespace {

constexpr int kBm = 64, kBn = 64, kBk = 32, kThreads = 256, kPer = 4;

template <bool Bf16>
__global__ void __launch_bounds__(kThreads) linear_kernel(float * out, const float * x, const void * w,
                                                          const float * bias, int64_t n_rows, int64_t n_out,
                                                          int64_t n_in) {
    __shared__ float xs[kBm][kBk + 1];
    __shared__ float ws[kBn][kBk + 1];
    const int     tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBm, o0 = static_cast<int64_t>(blockIdx.x) * kBn;
    float         acc[kPer][kPer] = {};
    for (int64_t k0 = 0; k0 < n_in; k0 += kBk) {
        for (int idx = tid; idx < kBm * kBk; idx += kThreads) {
            const int     rr = idx / kBk, kk = idx % kBk;
            const int64_t r = r0 + rr, k = k0 + kk;
            xs[rr][kk] = (r < n_rows && k < n_in) ? x[r * n_in + k] : 0.0f;
        }
        for (int idx = tid; idx < kBn * kBk; idx += kThreads) {
            const int     oo = idx / kBk, kk = idx % kBk;
            const int64_t o = o0 + oo, k = k0 + kk;
            float         v = 0.0f;
            if (o < n_out && k < n_in) {
                if constexpr (Bf16) {
                    v = bf16_bits_to_f32(static_cast<const uint16_t *>(w)[o * n_in + k]);
                } else {
                    v = static_cast<const float *>(w)[o * n_in + k];
                }
            }
            ws[oo][kk] = v;
        }
        __syncthreads();
        // k past n_in is staged as 0 in both operands: fmaf(0, 0, acc) == acc, and which k
        // are padded depends on n_in only.
#pragma unroll 8
        for (int kk = 0; kk < kBk; ++kk) {
            float xv[kPer], wv[kPer];
#pragma unroll
            for (int a = 0; a < kPer; ++a) { xv[a] = xs[ty + 16 * a][kk]; }
#pragma unroll
            for (int c = 0; c < kPer; ++c) { wv[c] = ws[tx + 16 * c][kk]; }
#pragma unroll
            for (int a = 0; a < kPer; ++a) {
#pragma unroll
                for (int c = 0; c < kPer; ++c) { acc[a][c] = fmaf(xv[a], wv[c], acc[a][c]); }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int a = 0; a < kPer; ++a) {
        const int64_t r = r0 + ty + 16 * a;
        if (r >= n_rows) { continue; }
#pragma unroll
        for (int c = 0; c < kPer; ++c) {
            const int64_t o = o0 + tx + 16 * c;
            if (o < n_out) { out[r * n_out + o] = bias != nullptr ? acc[a][c] + bias[o] : acc[a][c]; }
        }
    }
}

// ---- few rows: the same chains, W streamed by cp.async ----

constexpr int kSkOut = 32;                  // outputs per block: one per lane
constexpr int kSkRowBytes = 256;            // bytes of one W row per tile (bf16: 128 k, f32: 64 k)
constexpr int kSkPitch = kSkRowBytes + 16;  // padded rows: the lanes' 16-byte reads hit distinct banks
constexpr int kSkStages = 4;
constexpr int kSkMaxRows = 64;              // up to here the skinny kernel; beyond, the tiled one

__device__ __forceinline__ void cp_async16(void * smem, const void * gmem, int src_bytes) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Block: one warp; rows r0 .. r0 + R - 1 (blockIdx.x, the fast index, so the row groups reading
// the same W run side by side and share it in L2), outputs o0 + lane (blockIdx.y). Needs n_in a
// multiple of the 16-byte chunk (8 bf16 / 4 f32) and 16-byte aligned x and W (the dispatch checks):
// a chunk is then wholly inside or wholly past n_in, and past it cp.async zero-fills.
template <bool Bf16, int R>
__global__ void __launch_bounds__(32) linear_skinny_kernel(float * out, const float * x, const void * w,
                                                           const float * bias, int64_t n_rows, int64_t n_out,
                                                           int64_t n_in) {
    constexpr int kEsz = Bf16 ? 2 : 4;
    constexpr int kTk = kSkRowBytes / kEsz;     // k per tile
    constexpr int kVec = 16 / kEsz;             // k per 16-byte W chunk
    constexpr int kChunks = kSkRowBytes / 16;   // W chunks per row per tile
    constexpr int kXChunks = kTk / 4;           // x chunks (4 floats) per row per tile
    __shared__ __align__(16) unsigned char ws[kSkStages][kSkOut][kSkPitch];
    __shared__ __align__(16) float         xs[kSkStages][R][kTk];
    const int     lane = static_cast<int>(threadIdx.x);
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * R, o0 = static_cast<int64_t>(blockIdx.y) * kSkOut;
    const int64_t k_end = (n_in + kBk - 1) / kBk * kBk;  // the tiled kernel's padded length
    const int64_t n_tiles = (k_end + kTk - 1) / kTk;
    const auto *  wb = static_cast<const unsigned char *>(w);
    // This lane's share of a tile's W copies, fixed for the whole walk: column chunk cw of rows
    // ow + i * kRowStep (i < kWPer), so a copy costs one address add (ncu on the H200: the
    // per-copy 64-bit index arithmetic had the single warp issue ~8 instructions per k).
    constexpr int kWPer = kSkOut * kChunks / 32, kRowStep = 32 / kChunks;
    static_assert(kSkOut * kChunks % 32 == 0 && 32 % kChunks == 0, "W copies split evenly over the lanes");
    const int             cw = lane % kChunks, ow = lane / kChunks;
    const int64_t         n_valid = n_out - o0 < kSkOut ? n_out - o0 : kSkOut;  // rows of W in this block
    const int64_t         w_row_step = static_cast<int64_t>(kRowStep) * n_in * kEsz;
    const unsigned char * w_lane = wb + (o0 + ow) * n_in * kEsz + cw * 16;  // tile 0, i = 0
    auto                  issue = [&](int64_t t) {
        const int             st = static_cast<int>(t % kSkStages);
        const int64_t         kt = t * kTk;
        const bool            k_in = kt + cw * kVec < n_in;
        const unsigned char * src = w_lane + kt * kEsz;
        unsigned char *       dst = &ws[st][ow][cw * 16];
#pragma unroll
        for (int i = 0; i < kWPer; ++i) {
            const bool in = k_in && ow + i * kRowStep < n_valid;
            cp_async16(dst + i * kRowStep * kSkPitch, in ? src + i * w_row_step : wb, in ? 16 : 0);
        }
        for (int c = lane; c < R * kXChunks; c += 32) {
            const int     rr = c / kXChunks, cc = c % kXChunks;
            const int64_t r = r0 + rr, k = kt + cc * 4;
            const bool    in = r < n_rows && k < n_in;
            cp_async16(&xs[st][rr][cc * 4], in ? x + r * n_in + k : x, in ? 16 : 0);
        }
    };
    for (int t = 0; t < kSkStages - 1; ++t) {
        if (t < n_tiles) { issue(t); }
        cp_async_commit();
    }
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) { acc[r] = 0.0f; }
    for (int64_t t = 0; t < n_tiles; ++t) {
        if (t + kSkStages - 1 < n_tiles) { issue(t + kSkStages - 1); }
        cp_async_commit();
        cp_async_wait<kSkStages - 1>();  // tile t has landed (this lane's copies) ...
        __syncwarp();                    // ... and every lane's
        const int              st = static_cast<int>(t % kSkStages);
        const unsigned char *  row = ws[st][lane];
        const int64_t          left = k_end - t * kTk;  // a multiple of 32: whole chunks
        const int              n_ch = left < kTk ? static_cast<int>(left / kVec) : kChunks;
#pragma unroll 4
        for (int cc = 0; cc < n_ch; ++cc) {
            const uint4 q = *reinterpret_cast<const uint4 *>(row + cc * 16);
            float       wv[kVec];
            if constexpr (Bf16) {
                const uint32_t u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    wv[2 * j]     = __uint_as_float(u[j] << 16);
                    wv[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
                }
            } else {
                wv[0] = __uint_as_float(q.x); wv[1] = __uint_as_float(q.y);
                wv[2] = __uint_as_float(q.z); wv[3] = __uint_as_float(q.w);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float * xr = &xs[st][r][cc * kVec];
#pragma unroll
                for (int j = 0; j < kVec; ++j) { acc[r] = fmaf(xr[j], wv[j], acc[r]); }
            }
        }
        __syncwarp();  // every lane is done with stage st before a later issue() refills it
    }
    cp_async_wait<0>();
    const int64_t o = o0 + lane;
    if (o >= n_out) { return; }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r0 + r < n_rows) { out[(r0 + r) * n_out + o] = bias != nullptr ? acc[r] + bias[o] : acc[r]; }
    }
}

template <int R>
void launch_skinny(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
                   int64_t n_out, int64_t n_in, cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>((n_rows + R - 1) / R), static_cast<unsigned>((n_out + kSkOut - 1) / kSkOut));
    if (wtype == WType::bf16) {
        linear_skinny_kernel<true, R><<<grid, 32, 0, stream>>>(out, x, w, bias, n_rows, n_out, n_in);
    } else {
        linear_skinny_kernel<false, R><<<grid, 32, 0, stream>>>(out, x, w, bias, n_rows, n_out, n_in);
    }
}

bool skinny_fits(const float * x, const void * w, WType wtype, int64_t n_rows, int64_t n_out, int64_t n_in) {
    const int64_t vec = wtype == WType::bf16 ? 8 : 4;
    return n_rows <= kSkMaxRows && n_in > 0 && n_in % vec == 0 && (n_out + kSkOut - 1) / kSkOut <= 65535 &&
           reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

}  // namespace

void linear(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
            int64_t n_out, int64_t n_in, cudaStream_t stream) {
    if (n_rows <= 0 || n_out <= 0) { return; }
    if (skinny_fits(x, w, wtype, n_rows, n_out, n_in)) {
        if (n_rows == 1) {
            launch_skinny<1>(out, x, w, wtype, bias, n_rows, n_out, n_in, stream);
        } else if (n_rows == 2) {
            launch_skinny<2>(out, x, w, wtype, bias, n_rows, n_out, n_in, stream);
        } else {
            launch_skinny<4>(out, x, w, wtype, bias, n_rows, n_out, n_in, stream);
        }
        check_launch("linear");
        return;
    }
    const dim3 grid(static_cast<unsigned>((n_out + kBn - 1) / kBn), static_cast<unsigned>((n_rows + kBm - 1) / kBm));
    if (wtype == WType::bf16) {
        linear_kernel<true><<<grid, kThreads, 0, stream>>>(out, x, w, bias, n_rows, n_out, n_in);
    } else {
        linear_kernel<false><<<grid, kThreads, 0, stream>>>(out, x, w, bias, n_rows, n_out, n_in);
    }
    check_launch("linear");
}

}  // namespace fd::kernels::cuda
