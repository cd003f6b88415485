// fd/model/kv_copier.h — one rank's background KV block copies, device pool → host tier (the
// multi-level prefix cache's write-ahead offloads, fd/kv/kv_cache.h).
//
// start_download() starts a batch of copies and returns at once; the batch runs while the
// rank's next forward step computes. Who started it keeps every byte it reads (device blocks)
// and writes (host blocks) untouched until wait() said the batch landed: the engine holds those
// blocks until its next swap_kv call, and the Worker waits here before any copy or release of
// its own (fd/model/worker.h), so no block is ever torn.
//   CUDA (Backend::copy_queue()): the copies are cudaMemcpyAsync on the backend's copy stream,
//     after an event on the op stream (they read what earlier steps wrote), into the pinned
//     kv_swap region; a fence event says when they landed. No host thread.
//   CPU: a copy thread of its own runs each batch (memcpy), FIFO.
// A wait is always bounded (timeout_s); a batch that has not landed by then is reported, never
// abandoned (the thread or the stream still finishes it).
// Used by the Worker's thread only (the copy thread is internal).
#pragma once

#include "fd/kernels/backend.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace fd::model {

class KvCopier {
public:
    /// One contiguous copy: `bytes` from `src` (backend memory) to `dst` (host memory).
    struct Piece {
        void *       dst   = nullptr;
        const void * src   = nullptr;
        int64_t      bytes = 0;
    };

    /// `backend` (not owned) must outlive the copier. `test_delay_s` > 0, TEST ONLY: a batch
    /// lands no earlier than that long after it started (the daemon reads
    /// FD_TEST_KV_COPY_DELAY_MS), so tests can catch a transfer in flight.
    explicit KvCopier(kernels::Backend * backend, double test_delay_s = 0.0);
    /// Waits (bounded, 60 s) for what is in flight, then stops the copy thread.
    ~KvCopier();
    KvCopier(const KvCopier &)             = delete;
    KvCopier & operator=(const KvCopier &) = delete;

    /// Start copying `pieces` in the background (empty: nothing). Returns at once.
    void start_download(std::vector<Piece> pieces);
    /// Whether every batch started so far has landed. Never waits.
    /// Errors  fd::Error{internal} when a device copy failed.
    bool idle();
    /// Wait until idle(), at most `timeout_s`; false when batches are still in flight then.
    bool wait(double timeout_s);
    /// Batches started and not yet seen landed.
    int64_t n_in_flight();
    /// Bytes copied by batches that landed, since construction.
    int64_t bytes_done() const { return bytes_done_.load(); }

private:
    struct Batch {
        std::vector<Piece>                    pieces;
        uint64_t                              fence = 0;  ///< CUDA: the copy queue's fence
        std::chrono::steady_clock::time_point earliest;   ///< test delay: not landed before
        int64_t                               bytes = 0;
    };
    void run();  ///< the CPU copy thread

    kernels::Backend *      backend_;
    const bool              device_queue_;  ///< the backend's copy queue runs the copies
    const double            delay_s_;
    std::mutex              mu_;
    std::condition_variable cv_;
    std::deque<Batch>       queue_;          ///< started, not landed (CPU: front is being copied)
    bool                    stop_ = false;
    std::atomic<int64_t>    bytes_done_{0};
    std::thread             thread_;
};

}  // namespace fd::model
