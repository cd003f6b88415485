// The Llama / Qwen2 / Qwen3 / Mistral (and MoE: Qwen3-MoE, Qwen2-MoE, Mixtral) forward pass, one readable function over a Backend (after llama2.c
// forward()). Every tensor is backend memory (the weight and kv_cache regions, the scratch
// buffers); the batch's index arrays stay on the host (see fd/kernels/backend.h).
#include "fd/model/worker.h"
#include "worker_graphs.h"

#include "fd/model/graph_plan.h"
#include "fd/comm/comm.h"
#include "fd/status.h"

#include <algorithm>
#include <cmath>

namespace fd::model {

int32_t route_cols(const ModelConfig & cfg) {
    if (!cfg.moe.enabled()) { return 0; }
    return static_cast<int32_t>(std::count(cfg.moe.sparse_layer.begin(), cfg.moe.sparse_layer.end(), true)) * cfg.moe.top_k;
}

kernels::PagedKv Worker::layer_kv(int il) {
    return {k_pool_[il], v_pool_[il], wcfg_.block_size, cfg_.n_kv_heads / wcfg_.tp_size, cfg_.head_dim, wcfg_.kv_dtype};
}

bool Worker::forward(const StepBatch & b, float * logits, const std::atomic<bool> * abandon) {
    FD_CHECK(alloc_->resident(memory::Tag::weight) && alloc_->resident(memory::Tag::kv_cache),
             "forward with released weights or KV pool");
    const int64_t n = b.n_tokens();
    for (int64_t t = 0; t < n; ++t) {
        FD_CHECK(b.tokens[t] >= 0 && b.tokens[t] < cfg_.vocab_size, "token id {} outside vocab", b.tokens[t]);
        FD_CHECK(b.positions[t] < wcfg_.max_model_len, "position {} beyond max_model_len", b.positions[t]);
    }
    if (graphs_on() && s_.x.capacity_bytes() == 0) { restore_graph_memory(); }  // after release_graphs()
    // R3: moe_mlp writes each sparse layer's routes into [n, n_moe_layers, top_k] (MoE steps never run as graphs).
    moe_host_.record = b.want_routes && cfg_.moe.enabled();
    if (moe_host_.record) { moe_host_.routes.assign(static_cast<size_t>(n * route_cols(cfg_)), -1); }
    if (graphs_on() && is_graph_step(b, g_->buckets.back(), wcfg_.max_model_len)) { return g_->forward(*this, b, logits, abandon); }
    backend_->begin_step({b.tokens.data(), b.positions.data(), b.slots.data(), b.queries.data(), n});
    // The logits land in the caller's host buffer directly where backend memory is host memory.
    const int64_t full = static_cast<int64_t>(b.logits_rows.size()) * cfg_.vocab_size;
    float *       out  = device_mem_ ? s_.logits.floats(full) : logits;  // [n_logits, vocab]
    if (!run_model(b, out, abandon)) { return false; }
    if (comm_ && wcfg_.rank != 0) { return true; }
    if (out != logits) { backend_->download(logits, out, full * static_cast<int64_t>(sizeof(float))); }
    return true;
}

bool Worker::run_model(const StepBatch & b, float * out, const std::atomic<bool> * abandon) {
    kernels::Backend & be = *backend_;
    // This rank's share of every split dimension (T = 1: the whole model).
    const int64_t T = wcfg_.tp_size, n = b.n_tokens(), h = cfg_.hidden_size, hd = cfg_.head_dim;
    const int64_t n_heads = cfg_.n_heads / T, n_kv_heads = cfg_.n_kv_heads / T, q_dim = n_heads * hd;
    const int64_t kv_dim = n_kv_heads * hd, qkv_dim = q_dim + 2 * kv_dim, ff = cfg_.intermediate_size / T;
    const int64_t vocab = cfg_.vocab_size / T, vocab0 = wcfg_.rank * vocab;  // this rank's vocab rows
    const float   eps   = cfg_.rms_norm_eps;
    float * x    = s_.x.floats(n * h);          // [n, hidden] residual stream
    float * xn   = s_.xn.floats(n * h);         // [n, hidden] normalized / a layer's output
    float * qkv  = s_.qkv.floats(n * qkv_dim);  // [n, q_dim + 2 kv_dim]
    float * q    = s_.q.floats(n * q_dim);      // [n, n_heads, head_dim]
    float * k    = s_.k.floats(n * kv_dim);     // [n, n_kv_heads, head_dim]
    float * v    = s_.v.floats(n * kv_dim);
    float * att  = s_.att.floats(n * q_dim);    // [n, n_heads, head_dim]
    float * gu   = s_.ff.floats(n * 2 * ff);    // [n, 2 * intermediate]  gate | up
    float * gate = s_.gate.floats(n * ff);      // [n, intermediate]
    const float * rope = rope_.data();          // [max_model_len, head_dim]

    be.embedding(x, w_.embed.w, w_.embed.type, b.tokens.data(), n, h, vocab0, vocab);
    if (comm_) { comm_->all_reduce_sum(x, n * h); }  // vocab parallel: the other ranks added zeros
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    for (int il = 0; il < cfg_.n_layers; ++il) {
        if (abandon && abandon->load(std::memory_order_relaxed)) { return false; }
        const LayerWeights & L = w_.layers[il];
        // attention
        be.rms_norm(xn, x, L.attn_norm, n, h, eps);
        be.linear(qkv, xn, L.qkv.w, L.qkv.type, L.bqkv, n, qkv_dim, h);
        be.copy_rows(q, q_dim, qkv, qkv_dim, n, q_dim);
        be.copy_rows(k, kv_dim, qkv + q_dim, qkv_dim, n, kv_dim);
        be.copy_rows(v, kv_dim, qkv + q_dim + kv_dim, qkv_dim, n, kv_dim);
        if (L.q_norm) {  // Qwen3: RMSNorm over each head of q and k, before RoPE
            be.rms_norm(q, q, L.q_norm, n * n_heads, hd, eps);
            be.rms_norm(k, k, L.k_norm, n * n_kv_heads, hd, eps);
        }
        be.rope(q, b.positions.data(), rope, n, n_heads, hd);
        be.rope(k, b.positions.data(), rope, n, n_kv_heads, hd);
        const kernels::PagedKv kv = layer_kv(il);
        be.kv_store(kv, k, v, b.slots.data(), n);
        be.attention_paged(att, q, b.queries.data(), n, n_heads, kv, scale);
        be.linear(xn, att, L.o.w, L.o.type, nullptr, n, h, q_dim);
        if (comm_) { comm_->all_reduce_sum(xn, n * h); }  // row parallel: sum the ranks' partial outputs
        be.add(x, xn, n * h);
        // SwiGLU MLP, or a sparse MoE block (moe_forward.cpp)
        be.rms_norm(xn, x, L.mlp_norm, n, h, eps);
        if (cfg_.is_moe_layer(il)) {
            float * moe = s_.moe_out.floats(n * h);
            moe_mlp(il, xn, moe, n);
            if (comm_ && wcfg_.ep_size == 1) { comm_->all_reduce_sum(moe, n * h); }  // expert parallel: whole on every rank
            be.add(x, moe, n * h);
            continue;
        }
        be.linear(gu, xn, L.gate_up.w, L.gate_up.type, nullptr, n, 2 * ff, h);
        be.silu_mul(gate, gu, n, ff);
        be.linear(xn, gate, L.down.w, L.down.type, nullptr, n, h, ff);
        if (comm_) { comm_->all_reduce_sum(xn, n * h); }
        be.add(x, xn, n * h);
    }
    // Final norm and LM head, only for the rows that need logits. When every row needs them in
    // order (decode, graph steps) the norm reads x directly: same arithmetic, no gather (and no
    // host row ids inside a captured graph).
    if (wcfg_.mtp_draft_tokens > 0) {  // every row's final-normed hidden state: what the MTP layer reads (draft_mtp)
        be.rms_norm(s_.hidden.floats(n * h), x, w_.final_norm, n, h, eps);
        n_hidden_rows_ = n;
    }
    const int64_t n_logits = static_cast<int64_t>(b.logits_rows.size());
    float *       rows     = s_.rows.floats(n_logits * h);  // [n_logits, hidden]
    bool          all_rows = n_logits == n;
    for (int64_t i = 0; all_rows && i < n; ++i) { all_rows = b.logits_rows[i] == i; }
    if (all_rows) {
        be.rms_norm(rows, x, w_.final_norm, n_logits, h, eps);
    } else {
        be.gather_rows(rows, x, b.logits_rows.data(), n_logits, h);
        be.rms_norm(rows, rows, w_.final_norm, n_logits, h, eps);
    }
    if (!comm_) {
        be.linear(out, rows, w_.lm_head.w, w_.lm_head.type, nullptr, n_logits, vocab, h);
    } else {
        // Column parallel head: this rank's [n_logits, vocab/T], gathered to rank 0 as
        // [T, n_logits, vocab/T] and laid out there as [n_logits, vocab].
        float * part     = s_.part.floats(n_logits * vocab);
        float * gathered = s_.gathered.floats(wcfg_.rank == 0 ? T * n_logits * vocab : 0);
        be.linear(part, rows, w_.lm_head.w, w_.lm_head.type, nullptr, n_logits, vocab, h);
        comm_->gather(part, n_logits * vocab, gathered);
        if (wcfg_.rank != 0) { return true; }
        for (int64_t r = 0; r < T; ++r) { be.copy_rows(out + r * vocab, T * vocab, gathered + r * n_logits * vocab, vocab, n_logits, vocab); }
    }
    return true;
}

}  // namespace fd::model
