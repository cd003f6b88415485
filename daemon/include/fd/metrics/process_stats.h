// fd/metrics/process_stats.h — the standard Prometheus `process_*` numbers of this process,
// read from /proc (the same definitions as the official client libraries' process collector).
#pragma once

#include <cstdint>

namespace fd::metrics {

struct ProcessStats {
    double  cpu_seconds_total      = 0.0;  ///< user + system CPU time, seconds
    int64_t resident_memory_bytes  = 0;    ///< RSS, bytes
    int64_t virtual_memory_bytes   = 0;    ///< VSZ, bytes
    double  start_time_seconds     = 0.0;  ///< process start, seconds since the Unix epoch
    int64_t open_fds               = 0;    ///< entries of /proc/self/fd
    int64_t max_fds                = 0;    ///< RLIMIT_NOFILE soft limit
};

/// Read the numbers above from /proc/self/stat, /proc/stat (btime) and /proc/self/fd.
/// Fields that cannot be read stay 0; never throws.
ProcessStats read_process_stats();

}  // namespace fd::metrics
