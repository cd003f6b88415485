// Mixture-of-experts routing and grouping (fd/kernels/moe.h): host code shared by every backend.
#include "fd/kernels/moe.h"

#include "fd/status.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace fd::kernels {

void moe_route(int32_t * ids, float * weights, const float * logits, int64_t n_rows, int64_t n_experts, int32_t top_k,
               bool renormalize) {
    std::vector<float>   p(static_cast<size_t>(n_experts));
    std::vector<int32_t> order(static_cast<size_t>(n_experts));
    for (int64_t t = 0; t < n_rows; ++t) {
        const float * x = logits + t * n_experts;
        float m = x[0];
        for (int64_t e = 1; e < n_experts; ++e) { m = std::max(m, x[e]); }
        float sum = 0.0f;
        for (int64_t e = 0; e < n_experts; ++e) {
            p[e] = std::exp(x[e] - m);
            sum += p[e];
        }
        for (int64_t e = 0; e < n_experts; ++e) { p[e] /= sum; }
        std::iota(order.begin(), order.end(), 0);
        // Descending probability, the lower id first among equals.
        std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int32_t a, int32_t b) {
            return p[a] > p[b] || (p[a] == p[b] && a < b);
        });
        int32_t * out_ids = ids + t * top_k;
        float *   out_w   = weights + t * top_k;
        float     top_sum = 0.0f;
        for (int32_t k = 0; k < top_k; ++k) {
            out_ids[k] = order[k];
            out_w[k]   = p[order[k]];
            top_sum += out_w[k];
        }
        if (renormalize) {
            for (int32_t k = 0; k < top_k; ++k) { out_w[k] /= top_sum; }
        }
    }
}

MoePlan moe_plan(const int32_t * ids, const float * weights, int64_t n_rows, int32_t top_k, int64_t n_experts) {
    MoePlan plan;
    std::vector<int64_t> count(static_cast<size_t>(n_experts) + 1, 0);
    const int64_t n_pairs = n_rows * top_k;
    for (int64_t i = 0; i < n_pairs; ++i) {
        FD_CHECK(ids[i] >= 0 && ids[i] < n_experts, "moe_plan: expert id {} outside [0, {})", ids[i], n_experts);
        ++count[static_cast<size_t>(ids[i]) + 1];
    }
    std::vector<int64_t> start(static_cast<size_t>(n_experts) + 1, 0);
    for (int64_t e = 0; e < n_experts; ++e) { start[e + 1] = start[e] + count[e + 1]; }
    plan.rows.resize(static_cast<size_t>(n_pairs));
    plan.weights.resize(static_cast<size_t>(n_pairs));
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n_pairs; ++i) {  // tokens in ascending order within each expert
        const int64_t at = next[ids[i]]++;
        plan.rows[at]    = static_cast<int32_t>(i / top_k);
        plan.weights[at] = weights[i];
    }
    plan.begin.push_back(0);
    for (int64_t e = 0; e < n_experts; ++e) {
        const int64_t n = start[e + 1] - start[e];
        if (n == 0) { continue; }
        plan.experts.push_back(static_cast<int32_t>(e));
        plan.begin.push_back(start[e + 1]);
        plan.max_rows = std::max(plan.max_rows, n);
    }
    return plan;
}

}  // namespace fd::kernels
