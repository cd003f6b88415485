#include "fd/model/kv_copier.h"

#include "fd/log.h"

#include <cstring>

namespace fd::model {

using Clock = std::chrono::steady_clock;

KvCopier::KvCopier(kernels::Backend * backend, double test_delay_s)
    : backend_(backend), device_queue_(backend->copy_queue()), delay_s_(std::max(0.0, test_delay_s)) {
    if (!device_queue_) { thread_ = std::thread([this] { run(); }); }
}

KvCopier::~KvCopier() {
    if (!wait(60.0)) { log::get("model")->error("KV copier: {} background copy batch(es) still in flight after 60 s at shutdown", n_in_flight()); }
    {
        std::lock_guard lk(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) { thread_.join(); }
}

void KvCopier::start_download(std::vector<Piece> pieces) {
    if (pieces.empty()) { return; }
    Batch b;
    b.earliest = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(delay_s_));
    for (const Piece & p : pieces) { b.bytes += p.bytes; }
    if (device_queue_) {
        backend_->copy_queue_after_ops();  // the blocks were written by ops issued before
        for (const Piece & p : pieces) { backend_->download_async(p.dst, p.src, p.bytes); }
        b.fence = backend_->copy_queue_fence();
    } else {
        b.pieces = std::move(pieces);
    }
    {
        std::lock_guard lk(mu_);
        queue_.push_back(std::move(b));
    }
    cv_.notify_all();
}

bool KvCopier::idle() {
    std::lock_guard lk(mu_);
    if (!device_queue_) { return queue_.empty(); }
    while (!queue_.empty() && Clock::now() >= queue_.front().earliest && backend_->copy_queue_done(queue_.front().fence)) {
        bytes_done_ += queue_.front().bytes;
        queue_.pop_front();
    }
    return queue_.empty();
}

bool KvCopier::wait(double timeout_s) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
    if (device_queue_) {
        while (!idle()) {
            if (Clock::now() >= deadline) { return false; }
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        return true;
    }
    std::unique_lock lk(mu_);
    return cv_.wait_until(lk, deadline, [&] { return queue_.empty(); });
}

int64_t KvCopier::n_in_flight() {
    idle();
    std::lock_guard lk(mu_);
    return static_cast<int64_t>(queue_.size());
}

void KvCopier::run() {
    std::unique_lock lk(mu_);
    for (;;) {
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) { return; }  // stop_ and nothing left
        Batch & b = queue_.front();      // stays in the queue (in flight) until copied
        const auto earliest = b.earliest;
        const std::vector<Piece> pieces = b.pieces;
        lk.unlock();
        std::this_thread::sleep_until(earliest);  // the test delay (a no-op without one)
        for (const Piece & p : pieces) { std::memcpy(p.dst, p.src, static_cast<size_t>(p.bytes)); }
        lk.lock();
        bytes_done_ += queue_.front().bytes;
        queue_.pop_front();
        cv_.notify_all();
    }
}

}  // namespace fd::model
