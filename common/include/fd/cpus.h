// fd/cpus.h — how many CPUs this process may use: what sizes the default --threads and decides
// whether there are cores to spare (a weight stream's staging ahead, fd/stream/weight_stream.h).
//
// std::thread::hardware_concurrency() counts the host's CPUs; a container or a taskset may give
// the process fewer. The count here is the affinity mask's (sched_getaffinity: cpusets,
// taskset), capped by the cgroup CPU quota when one is set (cgroup v2 cpu.max "QUOTA PERIOD",
// v1 cpu.cfs_quota_us / cpu.cfs_period_us; Kubernetes' CPU limits), rounded up. Never throws.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace fd {

/// CPUs this process may use (>= 1): affinity_cpus() capped by cgroup_cpu_quota().
int32_t usable_cpus();

/// CPUs in this process's affinity mask (>= 1; hardware_concurrency() where it cannot be read).
int32_t affinity_cpus();

/// The cgroup CPU quota in CPUs, rounded up, or nullopt when none is set or readable: cgroup v2
/// `cpu.max` of this process's cgroup (else the mount root's), else v1 `cpu.cfs_quota_us` /
/// `cpu.cfs_period_us`.
std::optional<int32_t> cgroup_cpu_quota();

/// Parse cgroup v2 `cpu.max` text ("max 100000" → nullopt; "150000 100000" → 2).
std::optional<int32_t> parse_cpu_max(std::string_view text);

/// From cgroup v1 values (quota -1 or either <= 0 → nullopt; 250000 / 100000 → 3).
std::optional<int32_t> cpu_quota_v1(int64_t quota_us, int64_t period_us);

}  // namespace fd
