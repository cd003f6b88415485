// Starting and watching local rank processes (rank_spawn.h).
#include "rank_spawn.h"

#include "fd/process.h"
#include "fd/runtime/rank_link.h"
#include "fd/status.h"

#include <fmt/format.h>

#include <poll.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <utility>

namespace fd::runtime {

/// How a rank process that stopped answering is doing, in words ("was killed by signal 9").
std::string process_condition(pid_t pid, bool & reaped) {
    if (pid <= 0) { return "has exited"; }
    int st = 0;
    const pid_t w = ::waitpid(pid, &st, WNOHANG);
    if (w == pid) {
        reaped = true;
        if (WIFSIGNALED(st)) { return fmt::format("was killed by signal {} ({})", WTERMSIG(st), strsignal(WTERMSIG(st))); }
        return fmt::format("exited with code {}", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    }
    const char state = process_state(pid);
    if (state == 'T' || state == 't') { return "is stopped (SIGSTOP?) and did not answer"; }
    if (state == 'Z') { return "has exited"; }
    return "did not answer";
}

int open_pidfd(pid_t pid) {
    if (pid <= 0) { return -1; }
    return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));  // pidfds are close-on-exec
}

bool pidfd_exited(int pidfd) {
    if (pidfd < 0) { return false; }
    pollfd p{pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

bool process_stopped(pid_t pid) {
    const char state = process_state(pid);
    return state == 'T' || state == 't';
}

SpawnThread::~SpawnThread() {
    {
        std::lock_guard lk(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
}

pid_t SpawnThread::spawn(const std::string & binary, int link_fd, int region_fd, double timeout_s) {
    std::packaged_task<pid_t()> task([&] { return spawn_rank_process(binary, link_fd, region_fd); });
    auto result = task.get_future();
    {
        std::lock_guard lk(mu_);
        job_ = &task;
    }
    cv_.notify_all();
    if (result.wait_for(std::chrono::duration<double>(timeout_s)) != std::future_status::ready) {
        std::lock_guard lk(mu_);
        if (job_ == &task) {  // never started: withdraw it (a started spawn finishes in microseconds)
            job_ = nullptr;
            fail(Errc::rank_failed, "starting a rank process: the spawn thread did not respond within {:.1f} s", timeout_s);
        }
    }
    return result.get();
}

void SpawnThread::run() {
    std::unique_lock lk(mu_);
    for (;;) {
        cv_.wait(lk, [&] { return stop_ || job_ != nullptr; });
        if (job_ != nullptr) {
            auto * job = std::exchange(job_, nullptr);
            lk.unlock();
            (*job)();
            lk.lock();
            continue;
        }
        if (stop_) { return; }
    }
}

}  // namespace fd::runtime
