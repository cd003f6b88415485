// tests/bench/bench_util.h — small helpers shared by the bench programs: timing, rounding,
// percentiles, machine facts. Header-only; bench code only.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace fd::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

inline double round_to(double v, int digits) {
    const double s = std::pow(10.0, digits);
    return std::round(v * s) / s;
}

/// Sum of p[0, n) read as S streams side by side: S equal parts (n / S rounded down to 128
/// floats), 16 floats of each per step (the rest unread), one vector accumulator per stream (AVX2 has 16 ymm).
template <int S>
float sum_streams(const float * p, size_t n) {
    typedef float v8 __attribute__((vector_size(32)));
    const size_t part = n / S / 128 * 128;
    v8 a[S] = {};
    for (size_t i = 0; i < part; i += 16) {
        for (int s = 0; s < S; ++s) {
            v8 x, y;
            std::memcpy(&x, p + s * part + i, sizeof x);
            std::memcpy(&y, p + s * part + i + 8, sizeof y);
            a[s] += x + y;
        }
    }
    float r = 0.0f;
    for (int s = 0; s < S; ++s) {
        for (int j = 0; j < 8; ++j) { r += a[s][j]; }
    }
    return r;
}

/// Nearest-rank percentile (q in (0, 1]) of `v`.
inline double percentile(std::vector<double> v, double q) {
    if (v.empty()) { return 0.0; }
    std::sort(v.begin(), v.end());
    const size_t k = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
    return v[std::clamp<size_t>(k, 1, v.size()) - 1];
}

/// The upper median of `v` (v[n / 2] once sorted); `v` must not be empty.
inline double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

/// {n, p50_ms, p99_ms, min_ms, max_ms} of durations in seconds.
inline nlohmann::ordered_json ms_stats(const std::vector<double> & seconds) {
    std::vector<double> ms;
    for (double s : seconds) { ms.push_back(s * 1e3); }
    return {{"n", ms.size()},
            {"p50_ms", round_to(percentile(ms, 0.5), 4)},
            {"p99_ms", round_to(percentile(ms, 0.99), 4)},
            {"min_ms", round_to(ms.empty() ? 0.0 : *std::min_element(ms.begin(), ms.end()), 4)},
            {"max_ms", round_to(ms.empty() ? 0.0 : *std::max_element(ms.begin(), ms.end()), 4)}};
}

inline std::string read_first_line(const char * file) {
    std::ifstream in(file);
    std::string   line;
    std::getline(in, line);
    return line;
}

/// "model name" of the first CPU in /proc/cpuinfo.
inline std::string cpu_model() {
    std::ifstream in("/proc/cpuinfo");
    std::string   line;
    while (std::getline(in, line)) {
        if (line.rfind("model name", 0) == 0) {
            const auto colon = line.find(':');
            if (colon != std::string::npos) {
                auto s = line.substr(colon + 1);
                s.erase(0, s.find_first_not_of(" \t"));
                return s;
            }
        }
    }
    return "unknown";
}

/// The SIMD flags of the first CPU in /proc/cpuinfo that decide the kernels' paths: fma, avx2,
/// avx512*, amx* (space-separated; issue 28 asks every figure to carry them).
inline std::string cpu_simd_flags() {
    std::ifstream in("/proc/cpuinfo");
    std::string   line;
    while (std::getline(in, line)) {
        if (line.rfind("flags", 0) != 0) { continue; }
        std::istringstream words(line.substr(line.find(':') + 1));
        std::string        w, out;
        while (words >> w) {
            if (w == "fma" || w == "avx2" || w.rfind("avx512", 0) == 0 || w.rfind("amx", 0) == 0) { out += (out.empty() ? "" : " ") + w; }
        }
        return out;
    }
    return "";
}

/// Now as "YYYY-MM-DDTHH:MM:SSZ".
inline std::string utc_now() {
    const std::time_t t = std::time(nullptr);
    std::tm           tm{};
    gmtime_r(&t, &tm);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return buf;
}

/// "a,b" "c" → {a, b, c}: repeatable comma-list options.
inline std::vector<std::string> split_commas(const std::vector<std::string> & in) {
    std::vector<std::string> out;
    for (const auto & s : in) {
        std::stringstream ss(s);
        std::string       part;
        while (std::getline(ss, part, ',')) {
            if (!part.empty()) { out.push_back(part); }
        }
    }
    return out;
}

}  // namespace fd::bench
