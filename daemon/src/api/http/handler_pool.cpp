#include "handler_pool.h"

#include "fd/log.h"

#include <pthread.h>

namespace fd::api {

HandlerPool::HandlerPool(std::string name, int32_t min_threads, int32_t max_threads)
    : name_(std::move(name)), max_threads_(std::max(1, max_threads)) {
    std::lock_guard lk(mu_);
    for (int32_t i = 0; i < std::min(std::max(1, min_threads), max_threads_); ++i) { spawn_locked(); }
}

HandlerPool::~HandlerPool() { stop(); }

void HandlerPool::spawn_locked() {
    threads_.emplace_back([this] { run(); });
    pthread_setname_np(threads_.back().native_handle(), name_.substr(0, 15).c_str());
}

void HandlerPool::post(std::function<void()> fn) {
    {
        std::lock_guard lk(mu_);
        if (stopped_) { return; }
        q_.push_back(std::move(fn));
        // Idle threads will take what is queued; start one more only when all are busy.
        if (n_idle_ < static_cast<int32_t>(q_.size()) && static_cast<int32_t>(threads_.size()) < max_threads_) { spawn_locked(); }
    }
    cv_.notify_one();
}

void HandlerPool::run() {
    std::unique_lock lk(mu_);
    for (;;) {
        ++n_idle_;
        cv_.wait(lk, [&] { return stopped_ || !q_.empty(); });
        --n_idle_;
        if (stopped_) { return; }
        auto fn = std::move(q_.front());
        q_.pop_front();
        lk.unlock();
        try {
            fn();
        } catch (const std::exception & e) {  // handlers catch their own; this is a last resort
            log::get("api")->error("{}: task failed: {}", name_, e.what());
        }
        lk.lock();
    }
}

void HandlerPool::stop() {
    std::vector<std::thread> threads;
    {
        std::lock_guard lk(mu_);
        stopped_ = true;
        q_.clear();
        threads.swap(threads_);
    }
    cv_.notify_all();
    for (auto & t : threads) { t.join(); }
}

int32_t HandlerPool::n_threads() const {
    std::lock_guard lk(mu_);
    return static_cast<int32_t>(threads_.size());
}

}  // namespace fd::api
