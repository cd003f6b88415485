// LocalExecutor over the real stories260K Worker: the two-phase update (stage on every rank,
// then commit; drop on failure) never changes what is served before commit, and release /
// reload hand memory back and restore the same logits.
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/publish/safetensors_write.h"
#include "fd/runtime/executor.h"
#include "fd/status.h"

#include "test_util.h"

#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

using namespace fd;

namespace {

namespace fs = std::filesystem;

const fs::path kModel = fs::path(FD_SOURCE_DIR) / "models/stories260K";

/// A source that serves `dir`, or fails on demand (fetch, or the verify after the copy).
struct FakeSource final : weights::WeightSource {
    fs::path dir;
    bool     fail_fetch = false, fail_verify = false;
    std::string version = "v";
    weights::LoadStrategy strategy() const override { return weights::LoadStrategy::normal; }
    weights::FetchedCheckpoint fetch(const weights::FetchRequest &) override {
        if (fail_fetch) { throw Error(Errc::not_found, "no such version"); }
        weights::FetchedCheckpoint c;
        c.index   = model::read_tensor_index(dir);
        c.version = version;
        if (fail_verify) {
            c.verify_copied = [] { throw Error(Errc::source_unavailable, "record rewritten during the copy"); };
        }
        return c;
    }
};

/// stories260K with every tensor scaled by `scale`, written to `dir` (config and all).
void write_scaled_copy(const fs::path & dir, float scale) {
    for (const auto & e : fs::directory_iterator(kModel)) {
        if (e.is_regular_file()) { fs::copy_file(e.path(), dir / e.path().filename(), fs::copy_options::overwrite_existing); }
    }
    const auto idx = model::read_tensor_index(kModel);
    std::vector<publish::SafetensorsEntry> entries;
    std::vector<const model::TensorInfo *> infos;
    for (const auto & [name, t] : idx.tensors) {
        entries.push_back({name, model::DType::f32, t.shape});
        infos.push_back(&t);
    }
    publish::write_safetensors(dir / "model.safetensors", entries, [&](size_t i, std::byte * dst) {
        auto * f = reinterpret_cast<float *>(dst);
        model::read_tensor_f32(*infos[i], f);
        for (int64_t k = 0; k < infos[i]->numel(); ++k) { f[k] *= scale; }
    });
}

struct Fixture {
    model::ModelConfig cfg = model::load_model_config(kModel);
    FakeSource * source = nullptr;
    std::unique_ptr<runtime::Executor> ex;
    model::StepBatch batch;

    Fixture() {
        auto src = std::make_unique<FakeSource>();
        src->dir = kModel;
        source = src.get();
        auto worker = std::make_unique<model::Worker>(cfg, model::read_tensor_index(kModel),
                                                      model::WorkerConfig{.n_blocks = 4, .max_model_len = 64});
        ex = runtime::make_local_executor(std::move(worker), std::move(src));
        for (int32_t t = 0; t < 5; ++t) {
            batch.tokens.push_back(1 + 7 * t);
            batch.positions.push_back(t);
            batch.slots.push_back(t);
            batch.queries.push_back({.block_table = block_table, .n_ctx = t + 1});
        }
        batch.logits_rows = {4};
    }
    std::vector<float> logits() {
        std::vector<float> out(static_cast<size_t>(cfg.vocab_size));
        REQUIRE(ex->forward(batch, out.data(), nullptr));
        return out;
    }
    int32_t block_table[1] = {0};
};

}  // namespace

TEST_CASE("local executor: nothing staged is served before commit; a failed stage changes nothing") {
    Fixture f;
    const auto v1 = f.logits();
    fd::test::TempDir dir;
    write_scaled_copy(dir.path, 0.5f);
    f.source->dir = dir.path;

    f.source->fail_verify = true;
    CHECK_THROWS_AS(f.ex->stage_weights({}), Error);
    CHECK(f.logits() == v1);
    f.source->fail_verify = false;
    f.source->fail_fetch  = true;
    CHECK_THROWS_AS(f.ex->stage_weights({}), Error);
    CHECK(f.logits() == v1);
    f.source->fail_fetch = false;

    const auto staged = f.ex->stage_weights({});
    REQUIRE(staged.size() == 1);
    CHECK(staged[0].bytes > 0);
    CHECK(*staged[0].version == "v");
    CHECK(f.logits() == v1);  // staged, not live
    f.ex->drop_staged_weights();
    CHECK(f.logits() == v1);
    CHECK_THROWS(f.ex->commit_weights());  // nothing staged any more

    f.ex->stage_weights({});
    f.ex->commit_weights();
    const auto v2 = f.logits();
    CHECK(v2 != v1);

    // Back to the original: bit-exact v1 again.
    f.source->dir = kModel;
    f.ex->stage_weights({});
    f.ex->commit_weights();
    CHECK(f.logits() == v1);
}

TEST_CASE("local executor: release hands the bytes back, reload restores the same logits") {
    Fixture f;
    const auto v1 = f.logits();
    const int64_t wbytes = f.ex->weight_bytes();
    const auto rel = f.ex->release(runtime::MemoryTag::weight);
    REQUIRE(rel.size() == 1);
    CHECK(rel[0].freed_bytes >= wbytes);
    const auto kv = f.ex->release(runtime::MemoryTag::kv_cache);
    CHECK(kv[0].freed_bytes > 0);
    f.source->fail_fetch = true;
    CHECK_THROWS_AS(f.ex->reload_weights({.wakeup = true}), Error);
    f.source->fail_fetch = false;
    const auto re = f.ex->reload_weights({.wakeup = true});
    CHECK(re[0].bytes > 0);
    f.ex->acquire_kv();
    CHECK(f.logits() == v1);
}

namespace {

/// A 5-token prefill into device block `block`, then the decode step at position 5 attending
/// through `table`; returns the decode step's logits (the prefill's are discarded).
struct SwapFixture {
    model::ModelConfig cfg = model::load_model_config(kModel);
    std::unique_ptr<runtime::Executor> ex;
    explicit SwapFixture(int64_t n_swap_blocks) {
        auto src = std::make_unique<FakeSource>();
        src->dir = kModel;
        auto worker = std::make_unique<model::Worker>(cfg, model::read_tensor_index(kModel),
                                                      model::WorkerConfig{.n_blocks = 4, .n_swap_blocks = n_swap_blocks, .max_model_len = 64});
        ex = runtime::make_local_executor(std::move(worker), std::move(src));
    }
    void prefill(int32_t block) {
        int32_t table[1] = {block};
        model::StepBatch b;
        for (int32_t t = 0; t < 5; ++t) {
            b.tokens.push_back(1 + 7 * t);
            b.positions.push_back(t);
            b.slots.push_back(int64_t{block} * 16 + t);
            b.queries.push_back({.block_table = table, .n_ctx = t + 1});
        }
        b.logits_rows = {4};
        std::vector<float> out(static_cast<size_t>(cfg.vocab_size));
        REQUIRE(ex->forward(b, out.data(), nullptr));
    }
    std::vector<float> decode(int32_t block) {
        int32_t table[1] = {block};
        model::StepBatch b;
        b.tokens      = {42};
        b.positions   = {5};
        b.slots       = {int64_t{block} * 16 + 5};
        b.queries     = {{.block_table = table, .n_ctx = 6}};
        b.logits_rows = {0};
        std::vector<float> out(static_cast<size_t>(cfg.vocab_size));
        REQUIRE(ex->forward(b, out.data(), nullptr));
        return out;
    }
};

}  // namespace

TEST_CASE("local executor: KV swapped out to the host pool and back into another block decodes bit-identically") {
    SwapFixture ref(0);
    ref.prefill(0);
    const auto want = ref.decode(0);

    SwapFixture f(3);
    f.prefill(0);
    const kv::BlockCopy out[] = {{.src = 0, .dst = 2}};
    f.ex->swap_kv(out, 1, nullptr, 0);
    // The device pool is wiped (released and mapped again: zeros); only the host copy is left.
    CHECK(f.ex->release(runtime::MemoryTag::kv_cache)[0].freed_bytes > 0);
    f.ex->acquire_kv();
    CHECK(f.decode(3) != want);  // without its KV the step differs: the comparison below can fail
    const kv::BlockCopy in[] = {{.src = 2, .dst = 1}};
    f.ex->swap_kv(nullptr, 0, in, 1);
    CHECK(f.decode(1) == want);

    // Ids outside either pool are refused before anything is copied.
    const kv::BlockCopy bad_host[] = {{.src = 0, .dst = 3}};
    CHECK_THROWS_AS(f.ex->swap_kv(bad_host, 1, nullptr, 0), Error);
    const kv::BlockCopy bad_dev[] = {{.src = 0, .dst = 4}};
    CHECK_THROWS_AS(f.ex->swap_kv(nullptr, 0, bad_dev, 1), Error);

    // FD_ENABLE_SWAP_SPACE_CLEARING's release: the pool's bytes go back; acquire_kv maps it again.
    const auto rel = f.ex->release(runtime::MemoryTag::kv_swap);
    CHECK(rel[0].freed_bytes >= 3 * model::Worker::kv_block_bytes(f.cfg, 16));
    CHECK_THROWS_AS(f.ex->swap_kv(out, 1, nullptr, 0), Error);
    CHECK(f.ex->release(runtime::MemoryTag::kv_swap)[0].freed_bytes == 0);
    f.ex->acquire_kv();
    f.ex->swap_kv(out, 1, nullptr, 0);
}

TEST_CASE("local executor: a background swap-out runs during the next forward and the next swap_kv waits for it") {
    SwapFixture ref(0);
    ref.prefill(0);
    const auto want = ref.decode(0);

    ::setenv("FD_TEST_KV_COPY_DELAY_MS", "1000", 1);  // the copy lands no earlier than 1 s after it started
    SwapFixture f(3);
    ::unsetenv("FD_TEST_KV_COPY_DELAY_MS");
    f.prefill(0);
    const kv::BlockCopy bg[] = {{.src = 0, .dst = 2}};
    const auto t0 = std::chrono::steady_clock::now();
    f.ex->swap_kv(nullptr, 0, nullptr, 0, bg, 1);
    const double started_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(started_s < 0.9);            // returned without waiting for the copy
    f.prefill(1);                      // a forward on another block runs while the copy is in flight
    f.ex->swap_kv(nullptr, 0, nullptr, 0);  // the wait alone
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >= 1.0);
    // The host block holds block 0's KV: wiped device pool, copied back into block 3, same decode.
    f.ex->release(runtime::MemoryTag::kv_cache);
    f.ex->acquire_kv();
    const kv::BlockCopy in[] = {{.src = 2, .dst = 3}};
    f.ex->swap_kv(nullptr, 0, in, 1);
    CHECK(f.decode(3) == want);
    // Ids outside the pools are refused before anything starts.
    const kv::BlockCopy bad[] = {{.src = 0, .dst = 3}};
    CHECK_THROWS_AS(f.ex->swap_kv(nullptr, 0, nullptr, 0, bad, 1), Error);
}

namespace {

/// stories260K scaled by `scale`, split into bucket files `dir`/bucket-000<k>.safetensors (tensor
/// i into bucket i % n_buckets), as a weight stream's staging dir holds them. Returns their paths.
std::vector<fs::path> write_buckets(const fs::path & dir, float scale, int n_buckets) {
    const auto idx = model::read_tensor_index(kModel);
    std::vector<std::vector<publish::SafetensorsEntry>> entries(static_cast<size_t>(n_buckets));
    std::vector<std::vector<const model::TensorInfo *>> infos(static_cast<size_t>(n_buckets));
    int i = 0;
    for (const auto & [name, t] : idx.tensors) {
        entries[static_cast<size_t>(i % n_buckets)].push_back({name, model::DType::f32, t.shape});
        infos[static_cast<size_t>(i % n_buckets)].push_back(&t);
        ++i;
    }
    std::vector<fs::path> files;
    for (int b = 0; b < n_buckets; ++b) {
        const fs::path f = dir / ("bucket-000" + std::to_string(b) + ".safetensors");
        const fs::path tmp = dir / ".tmp";
        publish::write_safetensors(tmp, entries[static_cast<size_t>(b)], [&](size_t k, std::byte * dst) {
            auto * p = reinterpret_cast<float *>(dst);
            model::read_tensor_f32(*infos[static_cast<size_t>(b)][k], p);
            for (int64_t e = 0; e < infos[static_cast<size_t>(b)][k]->numel(); ++e) { p[e] *= scale; }
        });
        fs::rename(tmp, f);  // a new inode, as a stream's bucket file
        files.push_back(f);
    }
    return files;
}

void stage_bucket(Fixture & f, const fs::path & file) {
    runtime::RankRequest req{.op = runtime::RankOp::stage_bucket};
    req.fetch.weight_dir = file.string();
    const auto reps = f.ex->rank_call(req);
    REQUIRE(reps.size() == 1);
    CHECK(reps[0].bytes > 0);
}

}  // namespace

TEST_CASE("local executor: a stream's buckets staged as they arrive commit what a full stage commits; anything else is copied in full") {
    Fixture f;
    const auto v1 = f.logits();
    fd::test::TempDir dir;
    const auto files = write_buckets(dir.path, 0.5f, 3);
    f.source->dir = dir.path;
    f.ex->stage_weights({});  // the reference: a full stage of the same files
    f.ex->commit_weights();
    const auto half = f.logits();
    REQUIRE(half != v1);
    f.source->dir = kModel;
    f.ex->stage_weights({});
    f.ex->commit_weights();
    REQUIRE(f.logits() == v1);

    f.source->dir = dir.path;
    SUBCASE("every bucket staged ahead: the stage only validates, it reads no tensor again") {
        for (const auto & b : files) { stage_bucket(f, b); }
        CHECK(f.logits() == v1);  // staged, nothing live changed
        // Zero the final norm in its bucket file in place (same inode, size and header): a stage
        // that read it again would serve the zeros; the staged copy serves what the bucket held.
        bool zeroed = false;
        for (const auto & b : files) {
            const auto idx = model::read_tensor_files(b, {b});
            const auto it  = idx.tensors.find("model.norm.weight");
            if (it == idx.tensors.end()) { continue; }
            std::FILE * fp = std::fopen(b.c_str(), "r+b");
            REQUIRE(fp);
            std::fseek(fp, static_cast<long>(it->second.offset_bytes), SEEK_SET);
            const std::vector<char> zeros(static_cast<size_t>(it->second.size_bytes), 0);
            CHECK(std::fwrite(zeros.data(), 1, zeros.size(), fp) == zeros.size());
            std::fclose(fp);
            zeroed = true;
        }
        REQUIRE(zeroed);
        f.ex->stage_weights({});
        f.ex->commit_weights();
        CHECK(f.logits() == half);
    }
    SUBCASE("a bucket missed (a rank that restarted): the stage copies everything") {
        stage_bucket(f, files[0]);
        stage_bucket(f, files[2]);
        f.ex->stage_weights({});
        f.ex->commit_weights();
        CHECK(f.logits() == half);
    }
    SUBCASE("a bucket file replaced after it was staged: the stage copies everything, the new bytes serve") {
        for (const auto & b : files) { stage_bucket(f, b); }
        fd::test::TempDir other;
        const auto quarter = write_buckets(other.path, 0.25f, 3);
        fs::rename(quarter[1], files[1]);  // same name and size, another inode and other bytes
        f.ex->stage_weights({});
        f.ex->commit_weights();
        const auto mixed = f.logits();
        CHECK(mixed != half);
        f.source->dir = kModel;  // a plain full stage of the same mixed files gives the same logits
        f.ex->stage_weights({});
        f.ex->commit_weights();
        f.source->dir = dir.path;
        f.ex->stage_weights({});
        f.ex->commit_weights();
        CHECK(f.logits() == mixed);
    }
}
