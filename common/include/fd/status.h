// fd/status.h — the one error-code table of fdrollout and fdctl.
//
// Every expected failure is an `fd::Error` carrying an `Errc`. Its snake_case name is the
// `error.type` in JSON bodies; the table below maps it to the HTTP status and the exit code of
// fdctl (and of fdrollout when start-up fails). Part of the shm contract: fdctl links it too.
// Broken invariants (our bugs) use FD_CHECK, which throws fd::Error{Errc::internal}.
//
// fdctl exit codes: 0 success, 2 usage error (nothing sent), then one per type below.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <string_view>

namespace fd {

enum class Errc {
    ok,
    invalid_argument,    ///< request, tag, version string or flag is wrong
    unauthorized,        ///< missing or wrong API key
    forbidden,           ///< a file or shm object the daemon must trust is owned or writable by another user
    not_found,           ///< model, version, file or route missing; dynamic loading off
    wrong_state,         ///< operation not allowed in the current engine state
    invalid_checkpoint,  ///< names/shapes/dtypes/sizes do not match the model
    checksum_mismatch,   ///< a file or tensor differs from its manifest
    engine_paused,       ///< generation refused while paused/asleep/cleared (shutdown: shutting_down)
    source_unavailable,  ///< weight source unreachable
    timeout,             ///< a wait ran out
    unreachable,         ///< fdctl only: no daemon on that port/socket
    rank_failed,         ///< a tensor-parallel rank died, hung or never joined (the message names it)
    internal,            ///< FD_CHECK fired
    shutting_down,       ///< the daemon is draining or stopping (SIGTERM/SIGINT): retry on another replica.
                         ///< Last so that the numbers above, which ranks and nodes exchange, stay put.
};

struct ErrcInfo {
    Errc             code;
    std::string_view name;        ///< JSON `error.type`
    int              http_status; ///< 0 = never sent over HTTP
    int              exit_code;   ///< fdctl exit code
};

/// THE table. Order follows the enum.
inline constexpr ErrcInfo kErrcTable[] = {
    {Errc::ok,                 "ok",                 200, 0},
    {Errc::invalid_argument,   "invalid_argument",   400, 10},
    {Errc::unauthorized,       "unauthorized",       401, 9},
    {Errc::forbidden,          "forbidden",          403, 13},
    {Errc::not_found,          "not_found",          404, 3},
    {Errc::wrong_state,        "wrong_state",        409, 4},
    {Errc::invalid_checkpoint, "invalid_checkpoint", 422, 5},
    {Errc::checksum_mismatch,  "checksum_mismatch",  422, 11},
    {Errc::engine_paused,      "engine_paused",      503, 6},
    {Errc::source_unavailable, "source_unavailable", 503, 12},
    {Errc::timeout,            "timeout",            504, 7},
    {Errc::unreachable,        "unreachable",        0,   8},
    {Errc::rank_failed,        "rank_failed",        503, 14},
    {Errc::internal,           "internal",           500, 70},
    {Errc::shutting_down,      "shutting_down",      503, 15},
};

/// fdctl: the command line was wrong; nothing was sent.
inline constexpr int kExitUsage = 2;

constexpr const ErrcInfo & errc_info(Errc c) { return kErrcTable[static_cast<int>(c)]; }

/// The Errc named `name` (an `error.type`), or Errc::internal if unknown.
constexpr Errc errc_from_name(std::string_view name) {
    for (const auto & e : kErrcTable) {
        if (e.name == name) { return e.code; }
    }
    return Errc::internal;
}
constexpr std::string_view errc_name(Errc c) { return errc_info(c).name; }
constexpr int errc_http_status(Errc c) { return errc_info(c).http_status; }

/// An expected failure: a code from the table plus a message that says what to do next.
/// `param` names the offending request field when there is one (OpenAI error objects carry it).
class Error : public std::runtime_error {
public:
    Error(Errc code, std::string message, std::string param = {})
        : std::runtime_error(std::move(message)), code_(code), param_(std::move(param)) {}
    Errc code() const { return code_; }
    const std::string & param() const { return param_; }

private:
    Errc        code_;
    std::string param_;
};

/// Throw fd::Error{code, fmt::format(...)}.
template <typename... Args>
[[noreturn]] void fail(Errc code, fmt::format_string<Args...> f, Args &&... args) {
    throw Error(code, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace fd

/// Broken invariant: throws fd::Error{Errc::internal} naming the condition, file and line.
#define FD_CHECK(cond, ...)                                                                      \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            throw ::fd::Error(::fd::Errc::internal,                                              \
                              fmt::format("{}:{}: check `{}` failed: {}", __FILE__, __LINE__,    \
                                          #cond, fmt::format(__VA_ARGS__)));                     \
        }                                                                                        \
    } while (0)
