#include "fd/log.h"
#include "fd/utf8.h"

#include "fd/status.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/null_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <unistd.h>

#include <ctime>
#include <map>
#include <mutex>

namespace fd::log {
namespace {

std::mutex                                              g_mu;
std::map<std::string, std::shared_ptr<spdlog::logger>> g_loggers;
spdlog::sink_ptr                                        g_sink;  // null until setup()
spdlog::level::level_enum                               g_level = spdlog::level::info;

/// Append `s` to `out` as the inside of a JSON string (RFC 8259 escapes; well-formed UTF-8 as
/// is, each ill-formed part as U+FFFD, utf8::lossy: a request path with a stray byte 0xE9 made a log line that no
/// JSON parser reads, a probe).
void json_escape(spdlog::string_view_t raw, spdlog::memory_buf_t & out) {
    static constexpr char kHex[] = "0123456789abcdef";
    const std::string s = utf8::lossy(std::string_view(raw.data(), raw.size()));
    for (const char ch : s) {
        const auto c = static_cast<unsigned char>(ch);
        switch (c) {
            case '"':  out.append(std::string_view("\\\"")); break;
            case '\\': out.append(std::string_view("\\\\")); break;
            case '\n': out.append(std::string_view("\\n")); break;
            case '\r': out.append(std::string_view("\\r")); break;
            case '\t': out.append(std::string_view("\\t")); break;
            default:
                if (c < 0x20) {
                    const char esc[] = {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 15]};
                    out.append(esc, esc + sizeof esc);
                } else {
                    out.push_back(ch);
                }
        }
    }
}

class JsonFormatter final : public spdlog::formatter {
public:
    void format(const spdlog::details::log_msg & msg, spdlog::memory_buf_t & dest) override {
        const auto since_epoch = msg.time.time_since_epoch();
        const auto secs = std::chrono::duration_cast<std::chrono::seconds>(since_epoch);
        const auto ms   = std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch - secs).count();
        const std::time_t t = secs.count();
        std::tm tm{};
        gmtime_r(&t, &tm);
        char ts[40];
        const size_t n = std::strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
        fmt::format_to(std::back_inserter(dest), "{{\"time\":\"{}.{:03d}Z\",\"level\":\"", std::string_view(ts, n), static_cast<int>(ms));
        const auto lvl = spdlog::level::to_string_view(msg.level);
        dest.append(lvl.data(), lvl.data() + lvl.size());
        dest.append(std::string_view("\",\"logger\":\""));
        json_escape(msg.logger_name, dest);
        dest.append(std::string_view("\",\"msg\":\""));
        json_escape(msg.payload, dest);
        fmt::format_to(std::back_inserter(dest), "\",\"pid\":{},\"thread\":{}}}\n", static_cast<int>(::getpid()), msg.thread_id);
    }
    std::unique_ptr<spdlog::formatter> clone() const override { return std::make_unique<JsonFormatter>(); }
};

}  // namespace

std::unique_ptr<spdlog::formatter> make_json_formatter() { return std::make_unique<JsonFormatter>(); }

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

void setup(const std::string & level, const std::string & format) {
    auto lvl = spdlog::level::from_str(level);
    if (lvl == spdlog::level::off && level != "off") {
        fail(Errc::invalid_argument, "--log-level '{}': unknown log level (trace, debug, info, warn, error, critical, off)", level);
    }
    if (format != "text" && format != "json") { fail(Errc::invalid_argument, "--log-format '{}': unknown log format (text, json)", format); }
    std::lock_guard lk(g_mu);
    g_sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    if (format == "json") {
        g_sink->set_formatter(make_json_formatter());
    } else {
        g_sink->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [%n] %v");
    }
    g_level = lvl;
    for (auto & [name, logger] : g_loggers) {
        logger->sinks() = {g_sink};
        logger->set_level(lvl);
    }
}

}  // namespace fd::log
