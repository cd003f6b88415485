// Worker::GraphState — the Worker's CUDA-graph steps, private to the model module (included by
// worker.cpp, forward.cpp and worker_graphs.cpp only; fd/model/worker.h declares it opaque).
// What it holds and how a captured graph stays valid: worker_graphs.cpp.
#pragma once

#include "fd/model/worker.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

namespace fd::model {

struct Worker::GraphState {
    /// Every address a captured graph holds (weights, KV, rope, norms, activations); checked
    /// before each replay, so a fixed array: no allocation per step.
    using Addresses = std::array<const void *, 15>;

    std::vector<int32_t> buckets;        ///< ascending (graph_plan.h), never empty
    std::vector<int32_t> ids;            ///< [buckets] backend graph id per bucket, -1 = none
    Addresses            addrs{};        ///< addresses(w) at capture
    std::vector<int32_t> scratch_table;  ///< {n_blocks}: the padding rows' block table
    int64_t              scratch_slot = 0;
    StepBatch            pad;            ///< the padded step (reused)
    int64_t              captures = 0, steps = 0;

    /// Buckets for decode steps of up to wcfg.graph_max_batch rows; the padding rows write the
    /// extra KV block map_kv_pool adds after wcfg.n_blocks.
    explicit GraphState(const WorkerConfig & wcfg);

    /// The addresses `w`'s graphs hold now.
    static Addresses addresses(const Worker & w);
    /// Reserve the fixed buffers and capture every bucket (an eager warm-up run first).
    void capture_all(Worker & w);
    /// Capture bucket k's graph on an all-padding step.
    void capture_bucket(Worker & w, size_t k);
    /// A graph step (is_graph_step): pad, upload the indices, replay, download n rows of logits.
    /// Shapes  logits [b.logits_rows, vocab] f32 host memory. False when `abandon` fired.
    bool forward(Worker & w, const StepBatch & b, float * logits, const std::atomic<bool> * abandon);
};

}  // namespace fd::model
