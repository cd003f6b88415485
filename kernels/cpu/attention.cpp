// Paged KV store and causal GQA attention (see ops.h).
#include "fd/kernels/ops.h"

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

/// One (token, head): scores over the context, softmax, weighted sum of V.
void attend_one(float * out, const float * q, const AttnQuery & qry, int64_t kvh, PagedKv kv,
                float scale, float * scores) {
    const int64_t hd       = kv.head_dim;
    const int64_t row      = static_cast<int64_t>(kv.n_kv_heads) * hd;
    const int64_t bs       = kv.block_size;
    float         mx       = -INFINITY;
    for (int64_t t = 0; t < qry.n_ctx; ++t) {
        const int64_t slot = static_cast<int64_t>(qry.block_table[t / bs]) * bs + t % bs;
        const float * k    = kv.k + slot * row + kvh * hd;
        float         s    = 0.0f;
        for (int64_t d = 0; d < hd; ++d) { s += q[d] * k[d]; }
        s *= scale;
        scores[t] = s;
        mx        = s > mx ? s : mx;
    }
    float sum = 0.0f;
    for (int64_t t = 0; t < qry.n_ctx; ++t) {
        scores[t] = std::exp(scores[t] - mx);
        sum += scores[t];
    }
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < hd; ++d) { out[d] = 0.0f; }
    for (int64_t t = 0; t < qry.n_ctx; ++t) {
        const int64_t slot = static_cast<int64_t>(qry.block_table[t / bs]) * bs + t % bs;
        const float * v    = kv.v + slot * row + kvh * hd;
        const float   w    = scores[t] * inv;
        for (int64_t d = 0; d < hd; ++d) { out[d] += w * v[d]; }
    }
}

}  // namespace

void attention_paged(float * out, const float * q, const AttnQuery * queries, int64_t n_tokens,
                     int64_t n_heads, PagedKv kv, float scale, ThreadPool * pool) {
    const int64_t hd    = kv.head_dim;
    const int64_t group = n_heads / kv.n_kv_heads;
    int32_t       n_ctx_max = 1;
    for (int64_t i = 0; i < n_tokens; ++i) { n_ctx_max = std::max(n_ctx_max, queries[i].n_ctx); }
    // Task = one token, all heads: keeps the per-token scratch simple and the work coarse.
    auto run = [&](int64_t i) {
        thread_local std::vector<float> scores;
        if (static_cast<int32_t>(scores.size()) < n_ctx_max) { scores.resize(n_ctx_max); }
        for (int64_t h = 0; h < n_heads; ++h) {
            attend_one(out + (i * n_heads + h) * hd, q + (i * n_heads + h) * hd, queries[i],
                       h / group, kv, scale, scores.data());
        }
    };
    const int64_t work = static_cast<int64_t>(n_ctx_max) * n_tokens * n_heads * hd;
    if (pool && n_tokens > 1 && work > (1 << 16)) {
        pool->parallel_for(n_tokens, run);
    } else {
        for (int64_t i = 0; i < n_tokens; ++i) { run(i); }
    }
}

}  // namespace fd::kernels
