// cli/wait_state.h — `fdctl wait --until STATE`: poll a daemon's /health until its state holds,
// bounded by --timeout (one daemon, or each daemon of a fleet in parallel: cli/fleet.cpp).
#pragma once

#include "transport.h"

#include "fd/status.h"

#include <functional>
#include <string>

namespace fdctl {

struct WaitOutcome {
    int         exit_code = 0;  ///< 0 reached; else fdctl's timeout code, or rank_failed's (14) when the daemon is degraded
    std::string state;          ///< /health's last `state` ("unreachable" if never answered)
    std::string body;           ///< the last /health body (when reached)
    std::string message;        ///< why not (on timeout, or degraded)
    fd::Errc    code = fd::Errc::timeout;  ///< the error when not reached: timeout, or rank_failed (degraded)
};

/// True when /health body `health` satisfies `until`: serving | paused (also while sleeping:
/// sleep implies pause) | sleeping. `state` gets /health's `state`.
bool state_reached(const std::string & health, const std::string & until, std::string & state);

/// Call `status(left_s)` (a /health call given what is left of `timeout_s`) every 50 ms until
/// the state holds or `timeout_s` passes. unreachable and timeout answers count as "not yet";
/// a degraded daemon (a rank failed: only a wakeup recovers it) ends the wait at once with
/// rank_failed's exit code; any other error propagates.
/// Errors  what `status` throws besides unreachable/timeout.
WaitOutcome wait_until(const std::function<Reply(double left_s)> & status, const std::string & until, double timeout_s);

}  // namespace fdctl
