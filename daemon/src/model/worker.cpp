// The rank Worker: loading, the tagged regions (weights, staging, KV pool) and weight control.
// The forward pass itself is in forward.cpp.
#include "fd/model/worker.h"
#include "worker_graphs.h"

#include "fd/arena.h"
#include "fd/log.h"
#include "fd/model/graph_plan.h"
#include "fd/comm/comm.h"
#include "fd/status.h"
#include "fd/stream/landing.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

namespace fd::model {

using memory::Tag;

int64_t Worker::kv_block_bytes(const ModelConfig & c, int32_t block_size, int32_t tp_size, kernels::WType kv_dtype) {
    return 2LL * c.n_layers * block_size * (c.kv_dim() / std::max(1, tp_size)) * kernels::kv_elem_bytes(kv_dtype);
}

int64_t Worker::mtp_block_bytes(const ModelConfig & c, int32_t block_size, int32_t tp_size) {
    return 2LL * block_size * (c.kv_dim() / std::max(1, tp_size)) * static_cast<int64_t>(sizeof(float));
}

int64_t Worker::swap_block_bytes(const ModelConfig & c, int32_t block_size, int32_t tp_size, kernels::WType kv_dtype, bool mtp) {
    return kv_block_bytes(c, block_size, tp_size, kv_dtype) + (mtp ? mtp_block_bytes(c, block_size, tp_size) : 0);
}

namespace {

/// Every matrix of the layout (dtype in memory) is one the backend's kernels read: asked of the
/// backend (Backend::supports), not assumed from the device kind.
/// Errors  fd::Error{invalid_checkpoint} naming the tensor, its dtype, the op and the backend.
void check_backend_supports(const kernels::Backend & be, const WeightLayout & layout) {
    for (const InferenceTensor & t : layout.tensors) {
        if (t.shape.size() < 2) { continue; }  // norms and biases: widened to f32 at bind
        const kernels::BackendOp op = t.name.find("embed_tokens") != std::string::npos ? kernels::BackendOp::embedding
                                    : t.name.find(".experts.") != std::string::npos  ? kernels::BackendOp::moe_experts
                                                                                     : kernels::BackendOp::linear;
        if (!be.supports(op, t.dtype)) {
            fail(Errc::invalid_checkpoint, "tensor '{}' is {} in memory, which the {} backend's {} does not read", t.name,
                 fd::dtype_name(t.dtype), be.name(), kernels::backend_op_name(op));
        }
    }
}

}  // namespace

Worker::Worker(const ModelConfig & cfg, const TensorIndex & given, const WorkerConfig & wcfg, comm::Comm * comm)
    : cfg_(cfg), wcfg_(wcfg) {
    TensorIndex renamed;  // transformers v5 Mixtral names → the layout's (fd/checkpoint/layout.h)
    const TensorIndex & idx = with_v4_names(cfg_, given, renamed);
    FD_CHECK(wcfg.n_blocks > 0 && wcfg.block_size > 0, "worker needs KV blocks ({} x {})", wcfg.n_blocks, wcfg.block_size);
    check_tp_divides(cfg_, wcfg.tp_size, wcfg.ep_size);
    if (wcfg.ep_size > 1 && wcfg.ep_size != wcfg.tp_size) {
        fail(Errc::invalid_argument, "expert parallel size {} must equal the tensor parallel size {}", wcfg.ep_size, wcfg.tp_size);
    }
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
    layout_ = plan_layout(cfg_, idx, {wcfg.rank, wcfg.tp_size, wcfg.ep_size});
    validate_against_layout(layout_, idx, &cfg_);
    backend_ = kernels::make_backend({.kind = wcfg.device, .n_threads = std::max(1, wcfg.n_threads), .device_id = wcfg.device_id,
                                      .batch_invariant = wcfg.batch_invariant, .compute = wcfg.compute});
    check_backend_supports(*backend_, layout_);
    alloc_   = memory::make_allocator(backend_->kind(), wcfg.device_id);
    device_mem_ = !backend_->host_visible() || wcfg.test_device_paths;
    for (kernels::ScratchBuffer * b : {&s_.x, &s_.xn, &s_.qkv, &s_.q, &s_.k, &s_.v, &s_.att, &s_.ff, &s_.gate, &s_.rows,
                                       &s_.logits, &s_.part, &s_.gathered, &rope_, &small_, &s_.moe_logits, &s_.moe_out,
                                       &s_.moe_work, &s_.shared_gu, &s_.shared_act, &s_.shared_y, &s_.shared_g, &s_.hidden,
                                       &s_.mtp_in, &s_.mtp_cat, &s_.mtp_out, &s_.mtp_cur, &s_.mtp_logits}) {
        *b = kernels::ScratchBuffer(backend_.get());
    }
    if (wcfg.graph_max_batch > 0 && wcfg.tp_size == 1 && cfg_.moe.enabled()) {
        log::get("model")->warn("--use-cudagraph: {} routes tokens on the host between ops, which a graph cannot capture; its "
                                "decode steps run eagerly", cfg_.architecture);
    }
    if (wcfg.mtp_draft_tokens > 0 && cfg_.n_mtp_layers < 1) {
        fail(Errc::invalid_argument, "MTP drafts need a checkpoint with MTP layers (num_nextn_predict_layers >= 1, has {})",
             cfg_.n_mtp_layers);
    }
    if (wcfg.graph_max_batch > 0 && wcfg.mtp_draft_tokens > 0) {
        log::get("model")->warn("--use-cudagraph with MTP speculation: every step runs eagerly (the draft layer reads every row's hidden state)");
    }
    if (wcfg.graph_max_batch > 0 && wcfg.tp_size == 1 && !cfg_.moe.enabled() && wcfg.mtp_draft_tokens == 0) {
        g_ = std::make_unique<GraphState>(wcfg);
    }
    const int64_t reserve = std::max<int64_t>(wcfg.reserve_tokens, graphs_on() ? g_->buckets.back() : 0);
    if (reserve > 0) { reserve_scratch(reserve, reserve); }
    fill_region(Tag::weight, idx, /*populate=*/false);
    bind();
    map_kv_pool(/*fresh=*/true);
    map_mtp_cache(/*fresh=*/true);
    map_swap_pool(/*fresh=*/true);
    if (wcfg.n_swap_blocks > 0) {
        const char * delay_ms = std::getenv("FD_TEST_KV_COPY_DELAY_MS");  // TEST ONLY (kv_copier.h)
        copier_ = std::make_unique<KvCopier>(backend_.get(), delay_ms ? std::atof(delay_ms) / 1000.0 : 0.0);
    }
    std::vector<float> rope(static_cast<size_t>(wcfg.max_model_len) * cfg_.head_dim);  // [max_model_len, head_dim]
    kernels::rope_table_inv_freq(rope.data(), wcfg.max_model_len, cfg_.head_dim, rope_inv_freq(cfg_).data());
    backend_->upload(rope_.floats(static_cast<int64_t>(rope.size())), rope.data(), static_cast<int64_t>(rope.size() * sizeof(float)));
    if (graphs_on()) { g_->capture_all(*this); }
    log::get("model")->info("rank={}/{} | {} backend{}, {} allocator | weights {:.1f} MiB, KV pool {} blocks x {} tokens = {} tokens, {} "
                            "bytes per token ({} KV) = {:.1f} MiB, {} threads",
                            wcfg.rank, wcfg.tp_size, backend_->name(), device_mem_ && backend_->host_visible() ? " (TEST: device-memory paths)" : "",
                            alloc_->name(), weight_bytes() / 1048576.0, wcfg.n_blocks, wcfg.block_size, wcfg.n_blocks * wcfg.block_size,
                            kv_block_bytes(cfg_, 1, wcfg.tp_size, wcfg.kv_dtype), wcfg.kv_dtype == kernels::WType::bf16 ? "bfloat16" : "float32",
                            kv_bytes() / 1048576.0, backend_->host_pool()->n_threads());
    if (wcfg.n_swap_blocks > 0) {
        // The pool's bytes as /health kv_host_tier.capacity_bytes counts them (blocks x block bytes),
        // not the mapping's (rounded up to whole huge pages: 12.0 MiB logged for a 10.2 MiB pool).
        log::get("model")->info("rank={}/{} | host KV swap pool {} blocks x {} bytes = {:.1f} MiB", wcfg.rank, wcfg.tp_size,
                                wcfg.n_swap_blocks, host_block_bytes(), wcfg.n_swap_blocks * host_block_bytes() / 1048576.0);
    }
}

Worker::~Worker() = default;  // here, where GraphState is complete

int64_t Worker::weight_bytes() const {
    return alloc_->resident(Tag::weight) ? (layout_.arena_bytes + 63) / 64 * 64 : 0;
}

std::byte * Worker::region(Tag tag, int64_t bytes, bool populate) {
    if (alloc_->capacity_bytes(tag) >= bytes) { return alloc_->reacquire(tag, populate); }
    return alloc_->map(tag, bytes, populate);
}

void Worker::map_kv_pool(bool fresh) {
    // 64-byte aligned per layer and K/V, as the bump arena laid them out. Graph steps: one more
    // block, the padding rows' scratch slot (block id n_blocks: the engine never hands it out).
    const int64_t n_blocks  = wcfg_.n_blocks + (graphs_on() ? 1 : 0);
    const int64_t per_layer = n_blocks * block_bytes();
    const int64_t stride    = (per_layer + 63) / 64 * 64;
    const int64_t bytes     = 2 * cfg_.n_layers * stride;
    std::byte *   base      = fresh ? alloc_->map(Tag::kv_cache, bytes, /*populate=*/true) : region(Tag::kv_cache, bytes, true);
    k_pool_.clear();
    v_pool_.clear();
    for (int il = 0; il < cfg_.n_layers; ++il) {
        k_pool_.push_back(base + (2 * il) * stride);
        v_pool_.push_back(base + (2 * il + 1) * stride);
    }
}

void Worker::map_mtp_cache(bool fresh) {
    if (wcfg_.mtp_draft_tokens <= 0) { return; }
    const int64_t n_blocks = wcfg_.n_blocks + wcfg_.mtp_scratch_blocks;
    const int64_t stride   = Arena::footprint_floats(n_blocks * wcfg_.block_size * static_cast<int64_t>(cfg_.kv_dim() / wcfg_.tp_size));
    std::byte *   base     = fresh ? alloc_->map(Tag::mtp_cache, 2 * stride, /*populate=*/true)
                                   : region(Tag::mtp_cache, 2 * stride, /*populate=*/true);
    mtp_k_ = reinterpret_cast<float *>(base);
    mtp_v_ = reinterpret_cast<float *>(base + stride);
}

void Worker::map_swap_pool(bool fresh) {
    if (wcfg_.n_swap_blocks <= 0) { return; }
    // Pre-faulted: the pool is really held (RSS shows it) and a swap-out never page-faults.
    const int64_t bytes = wcfg_.n_swap_blocks * host_block_bytes();
    if (fresh) {
        alloc_->map(Tag::kv_swap, bytes, /*populate=*/true);
    } else {
        region(Tag::kv_swap, bytes, /*populate=*/true);
    }
}

void Worker::check_copies(const kv::BlockCopy * copies, int64_t n, bool out) const {
    FD_CHECK(alloc_->resident(Tag::kv_cache) && alloc_->resident(Tag::kv_swap), "KV swap with a released KV or swap pool");
    FD_CHECK(wcfg_.mtp_draft_tokens <= 0 || alloc_->resident(Tag::mtp_cache), "KV swap with a released MTP cache");
    const int64_t n_src = out ? wcfg_.n_blocks : wcfg_.n_swap_blocks, n_dst = out ? wcfg_.n_swap_blocks : wcfg_.n_blocks;
    for (int64_t i = 0; i < n; ++i) {
        FD_CHECK(copies[i].src >= 0 && copies[i].src < n_src && copies[i].dst >= 0 && copies[i].dst < n_dst,
                 "KV swap {} block {} -> {} outside the pools ({} device, {} host blocks)", out ? "out" : "in", copies[i].src,
                 copies[i].dst, wcfg_.n_blocks, wcfg_.n_swap_blocks);
    }
}

void Worker::wait_copies() {
    if (!copier_) { return; }
    const double timeout_s = wcfg_.io_timeout_s > 0 ? wcfg_.io_timeout_s : 300.0;
    if (!copier_->wait(timeout_s)) {
        fail(Errc::timeout, "rank {}: {} background KV copy batch(es) to the host tier did not land within {:.1f} s", wcfg_.rank,
             copier_->n_in_flight(), timeout_s);
    }
}

void Worker::swap_out_background(const kv::BlockCopy * copies, int64_t n) {
    if (n == 0) { return; }
    check_copies(copies, n, true);
    FD_CHECK(copier_ != nullptr, "background KV copies without a swap pool");
    const int64_t bf = block_bytes(), bytes = bf, mb = mtp_half_block_bytes(), hb = host_block_bytes();
    std::byte * host = alloc_->data(Tag::kv_swap);
    std::vector<KvCopier::Piece> pieces;
    pieces.reserve(static_cast<size_t>(n * (2 * cfg_.n_layers + 2)));
    for (int64_t i = 0; i < n; ++i) {
        std::byte * dst = host + static_cast<int64_t>(copies[i].dst) * hb;
        for (int il = 0; il < cfg_.n_layers; ++il) {
            pieces.push_back({dst + (2 * il) * bf, k_pool_[il] + copies[i].src * bf, bytes});
            pieces.push_back({dst + (2 * il + 1) * bf, v_pool_[il] + copies[i].src * bf, bytes});
        }
        if (mb > 0) {  // the MTP cache's K and V of the block, after the target's layers
            std::byte * m = dst + 2 * cfg_.n_layers * bf;
            pieces.push_back({m, reinterpret_cast<const std::byte *>(mtp_k_) + copies[i].src * mb, mb});
            pieces.push_back({m + mb, reinterpret_cast<const std::byte *>(mtp_v_) + copies[i].src * mb, mb});
        }
    }
    copier_->start_download(std::move(pieces));
}

// The swap pool is host memory; the KV pool is the backend's (download / upload: memcpy on the CPU).
void Worker::swap_out(const kv::BlockCopy * copies, int64_t n) {
    wait_copies();  // (a block a background copy reads may be the one written next)
    if (n == 0) { return; }
    check_copies(copies, n, true);
    const int64_t bf = block_bytes(), bytes = bf, mb = mtp_half_block_bytes(), hb = host_block_bytes();
    std::byte * host = alloc_->data(Tag::kv_swap);
    for (int64_t i = 0; i < n; ++i) {
        std::byte * dst = host + static_cast<int64_t>(copies[i].dst) * hb;
        for (int il = 0; il < cfg_.n_layers; ++il) {
            backend_->download(dst + (2 * il) * bf, k_pool_[il] + copies[i].src * bf, bytes);
            backend_->download(dst + (2 * il + 1) * bf, v_pool_[il] + copies[i].src * bf, bytes);
        }
        if (mb > 0) {  // the MTP cache's K and V of the block: the draft KV travels with the target's
            std::byte * m = dst + 2 * cfg_.n_layers * bf;
            backend_->download(m, reinterpret_cast<const std::byte *>(mtp_k_) + copies[i].src * mb, mb);
            backend_->download(m + mb, reinterpret_cast<const std::byte *>(mtp_v_) + copies[i].src * mb, mb);
        }
    }
}

void Worker::swap_in(const kv::BlockCopy * copies, int64_t n) {
    wait_copies();
    if (n == 0) { return; }
    check_copies(copies, n, false);
    const int64_t bf = block_bytes(), bytes = bf, mb = mtp_half_block_bytes(), hb = host_block_bytes();
    const std::byte * host = alloc_->data(Tag::kv_swap);
    for (int64_t i = 0; i < n; ++i) {
        const std::byte * src = host + static_cast<int64_t>(copies[i].src) * hb;
        for (int il = 0; il < cfg_.n_layers; ++il) {
            backend_->upload(k_pool_[il] + copies[i].dst * bf, src + (2 * il) * bf, bytes);
            backend_->upload(v_pool_[il] + copies[i].dst * bf, src + (2 * il + 1) * bf, bytes);
        }
        if (mb > 0) {
            const std::byte * m = src + 2 * cfg_.n_layers * bf;
            backend_->upload(reinterpret_cast<std::byte *>(mtp_k_) + copies[i].dst * mb, m, mb);
            backend_->upload(reinterpret_cast<std::byte *>(mtp_v_) + copies[i].dst * mb, m + mb, mb);
        }
    }
}

int64_t Worker::release_swap() { return alloc_->release(Tag::kv_swap); }

void Worker::fill_region(Tag tag, const TensorIndex & idx, bool populate, const WeightLayout & layout) {
    std::byte * base = region(tag, layout_.arena_bytes, populate);
    fill_weights(layout, idx, base, backend_->host_pool(),
                 {.check_finite = wcfg_.check_finite_weights, .timeout_s = wcfg_.io_timeout_s,
                  .upload_to = device_mem_ ? backend_.get() : nullptr});
}

void Worker::bind() {
    w_ = device_mem_ ? bind_weights(cfg_, layout_, alloc_->data(Tag::weight), backend_.get(), &small_)
                     : bind_weights(cfg_, layout_, alloc_->data(Tag::weight));
}

// The sizes forward() asks of each buffer (kept in step with it; test_worker_device_paths checks
// that a reserved Worker's buffers never grow).
void Worker::reserve_scratch(int64_t n, int64_t n_logits) {
    const int64_t T = wcfg_.tp_size, h = cfg_.hidden_size, hd = cfg_.head_dim;
    const int64_t q_dim = cfg_.n_heads / T * hd, kv_dim = cfg_.n_kv_heads / T * hd, ff = cfg_.intermediate_size / T;
    const int64_t vocab = cfg_.vocab_size / T;
    s_.x.floats(n * h);
    s_.xn.floats(n * h);
    s_.qkv.floats(n * (q_dim + 2 * kv_dim));
    s_.q.floats(n * q_dim);
    s_.k.floats(n * kv_dim);
    s_.v.floats(n * kv_dim);
    s_.att.floats(n * q_dim);
    s_.ff.floats(n * 2 * ff);
    s_.gate.floats(n * ff);
    s_.rows.floats(n_logits * h);
    if (device_mem_ || graphs_on()) { s_.logits.floats(n_logits * cfg_.vocab_size); }
    if (T > 1) {
        s_.part.floats(n_logits * vocab);
        s_.gathered.floats(wcfg_.rank == 0 ? T * n_logits * vocab : 0);
    }
}

/// Every buffer of a Worker's Scratch, const or not (one list for activation_buffers and
/// scratch_bytes).
template <class S> static auto buffers_of(S & s) -> std::array<decltype(&s.x), 20> {
    return {&s.x,        &s.xn,      &s.qkv,       &s.q,       &s.k,         &s.v,          &s.att,
            &s.ff,       &s.gate,    &s.rows,      &s.logits,  &s.part,      &s.gathered,   &s.moe_logits,
            &s.moe_out,  &s.moe_work, &s.shared_gu, &s.shared_act, &s.shared_y, &s.shared_g};
}

std::array<kernels::ScratchBuffer *, 20> Worker::activation_buffers() { return buffers_of(s_); }

int64_t Worker::scratch_bytes() const {
    int64_t sum = 0;
    for (const kernels::ScratchBuffer * b : buffers_of(s_)) { sum += b->capacity_bytes(); }
    return sum;
}

int64_t Worker::release_activations() {
    const int64_t activations = scratch_bytes();
    for (kernels::ScratchBuffer * b : activation_buffers()) { b->reset(); }
    const int64_t kernel_scratch = backend_->release_scratch();
    log::get("model")->info("rank={} | weight sleep: {} bytes of activation buffers and {} bytes of kernel scratch freed too (grown "
                            "again by the next step)",
                            wcfg_.rank, activations, kernel_scratch);
    return activations + kernel_scratch;
}

int64_t Worker::release_weights() {
    stop_landing();
    w_ = ModelWeights{};
    staged_  = false;
    buckets_ = {};
    int64_t freed = alloc_->release(Tag::weight) + alloc_->release(Tag::staging);
    // The delta buffers kept from one update to the next (undo values, plan, the delta file's copy) go with the
    // weights they were for; the next delta grows them again.
    freed += delta_old_bytes_;
    delta_undo_ = {};
    delta_old_.reset();
    delta_old_bytes_ = 0;
    freed += delta_file_.release();
    freed += land_delta_buf_.release();
    // No step runs until the weights are back: the step buffers go too, unless captured graphs
    // hold their addresses (those go with the cuda_graph tag, release_graphs).
    if (!graphs_on()) { freed += release_activations(); }
    return freed;
}

int64_t Worker::release(Tag tag) {
    if (tag == Tag::kv_cache || tag == Tag::kv_swap) { wait_copies(); }  // never unmap under a copy
    switch (tag) {
    case Tag::weight: return release_weights();
    case Tag::kv_cache: return release_kv();
    case Tag::staging: stop_landing(); staged_ = false; buckets_ = {}; return alloc_->release(Tag::staging);
    case Tag::kv_swap: return release_swap();
    case Tag::mtp_cache: mtp_k_ = mtp_v_ = nullptr; return alloc_->release(Tag::mtp_cache);
    case Tag::ep_buffer: return alloc_->release(Tag::ep_buffer);  // the next MoE step maps it again
    }
    return 0;
}

int64_t Worker::release_kv() {
    k_pool_.clear();
    v_pool_.clear();
    int64_t freed = alloc_->release(Tag::kv_cache);
    if (wcfg_.mtp_draft_tokens > 0) { freed += release(Tag::mtp_cache); }  // the draft layer's KV goes with the target's
    return freed;
}

void Worker::acquire_kv() {
    if (!alloc_->resident(Tag::kv_cache)) { map_kv_pool(/*fresh=*/false); }
    if (wcfg_.mtp_draft_tokens > 0 && !alloc_->resident(Tag::mtp_cache)) { map_mtp_cache(/*fresh=*/false); }
    if (wcfg_.n_swap_blocks > 0 && !alloc_->resident(Tag::kv_swap)) { map_swap_pool(/*fresh=*/false); }
}

void Worker::reload_weights(const TensorIndex & given, const std::function<void()> & verify_copied) {
    TensorIndex renamed;
    const TensorIndex & idx = with_v4_names(cfg_, given, renamed);
    validate_against_layout(layout_, idx, &cfg_);
    delta_undo_ = {};
    try {
        fill_region(Tag::weight, idx, /*populate=*/false);
        if (verify_copied) { verify_copied(); }
        // Expert parallel: the dispatch/combine buffers come back with the weights (same size).
        if (alloc_->capacity_bytes(Tag::ep_buffer) > 0) { alloc_->reacquire(Tag::ep_buffer, /*populate=*/true); }
    } catch (...) {
        alloc_->release(Tag::weight);
        alloc_->release(Tag::ep_buffer);
        throw;
    }
    bind();
}

int64_t Worker::stage_weights(const TensorIndex & given, const std::function<void()> & verify_copied) {
    FD_CHECK(alloc_->resident(Tag::weight), "update_weights while the weights are released");
    TensorIndex renamed;
    const TensorIndex & idx = with_v4_names(cfg_, given, renamed);
    validate_against_layout(layout_, idx, &cfg_);
    // Every byte of the new weights in memory before anything live changes. A failed read
    // leaves only the staging region dirty.
    stop_landing();
    staged_ = false;
    delta_undo_ = {};
    const bool ahead = staged_by_buckets(idx);  // a stream's buckets, staged as they arrived
    if (ahead) {
        log::get("model")->info("rank={} | update_weights: all {} tensors were staged bucket by bucket as the stream arrived; no second copy",
                                wcfg_.rank, idx.tensors.size());
    }
    buckets_ = {};
    try {
        if (!ahead) { fill_region(Tag::staging, idx, /*populate=*/true); }
        if (verify_copied) { verify_copied(); }
    } catch (...) {
        drop_staged();
        throw;
    }
    staged_ = true;
    return idx.total_bytes;
}

bool Worker::staged_by_buckets(const TensorIndex & idx) const {
    if (buckets_.tensors.size() != idx.tensors.size() || buckets_.tensors.empty()) { return false; }
    for (const auto & [name, t] : idx.tensors) {
        const auto it = buckets_.tensors.find(name);
        if (it == buckets_.tensors.end()) { return false; }
        const TensorInfo & b = it->second;
        if (b.file != t.file || b.file_dev != t.file_dev || b.file_ino != t.file_ino || b.file_dev == 0 || b.offset_bytes != t.offset_bytes ||
            b.size_bytes != t.size_bytes || b.dtype != t.dtype || b.shape != t.shape || t.on_cuda_ipc) {
            return false;
        }
    }
    return true;
}

int64_t Worker::stage_bucket(const TensorIndex & given) {
    FD_CHECK(alloc_->resident(Tag::weight), "update_weights while the weights are released");
    TensorIndex renamed;
    const TensorIndex & idx = with_v4_names(cfg_, given, renamed);
    if (idx.tensors.empty()) { return 0; }
    const std::filesystem::path dir = idx.tensors.begin()->second.file.parent_path();
    stop_landing();
    if (staged_ || buckets_.dir != dir) {  // a new update: what was staged before is not its
        staged_  = false;
        buckets_ = {};
        buckets_.dir = dir;
    }
    // The layout's part of this bucket: the tensors it holds in inference form, the parts it holds of the others.
    WeightLayout part = layout_;
    part.tensors.clear();
    for (const InferenceTensor & t : layout_.tensors) {
        if (holds_inference_form(t, idx)) {
            part.tensors.push_back(t);
            continue;
        }
        InferenceTensor some = t;
        some.parts.clear();
        for (const WeightPart & p : t.parts) {
            if (idx.tensors.count(p.hf_name)) { some.parts.push_back(p); }
        }
        if (!some.parts.empty()) { part.tensors.push_back(std::move(some)); }
    }
    try {
        validate_against_layout(part, idx, &cfg_);
        for (const auto & [name, t] : idx.tensors) {
            if (buckets_.tensors.count(name)) { fail(Errc::invalid_checkpoint, "tensor '{}' was staged by an earlier bucket", name); }
        }
        fill_region(Tag::staging, idx, /*populate=*/buckets_.tensors.empty(), part);
    } catch (...) {
        buckets_ = {};
        throw;
    }
    for (const auto & [name, t] : idx.tensors) { buckets_.tensors.emplace(name, t); }
    return idx.total_bytes;
}

void Worker::commit_staged() {
    FD_CHECK(staged_, "commit_staged with nothing staged");
    if (graphs_on()) {
        // Captured graphs hold the weights' addresses: copy staging into the weight region
        // (device to device, at memory bandwidth) instead of swapping the regions. Both are
        // resident and validated, so only a device fault can fail it (then nothing serves).
        backend_->copy(alloc_->data(Tag::weight), alloc_->data(Tag::staging), layout_.arena_bytes);
        backend_->synchronize();
    } else {
        alloc_->swap(Tag::weight, Tag::staging);
    }
    bind();
    staged_  = false;
    buckets_ = {};
    if (!wcfg_.keep_update_staging) { alloc_->release(Tag::staging); }
}

void Worker::drop_staged() {
    stop_landing();
    staged_  = false;
    buckets_ = {};
    if (!wcfg_.keep_update_staging) { alloc_->release(Tag::staging); }
}

}  // namespace fd::model

