// fd/kernels/thread_pool.h — the fork-join pool the CPU ops run on.
//
// Owns `n_threads - 1` worker threads; the calling thread is the last worker. One
// parallel_for at a time (the engine thread is the only caller). Partitioning never changes a
// result: ops split work over independent outputs only, so results are bitwise the same for
// any thread count.
//
// Hand-off: a forward pass runs a few parallel_for calls per layer back to back, so a worker
// that finished a job spins for a short while (kSpinNs) on the job counter before sleeping on
// a futex, and the caller, once its own tasks are done, spins as long for the workers to
// finish before sleeping. Waking a sleeping thread costs tens of microseconds on a VM (an IPI
// to a halted vCPU); a spinning one sees the job within ~100 ns. The spin is bounded, so an
// idle pool sleeps and an oversubscribed machine loses at most kSpinNs per hand-off.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace fd::kernels {

class ThreadPool {
public:
    /// How long (ns) a thread spins before sleeping: a worker for the next job, the caller for
    /// the workers to finish.
    static constexpr int64_t kSpinNs = 100'000;

    /// n_threads >= 1 (1 = run everything on the caller).
    explicit ThreadPool(int n_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool &) = delete;
    ThreadPool & operator=(const ThreadPool &) = delete;

    int n_threads() const { return static_cast<int>(workers_.size()) + 1; }

    /// Calls fn(i) for every i in [0, n_tasks), spread over the threads; returns when all are
    /// done. Tasks are claimed dynamically in ascending i (put the largest first when their
    /// sizes differ), so fn must not depend on which thread runs it.
    void parallel_for(int64_t n_tasks, const std::function<void(int64_t)> & fn);

    /// Calls fn() once on every thread of the pool (each worker and the caller), returns when
    /// all are done: for per-thread state, e.g. freeing the kernels' thread_local scratch
    /// (fd::kernels::release_thread_scratch) when the weights sleep.
    void on_each_thread(const std::function<void()> & fn);

    /// Counters for profiling (fd_bench): parallel_for calls that used the workers, and the
    /// seconds the caller spent waiting for them after its own tasks ran out (load imbalance
    /// plus hand-off latency). Read and reset by the caller's thread only.
    struct Stats {
        int64_t jobs   = 0;
        double  wait_s = 0.0;
    };
    Stats stats() const { return stats_; }
    void  reset_stats() { stats_ = {}; }

private:
    void worker_loop();
    void run_tasks();
    void start_job();  ///< hand the job set up in the fields to every worker
    void wait_job();   ///< until every worker is out of it

    std::vector<std::thread>             workers_;
    const std::function<void(int64_t)> * fn_      = nullptr;
    const std::function<void()> *        each_    = nullptr;  ///< on_each_thread's job (else fn_'s tasks)
    int64_t                              n_tasks_ = 0;
    alignas(64) std::atomic<int64_t>     next_{0};      ///< the next task to claim
    alignas(64) std::atomic<uint32_t>    job_{0};       ///< bumped per job (futex word)
    std::atomic<int32_t>                 sleepers_{0};  ///< workers asleep (or about to be) on job_
    std::atomic<bool>                    stop_{false};
    alignas(64) std::atomic<uint32_t>    busy_{0};      ///< workers still inside the job (futex word)
    std::atomic<int32_t>                 caller_asleep_{0};
    Stats                                stats_;
};

}  // namespace fd::kernels
