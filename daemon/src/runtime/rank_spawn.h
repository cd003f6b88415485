// Starting and watching local rank processes for the multi-process executor (mp_executor_ranks.cpp):
// the one thread ranks are spawned from, and how a rank that stopped answering is doing.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <future>
#include <mutex>
#include <string>
#include <thread>

namespace fd::runtime {

/// How a rank process that stopped answering is doing, in words ("was killed by signal 9",
/// "is stopped (SIGSTOP?) and did not answer"). Reaps it (waitpid WNOHANG) when it has exited and
/// then sets `reaped`. pid <= 0: "has exited".
std::string process_condition(pid_t pid, bool & reaped);

/// A pidfd for `pid` (pidfd_open, close-on-exec): it turns readable (POLLIN) the moment the
/// process exits, before it is reaped. -1 when the kernel has none (< 5.3) or the pid is gone.
int open_pidfd(pid_t pid);

/// True when `pidfd`'s process has exited (a poll without waiting). pidfd < 0: false.
bool pidfd_exited(int pidfd);

/// True while `pid` is stopped (SIGSTOP, SIGTSTP, a debugger: state T or t in /proc/PID/stat).
bool process_stopped(pid_t pid);

/// The one thread local rank processes are started from. A rank's PR_SET_PDEATHSIG fires when
/// the *thread* that spawned it ends, not the daemon process: a rank respawned by wakeup from the
/// engine thread was SIGKILLed when that thread stopped (daemon shutdown), before the executor
/// could shut it down in order. This thread lives as long as the executor (it ends after the
/// ranks are reaped), so every rank dies exactly with the daemon, or when told.
class SpawnThread {
public:
    SpawnThread() : thread_([this] { run(); }) {}
    ~SpawnThread();
    SpawnThread(const SpawnThread &) = delete;
    SpawnThread & operator=(const SpawnThread &) = delete;

    /// spawn_rank_process(binary, link_fd, region_fd) on this thread; its errors rethrown here.
    /// Errors  rank_failed when the thread does not get to it within `timeout_s`.
    pid_t spawn(const std::string & binary, int link_fd, int region_fd, double timeout_s);

private:
    void run();

    std::mutex                     mu_;
    std::condition_variable        cv_;
    std::packaged_task<pid_t()> *  job_ = nullptr;
    bool                           stop_ = false;
    std::thread                    thread_;  ///< last: started once the rest is initialised
};

}  // namespace fd::runtime
