// Internal to fd::api: the threads route handlers run on, so a handler that blocks (a control
// call waiting on the engine, a large body's JSON parse) never holds an I/O thread. One pool per
// lane (http_server.h): control calls never queue behind generation handlers.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fd::api {

class HandlerPool {
public:
    /// Starts `min_threads`; grows by one thread whenever a task arrives and no thread is idle,
    /// up to `max_threads` (beyond that tasks queue). Threads are named `name` (for top/gdb).
    HandlerPool(std::string name, int32_t min_threads, int32_t max_threads);
    ~HandlerPool();  ///< stop()

    /// Run `fn` on a pool thread. After stop(), dropped.
    void post(std::function<void()> fn);
    /// Drop queued tasks, let running ones finish, join every thread. Idempotent.
    void stop();

    int32_t n_threads() const;

private:
    void spawn_locked();
    void run();

    std::string                       name_;
    int32_t                           max_threads_;
    mutable std::mutex                mu_;
    std::condition_variable           cv_;
    std::deque<std::function<void()>> q_;
    std::vector<std::thread>          threads_;
    int32_t                           n_idle_  = 0;
    bool                              stopped_ = false;
};

}  // namespace fd::api
