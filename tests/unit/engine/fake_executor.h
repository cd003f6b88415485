// tests/unit/engine/fake_executor.h — an Executor with no model, for the Engine's unit tests.
//
// forward(): every logits row is -10 except the token after the row's input token
// ((token + 1) mod vocab), which is +10, so greedy decoding from a prompt ending in t yields
// t+1, t+2, ... (mod vocab): outputs have an independent reference.
// Every call is appended to log() ("forward", "stage", "commit", "drop", "release:weight",
// "release:kv_cache", "acquire_kv", "reload", "recover"); failures are injected per call kind.
// Called on the engine thread; the test reads log()/set fields between commands (the control
// future's completion orders them).
#pragma once

#include "fd/runtime/executor.h"
#include "fd/status.h"
#include "fd/tokenizer/tokenizer.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace fd::test {

class FakeExecutor final : public runtime::Executor {
public:
    explicit FakeExecutor(int32_t world = 2, int32_t vocab = 32) : world_(world) {
        cfg_.vocab_size = vocab;
        cfg_.hidden_size = 8;
        cfg_.intermediate_size = 8;
        cfg_.n_layers = 1;
        cfg_.n_heads = 1;
        cfg_.n_kv_heads = 1;
        cfg_.head_dim = 8;
        cfg_.max_position_embeddings = 256;
    }

    // --- what the test sets ---
    std::optional<Error>  fail_stage;          ///< thrown by the next stage_weights (then cleared)
    std::optional<Error>  fail_commit;         ///< thrown by the next commit_weights (then cleared)
    std::optional<Error>  fail_forward;        ///< thrown by every forward while set (until recover())
    std::vector<int32_t>  forward_failed_ranks;  ///< what failed_ranks() says once a forward failed
    std::optional<Error>  fail_reload;         ///< thrown by the next reload_weights (then cleared)
    std::optional<std::string> source_version = "src-1";  ///< the version a fetch reports
    std::atomic<int>      step_delay_ms{0};    ///< each forward sleeps this long (keeps requests in flight)

    std::vector<std::string> log() const {
        std::lock_guard lk(mu_);
        return log_;
    }
    int count(const std::string & what) const {
        int n = 0;
        for (const auto & s : log()) { n += s == what; }
        return n;
    }

    // --- Executor ---
    int32_t world_size() const override { return world_; }
    const model::ModelConfig & model_config() const override { return cfg_; }

    bool forward(const model::StepBatch & batch, float * logits, const std::atomic<bool> *) override {
        note("forward");
        if (step_delay_ms.load() > 0) { std::this_thread::sleep_for(std::chrono::milliseconds(step_delay_ms.load())); }
        if (fail_forward) {
            failed_ = forward_failed_ranks;
            throw *fail_forward;
        }
        const int32_t V = cfg_.vocab_size;
        for (size_t i = 0; i < batch.logits_rows.size(); ++i) {
            float * row = logits + i * static_cast<size_t>(V);
            for (int32_t v = 0; v < V; ++v) { row[v] = -10.0f; }
            row[(batch.tokens[static_cast<size_t>(batch.logits_rows[i])] + 1) % V] = 10.0f;
        }
        return true;
    }
    const float * forward_in_place(const model::StepBatch & batch, const std::atomic<bool> * abandon) override {
        buf_.resize(batch.logits_rows.size() * static_cast<size_t>(cfg_.vocab_size));
        return forward(batch, buf_.data(), abandon) ? buf_.data() : nullptr;
    }

    std::vector<runtime::RankReport> stage_weights(const weights::FetchRequest & req) override {
        note("stage");
        if (fail_stage) {
            const Error e = *fail_stage;
            fail_stage.reset();
            note("drop");  // the executor's contract: every staged copy dropped before it throws
            throw e;
        }
        return reports(req.version ? req.version : source_version, 1000);
    }
    std::vector<runtime::RankReport> commit_weights() override {
        note("commit");
        if (fail_commit) {
            const Error e = *fail_commit;
            fail_commit.reset();
            throw e;
        }
        return reports(std::nullopt, 0);
    }
    void drop_staged_weights() override { note("drop"); }
    /// A bare rank call: logged as "rank_call:<op>" (the engine makes one for sleep's
    /// cuda_graph tag: release_graphs, 7 bytes per rank).
    std::vector<runtime::RankReport> rank_call(const runtime::RankRequest & req) override {
        note(("rank_call:" + std::string(runtime::rank_op_name(req.op))).c_str());
        auto r = reports(std::nullopt, 0);
        if (req.op == runtime::RankOp::release_graphs) {
            for (auto & rep : r) { rep.freed_bytes = 7; }
        }
        return r;
    }
    std::vector<runtime::RankReport> release(runtime::MemoryTag tag) override {
        note(tag == runtime::MemoryTag::weight ? "release:weight" : tag == runtime::MemoryTag::kv_cache ? "release:kv_cache" : "release:other");
        auto r = reports(std::nullopt, 0);
        for (auto & rep : r) { rep.freed_bytes = 100; }
        return r;
    }
    std::vector<runtime::RankReport> acquire_kv() override {
        note("acquire_kv");
        return reports(std::nullopt, 0);
    }
    void swap_kv(const kv::BlockCopy *, int64_t, const kv::BlockCopy *, int64_t, const kv::BlockCopy *, int64_t) override { note("swap_kv"); }
    std::vector<runtime::RankReport> reload_weights(const weights::FetchRequest & req) override {
        note("reload");
        if (fail_reload) {
            const Error e = *fail_reload;
            fail_reload.reset();
            throw e;
        }
        return reports(req.serving_version.empty() ? source_version : std::optional(req.serving_version), 1000);
    }
    int64_t weight_bytes() const override { return 1000; }
    int64_t kv_bytes() const override { return 1000; }
    const char * backend() const override { return "mp"; }
    std::vector<int32_t> failed_ranks() override { return failed_; }
    void recover() override {
        note("recover");
        failed_.clear();
        fail_forward.reset();
    }

private:
    void note(const char * what) {
        std::lock_guard lk(mu_);
        log_.emplace_back(what);
    }
    std::vector<runtime::RankReport> reports(const std::optional<std::string> & version, int64_t bytes) const {
        std::vector<runtime::RankReport> r(static_cast<size_t>(world_));
        for (int32_t i = 0; i < world_; ++i) {
            r[i].rank    = i;
            r[i].version = version;
            r[i].bytes   = bytes;
        }
        return r;
    }

    int32_t                  world_;
    model::ModelConfig       cfg_;
    std::vector<float>       buf_;
    std::vector<int32_t>     failed_;  ///< engine thread only
    mutable std::mutex       mu_;
    std::vector<std::string> log_;
};

/// Token ids as text ("<5>"), no specials, no BOS/EOS: generation ends by max_tokens only.
class FakeTokenizer final : public tokenizer::Tokenizer {
public:
    explicit FakeTokenizer(int32_t vocab = 32) : vocab_(vocab) {}
    std::string_view kind() const override { return "fake"; }
    std::vector<int32_t> encode(std::string_view, bool) const override { return {1}; }
    std::string decode(std::span<const int32_t> ids, const tokenizer::DecodeOptions &) const override {
        std::string s;
        for (int32_t id : ids) { s += "<" + std::to_string(id) + ">"; }
        return s;
    }
    std::string piece(int32_t id) const override { return "<" + std::to_string(id) + ">"; }
    std::optional<int32_t> piece_to_id(std::string_view) const override { return std::nullopt; }
    int32_t vocab_size() const override { return vocab_; }
    std::optional<int32_t> bos_id() const override { return std::nullopt; }
    std::optional<int32_t> eos_id() const override { return std::nullopt; }
    bool is_special(int32_t) const override { return false; }
    std::vector<int32_t> special_ids() const override { return {}; }

private:
    int32_t vocab_;
};

}  // namespace fd::test
