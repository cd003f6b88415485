// tests/bench/control_analysis.h — stage-by-stage timing of the weight-control paths.
#pragma once

#include "fd/checkpoint/model_config.h"

#include <nlohmann/json.hpp>

#include <string>

namespace fd::bench {

/// Time each stage of update, wakeup and sleep for the checkpoint in `dir` (validate, fill a
/// resident or fresh arena on 1 or `n_threads` threads, unmap), against `memcpy_bps` bytes/s.
nlohmann::ordered_json analyse(const std::string & dir, const fd::model::ModelConfig & cfg, double memcpy_bps, int n_threads);

}  // namespace fd::bench
