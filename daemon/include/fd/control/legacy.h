// fd/control/legacy.h — FastDeploy's `model_weights_status` word (SPEC §4), owned by the control
// layer and driven from engine state; the engine knows nothing of it.
//
// Values (shm::WeightsStatus): NORMAL 0, UPDATING 1, CLEARING -1, CLEARED -2. The word is CLEARED
// while a tag is asleep, else NORMAL; the legacy pair moves it NORMAL → CLEARING → CLEARED
// (/clear_load_weight) and CLEARED → UPDATING → NORMAL (/update_model_weight) around a sleep or
// wakeup of both tags. It lives in this process until the shm watcher attaches it to the
// control block (fdctl and /metrics read it there).
#pragma once

#include "fd/control/outcome.h"
#include "fd/engine/control.h"
#include "fd/shm/weights_status.h"

#include <atomic>
#include <cstdint>

namespace fd::engine { class Engine; }

namespace fd::control {

class LegacyWord {
public:
    shm::WeightsStatus status() const { return static_cast<shm::WeightsStatus>(word_.load()->load()); }
    /// Compare-and-set from → to. False (nothing changed) when the word is not `from`.
    bool transition(shm::WeightsStatus from, shm::WeightsStatus to);
    /// Keep the word in `word` (the control block's) from now on; its value carries over.
    void attach(std::atomic<int32_t> * word);
    /// Back to the word of this process (before the block `word` pointed into goes away).
    void detach();
    /// After any command: CLEARED while a tag is asleep, else NORMAL. Left alone while a legacy
    /// operation holds it at CLEARING or UPDATING.
    void settle(const engine::EngineState & st);
    /// A legacy operation that held the word at `during` ended: CLEARED while a tag is asleep, else NORMAL.
    void finish(shm::WeightsStatus during, const engine::EngineState & st);

private:
    std::atomic<int32_t>                own_{static_cast<int32_t>(shm::WeightsStatus::normal)};
    std::atomic<std::atomic<int32_t> *> word_{&own_};
};

/// Run /clear_load_weight (`op` clear_load_weight) or /update_model_weight through `word`: answer
/// from the current word (already there, or the other operation in flight: 400/403), else move
/// it to CLEARING/UPDATING, run sleep/wakeup of both tags on the engine and wait for it at most
/// `timeout_s`. 200 with FastDeploy's message when the word settled at CLEARED/NORMAL; 404
/// "... timeout" (with the last control error) otherwise, the word then settling whenever the
/// engine finishes. Never throws.
LegacyAnswer run_legacy(engine::Engine & engine, LegacyWord & word, engine::ControlOp op, double timeout_s);

}  // namespace fd::control
