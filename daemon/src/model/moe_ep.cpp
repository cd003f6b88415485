// Expert parallelism's dispatch and combine (fd/model/moe_ep.h): the rank's experts on their
// tokens, one all-gather of the weighted rows, the tp = 1 kernel's summation order.
#include "fd/model/moe_ep.h"

#include "fd/status.h"

#include <algorithm>

namespace fd::model {

std::vector<int64_t> moe_ep_rank_pairs(const kernels::MoePlan & plan, int32_t n_experts, int32_t ep) {
    FD_CHECK(ep >= 1 && n_experts % ep == 0, "{} experts over {} expert-parallel ranks", n_experts, ep);
    const int32_t per = n_experts / ep;
    std::vector<int64_t> first(static_cast<size_t>(ep) + 1, plan.begin.back());
    // plan.experts ascending: each rank's groups are one contiguous run of them.
    for (int32_t r = ep - 1; r >= 0; --r) {
        first[static_cast<size_t>(r)] = first[static_cast<size_t>(r) + 1];
        for (size_t i = 0; i < plan.experts.size(); ++i) {
            if (plan.experts[i] >= r * per) {
                first[static_cast<size_t>(r)] = std::min(first[static_cast<size_t>(r) + 1], plan.begin[i]);
                break;
            }
        }
    }
    return first;
}

namespace {

int64_t max_rank_pairs(const std::vector<int64_t> & first) {
    int64_t m = 0;
    for (size_t r = 0; r + 1 < first.size(); ++r) { m = std::max(m, first[r + 1] - first[r]); }
    return std::max<int64_t>(m, 1);
}

void zero(kernels::Backend & be, float * p, int64_t n) {
    if (be.host_visible()) {
        std::fill(p, p + n, 0.0f);
        return;
    }
    const std::vector<float> zeros(static_cast<size_t>(n), 0.0f);
    be.upload(p, zeros.data(), n * static_cast<int64_t>(sizeof(float)));
}

}  // namespace

int64_t moe_ep_buffer_floats(const MoeEpCall & c) {
    return (1 + int64_t{c.ep}) * max_rank_pairs(moe_ep_rank_pairs(c.plan, c.n_experts, c.ep)) * c.n_embd;
}

void moe_experts_ep(kernels::Backend & be, comm::Comm & comm, const MoeEpCall & c, float * out, const float * x, float * work,
                    float * buffer) {
    const kernels::MoePlan & plan = c.plan;
    const int64_t h = c.n_embd, ff = c.n_ff, m_max = plan.max_rows;
    const std::vector<int64_t> first = moe_ep_rank_pairs(plan, c.n_experts, c.ep);
    const int64_t stride = max_rank_pairs(first);  // rows per rank in the gathered buffer
    const int64_t mine0  = first[static_cast<size_t>(c.ep_rank)];
    const int32_t per    = c.n_experts / c.ep;
    float * send = buffer;               // [stride, h]       this rank's pairs, plan order
    float * recv = buffer + stride * h;  // [ep, stride, h]   every rank's
    float * xe   = work;                 // [m, h]            a group's rows of x
    float * gu   = xe + m_max * h;       // [m, 2 * ff]
    float * act  = gu + m_max * 2 * ff;  // [m, ff]
    // Dispatch: this rank's experts on their tokens. A group's pairs are contiguous in plan
    // order, so expert e's output rows land as one block of send: rows [b - mine0, b - mine0 + m).
    for (size_t i = 0; i < plan.experts.size(); ++i) {
        const int64_t b = plan.begin[i], m = plan.begin[i + 1] - b;
        if (b < mine0 || b >= first[static_cast<size_t>(c.ep_rank) + 1]) { continue; }
        const kernels::ExpertWeights & w = c.experts[plan.experts[i]];
        FD_CHECK(w.gate_up != nullptr, "rank {} of ep {}: expert {} is not held here", c.ep_rank, c.ep, plan.experts[i]);
        be.gather_rows(xe, x, plan.rows.data() + b, m, h);
        be.linear(gu, xe, w.gate_up, w.gate_up_type, nullptr, m, 2 * ff, h);
        be.silu_mul(act, gu, m, ff);
        be.linear(send + (b - mine0) * h, act, w.down, w.down_type, nullptr, m, h, ff);
    }
    // Combine: every rank's rows, then exactly Backend::moe_experts' accumulation (the same
    // scale_add_rows calls with the same rows, weights and expert order): bit for bit tp = 1's.
    comm.all_gather(send, stride * h, recv);
    zero(be, out, c.n_rows * h);
    for (size_t i = 0; i < plan.experts.size(); ++i) {
        const int32_t owner = plan.experts[i] / per;
        const int64_t b = plan.begin[i], m = plan.begin[i + 1] - b;
        const float * y = recv + (owner * stride + (b - first[static_cast<size_t>(owner)])) * h;
        be.scale_add_rows(out, y, plan.rows.data() + b, plan.weights.data() + b, m, h);
    }
}

}  // namespace fd::model
