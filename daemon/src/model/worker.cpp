// The Llama / Qwen2 forward pass on the CPU ops, one readable function (after llama2.c forward()).
#include "fd/model/worker.h"

#include "fd/log.h"
#include "fd/runtime/comm.h"
#include "fd/status.h"

#include <chrono>
#include <cmath>
#include <cstring>

namespace fd::model {
namespace {

void linear(float * out, const float * x, const LinearWeight & w, const float * bias, int64_t n_rows, int64_t n_out,
            int64_t n_in, kernels::ThreadPool * pool) {
    kernels::linear(out, x, w.w, w.type, bias, n_rows, n_out, n_in, pool);
}

}  // namespace

int64_t Worker::kv_block_bytes(const ModelConfig & c, int32_t block_size, int32_t tp_size) {
    return 2LL * c.n_layers * block_size * (c.kv_dim() / std::max(1, tp_size)) * static_cast<int64_t>(sizeof(float));
}

Worker::Worker(const ModelConfig & cfg, const TensorIndex & idx, const WorkerConfig & wcfg, runtime::Comm * comm)
    : cfg_(cfg), wcfg_(wcfg), pool_(std::make_unique<kernels::ThreadPool>(std::max(1, wcfg.n_threads))) {
    FD_CHECK(wcfg.n_blocks > 0 && wcfg.block_size > 0, "worker needs KV blocks ({} x {})", wcfg.n_blocks, wcfg.block_size);
    check_tp_divides(cfg_, wcfg.tp_size);
    if (wcfg.rank < 0 || wcfg.rank >= wcfg.tp_size) {
        fail(Errc::invalid_argument, "rank {} is outside [0, {}) (tp size {})", wcfg.rank, wcfg.tp_size, wcfg.tp_size);
    }
    if (wcfg.tp_size > 1) {
        if (comm == nullptr || comm->world_size() != wcfg.tp_size || comm->rank() != wcfg.rank) {
            fail(Errc::invalid_argument, "rank {} of tp size {} needs a comm of that rank and world size (got {})", wcfg.rank,
                 wcfg.tp_size, comm ? fmt::format("rank {} of {}", comm->rank(), comm->world_size()) : std::string("none"));
        }
        comm_ = comm;
    }
    // A full Hugging Face checkpoint is checked as such; a rank's own state dict (inference
    // names) only against the layout it plans.
    if (idx.tensors.count("model.layers.0.self_attn.q_proj.weight")) { validate_checkpoint(cfg_, idx); }
    layout_ = plan_layout(cfg_, idx, {wcfg.rank, wcfg.tp_size});
    validate_against_layout(layout_, idx);
    fill_arena(weights_arena_, idx, /*populate=*/false);
    w_ = bind_weights(cfg_, layout_, weights_arena_.data());
    map_kv_pool();
    map_swap_pool();
    rope_.resize(static_cast<size_t>(wcfg.max_model_len) * cfg_.head_dim);
    kernels::rope_table_inv_freq(rope_.data(), wcfg.max_model_len, cfg_.head_dim, rope_inv_freq(cfg_).data());
    log::get("model")->info("rank={}/{} | weights {:.1f} MiB, KV pool {} blocks x {} tokens = {:.1f} MiB, {} threads",
                            wcfg.rank, wcfg.tp_size, weights_arena_.used_bytes() / 1048576.0, wcfg.n_blocks, wcfg.block_size,
                            kv_arena_.capacity_bytes() / 1048576.0, pool_->n_threads());
    if (wcfg.n_swap_blocks > 0) {
        log::get("model")->info("rank={}/{} | host KV swap pool {} blocks = {:.1f} MiB", wcfg.rank, wcfg.tp_size, wcfg.n_swap_blocks,
                                swap_arena_.capacity_bytes() / 1048576.0);
    }
}

void Worker::map_kv_pool() {
    const int64_t per_layer = wcfg_.n_blocks * wcfg_.block_size * static_cast<int64_t>(cfg_.kv_dim() / wcfg_.tp_size);
    kv_arena_.reserve(2 * cfg_.n_layers * Arena::footprint_floats(per_layer), /*populate=*/true);
    k_pool_.clear();
    v_pool_.clear();
    for (int il = 0; il < cfg_.n_layers; ++il) {
        k_pool_.push_back(kv_arena_.alloc_floats(per_layer));
        v_pool_.push_back(kv_arena_.alloc_floats(per_layer));
    }
}

void Worker::map_swap_pool() {
    if (wcfg_.n_swap_blocks <= 0) { return; }
    // Pre-faulted: the pool is really held (RSS shows it) and a swap-out never page-faults.
    swap_arena_.reserve(wcfg_.n_swap_blocks * 2 * cfg_.n_layers * block_floats() * static_cast<int64_t>(sizeof(float)),
                        /*populate=*/true);
}

void Worker::check_copies(const kv::BlockCopy * copies, int64_t n, bool out) const {
    FD_CHECK(kv_arena_.mapped() && swap_arena_.mapped(), "KV swap with a released KV or swap pool");
    const int64_t n_src = out ? wcfg_.n_blocks : wcfg_.n_swap_blocks, n_dst = out ? wcfg_.n_swap_blocks : wcfg_.n_blocks;
    for (int64_t i = 0; i < n; ++i) {
        FD_CHECK(copies[i].src >= 0 && copies[i].src < n_src && copies[i].dst >= 0 && copies[i].dst < n_dst,
                 "KV swap {} block {} -> {} outside the pools ({} device, {} host blocks)", out ? "out" : "in", copies[i].src,
                 copies[i].dst, wcfg_.n_blocks, wcfg_.n_swap_blocks);
    }
}

void Worker::swap_out(const kv::BlockCopy * copies, int64_t n) {
    if (n == 0) { return; }
    check_copies(copies, n, true);
    const int64_t bf = block_floats(), bytes = bf * static_cast<int64_t>(sizeof(float));
    auto * host = reinterpret_cast<float *>(swap_arena_.data());
    for (int64_t i = 0; i < n; ++i) {
        float * dst = host + static_cast<int64_t>(copies[i].dst) * 2 * cfg_.n_layers * bf;
        for (int il = 0; il < cfg_.n_layers; ++il) {
            std::memcpy(dst + (2 * il) * bf, k_pool_[il] + copies[i].src * bf, bytes);
            std::memcpy(dst + (2 * il + 1) * bf, v_pool_[il] + copies[i].src * bf, bytes);
        }
    }
}

void Worker::swap_in(const kv::BlockCopy * copies, int64_t n) {
    if (n == 0) { return; }
    check_copies(copies, n, false);
    const int64_t bf = block_floats(), bytes = bf * static_cast<int64_t>(sizeof(float));
    const auto * host = reinterpret_cast<const float *>(swap_arena_.data());
    for (int64_t i = 0; i < n; ++i) {
        const float * src = host + static_cast<int64_t>(copies[i].src) * 2 * cfg_.n_layers * bf;
        for (int il = 0; il < cfg_.n_layers; ++il) {
            std::memcpy(k_pool_[il] + copies[i].dst * bf, src + (2 * il) * bf, bytes);
            std::memcpy(v_pool_[il] + copies[i].dst * bf, src + (2 * il + 1) * bf, bytes);
        }
    }
}

int64_t Worker::release_swap() { return swap_arena_.release(); }

void Worker::fill_arena(Arena & arena, const TensorIndex & idx, bool populate) {
    if (!arena.mapped() || arena.capacity_bytes() < layout_.arena_bytes) { arena.reserve(layout_.arena_bytes, populate); }
    arena.release_allocations();
    fill_weights(layout_, idx, arena.alloc_bytes(layout_.arena_bytes), pool_.get(),
                 {.check_finite = wcfg_.check_finite_weights, .timeout_s = wcfg_.io_timeout_s});
}

int64_t Worker::release_weights() {
    w_ = ModelWeights{};
    staged_ = false;
    return weights_arena_.release() + staging_arena_.release();
}

int64_t Worker::release_kv() {
    k_pool_.clear();
    v_pool_.clear();
    return kv_arena_.release();
}

void Worker::acquire_kv() {
    if (!kv_arena_.mapped()) { map_kv_pool(); }
    if (!swap_arena_.mapped()) { map_swap_pool(); }
}

void Worker::reload_weights(const TensorIndex & idx, const std::function<void()> & verify_copied) {
    validate_against_layout(layout_, idx);
    try {
        fill_arena(weights_arena_, idx, /*populate=*/false);
        if (verify_copied) { verify_copied(); }
    } catch (...) {
        weights_arena_.release();
        throw;
    }
    w_ = bind_weights(cfg_, layout_, weights_arena_.data());
}

int64_t Worker::stage_weights(const TensorIndex & idx, const std::function<void()> & verify_copied) {
    FD_CHECK(weights_arena_.mapped(), "update_weights while the weights are released");
    validate_against_layout(layout_, idx);
    // Every byte of the new weights in memory before anything live changes. A failed read
    // leaves only the staging arena dirty.
    staged_ = false;
    try {
        fill_arena(staging_arena_, idx, /*populate=*/true);
        if (verify_copied) { verify_copied(); }
    } catch (...) {
        drop_staged();
        throw;
    }
    staged_ = true;
    return idx.total_bytes;
}

void Worker::commit_staged() {
    FD_CHECK(staged_, "commit_staged with nothing staged");
    weights_arena_.swap_mapping(staging_arena_);
    w_ = bind_weights(cfg_, layout_, weights_arena_.data());
    staged_ = false;
    if (!wcfg_.keep_update_staging) { staging_arena_.release(); }
}

void Worker::drop_staged() {
    staged_ = false;
    if (!wcfg_.keep_update_staging) { staging_arena_.release(); }
}

kernels::PagedKv Worker::layer_kv(int il) {
    return {k_pool_[il], v_pool_[il], wcfg_.block_size, cfg_.n_kv_heads / wcfg_.tp_size, cfg_.head_dim};
}

bool Worker::forward(const StepBatch & b, float * logits, const std::atomic<bool> * abandon) {
    FD_CHECK(weights_arena_.mapped() && kv_arena_.mapped(), "forward with released weights or KV pool");
    namespace K = kernels;
    // This rank's share of every split dimension (T = 1: the whole model).
    const int64_t T = wcfg_.tp_size, n = b.n_tokens(), h = cfg_.hidden_size;
    const int64_t n_heads = cfg_.n_heads / T, n_kv_heads = cfg_.n_kv_heads / T, q_dim = n_heads * cfg_.head_dim;
    const int64_t kv_dim = n_kv_heads * cfg_.head_dim, qkv_dim = q_dim + 2 * kv_dim, ff = cfg_.intermediate_size / T;
    const int64_t vocab = cfg_.vocab_size / T, vocab0 = wcfg_.rank * vocab;  // this rank's vocab rows
    K::ThreadPool * pool = pool_.get();
    x_.resize(n * h);        // [n, hidden] residual stream
    xn_.resize(n * h);       // [n, hidden] normalized
    qkv_.resize(n * qkv_dim);// [n, q_dim + 2 kv_dim]
    q_.resize(n * q_dim);    // [n, n_heads, head_dim]
    k_.resize(n * kv_dim);   // [n, n_kv_heads, head_dim]
    v_.resize(n * kv_dim);
    att_.resize(n * q_dim);  // [n, n_heads, head_dim]
    ff_.resize(n * 2 * ff);  // [n, 2 * intermediate]  gate | up
    gate_.resize(n * ff);    // [n, intermediate]

    for (int64_t t = 0; t < n; ++t) {
        FD_CHECK(b.tokens[t] >= 0 && b.tokens[t] < cfg_.vocab_size, "token id {} outside vocab", b.tokens[t]);
        FD_CHECK(b.positions[t] < wcfg_.max_model_len, "position {} beyond max_model_len", b.positions[t]);
        const int64_t id = b.tokens[t] - vocab0;
        if (id < 0 || id >= vocab) {  // another rank's vocab row: it adds the embedding
            std::fill_n(&x_[t * h], h, 0.0f);
        } else if (w_.embed.type == K::WType::bf16) {
            K::bf16_to_f32(&x_[t * h], static_cast<const uint16_t *>(w_.embed.w) + id * h, h);
        } else {
            std::memcpy(&x_[t * h], static_cast<const float *>(w_.embed.w) + id * h, sizeof(float) * h);
        }
    }
    if (comm_) { comm_->all_reduce_sum(x_.data(), n * h); }
    const float scale = 1.0f / std::sqrt(static_cast<float>(cfg_.head_dim));
    for (int il = 0; il < cfg_.n_layers; ++il) {
        if (abandon && abandon->load(std::memory_order_relaxed)) { return false; }
        const LayerWeights & L = w_.layers[il];
        // attention
        K::rms_norm(xn_.data(), x_.data(), L.attn_norm, n, h, cfg_.rms_norm_eps);
        linear(qkv_.data(), xn_.data(), L.qkv, L.bqkv, n, qkv_dim, h, pool);
        for (int64_t t = 0; t < n; ++t) {
            const float * row = &qkv_[t * qkv_dim];
            std::memcpy(&q_[t * q_dim], row, sizeof(float) * q_dim);
            std::memcpy(&k_[t * kv_dim], row + q_dim, sizeof(float) * kv_dim);
            std::memcpy(&v_[t * kv_dim], row + q_dim + kv_dim, sizeof(float) * kv_dim);
        }
        if (L.q_norm) {  // Qwen3: RMSNorm over each head of q and k, before RoPE
            K::rms_norm(q_.data(), q_.data(), L.q_norm, n * n_heads, cfg_.head_dim, cfg_.rms_norm_eps);
            K::rms_norm(k_.data(), k_.data(), L.k_norm, n * n_kv_heads, cfg_.head_dim, cfg_.rms_norm_eps);
        }
        K::rope_rotate_half(q_.data(), b.positions.data(), rope_.data(), n, n_heads, cfg_.head_dim);
        K::rope_rotate_half(k_.data(), b.positions.data(), rope_.data(), n, n_kv_heads, cfg_.head_dim);
        const K::PagedKv kv = layer_kv(il);
        K::kv_store(kv, k_.data(), v_.data(), b.slots.data(), n);
        K::attention_paged(att_.data(), q_.data(), b.queries.data(), n, n_heads, kv, scale, pool);
        linear(xn_.data(), att_.data(), L.o, nullptr, n, h, q_dim, pool);
        if (comm_) { comm_->all_reduce_sum(xn_.data(), n * h); }  // row parallel: sum the ranks' partial outputs
        K::add_inplace(x_.data(), xn_.data(), n * h);
        // SwiGLU MLP
        K::rms_norm(xn_.data(), x_.data(), L.mlp_norm, n, h, cfg_.rms_norm_eps);
        linear(ff_.data(), xn_.data(), L.gate_up, nullptr, n, 2 * ff, h, pool);
        for (int64_t t = 0; t < n; ++t) {
            K::silu_mul(&gate_[t * ff], &ff_[t * 2 * ff], &ff_[t * 2 * ff + ff], ff);
        }
        linear(xn_.data(), gate_.data(), L.down, nullptr, n, h, ff, pool);
        if (comm_) { comm_->all_reduce_sum(xn_.data(), n * h); }
        K::add_inplace(x_.data(), xn_.data(), n * h);
    }
    // Final norm and LM head, only for the rows that need logits.
    const int64_t n_logits = static_cast<int64_t>(b.logits_rows.size());
    rows_.resize(n_logits * h);
    for (int64_t i = 0; i < n_logits; ++i) {
        K::rms_norm(&rows_[i * h], &x_[static_cast<int64_t>(b.logits_rows[i]) * h], w_.final_norm, 1, h, cfg_.rms_norm_eps);
    }
    if (!comm_) {
        linear(logits, rows_.data(), w_.lm_head, nullptr, n_logits, vocab, h, pool);
        return true;
    }
    // Column parallel head: this rank's [n_logits, vocab/T], gathered to rank 0 as [T, n_logits,
    // vocab/T] and laid out there as [n_logits, vocab].
    part_.resize(n_logits * vocab);
    linear(part_.data(), rows_.data(), w_.lm_head, nullptr, n_logits, vocab, h, pool);
    gathered_.resize(wcfg_.rank == 0 ? T * n_logits * vocab : 0);
    comm_->gather(part_.data(), n_logits * vocab, gathered_.data());
    if (wcfg_.rank == 0) {
        for (int64_t i = 0; i < n_logits; ++i) {
            for (int64_t r = 0; r < T; ++r) {
                std::memcpy(logits + i * T * vocab + r * vocab, &gathered_[(r * n_logits + i) * vocab], sizeof(float) * vocab);
            }
        }
    }
    return true;
}

}  // namespace fd::model
