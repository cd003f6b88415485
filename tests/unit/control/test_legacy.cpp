// The legacy status word (control/legacy.cpp) and the events a control command holds back, over
// the Engine with a FakeExecutor (tests/unit/engine/fake_executor.h) and the control service:
// the word is the control layer's now, driven from engine state.
#include "fd/control/service.h"
#include "fd/engine/engine.h"

#include "../engine/fake_executor.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <thread>

using namespace fd::engine;
using fd::control::ControlService;
using fd::shm::MailboxCommand;
using fd::shm::WeightsStatus;
using fd::test::FakeExecutor;
using namespace std::chrono_literals;

namespace {

struct Harness {
    FakeExecutor * ex = nullptr;  // owned by the engine
    std::unique_ptr<Engine> engine;
    std::unique_ptr<ControlService> control;

    explicit Harness(double legacy_timeout_s = 10.0, int control_delay_ms = 0) {
        auto fake = std::make_unique<FakeExecutor>(2, 32);
        ex = fake.get();
        EngineConfig cfg;
        cfg.max_model_len          = 200;
        cfg.debug_control_delay_ms = control_delay_ms;
        engine = std::make_unique<Engine>(cfg, std::move(fake), std::make_shared<fd::test::FakeTokenizer>(32),
                                          fd::kv::KvCacheConfig{.n_blocks = 64, .block_size_tokens = 4});
        control = std::make_unique<ControlService>(
            fd::control::ControlConfig{.dynamic_load_weight = true, .legacy_timeout_s = legacy_timeout_s}, *engine);
        engine->start();
    }
    ~Harness() { engine->stop(); }  // the service outlives the engine's last answers, as in main.cpp

    /// {status, msg} of a legacy answer.
    std::pair<int, std::string> legacy(const char * op) {
        const auto r = control->handle(MailboxCommand{.op = op});
        return {r.http_status, nlohmann::json::parse(r.body).value("msg", "")};
    }
    WeightsStatus word() const { return control->legacy_word().status(); }
};

}  // namespace

TEST_CASE("legacy word: clear_load_weight sleeps and settles CLEARED; update_model_weight reloads, NORMAL; V1 settles it too") {
    Harness h;
    CHECK(h.word() == WeightsStatus::normal);
    CHECK_FALSE(h.control->legacy_word().transition(WeightsStatus::cleared, WeightsStatus::updating));  // not from NORMAL
    CHECK(h.legacy("update_model_weight") == std::pair<int, std::string>{200, "model weight is updated"});  // nothing to do
    CHECK(h.ex->count("reload") == 0);
    CHECK(h.legacy("clear_load_weight") == std::pair<int, std::string>{200, "clear model weight successfully"});
    CHECK(h.word() == WeightsStatus::cleared);
    CHECK(h.ex->count("release:weight") == 1);
    CHECK(h.ex->count("release:kv_cache") == 1);
    CHECK(h.engine->stats().state.weight_asleep);
    CHECK(h.legacy("clear_load_weight") == std::pair<int, std::string>{200, "model weight is cleared"});
    CHECK(h.ex->count("release:weight") == 1);
    CHECK(h.legacy("update_model_weight") == std::pair<int, std::string>{200, "update model weight successfully"});
    CHECK(h.word() == WeightsStatus::normal);
    CHECK(h.ex->count("reload") == 1);
    CHECK(h.ex->count("acquire_kv") == 1);
    CHECK_FALSE(h.engine->stats().state.weight_asleep);
    // A V1 sleep settles the word too; a V1 wakeup of that tag brings it back.
    CHECK(h.control->handle(MailboxCommand{.op = "sleep", .tags = "kv_cache"}).http_status == 200);
    CHECK(h.word() == WeightsStatus::cleared);
    CHECK(h.control->handle(MailboxCommand{.op = "wakeup", .tags = "kv_cache"}).http_status == 200);
    CHECK(h.word() == WeightsStatus::normal);
}

TEST_CASE("legacy word: while a legacy operation holds it, the other is 403 and the same one 400; V1 commands leave it alone") {
    Harness h;
    REQUIRE(h.control->legacy_word().transition(WeightsStatus::normal, WeightsStatus::clearing));
    CHECK(h.legacy("clear_load_weight") == std::pair<int, std::string>{400, "worker is clearing model weight already"});
    CHECK(h.legacy("update_model_weight") == std::pair<int, std::string>{403, "worker is clearing model weight, cannot update now"});
    CHECK(h.control->handle(MailboxCommand{.op = "pause"}).http_status == 200);
    CHECK(h.word() == WeightsStatus::clearing);  // settle() never overrides an operation in flight
    h.control->legacy_word().finish(WeightsStatus::clearing, h.engine->stats().state);
    CHECK(h.word() == WeightsStatus::normal);  // nothing asleep
}

TEST_CASE("legacy word: attach carries the value into the block's word, detach carries it back") {
    fd::control::LegacyWord w;
    REQUIRE(w.transition(WeightsStatus::normal, WeightsStatus::cleared));
    std::atomic<int32_t> block{0};
    w.attach(&block);
    CHECK(block.load() == static_cast<int32_t>(WeightsStatus::cleared));
    REQUIRE(w.transition(WeightsStatus::cleared, WeightsStatus::updating));
    CHECK(block.load() == static_cast<int32_t>(WeightsStatus::updating));
    w.detach();
    block.store(0);
    CHECK(w.status() == WeightsStatus::updating);
}

TEST_CASE("held events: a pause's aborted requests get their final event only when the service releases it") {
    Harness h;
    h.ex->step_delay_ms = 5;
    GenerateRequest req;
    req.prompts = {{1}};
    req.params.max_tokens  = 150;
    req.params.temperature = 0.0f;
    req.channel = std::make_shared<ResultChannel>(1, true);
    auto ch = req.channel;
    h.engine->submit(std::move(req));
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (ch->pop_all(20ms).empty()) { REQUIRE(std::chrono::steady_clock::now() < deadline); }
    // Straight to the engine: the result holds the abort event back ...
    auto fut = h.engine->control(ControlCommand{.op = ControlOp::pause});
    REQUIRE(fut.wait_for(10s) == std::future_status::ready);
    ControlResult r = fut.get();
    CHECK(r.n_aborted == 1);
    REQUIRE(r.held);
    std::this_thread::sleep_for(20ms);
    bool finished = false;
    for (const auto & ev : ch->pop_all(0ms)) { finished |= ev.finish != FinishReason::none; }
    CHECK_FALSE(finished);
    // ... until released (the control service's explicit call once it has its reply).
    r.held->release();
    for (const auto & ev : ch->pop_all(100ms)) { finished |= ev.finish == FinishReason::abort; }
    CHECK(finished);
}

TEST_CASE("legacy word: a clear that timed out while queued never runs later") {
    // A probe: clear_load_weight queued behind a draining pause answered 404 "timeout" after
    // 300 s, and the weights were cleared when the drain ended (SPEC §8.7). Here every engine
    // command takes 0.5 s (the debug delay), a pause holds the engine, and the legacy wait is 0.2 s.
    Harness h(0.2, 500);
    std::thread pause([&] { CHECK(h.control->handle(MailboxCommand{.op = "pause"}).http_status == 200); });
    std::this_thread::sleep_for(100ms);  // the pause is in the engine
    CHECK(h.legacy("clear_load_weight") == std::pair<int, std::string>{404, "clear model weight timeout"});
    pause.join();
    std::this_thread::sleep_for(800ms);  // long past when the withdrawn sleep would have run
    CHECK(h.ex->count("release:weight") == 0);
    CHECK_FALSE(h.engine->stats().state.weight_asleep);
    CHECK(h.word() == WeightsStatus::normal);
}
