// fd/log.h — one named spdlog logger per module.
//
// Library code calls fd::log::get("engine"). Until an executable calls fd::log::setup(), every
// logger is a null logger, so tests stay quiet. Only main() configures sinks and levels.
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace fd::log {

/// Returns the logger of `module` ("api", "engine", "kv", "model", "weights", "control").
/// Thread-safe. Never null.
std::shared_ptr<spdlog::logger> get(const std::string & module);

/// Installs a stderr sink with `level` ("trace".."critical", "off") for every module logger.
/// Throws fd::Error{invalid_argument} on an unknown level name.
void setup(const std::string & level);

}  // namespace fd::log
