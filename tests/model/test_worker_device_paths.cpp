// The Worker's device-memory paths (daemon/src/model/worker.cpp, weights.cpp) run on the CPU
// backend through the test hook WorkerConfig::test_device_paths: weights filled through host
// bounce buffers and Backend::upload, the norms and biases uploaded, the logits downloaded. The
// reference is the direct host path of the same build: every step's logits must be bitwise equal
// at load, after an update (stage/commit), after sleep/wakeup of the weights and of the KV pool,
// on stories260K (F32), a random Qwen2 (F32, q/k/v biases) and a random BF16 checkpoint in 3
// shards with an untied head. A NaN in an update is refused on the staged path too and the live
// weights keep serving bit-exactly. reserve_tokens (what --use-cudagraph sets) keeps every
// activation buffer at one address.
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/model/worker.h"
#include "fd/status.h"
#include "../unit/test_util.h"

#include <doctest/doctest.h>

#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace fd;

namespace {

const fs::path kStories = fs::path(FD_SOURCE_DIR) / "models" / "stories260K";
constexpr int32_t kBlock = 4;  // tokens per KV block: sequences span several blocks


model::WorkerConfig wcfg(bool device_paths, int64_t reserve = 0) {
    model::WorkerConfig w{.n_threads = 2, .block_size = kBlock, .n_blocks = 64, .max_model_len = 128};
    w.test_device_paths = device_paths;
    w.reserve_tokens    = reserve;
    return w;
}

/// Two sequences: A prefilled (11 tokens) and decoded alone 3 steps, then B prefilled (7 tokens)
/// batched with A's decode, then both decoded 3 steps. Logits of every step's last tokens,
/// concatenated ([n_logit_rows, vocab]).
std::vector<float> run(model::Worker & w) {
    const int32_t vocab = w.config().vocab_size;
    std::vector<int32_t> table(64);
    for (int32_t i = 0; i < 64; ++i) { table[i] = i; }
    std::vector<int32_t> a, b;
    for (int32_t i = 0; i < 20; ++i) {
        a.push_back((7 * i + 3) % vocab);
        b.push_back((11 * i + 5) % vocab);
    }
    std::vector<float> out;
    auto step = [&](std::vector<std::array<int32_t, 4>> spans) {  // {seq, from, to, block0}
        model::StepBatch s;
        for (const auto & sp : spans) {
            const auto & toks = sp[0] == 0 ? a : b;
            for (int32_t pos = sp[1]; pos < sp[2]; ++pos) {
                s.tokens.push_back(toks[pos]);
                s.positions.push_back(pos);
                s.slots.push_back(int64_t(sp[3] + pos / kBlock) * kBlock + pos % kBlock);
                s.queries.push_back({table.data() + sp[3], pos + 1});
            }
            s.logits_rows.push_back(static_cast<int32_t>(s.tokens.size()) - 1);
        }
        std::vector<float> logits(s.logits_rows.size() * static_cast<size_t>(vocab));
        REQUIRE(w.forward(s, logits.data()));
        out.insert(out.end(), logits.begin(), logits.end());
    };
    step({{0, 0, 11, 0}});
    for (int32_t p = 11; p < 14; ++p) { step({{0, p, p + 1, 0}}); }
    step({{0, 14, 15, 0}, {1, 0, 7, 32}});
    for (int32_t d = 0; d < 3; ++d) { step({{0, 15 + d, 16 + d, 0}, {1, 7 + d, 8 + d, 32}}); }
    return out;
}

/// Load `a` both ways, compare; update to `b` (stage + commit) both ways, compare with a direct
/// Worker on `b`; sleep/wake the weights (reload `a`) and the KV pool, compare.
void check_model(const fs::path & a, const fs::path & b) {
    const auto cfg = model::load_model_config(a);
    const auto idx_a = model::read_tensor_index(a), idx_b = model::read_tensor_index(b);
    model::Worker direct(cfg, idx_a, wcfg(false));
    model::Worker staged(cfg, idx_a, wcfg(true));
    CHECK_FALSE(direct.device_memory());
    CHECK(staged.device_memory());
    const auto ref_a = run(direct);
    CHECK(test::bits_equal(run(staged), ref_a));

    model::Worker direct_b(cfg, idx_b, wcfg(false));
    const auto ref_b = run(direct_b);
    CHECK_FALSE(test::bits_equal(ref_a, ref_b));  // the update changes something
    CHECK(staged.stage_weights(idx_b) == idx_b.total_bytes);
    CHECK(test::bits_equal(run(staged), ref_a));  // staged only: nothing live changed
    staged.commit_staged();
    CHECK(test::bits_equal(run(staged), ref_b));

    CHECK(staged.release(memory::Tag::weight) > 0);
    staged.reload_weights(idx_a);
    CHECK(staged.release(memory::Tag::kv_cache) > 0);
    staged.acquire_kv();
    CHECK(test::bits_equal(run(staged), ref_a));
}

}  // namespace

TEST_SUITE("model::device_paths") {
    TEST_CASE("stories260K (F32): staged fill, update and wakeup give bitwise the direct path's logits") {
        // An update to the same weights (different ones: the random models below).
        const auto cfg = model::load_model_config(kStories);
        const auto idx = model::read_tensor_index(kStories);
        model::Worker direct(cfg, idx, wcfg(false));
        model::Worker staged(cfg, idx, wcfg(true));
        const auto ref = run(direct);
        CHECK(test::bits_equal(run(staged), ref));
        CHECK(staged.release(memory::Tag::weight) > 0);
        staged.reload_weights(idx);
        CHECK(test::bits_equal(run(staged), ref));
        CHECK(staged.stage_weights(idx) == idx.total_bytes);
        staged.commit_staged();
        CHECK(test::bits_equal(run(staged), ref));
    }

    TEST_CASE("random Qwen2 (F32, q/k/v biases): load, update, sleep/wakeup bitwise equal") {
        test::TempDir d;
        fd::test::make_random_checkpoint(d.path / "a", "--preset tiny-qwen2");
        fd::test::make_random_checkpoint(d.path / "b", "--preset tiny-qwen2 --seed 9");
        check_model(d.path / "a", d.path / "b");
    }

    TEST_CASE("random BF16 in 3 shards, untied head: load, update, sleep/wakeup bitwise equal") {
        test::TempDir d;
        fd::test::make_random_checkpoint(d.path / "a", "--preset tiny-llama-bf16-sharded");
        fd::test::make_random_checkpoint(d.path / "b", "--preset tiny-llama-bf16-sharded --seed 9");
        check_model(d.path / "a", d.path / "b");
    }

    TEST_CASE("a NaN in an update is refused on the staged path; the live weights keep serving bitwise") {
        test::TempDir d;
        const fs::path a = d.path / "a", bad = d.path / "bad";
        fd::test::make_random_checkpoint(a, "--preset tiny-llama-bf16-sharded");
        fd::test::make_random_checkpoint(bad, "--preset tiny-llama-bf16-sharded --seed 9");
        const auto idx_bad = model::read_tensor_index(bad);
        const auto & t = idx_bad.tensors.at("model.layers.1.mlp.down_proj.weight");
        {  // element 1000 := BF16 NaN (0x7fc0), in place (same inode: the index stays valid)
            std::fstream f(t.file, std::ios::in | std::ios::out | std::ios::binary);
            f.seekp(t.offset_bytes + 1000 * 2);
            const unsigned char nan_bf16[2] = {0xc0, 0x7f};
            f.write(reinterpret_cast<const char *>(nan_bf16), 2);
        }
        const auto cfg = model::load_model_config(a);
        model::Worker staged(cfg, model::read_tensor_index(a), wcfg(true));
        const auto ref = run(staged);
        std::string what;
        CHECK(test::error_of([&] { staged.stage_weights(idx_bad); }, &what) == Errc::invalid_checkpoint);
        CHECK(what.find("element 1000") != std::string::npos);
        CHECK(what.find("down_proj") != std::string::npos);
        CHECK_FALSE(staged.has_staged());
        CHECK(test::bits_equal(run(staged), ref));
    }

    TEST_CASE("reserve_tokens sizes the activation buffers once: no step moves them (without it the first steps grow them)") {
        const auto cfg = model::load_model_config(kStories);
        const auto idx = model::read_tensor_index(kStories);
        model::Worker reserved(cfg, idx, wcfg(true, 32));
        const int64_t before = reserved.scratch_bytes();
        CHECK(before > 0);
        const auto ref = run(reserved);
        CHECK(reserved.scratch_bytes() == before);
        model::Worker grown(cfg, idx, wcfg(true));
        CHECK(grown.scratch_bytes() == 0);
        CHECK(test::bits_equal(run(grown), ref));
        CHECK(grown.scratch_bytes() > 0);
        CHECK(grown.scratch_bytes() <= before);
    }
}
