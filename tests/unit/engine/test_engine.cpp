// The Engine (daemon/src/engine/engine*.cpp) over a FakeExecutor (fake_executor.h): no model,
// fixed logits (greedy output t+1, t+2, ... after a prompt ending in t), injectable failures.
// Pause modes, update / stage / commit / drop, a failed stage, a failed rank, sleep/wakeup
// ordering, each checked through the engine's public API (the legacy status word, which the
// control layer owns, is tested in tests/unit/control/test_legacy.cpp).
#include "fd/engine/engine.h"
#include "fd/status.h"

#include "fake_executor.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

using namespace fd::engine;
using fd::Errc;
using fd::test::FakeExecutor;
using namespace std::chrono_literals;

namespace {

constexpr int32_t kVocab = 32;

struct Harness {
    FakeExecutor * ex = nullptr;  // owned by the engine
    std::unique_ptr<Engine> engine;

    explicit Harness(EngineConfig cfg = {}) {
        auto fake = std::make_unique<FakeExecutor>(2, kVocab);
        ex = fake.get();
        cfg.max_model_len = 200;
        engine = std::make_unique<Engine>(cfg, std::move(fake), std::make_shared<fd::test::FakeTokenizer>(kVocab),
                                          fd::kv::KvCacheConfig{.n_blocks = 64, .block_size_tokens = 4});
        engine->start();
    }
    ~Harness() { engine->stop(); }

    /// Run a command and wait (10 s at most) for its result; the reply counts as sent (the
    /// events it held back are released, as the control service does).
    ControlResult control(ControlCommand cmd) {
        auto fut = engine->control(std::move(cmd));
        REQUIRE(fut.wait_for(10s) == std::future_status::ready);
        ControlResult r = fut.get();
        if (r.held) { r.held->release(); }
        return r;
    }
    ControlResult op(ControlOp o) { return control({.op = o}); }

    std::shared_ptr<ResultChannel> submit(std::vector<int32_t> prompt, int32_t max_tokens) {
        GenerateRequest req;
        req.prompts = {std::move(prompt)};
        req.params.max_tokens  = max_tokens;
        req.params.temperature = 0.0f;
        req.channel = std::make_shared<ResultChannel>(1, true);
        auto ch = req.channel;
        engine->submit(std::move(req));
        return ch;
    }
};

struct Choice {
    std::vector<int32_t> tokens;
    FinishReason         finish = FinishReason::none;
    std::string          version;  ///< of the last event
    std::optional<fd::Error> error;
};

/// Pop events until the choice finishes (10 s at most).
Choice collect(ResultChannel & ch, Choice c = {}) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (c.finish == FinishReason::none) {
        REQUIRE(std::chrono::steady_clock::now() < deadline);
        for (auto & ev : ch.pop_all(50ms)) {
            c.tokens.insert(c.tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
            if (!ev.weight_version.empty()) { c.version = ev.weight_version; }
            if (ev.error) { c.error = ev.error; }
            if (ev.finish != FinishReason::none) { c.finish = ev.finish; }
        }
    }
    return c;
}

/// Wait (10 s at most) for the first token of a running choice.
Choice first_tokens(ResultChannel & ch) {
    Choice c;
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (c.tokens.empty() && c.finish == FinishReason::none) {
        REQUIRE(std::chrono::steady_clock::now() < deadline);
        for (auto & ev : ch.pop_all(50ms)) {
            c.tokens.insert(c.tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
            if (ev.finish != FinishReason::none) { c.finish = ev.finish; }
        }
    }
    return c;
}

std::vector<int32_t> ramp_after(int32_t last, int n) {
    std::vector<int32_t> v;
    for (int i = 1; i <= n; ++i) { v.push_back((last + i) % kVocab); }
    return v;
}

Errc code_of(const ControlResult & r) { return r.error ? r.error->code() : Errc::ok; }

}  // namespace

TEST_CASE("engine: greedy output follows the executor's logits and carries the weight version") {
    Harness h;
    const Choice c = collect(*h.submit({3, 4}, 5));
    CHECK(c.tokens == ramp_after(4, 5));
    CHECK(c.finish == FinishReason::length);
    CHECK(c.version == "0");
    CHECK(h.ex->count("forward") >= 5);
    const Choice wrap = collect(*h.submit({30}, 3));
    CHECK(wrap.tokens == std::vector<int32_t>{31, 0, 1});
}

TEST_CASE("engine: pause mode=abort ends the running request, refuses new ones; resume reopens") {
    Harness h;
    h.ex->step_delay_ms = 5;
    auto ch = h.submit({1}, 150);
    first_tokens(*ch);
    const ControlResult p = h.control({.op = ControlOp::pause, .pause_mode = PauseMode::abort});
    CHECK_FALSE(p.error);
    CHECK(p.is_paused);
    CHECK(p.n_aborted == 1);
    CHECK(collect(*ch).finish == FinishReason::abort);
    CHECK_THROWS_AS(h.submit({1}, 2), fd::Error);
    CHECK(h.engine->stats().state.paused);
    const ControlResult r = h.op(ControlOp::resume);
    CHECK_FALSE(r.error);
    CHECK_FALSE(r.is_paused);
    h.ex->step_delay_ms = 0;
    CHECK(collect(*h.submit({1}, 2)).tokens == std::vector<int32_t>{2, 3});
}

TEST_CASE("engine: pause mode=keep freezes a request; resume continues it where it was") {
    Harness h;
    h.ex->step_delay_ms = 5;
    auto ch = h.submit({7}, 40);
    Choice c = first_tokens(*ch);
    const ControlResult p = h.control({.op = ControlOp::pause, .pause_mode = PauseMode::keep});
    CHECK_FALSE(p.error);
    CHECK(p.n_kept == 1);
    CHECK(h.engine->stats().state.pause_mode == PauseMode::keep);
    const int forwards = h.ex->count("forward");
    std::this_thread::sleep_for(50ms);
    CHECK(h.ex->count("forward") == forwards);  // no step runs while kept
    h.ex->step_delay_ms = 0;
    CHECK_FALSE(h.op(ControlOp::resume).error);
    c = collect(*ch, c);
    CHECK(c.finish == FinishReason::length);
    CHECK(c.tokens == ramp_after(7, 40));  // the same tokens as an uninterrupted run
}

TEST_CASE("engine: update_weights needs a pause, stages then commits on every rank, and new outputs carry the version") {
    Harness h;
    const ControlResult refused = h.control({.op = ControlOp::update_weights, .version = "v2"});
    CHECK(code_of(refused) == Errc::wrong_state);
    CHECK(h.ex->count("stage") == 0);  // refused before touching the ranks
    CHECK_FALSE(h.op(ControlOp::pause).error);
    const ControlResult u = h.control({.op = ControlOp::update_weights, .version = "v2"});
    CHECK_FALSE(u.error);
    CHECK(u.version == "v2");
    CHECK(u.ranks.size() == 2);
    CHECK(u.is_paused);  // an update never resumes
    const auto log = h.ex->log();
    const auto stage = std::find(log.begin(), log.end(), "stage");
    REQUIRE(stage != log.end());
    CHECK(std::find(stage, log.end(), "commit") != log.end());  // commit after stage
    CHECK_FALSE(h.op(ControlOp::resume).error);
    CHECK(collect(*h.submit({2}, 2)).version == "v2");
    // No version in the request: the source's.
    CHECK_FALSE(h.op(ControlOp::pause).error);
    CHECK(h.control({.op = ControlOp::update_weights}).version == "src-1");
}

TEST_CASE("engine: two-phase update: commit=false stages only; commit checks the version; drop forgets it") {
    Harness h;
    CHECK_FALSE(h.op(ControlOp::pause).error);
    const ControlResult s = h.control({.op = ControlOp::update_weights, .version = "v3", .commit = false});
    CHECK_FALSE(s.error);
    CHECK(s.staged);
    CHECK(h.ex->count("commit") == 0);
    CHECK(h.engine->stats().state.staged_version == "v3");
    CHECK(h.engine->stats().state.weight_version == "0");  // still serving the old one
    const ControlResult wrong = h.control({.op = ControlOp::commit_weights, .version = "v4"});
    CHECK(code_of(wrong) == Errc::wrong_state);
    CHECK(h.ex->count("commit") == 0);
    const ControlResult c = h.control({.op = ControlOp::commit_weights, .version = "v3"});
    CHECK_FALSE(c.error);
    CHECK(h.engine->stats().state.weight_version == "v3");
    CHECK(h.engine->stats().state.staged_version.empty());
    // Stage again, then drop: nothing serves it, the executor dropped its copies.
    CHECK_FALSE(h.control({.op = ControlOp::update_weights, .version = "v5", .commit = false}).error);
    const int drops = h.ex->count("drop");
    const ControlResult d = h.op(ControlOp::drop_staged_weights);
    CHECK(d.version == "v5");
    CHECK(h.ex->count("drop") == drops + 1);
    CHECK(h.engine->stats().state.weight_version == "v3");
    CHECK(code_of(h.op(ControlOp::commit_weights)) == Errc::wrong_state);  // nothing staged now
}

TEST_CASE("engine: a failed stage changes nothing: the old version keeps serving") {
    Harness h;
    CHECK_FALSE(h.op(ControlOp::pause).error);
    h.ex->fail_stage = fd::Error(Errc::invalid_checkpoint, "rank 1: bad shard");
    const ControlResult u = h.control({.op = ControlOp::update_weights, .version = "v9"});
    CHECK(code_of(u) == Errc::invalid_checkpoint);
    CHECK(h.ex->count("commit") == 0);
    const auto st = h.engine->stats().state;
    CHECK(st.weight_version == "0");
    CHECK(st.staged_version.empty());
    CHECK(st.last_control_error.find("bad shard") != std::string::npos);
    CHECK_FALSE(h.op(ControlOp::resume).error);
    CHECK(collect(*h.submit({5}, 1)).version == "0");
}

TEST_CASE("engine: a failed rank degrades the engine until wakeup recovers it") {
    Harness h;
    h.ex->forward_failed_ranks = {1};
    h.ex->fail_forward         = fd::Error(Errc::rank_failed, "rank 1 exited");
    const Choice c = collect(*h.submit({1}, 3));
    CHECK(c.finish == FinishReason::error);
    REQUIRE(c.error);
    CHECK(c.error->code() == Errc::rank_failed);
    const auto st = h.engine->stats().state;
    CHECK(st.degraded);
    CHECK(st.failed_ranks == std::vector<int32_t>{1});
    CHECK_THROWS_AS(h.submit({1}, 1), fd::Error);
    CHECK(code_of(h.op(ControlOp::resume)) == Errc::rank_failed);
    const ControlResult w = h.control({.op = ControlOp::wakeup, .tags = {true, true}});
    CHECK_FALSE(w.error);
    CHECK_FALSE(w.is_paused);
    // recover, then every rank takes the serving weights again over a fresh KV pool.
    const auto log = h.ex->log();
    const auto rec = std::find(log.begin(), log.end(), "recover");
    REQUIRE(rec != log.end());
    const std::vector<std::string> after(rec, log.end());
    CHECK(after == std::vector<std::string>{"recover", "release:weight", "acquire_kv", "reload"});
    CHECK_FALSE(h.engine->stats().state.degraded);
    CHECK(collect(*h.submit({1}, 2)).tokens == std::vector<int32_t>{2, 3});
}

TEST_CASE("engine: sleep releases kv_cache then weight; wakeup reloads the weights before mapping the KV") {
    Harness h;
    const ControlResult s = h.control({.op = ControlOp::sleep, .tags = {true, true}});
    CHECK_FALSE(s.error);
    CHECK(s.tags_done == std::vector<std::string>{"kv_cache", "weight"});
    CHECK(s.freed_weight_bytes == 200);  // 100 per rank, two ranks
    CHECK(s.freed_kv_bytes == 200);
    auto log = h.ex->log();
    CHECK(std::vector<std::string>(log.end() - 2, log.end()) == std::vector<std::string>{"release:kv_cache", "release:weight"});
    CHECK(code_of(h.op(ControlOp::resume)) == Errc::wrong_state);  // asleep: wakeup first
    const ControlResult again = h.control({.op = ControlOp::sleep, .tags = {true, false}});
    CHECK(again.tags_skipped == std::vector<std::string>{"weight"});
    const ControlResult w = h.control({.op = ControlOp::wakeup, .tags = {true, true}});
    CHECK_FALSE(w.error);
    CHECK(w.tags_done == std::vector<std::string>{"kv_cache", "weight"});
    log = h.ex->log();
    CHECK(std::vector<std::string>(log.end() - 2, log.end()) == std::vector<std::string>{"reload", "acquire_kv"});
    CHECK_FALSE(w.is_paused);
    CHECK(collect(*h.submit({4}, 2)).tokens == std::vector<int32_t>{5, 6});
}

TEST_CASE("engine: sleep's cuda_graph tag releases the graphs on every rank; not a sleeping state") {
    Harness h;
    const ControlResult s = h.control({.op = ControlOp::sleep, .tags = {false, false, true}});
    REQUIRE_FALSE(s.error);
    CHECK(s.tags_done == std::vector<std::string>{"cuda_graph"});
    CHECK(s.freed_graph_bytes == 14);  // 7 per rank, two ranks
    CHECK(s.freed_weight_bytes == -1);
    CHECK(s.freed_kv_bytes == -1);
    CHECK(h.ex->count("rank_call:release_graphs") == 1);
    CHECK(h.ex->count("release:weight") + h.ex->count("release:kv_cache") == 0);
    auto st = h.engine->stats().state;
    CHECK((st.paused && !st.weight_asleep && !st.kv_asleep));
    CHECK_FALSE(h.op(ControlOp::resume).error);  // nothing asleep
    CHECK(collect(*h.submit({4}, 2)).tokens == std::vector<int32_t>{5, 6});
    // all three: kv_cache, weight, cuda_graph, in that order; the wakeup lists it and resumes
    const ControlResult all = h.control({.op = ControlOp::sleep, .tags = TagSet::all()});
    CHECK(all.tags_done == std::vector<std::string>{"kv_cache", "weight", "cuda_graph"});
    CHECK(h.ex->count("rank_call:release_graphs") == 2);
    const ControlResult w = h.control({.op = ControlOp::wakeup, .tags = TagSet::all()});
    REQUIRE_FALSE(w.error);
    CHECK(w.tags_done == std::vector<std::string>{"kv_cache", "weight", "cuda_graph"});
    CHECK_FALSE(w.is_paused);
    // no tags named by a caller = weight + kv_cache (parse_tags), the graphs untouched
    CHECK_FALSE(h.control({.op = ControlOp::sleep, .tags = parse_tags("")}).error);
    CHECK(h.ex->count("rank_call:release_graphs") == 2);
}

TEST_CASE("engine: update_weights while the weights are released loads them at once, all-or-nothing") {
    // AReaL's colocated loop: release all, train, update_weights_from_disk, then resume all.
    Harness h;
    const std::string before = h.engine->stats().state.weight_version;
    CHECK_FALSE(h.control({.op = ControlOp::sleep, .tags = {true, true}}).error);
    h.ex->fail_reload = fd::Error(Errc::invalid_checkpoint, "tensor cut short");
    CHECK(code_of(h.control({.op = ControlOp::update_weights, .version = "v7"})) == Errc::invalid_checkpoint);
    auto st = h.engine->stats().state;
    CHECK((st.weight_asleep && st.kv_asleep && !st.weights_valid && st.weight_version == before));
    CHECK(code_of(h.control({.op = ControlOp::update_weights, .version = "v7", .commit = false})) == Errc::wrong_state);
    CHECK(h.ex->count("stage") == 0);
    const ControlResult u = h.control({.op = ControlOp::update_weights, .version = "v7"});
    REQUIRE_FALSE(u.error);
    CHECK(u.version == "v7");
    CHECK(u.tags_done == std::vector<std::string>{"weight"});
    CHECK(h.ex->count("reload") == 2);
    st = h.engine->stats().state;
    CHECK((!st.weight_asleep && st.kv_asleep && st.weights_valid && st.paused && st.weight_version == "v7"));
    const ControlResult w = h.control({.op = ControlOp::wakeup, .tags = {true, true}});
    REQUIRE_FALSE(w.error);
    CHECK(w.tags_skipped == std::vector<std::string>{"weight"});  // already loaded: not loaded again
    CHECK(h.ex->count("reload") == 2);
    CHECK(w.version == "v7");
    CHECK_FALSE(w.is_paused);
    const Choice c = collect(*h.submit({4}, 2));
    CHECK(c.version == "v7");
}

TEST_CASE("engine: a failed weight reload leaves every tag asleep") {
    Harness h;
    CHECK_FALSE(h.control({.op = ControlOp::sleep, .tags = {true, true}}).error);
    h.ex->fail_reload = fd::Error(Errc::source_unavailable, "source down");
    const ControlResult w = h.control({.op = ControlOp::wakeup, .tags = {true, true}});
    CHECK(code_of(w) == Errc::source_unavailable);
    const auto st = h.engine->stats().state;
    CHECK(st.weight_asleep);
    CHECK(st.kv_asleep);
    CHECK(h.ex->count("acquire_kv") == 0);
}

TEST_CASE("engine: with --use-cudagraph, wakeup takes the tags in either order; serving needs both") {
    // SGLang's staged resume (slime's onload_weights, then onload_kv with cuda_graph) and the
    // opposite order: the weights come back while the KV cache sleeps, the engine stays paused
    // (a resume is refused) until the last tag is back, then serves.
    for (const bool weights_first : {true, false}) {
        CAPTURE(weights_first);
        EngineConfig cfg;
        cfg.use_cudagraph = true;
        Harness h(cfg);
        CHECK_FALSE(h.control({.op = ControlOp::sleep, .tags = {true, true}}).error);
        const TagSet first = weights_first ? TagSet{true, false} : TagSet{false, true};
        const TagSet last  = weights_first ? TagSet{false, true} : TagSet{true, false};
        const ControlResult w = h.control({.op = ControlOp::wakeup, .tags = first});
        REQUIRE_FALSE(w.error);
        CHECK(h.ex->count("reload") == (weights_first ? 1 : 0));
        CHECK(h.ex->count("acquire_kv") == (weights_first ? 0 : 1));
        auto st = h.engine->stats().state;
        CHECK(st.weight_asleep == !weights_first);
        CHECK(st.kv_asleep == weights_first);
        CHECK(st.paused);
        CHECK(code_of(h.op(ControlOp::resume)) == Errc::wrong_state);
        CHECK_FALSE(h.control({.op = ControlOp::wakeup, .tags = last}).error);
        CHECK(h.ex->count("reload") == 1);
        CHECK(h.ex->count("acquire_kv") == 1);
        st = h.engine->stats().state;
        CHECK_FALSE(st.weight_asleep);
        CHECK_FALSE(st.kv_asleep);
        CHECK_FALSE(st.paused);  // the wakeup that brings the last tag back resumes
    }
}
