// fd/shm/weights_status.h — the legacy `model_weights_status` word (SPEC.md §4).
//
// FastDeploy-compatible values, shared by the daemon (which reports it in /health and, later,
// writes it into the shared-memory control block) and fdctl (which reads it).
#pragma once

#include <cstdint>
#include <string_view>

namespace fd::shm {

/// The legacy status word. Values are part of the shm ABI: never renumber.
enum class WeightsStatus : int32_t {
    normal   = 0,   ///< weights loaded and serving (or servable once resumed)
    updating = 1,   ///< a reload is in progress
    clearing = -1,  ///< a clear (free weights + KV) is in progress
    cleared  = -2,  ///< weights and KV are freed; generation answers 503
};

/// "normal" | "updating" | "clearing" | "cleared".
constexpr std::string_view to_string(WeightsStatus s) {
    switch (s) {
        case WeightsStatus::normal:   return "normal";
        case WeightsStatus::updating: return "updating";
        case WeightsStatus::clearing: return "clearing";
        case WeightsStatus::cleared:  return "cleared";
    }
    return "unknown";
}

}  // namespace fd::shm
