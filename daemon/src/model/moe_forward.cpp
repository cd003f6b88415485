// The sparse MoE block of the forward pass (Qwen3-MoE, Qwen2-MoE, Mixtral; fd/checkpoint/
// model_config.h MoeConfig): router → host routing (f32, per token) → grouped experts
// (Backend::moe_experts, only the experts the batch uses) → Qwen2-MoE's gated shared expert.
// Under tensor parallelism every rank holds every expert's slice (TP-MoE) and the whole router,
// so every rank routes identically; the block's output is this rank's partial sum, all-reduced
// by the caller with the rest of the layer. Under expert parallelism (wcfg_.ep_size > 1) each
// rank holds its experts whole and the shared expert whole; the routed experts go through the
// dispatch/combine of fd/model/moe_ep.h and the block's output is the whole sum, bitwise tp=1's,
// on every rank (the caller does not all-reduce it).
#include "fd/model/moe_ep.h"
#include "fd/model/worker.h"

#include <algorithm>
#include <cmath>

namespace fd::model {

void Worker::moe_mlp(int il, const float * xn, float * out, int64_t n) {
    kernels::Backend & be = *backend_;
    const MoeConfig &  m  = cfg_.moe;
    const MoeWeights & W  = w_.layers[static_cast<size_t>(il)].moe;
    const bool    ep = wcfg_.ep_size > 1;
    const int64_t T = ep ? 1 : wcfg_.tp_size, h = cfg_.hidden_size, E = m.n_experts, ff = m.intermediate / T;
    MoeHost & host = moe_host_;
    // Router logits, then softmax → top-k (→ renormalise) per token on the host.
    float * logits = s_.moe_logits.floats(n * E);
    be.linear(logits, xn, W.router.w, W.router.type, nullptr, n, E, h);
    host.logits.resize(static_cast<size_t>(n * E));
    host.ids.resize(static_cast<size_t>(n * m.top_k));
    host.weights.resize(static_cast<size_t>(n * m.top_k));
    be.download(host.logits.data(), logits, n * E * static_cast<int64_t>(sizeof(float)));
    kernels::moe_route(host.ids.data(), host.weights.data(), host.logits.data(), n, E, m.top_k, m.norm_topk_prob);
    if (host.record) {  // R3: this layer's top_k ids of each token, at the layer's place among the sparse layers
        const int64_t k = m.top_k, cols = route_cols(cfg_);
        const int64_t at = std::count(m.sparse_layer.begin(), m.sparse_layer.begin() + il, true) * k;
        for (int64_t t = 0; t < n; ++t) { std::copy_n(host.ids.data() + t * k, k, host.routes.data() + t * cols + at); }
    }
    const kernels::MoePlan plan = kernels::moe_plan(host.ids.data(), host.weights.data(), n, m.top_k, E);
    float * work = s_.moe_work.floats(kernels::Backend::moe_work_floats(plan.max_rows, h, ff));
    if (ep) {
        const MoeEpCall call{.plan = plan, .experts = W.experts.data(), .n_experts = m.n_experts, .ep = wcfg_.ep_size,
                             .ep_rank = wcfg_.rank % wcfg_.ep_size, .n_rows = n, .n_embd = h, .n_ff = ff};
        if (wcfg_.test_ep_dispatch_hook) { wcfg_.test_ep_dispatch_hook(); }
        moe_experts_ep(be, *comm_, call, out, xn, work, ep_buffer(moe_ep_buffer_floats(call)));
    } else {
        be.moe_experts(out, xn, plan, W.experts.data(), n, h, ff, work);
    }
    if (m.shared_intermediate == 0) { return; }
    // Qwen2-MoE: + sigmoid(x · shared_expert_gateᵀ) · shared_expert(x)  (whole under ep: T = 1)
    const int64_t sf = m.shared_intermediate / T;
    float * gu  = s_.shared_gu.floats(n * 2 * sf);
    float * act = s_.shared_act.floats(n * sf);
    float * y   = s_.shared_y.floats(n * h);
    float * g   = s_.shared_g.floats(n);
    be.linear(gu, xn, W.shared_gate_up.w, W.shared_gate_up.type, nullptr, n, 2 * sf, h);
    be.silu_mul(act, gu, n, sf);
    be.linear(y, act, W.shared_down.w, W.shared_down.type, nullptr, n, h, sf);
    be.linear(g, xn, W.shared_gate.w, W.shared_gate.type, nullptr, n, 1, h);
    host.shared_scale.resize(static_cast<size_t>(n));
    be.download(host.shared_scale.data(), g, n * static_cast<int64_t>(sizeof(float)));
    for (float & s : host.shared_scale) { s = 1.0f / (1.0f + std::exp(-s)); }
    if (static_cast<int64_t>(host.identity.size()) < n) {
        host.identity.resize(static_cast<size_t>(n));
        for (int64_t t = 0; t < n; ++t) { host.identity[static_cast<size_t>(t)] = static_cast<int32_t>(t); }
    }
    be.scale_add_rows(out, y, host.identity.data(), host.shared_scale.data(), n, h);
}

float * Worker::ep_buffer(int64_t floats) {
    const int64_t bytes = floats * static_cast<int64_t>(sizeof(float));
    if (alloc_->resident(memory::Tag::ep_buffer) && alloc_->capacity_bytes(memory::Tag::ep_buffer) >= bytes) {
        return reinterpret_cast<float *>(alloc_->data(memory::Tag::ep_buffer));
    }
    // Grow by a quarter more than asked (steps vary in size); a released region comes back.
    const int64_t want = std::max(bytes, alloc_->capacity_bytes(memory::Tag::ep_buffer));
    return reinterpret_cast<float *>(region(memory::Tag::ep_buffer, want + (want > bytes ? 0 : bytes / 4), /*populate=*/true));
}

}  // namespace fd::model
