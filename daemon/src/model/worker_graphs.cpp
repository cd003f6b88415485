// The Worker's CUDA-graph steps (WorkerConfig::graph_max_batch, --use-cudagraph on cuda): every
// batch-size bucket captured once at construction, replayed for decode steps padded to it.
//
// What keeps a captured graph valid (it holds raw addresses and sizes):
//   - index arrays: the backend's fixed buffers (StepIndex::fixed), uploaded by begin_step()
//     before each replay, outside the graph; attention reads each row's n_ctx from them;
//   - activations: reserved once for the largest bucket (reserve_scratch), never regrown;
//   - weights and KV pool: allocator regions that keep their addresses across release and
//     reacquire (CudaVmmAllocator: sleep unmaps, wakeup maps new memory at the same VA), and
//     commit_staged() copies instead of swapping regions;
//   - norms/biases (small_) and the RoPE table: uploaded once, same size on every bind().
// graph_addresses() records all of them at capture; a step that finds one moved drops the
// graphs and captures again (counted in graph_captures(), logged) rather than replaying stale
// pointers.
//
// Sleep tag cuda_graph (release_graphs): the graphs, their fixed index buffers and the
// activations go back to the device; the next forward() reserves the buffers again (new
// addresses) and every bucket is captured again at its first step, by the same address check.
#include "fd/log.h"
#include "fd/model/graph_plan.h"
#include "fd/model/worker.h"
#include "fd/status.h"

#include <algorithm>
#include <string>

namespace fd::model {

using memory::Tag;

Worker::GraphAddresses Worker::graph_addresses() const {
    return {alloc_->data(Tag::weight), alloc_->data(Tag::kv_cache), rope_.data(), small_.data(), s_.x.data(), s_.xn.data(),
            s_.qkv.data(), s_.q.data(), s_.k.data(), s_.v.data(), s_.att.data(), s_.ff.data(), s_.gate.data(), s_.rows.data(),
            s_.logits.data()};
}

void Worker::capture_graphs() {
    const int32_t max_blocks = (wcfg_.max_model_len + wcfg_.block_size - 1) / wcfg_.block_size;
    backend_->reserve_graph_steps(g_.buckets.back(), std::max(1, max_blocks), wcfg_.block_size);
    if (!backend_->supports_graphs()) {
        log::get("model")->warn("rank={} | TEST: graph steps padded to buckets up to {} and run eagerly ({} backend has no graphs)",
                                wcfg_.rank, g_.buckets.back(), backend_->name());
        return;
    }
    const int64_t before = g_.captures;
    for (size_t k = 0; k < g_.buckets.size(); ++k) { capture_bucket(k); }
    g_.addrs = graph_addresses();
    std::string list;
    for (int32_t b : g_.buckets) { list += (list.empty() ? "" : " ") + std::to_string(b); }
    log::get("model")->info("rank={} | CUDA graphs: {} decode buckets captured ({}), {} activation bytes reserved", wcfg_.rank,
                            g_.captures - before, list, scratch_bytes());
}

int64_t Worker::release_graphs() {
    if (!graphs_on() || !backend_->supports_graphs()) { return 0; }
    backend_->synchronize();
    int64_t freed = backend_->release_graph_steps();
    std::fill(g_.ids.begin(), g_.ids.end(), -1);
    freed += scratch_bytes();
    for (kernels::ScratchBuffer * b : {&s_.x, &s_.xn, &s_.qkv, &s_.q, &s_.k, &s_.v, &s_.att, &s_.ff, &s_.gate, &s_.rows, &s_.logits,
                                       &s_.part, &s_.gathered, &s_.moe_logits, &s_.moe_out, &s_.moe_work, &s_.shared_gu,
                                       &s_.shared_act, &s_.shared_y, &s_.shared_g}) {
        b->reset();
    }
    log::get("model")->info("rank={} | CUDA graphs released: {} bytes (graphs, step index buffers, activations); captured again "
                            "at the next step", wcfg_.rank, freed);
    return freed;
}

void Worker::restore_graph_memory() {
    const int64_t reserve = std::max<int64_t>(wcfg_.reserve_tokens, g_.buckets.back());
    reserve_scratch(reserve, reserve);
    const int32_t max_blocks = (wcfg_.max_model_len + wcfg_.block_size - 1) / wcfg_.block_size;
    backend_->reserve_graph_steps(g_.buckets.back(), std::max(1, max_blocks), wcfg_.block_size);
    g_.addrs = graph_addresses();  // no graph holds the old ones: each bucket captures at its first step
}

void Worker::capture_bucket(size_t k) {
    // An all-padding step: it writes only the scratch slot. Run once eagerly first (module
    // loading, cuBLAS workspaces: nothing may initialise inside a capture), then captured.
    pad_graph_step(StepBatch{}, g_.buckets[k], g_.scratch_slot, g_.scratch_table.data(), &g_.pad);
    const int64_t n = g_.pad.n_tokens();
    backend_->begin_step({g_.pad.tokens.data(), g_.pad.positions.data(), g_.pad.slots.data(), g_.pad.queries.data(), n, true});
    float * out = s_.logits.floats(n * cfg_.vocab_size);
    run_model(g_.pad, out, nullptr);
    backend_->synchronize();
    backend_->begin_capture();
    try {
        run_model(g_.pad, out, nullptr);
        g_.ids[k] = backend_->end_capture();
    } catch (...) {
        backend_->abort_capture();
        throw;
    }
    ++g_.captures;
}

bool Worker::forward_graph(const StepBatch & b, float * logits, const std::atomic<bool> * abandon) {
    if (abandon && abandon->load(std::memory_order_relaxed)) { return false; }
    const int32_t k      = graph_bucket_index(g_.buckets, b.n_tokens());
    const int32_t bucket = g_.buckets[static_cast<size_t>(k)];
    pad_graph_step(b, bucket, g_.scratch_slot, g_.scratch_table.data(), &g_.pad);
    // The indices go to the fixed buffers first (outside the graph), then the graph runs.
    backend_->begin_step({g_.pad.tokens.data(), g_.pad.positions.data(), g_.pad.slots.data(), g_.pad.queries.data(), bucket, true});
    float * out = s_.logits.floats(int64_t{bucket} * cfg_.vocab_size);  // reserved: never moves
    if (backend_->supports_graphs()) {
        if (graph_addresses() != g_.addrs) {
            log::get("model")->warn("rank={} | CUDA graphs: a captured address moved; dropping {} graphs and capturing again",
                                    wcfg_.rank, g_.buckets.size());
            backend_->drop_graphs();
            std::fill(g_.ids.begin(), g_.ids.end(), -1);
            g_.addrs = graph_addresses();
        }
        if (g_.ids[static_cast<size_t>(k)] < 0) {
            capture_bucket(static_cast<size_t>(k));
            g_.addrs = graph_addresses();
            // capture_bucket left the fixed buffers holding its padding step: upload this step's again.
            pad_graph_step(b, bucket, g_.scratch_slot, g_.scratch_table.data(), &g_.pad);
            backend_->begin_step({g_.pad.tokens.data(), g_.pad.positions.data(), g_.pad.slots.data(), g_.pad.queries.data(), bucket, true});
        }
        backend_->replay(g_.ids[static_cast<size_t>(k)]);
    } else {
        run_model(g_.pad, out, nullptr);  // TEST: the padded step, eagerly
    }
    ++g_.steps;
    // Only the real rows' logits come back; the padding rows' are ignored.
    backend_->download(logits, out, b.n_tokens() * cfg_.vocab_size * static_cast<int64_t>(sizeof(float)));
    return true;
}

}  // namespace fd::model
