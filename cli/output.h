// cli/output.h — turning a daemon answer into fdctl's stdout and exit code.
#pragma once

#include "transport.h"

#include <string>

namespace fdctl {

/// Exit code for a daemon answer (the fd::Errc table in fd/status.h; legacy {"msg"} answers map
/// 400/403 → wrong_state, 404 "...timeout" → timeout, 404 "Dynamic Load Weight Disabled." → not_found).
int exit_code_for(const Reply & r);

/// One-line human summary of a successful answer to `op` (stdout without --json); `mode` is the
/// command's (flush_cache "device": the host KV tier was kept). Counts of ended or kept requests
/// are choices: a request with n > 1 counts n.
std::string human_summary(const std::string & op, const Reply & r, const std::string & mode = {});

/// The error message of a failed answer (stderr): "TYPE (HTTP status): message", the daemon's
/// route hints ("POST /v1/pause first") spoken as fdctl commands ("run `fdctl pause` first").
std::string error_message(const Reply & r);

}  // namespace fdctl
