// The Worker's graph steps (daemon/src/model/worker_graphs.cpp) on the CPU backend, where
// WorkerConfig::graph_max_batch pads decode steps to their bucket and runs them eagerly (TEST
// ONLY: the CPU has no graphs). The reference is an eager Worker of the same build without it:
// every step's logits bitwise equal for steps padded 1 -> 1, 2 -> 2, 3 -> 4 and 5 -> 8 rows (CPU
// ops are batch-invariant, so padding rows change nothing); padding rows write only the extra
// scratch block, never a live block (the live KV blocks are bitwise the eager Worker's); a prefill
// step runs eagerly; update (stage + commit) copies staging into the weights, keeping the weight
// region's address, and gives the new weights' logits; sleep/wakeup keeps the addresses too.
// The same checks with real capture/replay are tests/gpu/test_cuda_graph.cpp.
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/model/worker.h"
#include "graph_test_util.h"
#include "../unit/test_util.h"

#include <doctest/doctest.h>

#include <filesystem>
#include <vector>

namespace fs = std::filesystem;
using namespace fd;

namespace {

const fs::path    kStories = fs::path(FD_SOURCE_DIR) / "models" / "stories260K";
constexpr int32_t kBlock = 4, kBlocksPerSeq = 8, kBlocks = 64;

model::WorkerConfig wcfg(int32_t graph_max_batch) {
    model::WorkerConfig w{.n_threads = 2, .block_size = kBlock, .n_blocks = kBlocks, .max_model_len = kBlock * kBlocksPerSeq};
    w.graph_max_batch = graph_max_batch;
    return w;
}

}  // namespace

TEST_CASE("graph steps padded to buckets 1/2/4/8 give the eager logits bitwise and leave live KV alone") {
    const auto cfg = model::load_model_config(kStories);
    const auto idx = model::read_tensor_index(kStories);
    model::Worker g(cfg, idx, wcfg(8)), e(cfg, idx, wcfg(0));
    CHECK(g.graph_buckets() == std::vector<int32_t>{1, 2, 4, 8});
    CHECK(e.graph_buckets().empty());
    CHECK(g.graph_captures() == 0);  // no graphs on the CPU: padded, eager
    int64_t steps = 0;
    for (const int32_t n : {1, 2, 3, 5}) {
        CAPTURE(n);
        const auto want = test::decode_steps(e, n, 6, kBlock, kBlocksPerSeq);
        const auto got  = test::decode_steps(g, n, 6, kBlock, kBlocksPerSeq);
        steps += 6;
        CHECK(g.graph_steps() == steps);
        CHECK(test::bits_equal(want, got));
        CHECK(test::bits_equal(test::live_kv(e, kBlocks, kBlocks, kBlock), test::live_kv(g, kBlocks, kBlocks + 1, kBlock)));
    }
    CHECK(e.graph_steps() == 0);
    // The padding rows did write: the scratch block (block kBlocks, after the live ones) is not zero.
    const auto all = test::live_kv(g, kBlocks + 1, kBlocks + 1, kBlock);
    bool scratch_written = false;
    const int64_t blk = int64_t{kBlock} * cfg.kv_dim();
    for (int64_t i = kBlocks * blk; i < (kBlocks + 1) * blk; ++i) { scratch_written = scratch_written || all[i] != 0.0f; }
    CHECK(scratch_written);
    // A prefill (several tokens of one sequence) is not a graph step.
    model::StepBatch pf;
    std::vector<int32_t> table = {40, 41};
    for (int32_t p = 0; p < 5; ++p) {
        pf.tokens.push_back(p + 1);
        pf.positions.push_back(p);
        pf.slots.push_back(int64_t{table[p / kBlock]} * kBlock + p % kBlock);
        pf.queries.push_back({table.data(), p + 1});
    }
    pf.logits_rows.push_back(4);
    std::vector<float> logits(static_cast<size_t>(cfg.vocab_size));
    REQUIRE(g.forward(pf, logits.data()));
    CHECK(g.graph_steps() == steps);
}

TEST_CASE("graph steps: update commits by copy (weight address kept) and sleep/wakeup keeps addresses; new weights served") {
    test::TempDir d;
    test::make_random_checkpoint(d.path / "a", "--preset tiny-llama-bf16-sharded");
    test::make_random_checkpoint(d.path / "b", "--preset tiny-llama-bf16-sharded --seed 9");
    const auto cfg   = model::load_model_config(d.path / "a");
    const auto idx_a = model::read_tensor_index(d.path / "a"), idx_b = model::read_tensor_index(d.path / "b");
    model::Worker g(cfg, idx_a, wcfg(4)), e(cfg, idx_a, wcfg(0)), ref_b(cfg, idx_b, wcfg(0));
    const std::byte * weights = g.allocator().data(memory::Tag::weight);
    const std::byte * kv      = g.allocator().data(memory::Tag::kv_cache);
    const auto a0 = test::decode_steps(e, 3, 5, kBlock, kBlocksPerSeq);
    CHECK(test::bits_equal(a0, test::decode_steps(g, 3, 5, kBlock, kBlocksPerSeq)));

    g.stage_weights(idx_b);
    g.commit_staged();
    CHECK(g.allocator().data(memory::Tag::weight) == weights);
    const auto b0 = test::decode_steps(ref_b, 3, 5, kBlock, kBlocksPerSeq);
    CHECK_FALSE(test::bits_equal(a0, b0));  // the two checkpoints differ
    CHECK(test::bits_equal(b0, test::decode_steps(g, 3, 5, kBlock, kBlocksPerSeq)));
    // A second update through the kept staging region, back to a.
    g.stage_weights(idx_a);
    g.commit_staged();
    CHECK(g.allocator().data(memory::Tag::weight) == weights);
    CHECK(test::bits_equal(a0, test::decode_steps(g, 3, 5, kBlock, kBlocksPerSeq)));

    // Sleep both tags, wake kv_cache first (the --use-cudagraph rule), then the weights (b).
    CHECK(g.release(memory::Tag::weight) > 0);
    CHECK(g.release(memory::Tag::kv_cache) > 0);
    g.acquire_kv();
    g.reload_weights(idx_b);
    CHECK(g.allocator().data(memory::Tag::weight) == weights);
    CHECK(g.allocator().data(memory::Tag::kv_cache) == kv);
    CHECK(test::bits_equal(b0, test::decode_steps(g, 3, 5, kBlock, kBlocksPerSeq)));
    CHECK(g.graph_captures() == 0);

    // Weights first, then kv_cache (SGLang's staged resume, slime's onload_weights / onload_kv):
    // same addresses, a's logits.
    CHECK(g.release(memory::Tag::weight) > 0);
    CHECK(g.release(memory::Tag::kv_cache) > 0);
    g.reload_weights(idx_a);
    CHECK(g.allocator().data(memory::Tag::weight) == weights);
    g.acquire_kv();
    CHECK(g.allocator().data(memory::Tag::kv_cache) == kv);
    CHECK(test::bits_equal(a0, test::decode_steps(g, 3, 5, kBlock, kBlocksPerSeq)));
    CHECK(g.graph_captures() == 0);
}
