// kernels/cpu/lanes.h — 16-lane f32 vectors and the one fixed reduction of 16 lanes that the
// CPU ops share (linear's dot products, attention's scores and softmax sums). Internal to
// kernels/cpu: every batch-invariant op reduces lanes with these, never another order.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fd::kernels {
namespace {

typedef float    f32x16 __attribute__((vector_size(64)));
typedef float    f32x8  __attribute__((vector_size(32)));
typedef float    f32x4  __attribute__((vector_size(16)));

constexpr int kLanes = 16;

inline f32x16 load16(const float * p) {
    f32x16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

/// Fixed pairwise reduction: halves, then quarters, ... (the same for every output).
inline float reduce16(f32x16 v) {
    f32x8 lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char *>(&v) + sizeof lo, sizeof hi);
    const f32x8 s8 = lo + hi;
    f32x4 l4, h4;
    std::memcpy(&l4, &s8, sizeof l4);
    std::memcpy(&h4, reinterpret_cast<const char *>(&s8) + sizeof l4, sizeof h4);
    const f32x4 s4 = l4 + h4;
    const float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
    return s2a + s2b;
}

#if defined(__AVX512BW__)
/// reduce16 of 16 (or 8) accumulators at once, transposed: each level adds whole vectors whose
/// lanes pair exactly as reduce16 pairs them (lane i with i + 8, then i + 4, then (0 + 2) and
/// (1 + 3), then those two), so every sum is bitwise reduce16's. out[i] = reduce16(v[i]).
// Shuffles and permutes with every lane selected use the zero-masked intrinsics: GCC 12 flags the
// _mm512_undefined_ps() inside the plain ones (-Wuninitialized wherever they are inlined).
#define FD_SHUF_F32X4(a, b, imm) _mm512_maskz_shuffle_f32x4(__mmask16(0xFFFF), (a), (b), (imm))
inline __m512 pair_halves(__m512 a, __m512 b) {  // [a: i + (i+8) | b: i + (i+8)], i < 8
    return _mm512_add_ps(FD_SHUF_F32X4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), FD_SHUF_F32X4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m512 pair_quarters(__m512 ab, __m512 cd) {  // quarter g of 4: i + (i+4), i < 4, of a, b, c, d
    return _mm512_add_ps(FD_SHUF_F32X4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)), FD_SHUF_F32X4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
}
#undef FD_SHUF_F32X4
inline __m512 pair_02_13(__m512 p, __m512 q) {  // per quarter [p0+p2, p1+p3, q0+q2, q1+q3]
    return _mm512_add_ps(_mm512_shuffle_ps(p, q, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(p, q, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m512 pair_last(__m512 r, __m512 s) {  // per quarter [r0+r1, r2+r3, s0+s1, s2+s3]
    return _mm512_add_ps(_mm512_shuffle_ps(r, s, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(r, s, _MM_SHUFFLE(3, 1, 3, 1)));
}
/// n = 16 or 8 accumulators → out[n].
inline void reduce16_many(const f32x16 * acc, int n, float * out) {
    __m512 v[16] = {}, h[8] = {}, q[4] = {}, t[2] = {};
    for (int i = 0; i < n; ++i) { std::memcpy(&v[i], &acc[i], sizeof(__m512)); }
    for (int i = 0; i < n / 2; ++i) { h[i] = pair_halves(v[2 * i], v[2 * i + 1]); }
    for (int i = 0; i < n / 4; ++i) { q[i] = pair_quarters(h[2 * i], h[2 * i + 1]); }
    // q[g] quarter j holds accumulator 4g + j; t[m] quarter j: (a, b) of q[2m] then of q[2m + 1].
    for (int i = 0; i < n / 8; ++i) { t[i] = pair_02_13(q[2 * i], q[2 * i + 1]); }
    const __m512 f = pair_last(t[0], n == 16 ? t[1] : t[0]);  // lane 4j + g: accumulator 4g + j
    const __m512i from = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);  // i → 4 (i % 4) + i / 4
    _mm512_mask_storeu_ps(out, n == 16 ? __mmask16(0xFFFF) : __mmask16(0x00FF), _mm512_maskz_permutexvar_ps(__mmask16(0xFFFF), from, f));
}
/// A 4 x 6 tile's epilogue kept in registers (linear_packed.cpp's packed f32 tiles, linear_bf16.cpp's
/// bf16 ones): v [24] accumulators row-major (i = r * 6 + c) →
///   out[r * ldo + c] = reduce16(v[i]) (+ bias[c]), r < n_rows, c < n_cols,
/// bitwise reduce_all then a scalar loop (the same pairs at every level, the same one add). f0
/// lane 4 (i % 4) + i / 4 holds sum i < 16, f1 lane 4 (j % 4) + j / 4 sum 16 + j; row r (sums
/// 6r .. 6r + 5) is then one two-source permute and one masked store (the trip through memory,
/// a masked store then reloads at other offsets, stalls store forwarding).
inline void store_4x6(float * out, int64_t ldo, const float * bias, const __m512 * v, int n_rows, int n_cols) {
    // First level as pair_halves (lane i + lane i + 8), but x's sums in the low half and y's in
    // the high half from one blend and one shuffle: [x lo | y hi] + [x hi | y lo]; y's adds have
    // their operands swapped, which is exact (addition commutes).
    auto ph = [](__m512 x, __m512 y) {
        const __m512 bl = _mm512_mask_blend_ps(__mmask16(0xFF00), x, y);
        const __m512 sh = _mm512_maskz_shuffle_f32x4(__mmask16(0xFFFF), x, y, _MM_SHUFFLE(1, 0, 3, 2));
        return _mm512_add_ps(bl, sh);
    };
    const __m512 h0 = ph(v[0], v[1]), h1 = ph(v[2], v[3]), h2 = ph(v[4], v[5]);
    const __m512 h3 = ph(v[6], v[7]), h4 = ph(v[8], v[9]), h5 = ph(v[10], v[11]);
    const __m512 h6 = ph(v[12], v[13]), h7 = ph(v[14], v[15]), h8 = ph(v[16], v[17]);
    const __m512 h9 = ph(v[18], v[19]), h10 = ph(v[20], v[21]), h11 = ph(v[22], v[23]);
    const __m512 q0 = pair_quarters(h0, h1), q1 = pair_quarters(h2, h3), q2 = pair_quarters(h4, h5);
    const __m512 q3 = pair_quarters(h6, h7), q4 = pair_quarters(h8, h9), q5 = pair_quarters(h10, h11);
    const __m512 t0 = pair_02_13(q0, q1), t1 = pair_02_13(q2, q3), t2 = pair_02_13(q4, q5);
    const __m512 f0 = pair_last(t0, t1), f1 = pair_last(t2, t2);
    const __mmask16 cols = __mmask16((1u << n_cols) - 1);  // the tile's outputs in a row
    const __m512    b    = bias ? _mm512_maskz_loadu_ps(cols, bias) : _mm512_setzero_ps();
    // lane of sum i in (f0 | f1): i < 16: 4 (i % 4) + i / 4; else 16 + 4 (j % 4) + j / 4, j = i - 16
    const __m512i idx[4] = {_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                            _mm512_setr_epi32(9, 13, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                            _mm512_setr_epi32(3, 7, 11, 15, 16, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                            _mm512_setr_epi32(24, 28, 17, 21, 25, 29, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)};
#pragma GCC unroll 8
    for (int r = 0; r < 4; ++r) {
        __m512 o = _mm512_permutex2var_ps(f0, idx[r], f1);
        if (bias) { o = _mm512_add_ps(o, b); }  // the same one rounding as the scalar add
        if (r < n_rows) { _mm512_mask_storeu_ps(out + r * ldo, cols, o); }
    }
}
#endif

#if !defined(__AVX512BW__) && defined(__AVX2__)
/// AVX2: out[i] = reduce16(acc[i]) for 8 accumulators, transposed: the same pairs at every level
/// (i + (i+8); then i + (i+4); then (0 + 2) and (1 + 3); then those two), so bitwise reduce16's.
inline void reduce16_x8_avx2(const f32x16 * acc, float * out) {
    __m256 s8[8], q[4], t[2];
    for (int i = 0; i < 8; ++i) {  // lane i + lane i + 8
        __m256 h[2];
        std::memcpy(h, &acc[i], sizeof h);
        s8[i] = _mm256_add_ps(h[0], h[1]);
    }
    for (int i = 0; i < 4; ++i) {  // [a: i + (i+4) | b: i + (i+4)], (a, b) = accumulators 2i, 2i + 1
        q[i] = _mm256_add_ps(_mm256_permute2f128_ps(s8[2 * i], s8[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(s8[2 * i], s8[2 * i + 1], 0x31));
    }
    for (int i = 0; i < 2; ++i) {  // per 128 bits [p0+p2, p1+p3, q0+q2, q1+q3]
        t[i] = _mm256_add_ps(_mm256_shuffle_ps(q[2 * i], q[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(q[2 * i], q[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    // per 128 bits [r0+r1, r2+r3, s0+s1, s2+s3]: low half accumulators 0, 2, 4, 6, high 1, 3, 5, 7
    const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

/// out[i] = reduce16(acc[i]) for i < n.
inline void reduce_all(const f32x16 * acc, int n, float * out) {
    int i = 0;
#if defined(__AVX512BW__)
    for (; i + 16 <= n; i += 16) { reduce16_many(acc + i, 16, out + i); }
    for (; i + 8 <= n; i += 8) { reduce16_many(acc + i, 8, out + i); }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) { reduce16_x8_avx2(acc + i, out + i); }
#endif
    for (; i < n; ++i) { out[i] = reduce16(acc[i]); }
}

}  // namespace
}  // namespace fd::kernels
