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
// GraphState::addresses() records all of them at capture; a step that finds one moved drops the
// graphs and captures again (counted in graph_captures(), logged) rather than replaying stale
// pointers.
//
// Sleep tag cuda_graph (release_graphs): the graphs, their fixed index buffers and the
// activations go back to the device; the next forward() reserves the buffers again (new
// addresses) and every bucket is captured again at its first step, by the same address check.
#include "worker_graphs.h"

#include "fd/log.h"
#include "fd/model/graph_plan.h"
#include "fd/status.h"

#include <algorithm>
#include <string>

namespace fd::model {

using memory::Tag;

Worker::GraphState::GraphState(const WorkerConfig & wcfg)
    : buckets(model::graph_buckets(wcfg.graph_max_batch)), ids(buckets.size(), -1), scratch_table{static_cast<int32_t>(wcfg.n_blocks)},
      scratch_slot(wcfg.n_blocks * wcfg.block_size) {
    FD_CHECK(!buckets.empty(), "graph steps need graph_max_batch > 0 (got {})", wcfg.graph_max_batch);
}

Worker::GraphState::Addresses Worker::GraphState::addresses(const Worker & w) {
    const Worker::Scratch & s = w.s_;
    return {w.alloc_->data(Tag::weight), w.alloc_->data(Tag::kv_cache), w.rope_.data(), w.small_.data(), s.x.data(), s.xn.data(),
            s.qkv.data(), s.q.data(), s.k.data(), s.v.data(), s.att.data(), s.ff.data(), s.gate.data(), s.rows.data(),
            s.logits.data()};
}

void Worker::GraphState::capture_all(Worker & w) {
    const int32_t max_blocks = (w.wcfg_.max_model_len + w.wcfg_.block_size - 1) / w.wcfg_.block_size;
    w.backend_->reserve_graph_steps(buckets.back(), std::max(1, max_blocks), w.wcfg_.block_size);
    if (!w.backend_->supports(kernels::BackendOp::graph_capture, fd::DType::f32)) {
        log::get("model")->warn("rank={} | TEST: graph steps padded to buckets up to {} and run eagerly ({} backend has no graphs)",
                                w.wcfg_.rank, buckets.back(), w.backend_->name());
        return;
    }
    const int64_t before = captures;
    for (size_t k = 0; k < buckets.size(); ++k) { capture_bucket(w, k); }
    addrs = addresses(w);
    std::string list;
    for (int32_t b : buckets) { list += (list.empty() ? "" : " ") + std::to_string(b); }
    log::get("model")->info("rank={} | CUDA graphs: {} decode buckets captured ({}), {} activation bytes reserved", w.wcfg_.rank,
                            captures - before, list, w.scratch_bytes());
}

int64_t Worker::release_graphs() {
    if (!graphs_on() || !backend_->supports_graphs()) { return 0; }
    backend_->synchronize();
    int64_t freed = backend_->release_graph_steps();
    std::fill(g_->ids.begin(), g_->ids.end(), -1);
    freed += scratch_bytes();
    for (kernels::ScratchBuffer * b : activation_buffers()) { b->reset(); }
    log::get("model")->info("rank={} | CUDA graphs released: {} bytes (graphs, step index buffers, activations); captured again "
                            "at the next step", wcfg_.rank, freed);
    return freed;
}

void Worker::restore_graph_memory() {
    const int64_t reserve = std::max<int64_t>(wcfg_.reserve_tokens, g_->buckets.back());
    reserve_scratch(reserve, reserve);
    const int32_t max_blocks = (wcfg_.max_model_len + wcfg_.block_size - 1) / wcfg_.block_size;
    backend_->reserve_graph_steps(g_->buckets.back(), std::max(1, max_blocks), wcfg_.block_size);
    g_->addrs = GraphState::addresses(*this);  // no graph holds the old ones: each bucket captures at its first step
}

void Worker::GraphState::capture_bucket(Worker & w, size_t k) {
    // An all-padding step: it writes only the scratch slot. Run once eagerly first (module
    // loading, cuBLAS workspaces: nothing may initialise inside a capture), then captured.
    pad_graph_step(StepBatch{}, buckets[k], scratch_slot, scratch_table.data(), &pad);
    const int64_t n = pad.n_tokens();
    w.backend_->begin_step({pad.tokens.data(), pad.positions.data(), pad.slots.data(), pad.queries.data(), n, true});
    float * out = w.s_.logits.floats(n * w.cfg_.vocab_size);
    w.run_model(pad, out, nullptr);
    w.backend_->synchronize();
    w.backend_->begin_capture();
    try {
        w.run_model(pad, out, nullptr);
        ids[k] = w.backend_->end_capture();
    } catch (...) {
        w.backend_->abort_capture();
        throw;
    }
    ++captures;
}

bool Worker::GraphState::forward(Worker & w, const StepBatch & b, float * logits, const std::atomic<bool> * abandon) {
    if (abandon && abandon->load(std::memory_order_relaxed)) { return false; }
    kernels::Backend & be     = *w.backend_;
    const int32_t      k      = graph_bucket_index(buckets, b.n_tokens());
    const int32_t      bucket = buckets[static_cast<size_t>(k)];
    pad_graph_step(b, bucket, scratch_slot, scratch_table.data(), &pad);
    // The indices go to the fixed buffers first (outside the graph), then the graph runs.
    be.begin_step({pad.tokens.data(), pad.positions.data(), pad.slots.data(), pad.queries.data(), bucket, true});
    float * out = w.s_.logits.floats(int64_t{bucket} * w.cfg_.vocab_size);  // reserved: never moves
    if (be.supports(kernels::BackendOp::graph_capture, fd::DType::f32)) {
        if (addresses(w) != addrs) {
            log::get("model")->warn("rank={} | CUDA graphs: a captured address moved; dropping {} graphs and capturing again",
                                    w.wcfg_.rank, buckets.size());
            be.drop_graphs();
            std::fill(ids.begin(), ids.end(), -1);
            addrs = addresses(w);
        }
        if (ids[static_cast<size_t>(k)] < 0) {
            capture_bucket(w, static_cast<size_t>(k));
            addrs = addresses(w);
            // capture_bucket left the fixed buffers holding its padding step: upload this step's again.
            pad_graph_step(b, bucket, scratch_slot, scratch_table.data(), &pad);
            be.begin_step({pad.tokens.data(), pad.positions.data(), pad.slots.data(), pad.queries.data(), bucket, true});
        }
        be.replay(ids[static_cast<size_t>(k)]);
    } else {
        w.run_model(pad, out, nullptr);  // TEST: the padded step, eagerly
    }
    ++steps;
    // Only the real rows' logits come back; the padding rows' are ignored.
    be.download(logits, out, b.n_tokens() * w.cfg_.vocab_size * static_cast<int64_t>(sizeof(float)));
    return true;
}

// ---- the Worker's public graph counters ----

const std::vector<int32_t> & Worker::graph_buckets() const {
    static const std::vector<int32_t> none;
    return g_ ? g_->buckets : none;
}

int64_t Worker::graph_captures() const { return g_ ? g_->captures : 0; }

int64_t Worker::graph_steps() const { return g_ ? g_->steps : 0; }

}  // namespace fd::model
