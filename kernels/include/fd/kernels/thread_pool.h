// fd/kernels/thread_pool.h — the fork-join pool the CPU ops run on.
//
// Owns `n_threads - 1` worker threads; the calling thread is the last worker. One
// parallel_for at a time (the engine thread is the only caller). Partitioning never changes a
// result: ops split work over independent outputs only, so results are bitwise the same for
// any thread count.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fd::kernels {

class ThreadPool {
public:
    /// n_threads >= 1 (1 = run everything on the caller).
    explicit ThreadPool(int n_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool &) = delete;
    ThreadPool & operator=(const ThreadPool &) = delete;

    int n_threads() const { return static_cast<int>(workers_.size()) + 1; }

    /// Calls fn(i) for every i in [0, n_tasks), spread over the threads; returns when all are
    /// done. Tasks are claimed dynamically, so fn must not depend on which thread runs it.
    void parallel_for(int64_t n_tasks, const std::function<void(int64_t)> & fn);

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

    std::vector<std::thread>               workers_;
    std::mutex                             mu_;
    std::condition_variable                cv_start_;
    std::condition_variable                cv_done_;
    const std::function<void(int64_t)> *   fn_      = nullptr;
    int64_t                                n_tasks_ = 0;
    std::atomic<int64_t>                   next_{0};
    int                                    n_busy_  = 0;   ///< workers still inside the job
    uint64_t                               job_id_  = 0;
    bool                                   stop_    = false;
    Stats                                  stats_;
};

}  // namespace fd::kernels
