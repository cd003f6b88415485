// The rsync program run as a child of the daemon (rsync_source.cpp, rsync_delta.cpp): no shell,
// its own process group, output captured, killed at a deadline.
#pragma once

#include <string>
#include <vector>

namespace fd::weights {

struct ProcessResult {
    int         exit_code = -1;  ///< -1: killed by a signal
    bool        timed_out = false;
    std::string output;          ///< stdout + stderr, the last 8 KiB
};

/// Run argv (no shell) in its own process group with stdout+stderr captured; kill the group
/// with SIGKILL at `timeout_s` (seconds). `rsync_progress`: rsync --info=progress2 lines go to
/// fd::Progress::current() instead of the output. Errors  source_unavailable when the program
/// cannot start.
ProcessResult run_process(const std::vector<std::string> & argv, double timeout_s, bool rsync_progress = false);

/// `s` as one line for an error message (newlines as spaces, the last 600 characters).
std::string oneline(std::string s);

}  // namespace fd::weights
