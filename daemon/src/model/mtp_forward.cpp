// MiMo's next-token-prediction (MTP) draft layer over a Backend (fd/model/worker.h, DraftBatch;
// vLLM vllm/model_executor/models/mimo_mtp.py). For rows (h, t, position p):
//   e   = embed(t), zeroed where p == 0 (vLLM masks the embedding at position 0)
//   x   = input_proj([hidden_layernorm(h) | token_layernorm(e)])       concat order: hidden first
//   x  += o_proj(attention(input_layernorm(x)))                          a Qwen2 decoder block,
//   x  += down(silu(gate) * up)(post_attention_layernorm(x))             its K/V in the MTP cache
//   out = final_layernorm(x);  logits = lm_head(out) (the target's head)
// h is the target's final-normed hidden state at p (Worker::forward keeps every row's), or, for
// a chain's later drafts, the MTP layer's own previous `out` (vLLM's reuse of layer 0 for k > 1).
// Tensor parallel (tp > 1) as a target block (forward.cpp): the embedding is vocab parallel
// (all-reduced), input_proj and the norms whole on every rank (checkpoint/src/layout.cpp), q/k/v
// and gate/up this rank's heads and intermediate rows, o_proj and down all-reduced; the MTP cache
// holds this rank's kv heads. The draft argmax runs over this rank's vocab rows of the shared
// head and the ranks all-gather their (max, id) pairs, so every rank picks the same draft.
#include "fd/model/worker.h"

#include "fd/comm/comm.h"
#include "fd/status.h"

#include <algorithm>
#include <cmath>

namespace fd::model {

void Worker::mtp_layer(const float * hin, const int32_t * tokens, const int32_t * positions, const int64_t * slots,
                       const kernels::AttnQuery * queries, int64_t n, float * out, const int32_t * out_rows, int64_t n_out) {
    kernels::Backend & be = *backend_;
    const MtpWeights & M  = w_.mtp.front();
    const LayerWeights & L = M.block;
    // This rank's share of every split dimension (T = 1: the whole layer), as run_model's.
    const int64_t T = wcfg_.tp_size, h = cfg_.hidden_size, hd = cfg_.head_dim, n_heads = cfg_.n_heads / T, n_kv_heads = cfg_.n_kv_heads / T;
    const int64_t q_dim = n_heads * hd, kv_dim = n_kv_heads * hd, qkv_dim = q_dim + 2 * kv_dim, ff = cfg_.intermediate_size / T;
    const int64_t vocab = cfg_.vocab_size / T, vocab0 = wcfg_.rank * vocab;  // this rank's embedding rows
    const float   eps = cfg_.rms_norm_eps;
    be.begin_step({tokens, positions, slots, queries, n});
    float * cat = s_.mtp_cat.floats(n * 2 * h);  // [n, 2 * hidden]  hidden | token
    float * e   = s_.mtp_in.floats(n * h);       // [n, hidden]
    be.embedding(e, w_.embed.w, w_.embed.type, tokens, n, h, vocab0, vocab);
    if (comm_) { comm_->all_reduce_sum(e, n * h); }  // vocab parallel: the other ranks added zeros
    for (int64_t i = 0; i < n; ++i) {
        if (positions[i] != 0) { continue; }
        const std::vector<float> zeros(static_cast<size_t>(h), 0.0f);
        be.upload(e + i * h, zeros.data(), h * static_cast<int64_t>(sizeof(float)));
    }
    be.rms_norm(e, e, M.token_norm, n, h, eps);
    be.copy_rows(cat + h, 2 * h, e, h, n, h);
    be.rms_norm(e, hin, M.hidden_norm, n, h, eps);
    be.copy_rows(cat, 2 * h, e, h, n, h);
    float * x    = s_.x.floats(n * h);
    float * xn   = s_.xn.floats(n * h);
    float * qkv  = s_.qkv.floats(n * qkv_dim);
    float * q    = s_.q.floats(n * q_dim);
    float * k    = s_.k.floats(n * kv_dim);
    float * v    = s_.v.floats(n * kv_dim);
    float * att  = s_.att.floats(n * q_dim);
    float * gu   = s_.ff.floats(n * 2 * ff);
    float * gate = s_.gate.floats(n * ff);
    be.linear(x, cat, M.input_proj.w, M.input_proj.type, nullptr, n, h, 2 * h);
    // the decoder block (as forward.cpp's dense layers)
    be.rms_norm(xn, x, L.attn_norm, n, h, eps);
    be.linear(qkv, xn, L.qkv.w, L.qkv.type, L.bqkv, n, qkv_dim, h);
    be.copy_rows(q, q_dim, qkv, qkv_dim, n, q_dim);
    be.copy_rows(k, kv_dim, qkv + q_dim, qkv_dim, n, kv_dim);
    be.copy_rows(v, kv_dim, qkv + q_dim + kv_dim, qkv_dim, n, kv_dim);
    if (L.q_norm) {
        be.rms_norm(q, q, L.q_norm, n * n_heads, hd, eps);
        be.rms_norm(k, k, L.k_norm, n * n_kv_heads, hd, eps);
    }
    be.rope(q, positions, rope_.data(), n, n_heads, hd);
    be.rope(k, positions, rope_.data(), n, n_kv_heads, hd);
    const kernels::PagedKv kv{mtp_k_, mtp_v_, wcfg_.block_size, static_cast<int32_t>(n_kv_heads), cfg_.head_dim};
    be.kv_store(kv, k, v, slots, n);
    std::vector<kernels::AttnQuery> out_queries;
    if (n_out >= 0) {  // only the rows out_rows[0, n_out) go on: gather their q, residual and query
        if (n_out == 0) { return; }
        float * qo = qkv;  // [n_out, q_dim] (qkv is read no more)
        float * xo = e;    // [n_out, hidden] (e neither)
        be.gather_rows(qo, q, out_rows, n_out, q_dim);
        be.gather_rows(xo, x, out_rows, n_out, h);
        out_queries.reserve(static_cast<size_t>(n_out));
        for (int64_t i = 0; i < n_out; ++i) { out_queries.push_back(queries[out_rows[i]]); }
        q = qo;
        x = xo;
        queries = out_queries.data();
        n = n_out;
    }
    be.attention_paged(att, q, queries, n, n_heads, kv, 1.0f / std::sqrt(static_cast<float>(hd)));
    be.linear(xn, att, L.o.w, L.o.type, nullptr, n, h, q_dim);
    if (comm_) { comm_->all_reduce_sum(xn, n * h); }  // row parallel: sum the ranks' partial outputs
    be.add(x, xn, n * h);
    be.rms_norm(xn, x, L.mlp_norm, n, h, eps);
    be.linear(gu, xn, L.gate_up.w, L.gate_up.type, nullptr, n, 2 * ff, h);
    be.silu_mul(gate, gu, n, ff);
    be.linear(xn, gate, L.down.w, L.down.type, nullptr, n, h, ff);
    if (comm_) { comm_->all_reduce_sum(xn, n * h); }
    be.add(x, xn, n * h);
    be.rms_norm(out, x, M.final_norm, n, h, eps);
}

// Greedy token of each row through the shared lm_head; at tp > 1 every rank returns the same ones.
void Worker::mtp_argmax(const float * hid, int64_t n, int32_t * tokens) {
    const int64_t T = wcfg_.tp_size, vocab = cfg_.vocab_size / T, vocab0 = wcfg_.rank * vocab;  // this rank's head rows
    float * logits = s_.mtp_logits.floats(n * vocab);  // [n, vocab / T]
    backend_->linear(logits, hid, w_.lm_head.w, w_.lm_head.type, nullptr, n, vocab, cfg_.hidden_size);
    std::vector<int64_t> ids(static_cast<size_t>(n));
    backend_->argmax_rows(ids.data(), logits, n, vocab);
    if (!comm_) {
        for (int64_t i = 0; i < n; ++i) { tokens[i] = static_cast<int32_t>(ids[static_cast<size_t>(i)]); }
        return;
    }
    // Column parallel head: every rank's (max logit, vocab id) per row, all-gathered as
    // [T, n, 2] f32 (bytes copied: the same on every rank), then the largest logit wins, the
    // lowest id (= the lowest rank) on a tie. Ids travel as f32 values: exact below 2^24.
    FD_CHECK(cfg_.vocab_size < (1 << 24), "MTP drafts at tp > 1 need a vocab below 2^24 (is {})", cfg_.vocab_size);
    std::vector<float> pick(static_cast<size_t>((T + 1) * n * 2));
    for (int64_t i = 0; i < n; ++i) {
        const int64_t id = ids[static_cast<size_t>(i)];
        backend_->download(&pick[static_cast<size_t>(2 * i)], logits + i * vocab + id, static_cast<int64_t>(sizeof(float)));
        pick[static_cast<size_t>(2 * i + 1)] = static_cast<float>(vocab0 + id);
    }
    float * buf = s_.part.floats((T + 1) * n * 2);  // [n, 2] this rank's, then [T, n, 2] everyone's (the head's part is done with)
    backend_->upload(buf, pick.data(), n * 2 * static_cast<int64_t>(sizeof(float)));
    comm_->all_gather(buf, n * 2, buf + n * 2);
    backend_->download(pick.data() + n * 2, buf + n * 2, T * n * 2 * static_cast<int64_t>(sizeof(float)));
    for (int64_t i = 0; i < n; ++i) {
        float best = 0.0f, best_id = -1.0f;
        for (int64_t r = 0; r < T; ++r) {
            const float v = pick[static_cast<size_t>((1 + r) * n * 2 + 2 * i)], id = pick[static_cast<size_t>((1 + r) * n * 2 + 2 * i + 1)];
            if (best_id < 0.0f || v > best) { best = v; best_id = id; }
        }
        tokens[i] = static_cast<int32_t>(best_id);
    }
}

void Worker::draft_mtp(const DraftBatch & db, std::vector<int32_t> & drafts) {
    FD_CHECK(wcfg_.mtp_draft_tokens > 0 && !w_.mtp.empty(), "draft_mtp without MTP drafts configured");
    FD_CHECK(alloc_->resident(memory::Tag::mtp_cache) && alloc_->resident(memory::Tag::weight), "draft_mtp with a released MTP cache or weights");
    const int64_t n = static_cast<int64_t>(db.hidden_rows.size()), h = cfg_.hidden_size, bs = wcfg_.block_size;
    for (int64_t i = 0; i < n; ++i) {
        FD_CHECK(db.hidden_rows[i] >= 0 && db.hidden_rows[i] < n_hidden_rows_, "MTP row {} outside the last forward's {} rows",
                 db.hidden_rows[i], n_hidden_rows_);
        FD_CHECK(db.tokens[i] >= 0 && db.tokens[i] < cfg_.vocab_size, "MTP token id {} outside vocab", db.tokens[i]);
        FD_CHECK(db.positions[i] < wcfg_.max_model_len, "MTP position {} beyond max_model_len", db.positions[i]);
    }
    drafts.clear();
    if (n == 0) { return; }
    // Catch-up: every kept position's MTP K/V; the whole layer only on the rows the chains start
    // from (out row c = chain c's row), none when no chain drafts (e.g. above the batch cut-off).
    const int64_t m = static_cast<int64_t>(db.chains.size());
    std::vector<int32_t> start(static_cast<size_t>(m));
    for (int64_t c = 0; c < m; ++c) {
        const auto & ch = db.chains[static_cast<size_t>(c)];
        FD_CHECK(ch.row >= 0 && ch.row < n && ch.k >= 1, "MTP chain row {} / k {} invalid", ch.row, ch.k);
        start[static_cast<size_t>(c)] = ch.row;
    }
    float * hin = s_.mtp_cur.floats(n * h);
    backend_->gather_rows(hin, s_.hidden.data(), db.hidden_rows.data(), n, h);
    float * out = s_.mtp_out.floats(std::max<int64_t>(m, 1) * h);
    mtp_layer(hin, db.tokens.data(), db.positions.data(), db.slots.data(), db.queries.data(), n, out, start.data(), m);
    if (m == 0) { return; }
    int32_t max_k = 0;
    std::vector<int32_t> offset(static_cast<size_t>(m) + 1, 0);  // chain c's drafts at [offset[c], offset[c+1])
    for (int64_t c = 0; c < m; ++c) {
        const auto & ch = db.chains[static_cast<size_t>(c)];
        offset[static_cast<size_t>(c) + 1] = offset[static_cast<size_t>(c)] + ch.k;
        max_k = std::max(max_k, ch.k);
    }
    drafts.assign(static_cast<size_t>(offset.back()), 0);
    // Draft 1 of every chain: the greedy token of its catch-up row.
    float * cur = s_.mtp_cur.floats(m * h);  // [m, hidden] the chains' current hidden rows
    backend_->copy_rows(cur, h, out, h, m, h);
    std::vector<int32_t> tok(static_cast<size_t>(m));
    mtp_argmax(cur, m, tok.data());
    for (int64_t c = 0; c < m; ++c) { drafts[static_cast<size_t>(offset[c])] = tok[static_cast<size_t>(c)]; }
    // Drafts 2..k: the layer again at the next position, on (its own output, the previous draft).
    const int64_t per_chain = (max_k + bs - 1) / bs + 1;  // scratch blocks a chain may need
    std::vector<std::vector<int32_t>> tables(static_cast<size_t>(m));
    std::vector<int32_t> live, toks, pos, rows;
    std::vector<int64_t> slots;
    std::vector<kernels::AttnQuery> queries;
    for (int32_t j = 1; j < max_k; ++j) {
        live.clear(); toks.clear(); pos.clear(); rows.clear(); slots.clear(); queries.clear();
        for (int64_t c = 0; c < m; ++c) {
            const auto & ch = db.chains[static_cast<size_t>(c)];
            if (ch.k <= j) { continue; }
            if (c >= wcfg_.mtp_scratch_blocks / per_chain) { continue; }  // no scratch left: one draft
            auto & t = tables[static_cast<size_t>(c)];
            if (t.empty()) {
                t.assign(ch.block_table, ch.block_table + ch.n_table_blocks);
                for (int64_t b = 0; b < per_chain; ++b) { t.push_back(static_cast<int32_t>(wcfg_.n_blocks + c * per_chain + b)); }
            }
            const int32_t p = db.positions[static_cast<size_t>(ch.row)] + j;
            if (p >= wcfg_.max_model_len || p / bs >= static_cast<int64_t>(t.size())) { continue; }
            live.push_back(static_cast<int32_t>(c));
            rows.push_back(static_cast<int32_t>(c));
            toks.push_back(drafts[static_cast<size_t>(offset[c] + j - 1)]);
            pos.push_back(p);
            slots.push_back(static_cast<int64_t>(t[static_cast<size_t>(p / bs)]) * bs + p % bs);
            queries.push_back({t.data(), p + 1});
        }
        if (live.empty()) { break; }
        const auto nl = static_cast<int64_t>(live.size());
        float * hin_j = s_.mtp_out.floats(nl * h);  // the catch-up output is no longer read
        backend_->gather_rows(hin_j, cur, rows.data(), nl, h);
        float * out_j = s_.rows.floats(nl * h);     // the target's head rows are done with too
        mtp_layer(hin_j, toks.data(), pos.data(), slots.data(), queries.data(), nl, out_j);
        mtp_argmax(out_j, nl, tok.data());
        for (int64_t i = 0; i < nl; ++i) {
            const int32_t c = live[static_cast<size_t>(i)];
            drafts[static_cast<size_t>(offset[c] + j)] = tok[static_cast<size_t>(i)];
            backend_->copy_rows(cur + static_cast<int64_t>(c) * h, h, out_j + i * h, h, 1, h);
        }
        // Chains that stopped (k reached, no scratch, max_model_len) keep their drafts so far.
        for (int64_t c = 0; c < m; ++c) {
            const auto & ch = db.chains[static_cast<size_t>(c)];
            if (ch.k > j && std::find(live.begin(), live.end(), static_cast<int32_t>(c)) == live.end()) {
                drafts[static_cast<size_t>(offset[c] + j)] = -1;  // marks the end of this chain's drafts
            }
        }
    }
}

}  // namespace fd::model
