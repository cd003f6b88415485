// fd/metrics/histogram.h — a Prometheus histogram with fixed bucket bounds, observed without a
// lock (the engine thread observes per token; /metrics reads from HTTP threads).
//
// Cost of observe(): a linear scan of at most ~25 bounds, one relaxed fetch_add on a bucket and
// one on the sum. A snapshot is not atomic across buckets (a concurrent observe may show in the
// buckets and not yet in the sum); Prometheus tolerates that.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace fd::metrics {

class Histogram {
public:
    /// `upper_bounds` in ascending order (Prometheus `le`, the unit of the observed values);
    /// a +Inf bucket is added. Errors  FD_CHECK when not strictly ascending.
    explicit Histogram(std::span<const double> upper_bounds);

    /// Count `v` in the first bucket whose bound is >= v (+Inf when none). Thread-safe.
    void observe(double v);

    struct Snapshot {
        std::vector<double>  upper_bounds;  ///< [n_buckets] without +Inf
        std::vector<int64_t> cumulative;    ///< [n_buckets + 1] counts <= each bound; last = +Inf = count
        double               sum   = 0.0;
        int64_t              count = 0;
    };
    Snapshot snapshot() const;

private:
    std::vector<double>                     bounds_;
    std::unique_ptr<std::atomic<int64_t>[]> counts_;  ///< [n_buckets + 1], not cumulative
    std::atomic<double>                     sum_{0.0};
};

}  // namespace fd::metrics
