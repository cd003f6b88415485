// fd::metrics::Histogram (daemon/src/metrics/histogram.cpp) against Prometheus' bucket rule
// (a value v counts in every bucket with v <= le; the +Inf bucket equals the count), checked
// against a direct count, including under concurrent observers; and the process stats against
// what the kernel reports in /proc.
#include "fd/metrics/histogram.h"
#include "fd/metrics/process_stats.h"
#include "fd/metrics/request_metrics.h"
#include "fd/status.h"

#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <random>
#include <thread>
#include <vector>

using fd::metrics::Histogram;

TEST_CASE("histogram buckets are cumulative, le is inclusive, +Inf is the count") {
    const std::vector<double> bounds = {0.001, 0.01, 0.1, 1.0};
    Histogram h(bounds);
    const std::vector<double> xs = {0.0, 0.001, 0.0010001, 0.01, 0.05, 0.1, 0.5, 1.0, 1.5, 1e9};
    for (double x : xs) { h.observe(x); }
    const auto s = h.snapshot();
    REQUIRE(s.cumulative.size() == bounds.size() + 1);
    for (size_t i = 0; i < bounds.size(); ++i) {
        int64_t want = 0;
        for (double x : xs) { want += x <= bounds[i] ? 1 : 0; }
        CHECK(s.cumulative[i] == want);
    }
    CHECK(s.cumulative.back() == static_cast<int64_t>(xs.size()));
    CHECK(s.count == static_cast<int64_t>(xs.size()));
    double sum = 0;
    for (double x : xs) { sum += x; }
    CHECK(s.sum == doctest::Approx(sum));
}

TEST_CASE("histogram counts every observation of concurrent threads") {
    Histogram h(fd::metrics::kItlBuckets);
    constexpr int kThreads = 4, kEach = 50000;
    std::vector<std::thread> ts;
    std::vector<int64_t> want(fd::metrics::kItlBuckets.size() + 1, 0);
    std::vector<std::vector<double>> values(kThreads);
    std::mt19937_64 rng(7);
    std::exponential_distribution<double> dist(50.0);  // mean 20 ms
    for (auto & v : values) {
        for (int i = 0; i < kEach; ++i) { v.push_back(dist(rng)); }
    }
    for (const auto & v : values) {
        for (double x : v) {
            for (size_t b = 0; b <= fd::metrics::kItlBuckets.size(); ++b) {
                if (b == fd::metrics::kItlBuckets.size() || x <= fd::metrics::kItlBuckets[b]) { ++want[b]; }
            }
        }
    }
    for (int t = 0; t < kThreads; ++t) {
        ts.emplace_back([&, t] {
            for (double x : values[t]) { h.observe(x); }
        });
    }
    for (auto & t : ts) { t.join(); }
    const auto s = h.snapshot();
    CHECK(s.count == kThreads * kEach);
    for (size_t b = 0; b < want.size(); ++b) { CHECK(s.cumulative[b] == want[b]); }
}

TEST_CASE("histogram bounds must ascend") {
    const std::vector<double> bad = {0.1, 0.1};
    CHECK_THROWS_AS(Histogram(std::span<const double>(bad)), fd::Error);
}

TEST_CASE("process stats match /proc") {
    const auto s = fd::metrics::read_process_stats();
    CHECK(s.resident_memory_bytes > 0);
    CHECK(s.virtual_memory_bytes >= s.resident_memory_bytes);
    CHECK(s.max_fds > 0);
    int64_t n_fds = 0;
    for ([[maybe_unused]] const auto & e : std::filesystem::directory_iterator("/proc/self/fd")) { ++n_fds; }
    CHECK(s.open_fds == n_fds - 1);  // the iterator's own descriptor
    CHECK(s.start_time_seconds > 1.5e9);
    CHECK(s.start_time_seconds <= static_cast<double>(::time(nullptr)) + 1);
}
