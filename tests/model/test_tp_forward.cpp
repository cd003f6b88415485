// Tensor-parallel forward (Worker rank r of T, daemon/src/model/worker.cpp) against tp = 1:
// real Gloo over loopback between fork()ed rank processes, on stories260K, random Qwen2
// checkpoints (make_random_checkpoint.py, F32 with q/k/v biases), a random Qwen3 and a random BF16 checkpoint
// in 3 safetensors shards with an untied head. Per model and tp in {2, 4}: every step's logits
// within 1e-4 of tp = 1, the same greedy tokens, a sequence's logits bitwise the same alone and
// batched; per-rank snapshot files (inference names) load and stage/commit like the full
// checkpoint, release/reload reads each rank's slices again; the layout RolloutModel
// publishes is the one each rank's Worker holds.
#include "fd/checkpoint/model_config.h"
#include "fd/publish/rollout_model.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/publish/safetensors_write.h"
#include "fd/model/worker.h"
#include "fd/comm/comm.h"
#include "fd/comm/tcp_store.h"
#include "fd/status.h"
#include "../unit/test_util.h"

#include "../fork_ranks.h"

#include <doctest/doctest.h>

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace fd;

namespace {

const fs::path kStories = fs::path(FD_SOURCE_DIR) / "models" / "stories260K";
constexpr int32_t kBlock = 4;  // tokens per KV block: sequences span several blocks


/// Rank `rank`'s state dict in inference names, as a trainer publishes it for ipc_snapshot
/// (RolloutModel::gather into model_state.tp<rank>.safetensors in `out`). Returns the file.
fs::path write_rank_snapshot(const fs::path & model, int tp, int rank, const fs::path & out) {
    const publish::RolloutModel m(model, tp);
    const auto idx  = model::read_tensor_index(model);
    const auto srcs = m.training_slices(rank);
    std::vector<publish::SafetensorsEntry> entries;
    for (const auto & s : srcs) { entries.push_back({s.tensor.name, s.tensor.dtype, s.tensor.shape}); }
    const fs::path file = out / ("model_state.tp" + std::to_string(rank) + ".safetensors");
    publish::write_safetensors(file, entries, [&](size_t i, std::byte * dst) { publish::RolloutModel::gather(srcs[i], idx, dst); });
    return file;
}

/// The token stream of the scenario: sequence A alone, then A again batched with B.
struct Scenario {
    std::vector<int32_t> a, b;  ///< prompt + continuation
    int32_t prompt_a = 0, prompt_b = 0;
    int32_t n_decode = 0;
};

/// One sequence in a step: its tokens [from, to) in blocks [block0, ...).
struct Span {
    const std::vector<int32_t> * tokens;
    int32_t from, to, block0;
};

/// The scenario's steps. Phase 1: A's prefill then n_decode decode steps, alone (blocks from
/// 0). Phase 2: A (blocks from 32) and B (blocks from 64) prefilled together, then decoded
/// together. Each step asks for the logits of each sequence's last token.
std::vector<model::StepBatch> build_steps(const Scenario & s, std::vector<int32_t> & tables) {
    tables.resize(96);
    for (int32_t i = 0; i < 96; ++i) { tables[i] = i; }
    std::vector<model::StepBatch> steps;
    auto step = [&](std::initializer_list<Span> spans) {
        model::StepBatch b;
        for (const Span & sp : spans) {
            for (int32_t pos = sp.from; pos < sp.to; ++pos) {
                b.tokens.push_back((*sp.tokens)[pos]);
                b.positions.push_back(pos);
                b.slots.push_back(int64_t(sp.block0 + pos / kBlock) * kBlock + pos % kBlock);
                b.queries.push_back({tables.data() + sp.block0, pos + 1});
            }
            b.logits_rows.push_back(static_cast<int32_t>(b.tokens.size()) - 1);
        }
        steps.push_back(std::move(b));
    };
    step({{&s.a, 0, s.prompt_a, 0}});
    for (int32_t d = 0; d < s.n_decode; ++d) { step({{&s.a, s.prompt_a + d, s.prompt_a + d + 1, 0}}); }
    step({{&s.a, 0, s.prompt_a, 32}, {&s.b, 0, s.prompt_b, 64}});
    for (int32_t d = 0; d < s.n_decode; ++d) {
        step({{&s.a, s.prompt_a + d, s.prompt_a + d + 1, 32}, {&s.b, s.prompt_b + d, s.prompt_b + d + 1, 64}});
    }
    return steps;
}

int64_t n_logit_rows(const std::vector<model::StepBatch> & steps) {
    int64_t n = 0;
    for (const auto & s : steps) { n += static_cast<int64_t>(s.logits_rows.size()); }
    return n;
}

model::WorkerConfig worker_config(int rank, int tp) {
    return {.rank = rank, .tp_size = tp, .n_threads = 1, .block_size = kBlock, .n_blocks = 96, .max_model_len = 64};
}

/// How a rank gets its weights.
struct Load {
    fs::path model;                  ///< the full HF checkpoint
    bool     snapshot = false;       ///< load model_state.tp<rank>.safetensors from `snapshot_dir` instead
    fs::path snapshot_dir;
    fs::path update_dir;             ///< non-empty: then stage + commit this dir's per-rank snapshot
    fs::path reload_dir;             ///< non-empty: then release the weights and reload this full checkpoint
};

model::TensorIndex rank_snapshot_index(const fs::path & dir, int rank) {
    const fs::path f = dir / ("model_state.tp" + std::to_string(rank) + ".safetensors");
    return model::read_tensor_files(dir, {f});
}

/// Run `steps` on a Worker of rank `rank` of `tp` (comm: nullptr at tp 1); rank 0 writes the
/// logits rows in order into `out` ([rows, vocab]).
void run_rank(const Load & load, int rank, int tp, comm::Comm * comm, const std::vector<model::StepBatch> & steps, float * out) {
    const auto cfg = model::load_model_config(load.model);
    const auto idx = load.snapshot ? rank_snapshot_index(load.snapshot_dir, rank) : model::read_tensor_index(load.model);
    model::Worker w(cfg, idx, worker_config(rank, tp), comm);
    if (!load.update_dir.empty()) {
        w.stage_weights(rank_snapshot_index(load.update_dir, rank));
        w.commit_staged();
    }
    if (!load.reload_dir.empty()) {
        w.release(memory::Tag::weight);
        w.reload_weights(model::read_tensor_index(load.reload_dir));
    }
    std::vector<float> logits;
    for (const auto & s : steps) {
        logits.assign(s.logits_rows.size() * static_cast<size_t>(cfg.vocab_size), 0.0f);
        if (!w.forward(s, logits.data())) { throw std::runtime_error("forward dropped the step"); }
        if (rank == 0) {
            std::memcpy(out, logits.data(), logits.size() * sizeof(float));
            out += logits.size();
        }
    }
}

/// The scenario's logits [rows, vocab] at `tp` (1: in this process; else tp fork()ed rank
/// processes over Gloo on loopback, rank 0's logits through a shared mapping).
std::vector<float> run_tp(const Load & load, int tp, const std::vector<model::StepBatch> & steps, int32_t vocab) {
    const size_t n = static_cast<size_t>(n_logit_rows(steps) * vocab);
    if (tp == 1) {
        std::vector<float> out(n);
        run_rank(load, 0, 1, nullptr, steps, out.data());
        return out;
    }
    void * shared = mmap(nullptr, n * sizeof(float), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    REQUIRE(shared != MAP_FAILED);
    comm::TcpStoreServer store("127.0.0.1", 0);
    const int failed = fd::testing::run_forked_ranks(tp, [&](int r) {
        auto comm = comm::make_gloo_comm({.rank = r, .world_size = tp, .store_port = store.port(), .timeout_s = 60});
        comm->connect(1);
        run_rank(load, r, tp, comm.get(), steps, static_cast<float *>(shared));
        comm->barrier();
        return 0;
    });
    std::vector<float> out(static_cast<float *>(shared), static_cast<float *>(shared) + n);
    munmap(shared, n * sizeof(float));
    REQUIRE(failed == 0);
    return out;
}

/// Greedy continuation of `prompt` by `n` tokens at tp 1.
std::vector<int32_t> greedy(const fs::path & model, std::vector<int32_t> prompt, int32_t n) {
    const auto cfg = model::load_model_config(model);
    model::Worker w(cfg, model::read_tensor_index(model), worker_config(0, 1));
    std::vector<int32_t> table(96);
    for (int32_t i = 0; i < 96; ++i) { table[i] = i; }
    std::vector<float> logits(static_cast<size_t>(cfg.vocab_size));
    int32_t from = 0;
    for (int32_t k = 0; k < n; ++k) {
        model::StepBatch b;
        const auto to = static_cast<int32_t>(prompt.size());
        for (int32_t pos = from; pos < to; ++pos) {
            b.tokens.push_back(prompt[pos]);
            b.positions.push_back(pos);
            b.slots.push_back(pos);
            b.queries.push_back({table.data(), pos + 1});
        }
        b.logits_rows = {static_cast<int32_t>(b.tokens.size()) - 1};
        REQUIRE(w.forward(b, logits.data()));
        from = to;
        prompt.push_back(static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
    }
    return prompt;
}

Scenario scenario(const fs::path & model) {
    Scenario s;
    s.n_decode = 6;
    const std::vector<int32_t> a = {1, 403, 13, 261, 72, 4, 19, 88, 300};  // 9 tokens: three blocks
    const std::vector<int32_t> b = {1, 45, 7, 211, 96};
    s.prompt_a = static_cast<int32_t>(a.size());
    s.prompt_b = static_cast<int32_t>(b.size());
    s.a = greedy(model, a, s.n_decode);
    s.b = greedy(model, b, s.n_decode);
    return s;
}

/// Row `i` of logits [rows, vocab].
std::vector<float> row(const std::vector<float> & l, int64_t i, int32_t vocab) {
    return {l.begin() + i * vocab, l.begin() + (i + 1) * vocab};
}

/// tp = 2 and tp = 4 (where they divide the model) against tp = 1.
void check_against_tp1(const fs::path & model, std::initializer_list<int> tps) {
    const auto cfg = model::load_model_config(model);
    const int32_t V = cfg.vocab_size;
    const Scenario s = scenario(model);
    std::vector<int32_t> tables;
    const auto steps = build_steps(s, tables);
    const auto ref = run_tp({.model = model}, 1, steps, V);
    const int64_t rows = n_logit_rows(steps), alone = 1 + s.n_decode;
    for (int tp : tps) {
        CAPTURE(tp);
        const auto got = run_tp({.model = model}, tp, steps, V);
        double max_err = 0.0;
        for (size_t i = 0; i < got.size(); ++i) { max_err = std::max(max_err, double(std::fabs(got[i] - ref[i]))); }
        MESSAGE(model.filename().string(), " tp=", tp, ": max |logit - tp1 logit| = ", max_err);
        CHECK(max_err < 1e-4);
        CHECK(max_err > 0.0);  // the partial sums really were split (not a copy of tp 1)
        for (int64_t i = 0; i < rows; ++i) {  // greedy: the same argmax at every step
            const auto g = row(got, i, V), r = row(ref, i, V);
            CHECK(std::max_element(g.begin(), g.end()) - g.begin() == std::max_element(r.begin(), r.end()) - r.begin());
        }
        // The greedy tokens themselves: A's continuation is the argmax of the previous step.
        for (int32_t d = 0; d < s.n_decode; ++d) {
            const auto g = row(got, d, V);
            CHECK(std::max_element(g.begin(), g.end()) - g.begin() == s.a[s.prompt_a + d]);
        }
        // Batch invariance within this tp: A's rows batched with B (phase 2, even rows) are
        // bitwise A's rows alone (phase 1).
        for (int64_t d = 0; d < alone; ++d) {
            CAPTURE(d);
            CHECK(row(got, alone + 2 * d, V) == row(got, d, V));
        }
    }
}

/// A Comm that only says its rank (layout checks build Workers without peers).
class LayoutOnlyComm final : public comm::Comm {
public:
    LayoutOnlyComm(int32_t rank, int32_t world) : rank_(rank), world_(world) {}
    const char * name() const override { return "layout-only"; }
    int32_t rank() const override { return rank_; }
    int32_t world_size() const override { return world_; }
    bool connected() const override { return true; }
    void connect(int64_t) override {}
    void disconnect() override {}
    void all_reduce_sum(float *, int64_t) override { FAIL("no collectives here"); }
    void gather(const float *, int64_t, float *) override { FAIL("no collectives here"); }
    void barrier() override {}

private:
    int32_t rank_, world_;
};

using fd::test::error_of;

}  // namespace

TEST_SUITE("model::tp_forward") {

TEST_CASE("stories260K: tp 2 and 4 match tp 1 (logits, greedy tokens), batch invariant within each tp") {
    check_against_tp1(kStories, {2, 4});
}

TEST_CASE("random Qwen2 (q/k/v biases, F32): tp 2 on 2 kv heads, tp 2 and 4 on 4 kv heads") {
    test::TempDir d;
    fd::test::make_random_checkpoint(d.path / "q2", "--preset tiny-qwen2");
    check_against_tp1(d.path / "q2", {2});
    fd::test::make_random_checkpoint(d.path / "q4", "--preset tiny-qwen2 --kv-heads 4 --seed 3");
    check_against_tp1(d.path / "q4", {2, 4});
}

TEST_CASE("random Qwen3 (q_norm / k_norm per head, head_dim 128 != hidden / heads): tp 2 matches tp 1") {
    test::TempDir d;
    fd::test::make_random_checkpoint(d.path, "--preset qwen3-like");
    check_against_tp1(d.path, {2});
}

TEST_CASE("random BF16 checkpoint in 3 shards, untied head: tp 2 and 4 match tp 1") {
    test::TempDir d;
    fd::test::make_random_checkpoint(d.path, "--preset tiny-llama-bf16-sharded");
    check_against_tp1(d.path, {2, 4});
}

TEST_CASE("per-rank snapshot files load as they are; stage/commit and release/reload per rank switch every rank bitwise") {
    test::TempDir d;
    const fs::path a = d.path / "a", b = d.path / "b", snap_a = d.path / "snap_a", snap_b = d.path / "snap_b";
    fd::test::make_random_checkpoint(a, "--preset tiny-llama-bf16-sharded");
    fd::test::make_random_checkpoint(b, "--preset tiny-llama-bf16-sharded --seed 9");
    const auto cfg = model::load_model_config(a);
    const Scenario s = scenario(a);
    std::vector<int32_t> tables;
    const auto steps = build_steps(s, tables);
    for (int tp : {2, 4}) {
        CAPTURE(tp);
        fs::create_directories(snap_a);
        fs::create_directories(snap_b);
        for (int r = 0; r < tp; ++r) {
            write_rank_snapshot(a, tp, r, snap_a);
            write_rank_snapshot(b, tp, r, snap_b);
        }
        const auto full_a = run_tp({.model = a}, tp, steps, cfg.vocab_size);
        const auto full_b = run_tp({.model = b}, tp, steps, cfg.vocab_size);
        CHECK(full_a != full_b);
        // Loaded from the rank's own file: the same bytes as the slices of the full checkpoint.
        CHECK(run_tp({.model = a, .snapshot = true, .snapshot_dir = snap_a}, tp, steps, cfg.vocab_size) == full_a);
        // Loaded from a, then b's per-rank snapshot staged and committed on every rank.
        CHECK(run_tp({.model = a, .update_dir = snap_b}, tp, steps, cfg.vocab_size) == full_b);
        // Then released and reloaded from a's full checkpoint (each rank reads its slices).
        CHECK(run_tp({.model = a, .update_dir = snap_b, .reload_dir = a}, tp, steps, cfg.vocab_size) == full_a);
        fs::remove_all(snap_a);
        fs::remove_all(snap_b);
    }
}

TEST_CASE("the state dict RolloutModel publishes per rank is the layout each rank's Worker holds") {
    test::TempDir d;
    fd::test::make_random_checkpoint(d.path / "q", "--preset tiny-qwen2 --kv-heads 4");
    fd::test::make_random_checkpoint(d.path / "s", "--preset tiny-llama-bf16-sharded");
    for (const fs::path & m : {kStories, d.path / "q", d.path / "s"}) {
        const auto cfg = model::load_model_config(m);
        const auto idx = model::read_tensor_index(m);
        for (int tp : {1, 2, 4}) {
            const publish::RolloutModel rm(m, tp);
            int64_t total = 0;
            for (int r = 0; r < tp; ++r) {
                CAPTURE(m.filename().string());
                CAPTURE(tp);
                CAPTURE(r);
                LayoutOnlyComm comm(r, tp);
                model::Worker w(cfg, idx, worker_config(r, tp), tp > 1 ? &comm : nullptr);
                const auto sd = rm.state_dict(r);
                const auto & held = w.layout().tensors;
                REQUIRE(sd.size() == held.size());
                for (size_t i = 0; i < sd.size(); ++i) {
                    CHECK(sd[i].name == held[i].name);
                    CHECK(sd[i].shape == held[i].shape);
                    CHECK(sd[i].dtype == held[i].dtype);
                    total += held[i].bytes;
                }
                // The KV pool holds this rank's kv heads only.
                CHECK(w.kv_bytes() >= 96 * model::Worker::kv_block_bytes(cfg, kBlock, tp));
                CHECK(model::Worker::kv_block_bytes(cfg, kBlock, tp) * tp == model::Worker::kv_block_bytes(cfg, kBlock));
            }
            // Sharded tensors add up across ranks; replicated ones (norms) are on every rank.
            int64_t whole = 0, replicated = 0;
            for (const auto & t : rm.layout().tensors) {
                whole += t.bytes;
                replicated += t.shard == model::Shard::replicated ? t.bytes : 0;
            }
            CHECK(total == whole + (tp - 1) * replicated);
        }
    }
}

TEST_CASE("a tp that does not divide a dimension, a bad rank or a missing comm is invalid_argument naming it") {
    const auto cfg = model::load_model_config(kStories);
    const auto idx = model::read_tensor_index(kStories);
    std::string what;
    LayoutOnlyComm comm3(0, 3);
    CHECK(error_of([&] { model::Worker(cfg, idx, worker_config(0, 3), &comm3); }, &what) == Errc::invalid_argument);
    CHECK(what.find("num_attention_heads = 8") != std::string::npos);
    test::TempDir d;
    fd::test::make_random_checkpoint(d.path, "--preset tiny-qwen2");  // 2 kv heads
    LayoutOnlyComm comm4(0, 4);
    CHECK(error_of([&] { model::Worker(model::load_model_config(d.path), model::read_tensor_index(d.path), worker_config(0, 4), &comm4); },
                   &what) == Errc::invalid_argument);
    CHECK(what.find("num_key_value_heads = 2") != std::string::npos);
    CHECK(error_of([&] { model::Worker(cfg, idx, worker_config(0, 2), nullptr); }, &what) == Errc::invalid_argument);
    CHECK(what.find("needs a comm") != std::string::npos);
    LayoutOnlyComm comm2(0, 2);
    CHECK(error_of([&] { model::Worker(cfg, idx, worker_config(2, 2), &comm2); }) == Errc::invalid_argument);
}

}  // TEST_SUITE
