// fd/deadline.h — the longest wait any timeout may ask for, and a steady-clock deadline from a
// number of seconds. Past ~9.2e9 s a steady_clock deadline's nanosecond ticks overflow (every
// wait then ends at once, or never), so timeouts taken from flags, requests and the CLI are
// bounded by kMaxWaitS (refused above it where they are read; clamped here).
#pragma once

#include <algorithm>
#include <chrono>

namespace fd {

/// The longest timeout (seconds) a flag, request field or CLI option may give (~116 days).
inline constexpr double kMaxWaitS = 1e7;

/// steady_clock::now() + `s` seconds, `s` clamped to [0, kMaxWaitS] (NaN: now).
inline std::chrono::steady_clock::time_point deadline_after(double s) {
    const double c = s > 0 ? std::min(s, kMaxWaitS) : 0.0;
    return std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(c));
}

}  // namespace fd
