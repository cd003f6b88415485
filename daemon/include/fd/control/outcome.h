// fd/control/outcome.h — the typed result of one control command (ControlService::run), before
// any transport shape: fd/control/render.h turns it into the V1 body (HTTP and the shm reply)
// and each peer's shape; the vLLM/SGLang aliases read its fields directly.
#pragma once

#include "fd/engine/engine.h"
#include "fd/progress.h"
#include "fd/shm/weights_status.h"
#include "fd/status.h"

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fd::control {

/// What GET /health and the `status` op report (render: status_json).
struct StatusReport {
    engine::EngineStats                   stats;
    bool                                  draining = false;
    std::string                           model;              ///< --served-model-name
    std::string                           compute_dtype;      ///< --compute-dtype as served ("float32" | "bfloat16")
    shm::WeightsStatus                    model_weights_status = shm::WeightsStatus::normal;  ///< the legacy word
    int64_t                               rss_bytes = 0;      ///< the daemon and its rank processes
    std::vector<runtime::RankDevice>      devices;            ///< CUDA ranks (empty on cpu)
    std::optional<ProgressSnapshot>       progress;           ///< the long phase running now
    std::chrono::steady_clock::time_point taken{};            ///< when (device_memory age_s counts from it)
};

/// An answer of the legacy pair (SPEC §4), FastDeploy's: {"msg"[, "error"]} with its status, or
/// (disabled) FastDeploy's 404 error object "Dynamic Load Weight Disabled.".
struct LegacyAnswer {
    int         http_status = 200;
    std::string msg;
    std::string error;            ///< the last control error on a timeout ("" = none)
    bool        disabled = false; ///< --dynamic-load-weight is off
};

/// One command's outcome. Exactly one of: error; legacy; status (op status); state (op
/// is_paused); else result (an engine operation; also the legacy pair under
/// FD_ENABLE_V1_UPDATE_WEIGHTS, whose op is then sleep or wakeup).
struct ControlOutcome {
    engine::ControlOp                  op = engine::ControlOp::status;
    std::optional<Error>               error;   ///< the command failed or was refused: nothing changed (SPEC §3)
    engine::ControlResult              result;  ///< an engine operation's result (its held events handed to the release: null)
    std::optional<engine::EngineState> state;   ///< is_paused: the engine state when asked
    std::optional<StatusReport>        status;  ///< status
    std::optional<LegacyAnswer>        legacy;  ///< clear_load_weight / update_model_weight

    /// Succeeded (a legacy answer succeeds when its status is 200).
    bool ok() const { return !error && (!legacy || legacy->http_status == 200); }
};

}  // namespace fd::control
