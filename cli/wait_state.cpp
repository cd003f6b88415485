#include "wait_state.h"

#include "fd/status.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <thread>

namespace fdctl {

bool state_reached(const std::string & health, const std::string & until, std::string & state) {
    const auto j = nlohmann::json::parse(health, nullptr, false);
    if (!j.is_object()) {
        state = "?";
        return false;
    }
    state = j.value("state", "?");
    // The names are /health's `state` values; paused also holds while sleeping (sleep implies pause).
    return until == "serving" ? state == "serving" : until == "paused" ? j.value("is_paused", false) : state == "sleeping";
}

namespace {

/// /health's failed ranks and the reason (`degraded_ranks`, `last_control_error`), for the message.
std::string degraded_reason(const std::string & health) {
    const auto j = nlohmann::json::parse(health, nullptr, false);
    std::string out = "ranks ";
    out += j.is_object() && j.contains("degraded_ranks") ? j["degraded_ranks"].dump() : "?";
    if (j.is_object() && j.contains("last_control_error") && j["last_control_error"].is_string()) {
        out += ": " + j["last_control_error"].get<std::string>();
    }
    return out;
}

}  // namespace

WaitOutcome wait_until(const std::function<Reply(double left_s)> & status, const std::string & until, double timeout_s) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    WaitOutcome w{.state = "unreachable"};
    while (std::chrono::steady_clock::now() < deadline) {
        try {
            const double left = std::max(0.05, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count());
            const Reply r = status(left);
            const bool reached = state_reached(r.body, until, w.state);
            // A lost rank does not clear by waiting (only a wakeup recovers it), and its state also
            // reads as paused: answered at once as the rank failure (a probe: --until serving waited
            // the whole timeout, --until paused exited 0 on a dead rank).
            if (w.state == "degraded") {
                w.body      = r.body;
                w.code      = fd::Errc::rank_failed;
                w.exit_code = fd::errc_info(w.code).exit_code;
                w.message   = fmt::format("state is 'degraded': a rank failed ({}); fdctl wakeup (POST /v1/wakeup) recovers it",
                                          degraded_reason(r.body));
                return w;
            }
            if (reached) {
                w.body = r.body;
                return w;
            }
        } catch (const fd::Error & e) {
            if (e.code() != fd::Errc::unreachable && e.code() != fd::Errc::timeout) { throw; }
            w.state = e.code() == fd::Errc::timeout ? "not answering (stopped or stalled)" : "unreachable";
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    w.exit_code = fd::errc_info(fd::Errc::timeout).exit_code;
    w.message   = fmt::format("state is still '{}', not {} after {} s", w.state, until, timeout_s);
    return w;
}

}  // namespace fdctl
