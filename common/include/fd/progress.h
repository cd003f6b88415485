// fd/progress.h — bytes done / total of the long phase running now (a weight load, an rsync
// transfer), shown in /health as `progress` and drawn as a bar by fdctl.
//
// Control operations run one at a time, so one process-wide record suffices. The phase owner
// (fill_weights, the rsync source) opens a ProgressPhase; worker threads add bytes with one
// relaxed atomic add each; readers (HTTP threads) take a snapshot. Never throws.
#pragma once

#include "fd/liveness.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

namespace fd {

struct ProgressSnapshot {
    std::string op;               ///< the control operation the phase runs in ("update_weights", "wakeup"); "" = none (start-up)
    std::string phase;            ///< "transfer" (rsync pull), "verify" (store checksums), "load" (copy into the weight arena)
    int64_t     bytes_done  = 0;
    int64_t     bytes_total = 0;  ///< 0 = not known yet
    double      elapsed_s   = 0.0;///< since the phase began
};

class Progress {
public:
    /// The process-wide record.
    static Progress & current();

    /// The control operation running now ("" when it ends); a phase begun while it is set carries
    /// it in its snapshots, so a reader never pairs a phase with another operation's state.
    void set_op(std::string op);
    /// Start `phase` with `bytes_total` (0 = unknown yet); resets bytes_done.
    void begin(std::string phase, int64_t bytes_total);
    /// Called from any thread while the phase runs.
    /// Both also tick the process's liveness mark (fd/liveness.h): bytes moving is progress.
    void add_done(int64_t bytes) {
        done_.fetch_add(bytes, std::memory_order_relaxed);
        liveness::tick();
    }
    void set_done(int64_t bytes) {
        done_.store(bytes, std::memory_order_relaxed);
        liveness::tick();
    }
    void set_total(int64_t bytes) { total_.store(bytes, std::memory_order_relaxed); }
    /// The phase is over (success or failure).
    void end();
    /// The running phase; nullopt when none runs.
    std::optional<ProgressSnapshot> snapshot() const;
    /// The phase that ended last, as it stood at its end (logs, tests); nullopt before any.
    std::optional<ProgressSnapshot> last() const;

private:
    std::optional<ProgressSnapshot> snapshot_locked() const;

    mutable std::mutex                    mu_;
    std::string                           op_;        ///< the control operation running now (mu_)
    std::string                           phase_op_;  ///< op_ when the running phase began (mu_)
    std::string                           phase_;     ///< empty = none running (mu_)
    std::chrono::steady_clock::time_point t0_;        ///< (mu_)
    std::atomic<int64_t>                  done_{0}, total_{0};
    std::optional<ProgressSnapshot>       last_;      ///< (mu_)
};

/// RAII: Progress::current().begin(...) now, end() on scope exit (exceptions included).
class ProgressPhase {
public:
    ProgressPhase(std::string phase, int64_t bytes_total) { Progress::current().begin(std::move(phase), bytes_total); }
    ~ProgressPhase() { Progress::current().end(); }
    ProgressPhase(const ProgressPhase &) = delete;
    ProgressPhase & operator=(const ProgressPhase &) = delete;
};

}  // namespace fd
