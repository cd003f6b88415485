#include "fd/kernels/thread_pool.h"

#include "fd/liveness.h"

#include <chrono>
#include <climits>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace fd::kernels {
namespace {

using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

/// Sleeps while *word == expected (returns at once if it already differs; spurious wake-ups
/// are possible, callers re-check).
inline void futex_wait(std::atomic<uint32_t> & word, uint32_t expected) {
    syscall(SYS_futex, reinterpret_cast<uint32_t *>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t> & word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t *>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

/// Spins up to ThreadPool::kSpinNs until done() holds; true if it did.
template <typename Done>
bool spin_until(Done done) {
    if (done()) { return true; }
    const auto t_end = Clock::now() + std::chrono::nanoseconds(ThreadPool::kSpinNs);
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            cpu_relax();
            if (done()) { return true; }
        }
        if (Clock::now() >= t_end) { return done(); }
    }
}

}  // namespace

ThreadPool::ThreadPool(int n_threads) {
    for (int i = 1; i < n_threads; ++i) { workers_.emplace_back([this] { worker_loop(); }); }
}

ThreadPool::~ThreadPool() {
    stop_.store(true);
    job_.fetch_add(1);  // seq_cst: a worker either sees the new job or is counted in sleepers_
    futex_wake_all(job_);
    for (auto & t : workers_) { t.join(); }
}

void ThreadPool::run_tasks() {
    for (int64_t i = next_.fetch_add(1); i < n_tasks_; i = next_.fetch_add(1)) { (*fn_)(i); }
}

void ThreadPool::worker_loop() {
    uint32_t seen = 0;
    for (;;) {
        if (!spin_until([&] { return job_.load(std::memory_order_acquire) != seen; })) {
            // Dekker pairing with parallel_for: sleepers_ before re-reading job_, both seq_cst;
            // the caller bumps job_ before reading sleepers_. One of the two sees the other.
            sleepers_.fetch_add(1);
            while (job_.load() == seen) { futex_wait(job_, seen); }
            sleepers_.fetch_sub(1);
        }
        seen = job_.load(std::memory_order_acquire);
        if (stop_.load(std::memory_order_acquire)) { return; }
        if (each_ != nullptr) {
            (*each_)();
        } else {
            run_tasks();
        }
        if (busy_.fetch_sub(1) == 1 && caller_asleep_.load() != 0) { futex_wake_all(busy_); }
    }
}

void ThreadPool::parallel_for(int64_t n_tasks, const std::function<void(int64_t)> & fn) {
    if (n_tasks <= 0) { return; }
    if (workers_.empty() || n_tasks == 1) {
        for (int64_t i = 0; i < n_tasks; ++i) { fn(i); }
        liveness::tick();  // a kernel job done: the rank's heartbeat reports progress (fd/liveness.h)
        return;
    }
    // The previous job is over (busy_ reached 0), so no worker reads these until job_ moves.
    fn_      = &fn;
    n_tasks_ = n_tasks;
    next_.store(0, std::memory_order_relaxed);
    start_job();
    run_tasks();
    ++stats_.jobs;
    const auto t0 = Clock::now();
    wait_job();
    stats_.wait_s += std::chrono::duration<double>(Clock::now() - t0).count();
    fn_ = nullptr;
    liveness::tick();
}

void ThreadPool::on_each_thread(const std::function<void()> & fn) {
    if (!workers_.empty()) {
        each_ = &fn;
        start_job();  // every worker sees each job once (worker_loop's `seen`): fn once per worker
        fn();
        wait_job();
        each_ = nullptr;
    } else {
        fn();
    }
}

void ThreadPool::start_job() {
    busy_.store(static_cast<uint32_t>(workers_.size()), std::memory_order_relaxed);
    job_.fetch_add(1);  // seq_cst (release for the job's fields)
    if (sleepers_.load() != 0) { futex_wake_all(job_); }
}

void ThreadPool::wait_job() {
    if (!spin_until([&] { return busy_.load(std::memory_order_acquire) == 0; })) {
        caller_asleep_.store(1);  // seq_cst, paired with the last worker's busy_ decrement
        for (uint32_t b = busy_.load(); b != 0; b = busy_.load()) { futex_wait(busy_, b); }
        caller_asleep_.store(0, std::memory_order_relaxed);
    }
}

}  // namespace fd::kernels
