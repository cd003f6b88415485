// Paged KV store and causal GQA attention (see ops.h).
//
// Loop order: for each query token, walk its context once, reading every K (then V) row for all
// heads together (a row is n_kv_heads * head_dim contiguous floats). The q·k dot product sums
// in a fixed 8-lane order (lane-wise over head_dim, then a fixed reduction), and the V
// accumulation runs over t ascending, so results do not depend on the batch or the threads.
#include "fd/kernels/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace fd::kernels {

void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots,
              int64_t n_tokens) {
    const int64_t row = static_cast<int64_t>(kv.n_kv_heads) * kv.head_dim;
    for (int64_t t = 0; t < n_tokens; ++t) {
        std::memcpy(kv.k + slots[t] * row, k_new + t * row, sizeof(float) * row);
        std::memcpy(kv.v + slots[t] * row, v_new + t * row, sizeof(float) * row);
    }
}

namespace {

typedef float f32x8 __attribute__((vector_size(32)));

/// <a, b> over n elements: 8 lane-wise partial sums (n % 8 == 0), then a fixed pairwise reduction.
inline float dot8(const float * a, const float * b, int64_t n) {
    f32x8 acc{};
    for (int64_t d = 0; d < n; d += 8) {
        f32x8 x, y;
        std::memcpy(&x, a + d, sizeof x);
        std::memcpy(&y, b + d, sizeof y);
        acc += x * y;
    }
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

inline float dot_seq(const float * a, const float * b, int64_t n) {
    float s = 0.0f;
    for (int64_t d = 0; d < n; ++d) { s += a[d] * b[d]; }
    return s;
}

/// All heads of one query token.  scores [n_heads, n_ctx] scratch.
void attend_token(float * out, const float * q, const AttnQuery & qry, int64_t n_heads, PagedKv kv,
                  float scale, float * scores) {
    const int64_t hd    = kv.head_dim;
    const int64_t row   = static_cast<int64_t>(kv.n_kv_heads) * hd;
    const int64_t bs    = kv.block_size;
    const int64_t group = n_heads / kv.n_kv_heads;
    const int64_t n_ctx = qry.n_ctx;
    const bool    lanes = hd % 8 == 0;
    for (int64_t t = 0; t < n_ctx; ++t) {
        const int64_t slot = static_cast<int64_t>(qry.block_table[t / bs]) * bs + t % bs;
        const float * k    = kv.k + slot * row;
        for (int64_t h = 0; h < n_heads; ++h) {
            const float * kh = k + (h / group) * hd;
            scores[h * n_ctx + t] = (lanes ? dot8(q + h * hd, kh, hd) : dot_seq(q + h * hd, kh, hd)) * scale;
        }
    }
    for (int64_t h = 0; h < n_heads; ++h) {
        float * s  = scores + h * n_ctx;
        float   mx = -INFINITY;
        for (int64_t t = 0; t < n_ctx; ++t) { mx = s[t] > mx ? s[t] : mx; }
        float sum = 0.0f;
        for (int64_t t = 0; t < n_ctx; ++t) {
            s[t] = std::exp(s[t] - mx);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < n_ctx; ++t) { s[t] *= inv; }
    }
    std::fill(out, out + n_heads * hd, 0.0f);
    for (int64_t t = 0; t < n_ctx; ++t) {
        const int64_t slot = static_cast<int64_t>(qry.block_table[t / bs]) * bs + t % bs;
        const float * v    = kv.v + slot * row;
        for (int64_t h = 0; h < n_heads; ++h) {
            const float   w  = scores[h * n_ctx + t];
            const float * vh = v + (h / group) * hd;
            float *       o  = out + h * hd;
            for (int64_t d = 0; d < hd; ++d) { o[d] += w * vh[d]; }
        }
    }
}

}  // namespace

void attention_paged(float * out, const float * q, const AttnQuery * queries, int64_t n_tokens,
                     int64_t n_heads, PagedKv kv, float scale, ThreadPool * pool) {
    const int64_t hd        = kv.head_dim;
    int64_t       n_ctx_max = 1;
    for (int64_t i = 0; i < n_tokens; ++i) { n_ctx_max = std::max<int64_t>(n_ctx_max, queries[i].n_ctx); }
    auto run = [&](int64_t i) {
        thread_local std::vector<float> scores;
        if (static_cast<int64_t>(scores.size()) < n_heads * n_ctx_max) { scores.resize(n_heads * n_ctx_max); }
        attend_token(out + i * n_heads * hd, q + i * n_heads * hd, queries[i], n_heads, kv, scale, scores.data());
    };
    const int64_t work = n_ctx_max * n_tokens * n_heads * hd;
    if (pool && n_tokens > 1 && work > (1 << 16)) {
        pool->parallel_for(n_tokens, run);
    } else {
        for (int64_t i = 0; i < n_tokens; ++i) { run(i); }
    }
}

}  // namespace fd::kernels
