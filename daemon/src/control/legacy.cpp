// The legacy status word and the legacy pair (SPEC §4), driven from engine state: the service
// settles the word after every engine command (ControlCommand::on_done), and the legacy pair
// holds it at CLEARING/UPDATING while its sleep/wakeup runs.
#include "fd/control/legacy.h"

#include "fd/engine/engine.h"
#include "fd/log.h"

#include <chrono>

namespace fd::control {
namespace {

using shm::WeightsStatus;

WeightsStatus settled(const engine::EngineState & st) {
    return st.weight_asleep || st.kv_asleep ? WeightsStatus::cleared : WeightsStatus::normal;
}

}  // namespace

bool LegacyWord::transition(WeightsStatus from, WeightsStatus to) {
    int32_t expected = static_cast<int32_t>(from);
    return word_.load()->compare_exchange_strong(expected, static_cast<int32_t>(to));
}

void LegacyWord::attach(std::atomic<int32_t> * word) {
    word->store(word_.load()->load());
    word_.store(word);
}

void LegacyWord::detach() {
    own_.store(word_.load()->load());
    word_.store(&own_);
}

void LegacyWord::settle(const engine::EngineState & st) {
    // CAS, never a blind store: a legacy operation moving the word to CLEARING/UPDATING meanwhile wins.
    auto * w = word_.load();
    int32_t cur = w->load();
    while (cur == static_cast<int32_t>(WeightsStatus::normal) || cur == static_cast<int32_t>(WeightsStatus::cleared)) {
        if (w->compare_exchange_weak(cur, static_cast<int32_t>(settled(st)))) { return; }
    }
}

void LegacyWord::finish(WeightsStatus during, const engine::EngineState & st) { transition(during, settled(st)); }

LegacyAnswer run_legacy(engine::Engine & engine, LegacyWord & word, engine::ControlOp op, double timeout_s) {
    const bool clear = op == engine::ControlOp::clear_load_weight;
    const auto cur   = word.status();
    // CLEARED settles when either tag sleeps (the engine cannot serve): a clear after a V1 sleep
    // of one tag still releases the other (a probe: "model weight is cleared" with the weights
    // resident after sleep?tags=kv_cache).
    const auto st           = engine.stats().state;
    const bool all_released = st.weight_asleep && st.kv_asleep;
    if (clear) {
        switch (cur) {
            case WeightsStatus::cleared:
                if (all_released) { return {200, "model weight is cleared"}; }
                break;
            case WeightsStatus::clearing: return {400, "worker is clearing model weight already"};
            case WeightsStatus::updating: return {403, "worker is updating model weight, cannot clear now"};
            case WeightsStatus::normal: break;
        }
    } else {
        switch (cur) {
            case WeightsStatus::normal: return {200, "model weight is updated"};
            case WeightsStatus::updating: return {400, "worker is updating model weight already"};
            case WeightsStatus::clearing: return {403, "worker is clearing model weight, cannot update now"};
            case WeightsStatus::cleared: break;
        }
    }
    const WeightsStatus from   = clear ? cur : WeightsStatus::cleared;
    const WeightsStatus during = clear ? WeightsStatus::clearing : WeightsStatus::updating;
    const WeightsStatus target = clear ? WeightsStatus::cleared : WeightsStatus::normal;
    const char * what = clear ? "clear model weight" : "update model weight";
    auto timed_out = [&] { return LegacyAnswer{404, fmt::format("{} timeout", what), engine.stats().state.last_control_error}; };
    if (!word.transition(from, during)) { return timed_out(); }
    // The same work as V1 sleep/wakeup of both tags; the word stays CLEARING/UPDATING meanwhile
    // and settles when the engine finishes (on its thread), whether or not we still wait.
    engine::ControlCommand cmd{.op = clear ? engine::ControlOp::sleep : engine::ControlOp::wakeup, .tags = {true, true}};
    cmd.on_done = [&word, &engine, during, clear](const engine::ControlResult & r) {
        if (r.error) { log::get("control")->error("legacy {} failed: {}", clear ? "clear" : "update", r.error->what()); }
        word.finish(during, engine.stats().state);
    };
    // Gated: a command still queued at the timeout (behind a draining pause, say) is withdrawn
    // and never runs, so a "timeout" answer never takes effect later (SPEC §8.7; a probe saw the
    // weights cleared minutes after the 404). Its dropped answer settles the word back.
    const auto wait = std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
    auto gate = std::make_shared<engine::LocalStartGate>(std::chrono::steady_clock::now() + wait);
    cmd.gate  = gate;
    auto fut  = engine.control(std::move(cmd));
    if (fut.wait_for(wait) != std::future_status::ready) {
        if (gate->cancel()) { return timed_out(); }
        // It had started: its answer is the truth, once it comes (every engine op bounds its
        // own waits by --control-timeout-s; the hour is a backstop, not a deadline).
        if (fut.wait_for(std::chrono::hours(1)) != std::future_status::ready) { return timed_out(); }
    }
    const engine::ControlResult r = fut.get();
    if (r.held) { r.held->release(); }
    if (word.status() != target) { return timed_out(); }
    return {200, fmt::format("{} successfully", what)};
}

}  // namespace fd::control
