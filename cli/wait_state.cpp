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

WaitOutcome wait_until(const std::function<Reply(double left_s)> & status, const std::string & until, double timeout_s) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    WaitOutcome w{.state = "unreachable"};
    while (std::chrono::steady_clock::now() < deadline) {
        try {
            const double left = std::max(0.05, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count());
            const Reply r = status(left);
            if (state_reached(r.body, until, w.state)) {
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
