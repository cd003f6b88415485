// fd/log.h — one named spdlog logger per module.
//
// Library code calls fd::log::get("engine"). Until an executable calls fd::log::setup(), every
// logger is a null logger, so tests stay quiet. Only main() configures sinks and levels.
#pragma once

#include <spdlog/formatter.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace fd::log {

/// Returns the logger of `module` ("api", "engine", "kv", "model", "weights", "control").
/// Thread-safe. Never null.
std::shared_ptr<spdlog::logger> get(const std::string & module);

/// Installs a stderr sink with `level` ("trace".."critical", "off") for every module logger.
/// `format`: "text" (`2026-01-01T12:00:00.123 I [engine] message`) or "json" (one object per
/// line: {"time": ISO 8601 UTC with ms, "level", "logger", "msg", "pid", "thread"}, the message
/// JSON-escaped). Throws fd::Error{invalid_argument} on an unknown level or format name.
void setup(const std::string & level, const std::string & format = "text");

/// The "json" formatter of setup(), exposed for tests: renders `msg` as one JSON line.
std::unique_ptr<spdlog::formatter> make_json_formatter();

}  // namespace fd::log
