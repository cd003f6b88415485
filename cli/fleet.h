// cli/fleet.h — `fdctl --fleet FILE` / `--hosts h1:p1,h2:p2`: one control command on every
// daemon of a fleet, in parallel, over the V1 HTTP API (SPEC §8 invariant 8, §9).
//
// pause, resume, sleep, wakeup, status, is-paused, stage/commit/drop run once per host; wait
// --until STATE polls every host's /health in parallel, each bounded by --timeout.
// update-weights is all-or-nothing across the fleet: stage (update_weights "commit": false) on
// every host; only if every host staged the same version, commit it everywhere; otherwise drop
// it where this update may have staged it (every host keeps its old version). Afterwards every host's /health must report the
// new weight_version, which the command checks.
//
// abort REQUEST_ID asks every host; the hosts that do not run it answer not_found, which is
// expected: 0 if some host aborted it, 3 if none runs it, 20 if a host did not answer (it may
// run there). abort --all is a plain per-host command.
//
// Exit codes (besides fdctl's table): 0 every host succeeded; the shared code when every host
// failed the same way (e.g. 8 all unreachable); kExitFleetPartial when some hosts failed (for
// update-weights: rolled back, every host still on its old version); kExitFleetInconsistent when
// an update committed on some hosts but not all, or the hosts serve different versions afterwards
// (also after a roll-back, on a fleet split before the update).
#pragma once

#include "fd/shm/control_client.h"

#include <string>
#include <vector>

namespace fdctl {

inline constexpr int kExitFleetPartial      = 20;
inline constexpr int kExitFleetInconsistent = 21;

struct FleetOptions {
    std::vector<std::string> hosts;       ///< base URLs (http://host:port)
    std::string              api_key;
    double                   timeout_s = 600.0;
    bool                     json  = false;
    bool                     quiet = false;
    std::string              until;           ///< wait: serving | paused | sleeping
};

/// The fleet's base URLs from `--fleet FILE` (one `host:port` or `http://host:port` per line;
/// blank lines and `#` comments skipped) and/or `--hosts` (comma-separated).
/// Errors  fd::Error{invalid_argument} on an unreadable file, an empty fleet, a malformed or
///         repeated entry.
std::vector<std::string> fleet_hosts(const std::string & file, const std::string & csv);

/// Run `cmd` on every host (see above); prints per-host results (text or --json) on stdout,
/// failures on stderr. Returns the exit code.
int run_fleet(const FleetOptions & o, const fd::shm::MailboxCommand & cmd);

}  // namespace fdctl
