#include "fd/progress.h"

namespace fd {

Progress & Progress::current() {
    static Progress p;
    return p;
}

void Progress::set_op(std::string op) {
    std::lock_guard lk(mu_);
    op_ = std::move(op);
}

void Progress::begin(std::string phase, int64_t bytes_total) {
    std::lock_guard lk(mu_);
    phase_op_ = op_;
    phase_ = std::move(phase);
    t0_    = std::chrono::steady_clock::now();
    done_.store(0, std::memory_order_relaxed);
    total_.store(bytes_total, std::memory_order_relaxed);
}

void Progress::end() {
    std::lock_guard lk(mu_);
    last_ = snapshot_locked();
    phase_.clear();
}

std::optional<ProgressSnapshot> Progress::snapshot() const {
    std::lock_guard lk(mu_);
    return snapshot_locked();
}

std::optional<ProgressSnapshot> Progress::last() const {
    std::lock_guard lk(mu_);
    return last_;
}

std::optional<ProgressSnapshot> Progress::snapshot_locked() const {
    if (phase_.empty()) { return std::nullopt; }
    return ProgressSnapshot{.op          = phase_op_,
                            .phase       = phase_,
                            .bytes_done  = done_.load(std::memory_order_relaxed),
                            .bytes_total = total_.load(std::memory_order_relaxed),
                            .elapsed_s   = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count()};
}

}  // namespace fd
