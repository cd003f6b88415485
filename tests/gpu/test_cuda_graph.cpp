// CUDA graphs of decode steps (daemon/src/model/worker_graphs.cpp over the CUDA backend's
// capture/replay and fixed index buffers), against the same Worker on cuda run eagerly: replayed
// steps give the eager logits bitwise for buckets 1, 2 and 8 (7 rows + 1 padding row) and 4
// (3 + 1); padding rows leave every live KV block bitwise as the eager Worker's; after sleep
// (weight + kv_cache) and wakeup, and after update_weights (stage + commit), the same graphs
// replay the new weights' outputs: the capture counter does not move, the weight and KV
// addresses do not change. Label gpu; skipped (exit 77) without a GPU.
#include "gpu_util.h"

#include "fd/kernels/backend.h"
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/model/worker.h"
#include "../model/graph_test_util.h"
#include "../unit/test_util.h"

#include <algorithm>
#include <filesystem>
#include <vector>

namespace fs = std::filesystem;
using namespace fd;

namespace {

const fs::path    kStories = fs::path(FD_SOURCE_DIR) / "models" / "stories260K";
constexpr int32_t kBlock = 16, kBlocksPerSeq = 4, kBlocks = 64;

model::WorkerConfig wcfg(int32_t graph_max_batch) {
    model::WorkerConfig w{.device = kernels::DeviceKind::cuda, .n_threads = 2, .block_size = kBlock, .n_blocks = kBlocks,
                          .max_model_len = kBlock * kBlocksPerSeq};
    w.graph_max_batch = graph_max_batch;
    return w;
}

}  // namespace

TEST_CASE("graph replay equals eager decode bitwise for buckets 1/2/4/8 with padding; live KV untouched") {
    const auto cfg = model::load_model_config(kStories);
    const auto idx = model::read_tensor_index(kStories);
    model::Worker g(cfg, idx, wcfg(8)), e(cfg, idx, wcfg(0));
    REQUIRE(g.graph_buckets() == std::vector<int32_t>{1, 2, 4, 8});
    CHECK(g.graph_captures() == 4);  // every bucket at construction
    CHECK(e.graph_captures() == 0);
    int64_t steps = 0;
    for (const int32_t n : {1, 2, 7, 3}) {
        CAPTURE(n);
        const auto want = test::decode_steps(e, n, 20, kBlock, kBlocksPerSeq);  // crosses a block boundary
        const auto got  = test::decode_steps(g, n, 20, kBlock, kBlocksPerSeq);
        steps += 20;
        CHECK(g.graph_steps() == steps);
        CHECK(test::bits_equal(want, got));
        CHECK(test::bits_equal(test::live_kv(e, kBlocks, kBlocks, kBlock), test::live_kv(g, kBlocks, kBlocks + 1, kBlock)));
    }
    CHECK(g.graph_captures() == 4);  // replays only
}

TEST_CASE("graphs replay after sleep(weight, kv_cache) + wakeup and after update_weights, without recapture") {
    test::TempDir d;
    test::make_random_checkpoint(d.path / "a", "--preset tiny-llama-bf16-sharded");
    test::make_random_checkpoint(d.path / "b", "--preset tiny-llama-bf16-sharded --seed 9");
    const auto cfg   = model::load_model_config(d.path / "a");
    const auto idx_a = model::read_tensor_index(d.path / "a"), idx_b = model::read_tensor_index(d.path / "b");
    model::Worker g(cfg, idx_a, wcfg(8)), e(cfg, idx_a, wcfg(0)), ref_b(cfg, idx_b, wcfg(0));
    const int64_t     captured = g.graph_captures();
    const std::byte * weights  = g.allocator().data(memory::Tag::weight);
    const std::byte * kv       = g.allocator().data(memory::Tag::kv_cache);
    const auto a0 = test::decode_steps(e, 5, 10, kBlock, kBlocksPerSeq);
    const auto b0 = test::decode_steps(ref_b, 5, 10, kBlock, kBlocksPerSeq);
    CHECK_FALSE(test::bits_equal(a0, b0));
    CHECK(test::bits_equal(a0, test::decode_steps(g, 5, 10, kBlock, kBlocksPerSeq)));

    // Sleep both tags (device memory handed back), wake kv_cache first, then the weights.
    CHECK(g.release(memory::Tag::weight) > 0);
    CHECK(g.release(memory::Tag::kv_cache) > 0);
    g.acquire_kv();
    g.reload_weights(idx_a);
    CHECK(g.allocator().data(memory::Tag::weight) == weights);
    CHECK(g.allocator().data(memory::Tag::kv_cache) == kv);
    CHECK(test::bits_equal(a0, test::decode_steps(g, 5, 10, kBlock, kBlocksPerSeq)));
    CHECK(g.graph_captures() == captured);

    // update_weights to b: committed by a device-to-device copy into the same weight region.
    g.stage_weights(idx_b);
    g.commit_staged();
    CHECK(g.allocator().data(memory::Tag::weight) == weights);
    CHECK(test::bits_equal(b0, test::decode_steps(g, 5, 10, kBlock, kBlocksPerSeq)));
    CHECK(g.graph_captures() == captured);

    // And a wakeup from sleep into b's weights.
    g.release(memory::Tag::weight);
    g.release(memory::Tag::kv_cache);
    g.acquire_kv();
    g.reload_weights(idx_b);
    CHECK(test::bits_equal(b0, test::decode_steps(g, 5, 10, kBlock, kBlocksPerSeq)));
    CHECK(g.graph_captures() == captured);

    // SGLang's staged resume (slime: weights, the trainer's sync, then kv_cache + cuda_graph):
    // the weights come back while the KV pool is still unmapped; both keep their addresses, so
    // the graphs replay without a capture.
    g.release(memory::Tag::weight);
    g.release(memory::Tag::kv_cache);
    g.reload_weights(idx_a);
    CHECK(g.allocator().data(memory::Tag::weight) == weights);
    g.acquire_kv();
    CHECK(g.allocator().data(memory::Tag::kv_cache) == kv);
    CHECK(test::bits_equal(a0, test::decode_steps(g, 5, 10, kBlock, kBlocksPerSeq)));
    CHECK(g.graph_captures() == captured);
}

TEST_CASE("CudaBackend capture/replay: a fixed step's indices are read at replay, not at capture") {
    // Two graph steps through one capture: embedding of fixed tokens, replayed with new tokens.
    auto be = kernels::make_backend({.kind = kernels::DeviceKind::cuda, .n_threads = 1});
    REQUIRE(be->supports_graphs());
    CHECK(be->supports(fd::kernels::BackendOp::graph_capture, fd::DType::f32));  // the query callers use reads it
    be->reserve_graph_steps(4, 2, 16);
    const int64_t n_embd = 8, vocab = 16;
    std::vector<float> table(static_cast<size_t>(vocab * n_embd));
    for (size_t i = 0; i < table.size(); ++i) { table[i] = static_cast<float>(i); }
    auto * dtable = static_cast<float *>(be->alloc(vocab * n_embd * 4));
    auto * out    = static_cast<float *>(be->alloc(4 * n_embd * 4));
    be->upload(dtable, table.data(), vocab * n_embd * 4);
    std::vector<int32_t> tok = {1, 2, 3, 4}, pos = {0, 0, 0, 0}, blk = {0, 1};
    std::vector<int64_t> slots = {0, 1, 2, 3};
    std::vector<kernels::AttnQuery> q(4, kernels::AttnQuery{blk.data(), 1});
    be->begin_step({tok.data(), pos.data(), slots.data(), q.data(), 4, true});
    be->begin_capture();
    be->embedding(out, dtable, kernels::WType::f32, tok.data(), 4, n_embd, 0, vocab);
    const int32_t id = be->end_capture();
    CHECK(be->graphs_captured() >= 1);
    for (const std::vector<int32_t> & t : {std::vector<int32_t>{5, 6, 7, 8}, std::vector<int32_t>{15, 0, 9, 9}}) {
        std::copy(t.begin(), t.end(), tok.begin());  // same storage: the fixed step's pointer
        be->begin_step({tok.data(), pos.data(), slots.data(), q.data(), 4, true});
        be->replay(id);
        std::vector<float> got(static_cast<size_t>(4 * n_embd));
        be->download(got.data(), out, 4 * n_embd * 4);
        for (int64_t r = 0; r < 4; ++r) { CHECK(got[static_cast<size_t>(r * n_embd)] == table[static_cast<size_t>(t[r] * n_embd)]); }
    }
    // An index array that is not the fixed step's cannot be captured (it would replay stale host memory).
    std::vector<int32_t> other = {1, 1, 1, 1};
    be->begin_capture();
    CHECK_THROWS(be->embedding(out, dtable, kernels::WType::f32, other.data(), 4, n_embd, 0, vocab));
    be->abort_capture();
    be->free(dtable);
    be->free(out);
}
