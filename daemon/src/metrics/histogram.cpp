#include "fd/metrics/histogram.h"

#include "fd/status.h"

namespace fd::metrics {

Histogram::Histogram(std::span<const double> upper_bounds)
    : bounds_(upper_bounds.begin(), upper_bounds.end()), counts_(new std::atomic<int64_t>[upper_bounds.size() + 1]) {
    for (size_t i = 0; i < bounds_.size(); ++i) {
        FD_CHECK(i == 0 || bounds_[i - 1] < bounds_[i], "histogram bounds must ascend strictly (bound {} is {})", i, bounds_[i]);
    }
    for (size_t i = 0; i <= bounds_.size(); ++i) { counts_[i].store(0, std::memory_order_relaxed); }
}

void Histogram::observe(double v) {
    size_t b = 0;
    while (b < bounds_.size() && v > bounds_[b]) { ++b; }
    counts_[b].fetch_add(1, std::memory_order_relaxed);
    sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::snapshot() const {
    Snapshot s;
    s.upper_bounds = bounds_;
    s.cumulative.resize(bounds_.size() + 1);
    int64_t cum = 0;
    for (size_t i = 0; i <= bounds_.size(); ++i) {
        cum += counts_[i].load(std::memory_order_relaxed);
        s.cumulative[i] = cum;
    }
    s.count = cum;
    s.sum   = sum_.load(std::memory_order_relaxed);
    return s;
}

}  // namespace fd::metrics
