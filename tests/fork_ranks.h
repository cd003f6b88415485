// tests/fork_ranks.h — run a function as `n` fork()ed rank processes and count the failures
// (the Comm tests, the tensor-parallel forward tests and fd_tp_bench). Header-only; test code only.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

namespace fd::testing {

/// fork() `n` processes; process r runs `rank_main(r)` and exits with its return value (an
/// exception: its message on stderr, exit 1; never returns into the caller's code). Waits for all,
/// at most `timeout_s` seconds (no wait without a timeout: a rank stuck in a collective whose peer
/// died must not hang the test); ranks still running then are killed (SIGKILL) and count as failed.
/// Returns how many ranks exited non-zero, were killed or timed out.
inline int run_forked_ranks(int n, const std::function<int(int)> & rank_main, double timeout_s = 300.0) {
    std::vector<pid_t> pids;
    for (int r = 0; r < n; ++r) {
        const pid_t pid = fork();
        if (pid == 0) {
            int rc = 1;
            try {
                rc = rank_main(r);
            } catch (const std::exception & e) {
                std::fprintf(stderr, "rank %d: %s\n", r, e.what());
            } catch (...) {
            }
            _exit(rc);
        }
        pids.push_back(pid);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    int failed = 0;
    for (size_t r = 0; r < pids.size(); ++r) {
        int st = 0;
        pid_t got = 0;
        while ((got = waitpid(pids[r], &st, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        if (got == 0) {  // past the deadline: kill it and reap it
            std::fprintf(stderr, "rank %zu: still running after %.0f s: killed\n", r, timeout_s);
            kill(pids[r], SIGKILL);
            waitpid(pids[r], &st, 0);  // (SIGKILL cannot be caught: this returns)
            ++failed;
            continue;
        }
        failed += !(got == pids[r] && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    return failed;
}

}  // namespace fd::testing
