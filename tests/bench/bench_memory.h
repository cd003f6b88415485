// tests/bench/bench_memory.h — the memory reference of the control bench: anonymous mappings
// like fd::Arena, memcpy bandwidth, smaps_rollup fields. Bench code only.
#pragma once

#include "bench_mapping.h"
#include "bench_util.h"

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace fd::bench {

inline int64_t smaps_rollup_bytes(const std::string & key) {
    std::ifstream in("/proc/self/smaps_rollup");
    std::string   line;
    while (std::getline(in, line)) {
        if (line.rfind(key, 0) == 0) { return std::stoll(line.substr(key.size())) * 1024; }
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Memory reference
// ---------------------------------------------------------------------------------------------

using Mapping = MappingOf<std::byte>;  // the control bench's memory reference (bytes)

inline volatile uint8_t g_sink = 0;

/// Best-of-3 memcpy of `bytes` between two touched buffers on `n_threads` threads; GB/s of bytes copied.
inline double memcpy_gbs(size_t bytes, int n_threads) {
    Mapping src(bytes), dst(bytes);
    for (size_t i = 0; i < bytes; i += 64) { src.p[i] = static_cast<std::byte>(i >> 6); }
    std::memset(dst.p, 0, bytes);
    const size_t chunk = bytes / static_cast<size_t>(n_threads) / 4096 * 4096;
    double best = 1e300;
    for (int r = 0; r < 3; ++r) {
        const auto t0 = Clock::now();
        if (n_threads == 1) {
            std::memcpy(dst.p, src.p, chunk);
        } else {
            std::vector<std::thread> th;
            for (int t = 0; t < n_threads; ++t) {
                th.emplace_back([&, t] { std::memcpy(dst.p + t * chunk, src.p + t * chunk, chunk); });
            }
            for (auto & x : th) { x.join(); }
        }
        best = std::min(best, seconds_since(t0));
        g_sink = g_sink + static_cast<uint8_t>(dst.p[r * 4099]);
    }
    return static_cast<double>(chunk) * n_threads / best / 1e9;
}

}  // namespace fd::bench
