// kernels/cpu/attention_lanes.h — what the two paged-attention kernels share: attention.cpp
// (tiles of queries over one block table: a prefill) and attention_decode.cpp (one decode query).
// bf16 K/V widened exactly to f32, exp16, the softmax of one score row, where a block's keys
// start. Both kernels use these, so a query's output is bitwise the same on either path.
// Internal to kernels/cpu.
#pragma once

#include "fd/kernels/cpu_ops.h"
#include "lanes.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fd::kernels {
namespace {

/// A bf16 pool element (the upper half of an IEEE f32).
using Bf16 = uint16_t;
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/// 16 bf16 values widened exactly to f32 (shifted into the upper half).
inline f32x16 load16(const Bf16 * p) {
#if defined(__AVX512BW__)
    // One zero-extending load (vpmovzxwd) and one shift, on whole 512-bit registers (GCC's generic
    // convert below splits into 128-bit halves and re-inserts them: 3x the instructions).
    // (Zero-masked forms: the plain ones trip GCC 12's -Wmaybe-uninitialized, as in lanes.h.)
    const __m512i x = _mm512_maskz_cvtepu16_epi32(__mmask16(0xFFFF), _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
    return reinterpret_cast<f32x16>(_mm512_maskz_slli_epi32(__mmask16(0xFFFF), x, 16));
#else
    u16x16 h;
    std::memcpy(&h, p, sizeof h);
    const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    f32x16 f;
    std::memcpy(&f, &w, sizeof f);
    return f;
#endif
}
/// One element widened to f32.
inline float to_f32(float x) { return x; }
inline float to_f32(Bf16 x) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

/// 0, 1, ..., 15 (lane masks).
constexpr f32x16 kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};


/// e^x for x <= 0 (softmax after subtracting the max), 16 lanes: x = n ln2 + r, |r| <= ln2 / 2,
/// e^r by the Cephes expf polynomial, times 2^n. Within ~2 ulp of expf; lanes below -87 give
/// ~1e-38 instead of underflowing. Each lane depends on its own input only.
inline f32x16 exp16(f32x16 x) {
    const f32x16 lo = f32x16{} - 87.0f;
    x = x < lo ? lo : x;
    const f32x16 round = f32x16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const f32x16 n = (x * 1.44269504088896341f + round) - round;
    const f32x16 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    f32x16 p = f32x16{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const f32x16 y = p * r * r + r + 1.0f;
    const i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
    f32x16 scale;
    std::memcpy(&scale, &e, sizeof scale);
    return y * scale;
}

/// Where keys [t, t + 16) of the sequence start in the K pool, kv head 0 (block_size % 16 == 0
/// and t % 16 == 0, so the 16 keys are consecutive columns of one block's Kᵀ): dimension d of
/// key t + j of kv head g is at [(g * head_dim + d) * block_size + j].
template <typename T>
inline const T * key_lanes(const T * k, const AttnQuery & qry, int64_t t, int64_t bs, int64_t row) {
    return k + static_cast<int64_t>(qry.block_table[t / bs]) * bs * row + t % bs;
}

/// Keeps v in a register: one load serves all its uses (GCC otherwise folds the load into
/// every FMA that reads it).
/// Only where a 64-byte vector fits one register (AVX-512); elsewhere (AVX2: an f32x16 is two
/// ymm registers, which no asm operand can name) it is a no-op.
#if defined(__AVX512F__)
inline void in_register(f32x16 & v) { asm("" : "+v"(v)); }
#else
inline void in_register(f32x16 &) {}
#endif

/// Softmax of one (query, head) score row over its n entries, in place (attend_tile's code:
/// max exact, exp16(s - max), 16 lane-wise sums over t then reduce16, times 1 / sum); lanes of
/// the last vector past n become 0.
inline void softmax_row(float * s, int64_t n) {
    f32x16  m16 = f32x16{} - INFINITY;
    int64_t t = 0;
    for (; t + kLanes <= n; t += kLanes) {
        const f32x16 v = load16(s + t);
        m16 = v > m16 ? v : m16;
    }
    float mx = -INFINITY;
    for (int j = 0; j < kLanes; ++j) { mx = m16[j] > mx ? m16[j] : mx; }
    for (; t < n; ++t) { mx = s[t] > mx ? s[t] : mx; }
    f32x16  sum{};
    int64_t t1 = 0;
    for (; t1 + kLanes <= n; t1 += kLanes) {
        const f32x16 e = exp16(load16(s + t1) - mx);
        std::memcpy(s + t1, &e, sizeof e);
        sum += e;
    }
    if (t1 < n) {
        const f32x16 e = exp16(load16(s + t1) - mx);
        const f32x16 z = (kLaneIndex < static_cast<float>(n - t1)) ? e : f32x16{};
        std::memcpy(s + t1, &z, sizeof z);
        sum += z;
    }
    const f32x16 inv = f32x16{} + 1.0f / reduce16(sum);
    for (int64_t t2 = 0; t2 < n; t2 += kLanes) {
        const f32x16 v = load16(s + t2) * inv;
        std::memcpy(s + t2, &v, sizeof v);
    }
}

}  // namespace

/// attention_paged's decode path (attention_decode.cpp): one query over its own block table,
/// kv heads [g0, g1), block_size % 16 == 0 and head_dim % 16 == 0. Bitwise the tile kernel's
/// output for that query (the same FMA chains in the same order).
///   out [n_heads, head_dim] f32 (this query's row; heads of [g0, g1) written);  q [n_heads, head_dim]
/// T: float or Bf16 (the pool's element type, kv.dtype).
template <typename T>
void attend_one(float * out, const float * q, const AttnQuery & qry, int64_t n_heads, int64_t g0, int64_t g1,
                PagedKv kv, float scale);

// The AVX2 + FMA paths (attention_decode_avx2.cpp, attention_prefill_avx2.cpp): built where the
// compiler targets both.
#if defined(__AVX2__) && defined(__FMA__)
#define FD_ATTN_AVX2 1
/// attend_one on 8-lane registers (AttnIsa::avx2): same arguments, bitwise the same output.
template <typename T>
void attend_one_avx2(float * out, const float * q, const AttnQuery & qry, int64_t n_heads, int64_t g0, int64_t g1,
                     PagedKv kv, float scale);
/// attention.cpp's score_pairs on 8-lane registers (attention_prefill_avx2.cpp), bitwise its
/// result: for pairs m < n and keys l < 32 of the chunk,
///   s[m][l] = (FMA chain over d ascending of qh[m][d] * key(l)[d], from 0) * scale,
/// key l < 16's dimension d at k0[d * ld + l], key 16 + l's at k1[d * ld + l].
///   s [n] rows of >= 32 f32 written;  qh [n] rows of hd f32;  k0, k1 T (float or Bf16, widened exactly)
template <typename T>
void score_pairs_avx2(float * const * s, const float * const * qh, int n, const T * k0, const T * k1, int64_t ld,
                      int64_t hd, float scale);
/// attention.cpp's pv_pairs on 8-lane registers, bitwise its result: for pairs m < n,
///   o[m][d] = FMA chain over j < nt[m] ascending of p[m][j] * vr[j][d], from o[m][d].
///   o [n] rows of hd f32 updated;  p [n] rows of >= nt[m] f32;  nt [n] <= 32;  vr [32] rows of hd T
template <typename T>
void pv_pairs_avx2(float * const * o, const float * const * p, const int64_t * nt, int n, const T * const * vr,
                   int64_t hd);
#else
#define FD_ATTN_AVX2 0
#endif

}  // namespace fd::kernels
