#include "fd/log.h"

#include "fd/status.h"

#include <spdlog/sinks/null_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <map>
#include <mutex>

namespace fd::log {
namespace {

std::mutex                                              g_mu;
std::map<std::string, std::shared_ptr<spdlog::logger>> g_loggers;
spdlog::sink_ptr                                        g_sink;  // null until setup()
spdlog::level::level_enum                               g_level = spdlog::level::info;

}  // namespace

std::shared_ptr<spdlog::logger> get(const std::string & module) {
    std::lock_guard lk(g_mu);
    auto it = g_loggers.find(module);
    if (it != g_loggers.end()) { return it->second; }
    spdlog::sink_ptr sink = g_sink ? g_sink : std::make_shared<spdlog::sinks::null_sink_mt>();
    auto logger = std::make_shared<spdlog::logger>(module, sink);
    logger->set_level(g_sink ? g_level : spdlog::level::off);
    g_loggers.emplace(module, logger);
    return logger;
}

void setup(const std::string & level) {
    auto lvl = spdlog::level::from_str(level);
    if (lvl == spdlog::level::off && level != "off") {
        fail(Errc::invalid_argument, "unknown log level '{}' (trace, debug, info, warn, error, critical, off)", level);
    }
    std::lock_guard lk(g_mu);
    g_sink  = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    g_sink->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [%n] %v");
    g_level = lvl;
    for (auto & [name, logger] : g_loggers) {
        logger->sinks() = {g_sink};
        logger->set_level(lvl);
    }
}

}  // namespace fd::log
