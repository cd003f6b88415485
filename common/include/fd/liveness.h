// fd/liveness.h — whether this process's main loop is making progress: what a rank process's
// heartbeat reports to the daemon (fd/runtime/rank_link.h, LinkOp::beat).
//
// A rank process beats from a thread of its own while it works on a request; the beat alone
// proves only that the process runs and its link is up (a SIGSTOPped rank, a frozen host or a
// cut network send none). Whether the work itself moves is told by the progress mark here:
//   - tick(): the main loop (or a worker thread it is waiting for) finished a piece of work: a
//     kernel job (ThreadPool::parallel_for), a chunk of weight bytes (Progress::add_done /
//     set_done), a request, a collective. One relaxed store of the clock.
//   - WaitScope: the thread is waiting on something that has a bound of its own (a peer inside
//     a collective, bounded by the comm's timeout and watched by the daemon; a test pause).
//     While any scope is open the process counts as progressing.
// seconds_since_progress() is 0 while a WaitScope is open, else the time since the last tick.
// The daemon fails a rank as stuck when a beat reports it at or over --rank-stuck-s.
// Lock-free, never throws; one process-wide record (a rank process serves one request at a time).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace fd::liveness {

namespace detail {
inline std::atomic<int64_t> g_last_tick_ns{0};  ///< steady_clock ns of the last tick (0: none yet)
inline std::atomic<int32_t> g_waiting{0};       ///< open WaitScopes
inline int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace detail

/// The main loop made progress now (any thread may call it).
inline void tick() { detail::g_last_tick_ns.store(detail::now_ns(), std::memory_order_relaxed); }

/// Seconds since the last tick; 0 while a WaitScope is open or before the first tick.
inline double seconds_since_progress() {
    if (detail::g_waiting.load(std::memory_order_relaxed) > 0) { return 0.0; }
    const int64_t t = detail::g_last_tick_ns.load(std::memory_order_relaxed);
    return t == 0 ? 0.0 : static_cast<double>(detail::now_ns() - t) * 1e-9;
}

/// RAII: the calling thread waits on something bounded elsewhere; ticks when the wait ends.
class WaitScope {
public:
    WaitScope() { detail::g_waiting.fetch_add(1, std::memory_order_relaxed); }
    ~WaitScope() {
        tick();
        detail::g_waiting.fetch_sub(1, std::memory_order_relaxed);
    }
    WaitScope(const WaitScope &) = delete;
    WaitScope & operator=(const WaitScope &) = delete;
};

}  // namespace fd::liveness
