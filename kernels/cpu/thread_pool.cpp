#include "fd/kernels/thread_pool.h"

#include <chrono>

namespace fd::kernels {

ThreadPool::ThreadPool(int n_threads) {
    for (int i = 1; i < n_threads; ++i) { workers_.emplace_back([this] { worker_loop(); }); }
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard lk(mu_);
        stop_ = true;
    }
    cv_start_.notify_all();
    for (auto & t : workers_) { t.join(); }
}

void ThreadPool::run_tasks() {
    for (int64_t i = next_.fetch_add(1); i < n_tasks_; i = next_.fetch_add(1)) { (*fn_)(i); }
}

void ThreadPool::worker_loop() {
    uint64_t seen = 0;
    for (;;) {
        {
            std::unique_lock lk(mu_);
            cv_start_.wait(lk, [&] { return stop_ || job_id_ != seen; });
            if (stop_) { return; }
            seen = job_id_;
        }
        run_tasks();
        {
            std::lock_guard lk(mu_);
            if (--n_busy_ == 0) { cv_done_.notify_one(); }
        }
    }
}

void ThreadPool::parallel_for(int64_t n_tasks, const std::function<void(int64_t)> & fn) {
    if (n_tasks <= 0) { return; }
    if (workers_.empty() || n_tasks == 1) {
        for (int64_t i = 0; i < n_tasks; ++i) { fn(i); }
        return;
    }
    {
        std::lock_guard lk(mu_);
        fn_      = &fn;
        n_tasks_ = n_tasks;
        next_.store(0);
        n_busy_  = static_cast<int>(workers_.size());
        ++job_id_;
    }
    cv_start_.notify_all();
    run_tasks();
    ++stats_.jobs;
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock lk(mu_);
    cv_done_.wait(lk, [&] { return n_busy_ == 0; });
    fn_ = nullptr;
    stats_.wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace fd::kernels
