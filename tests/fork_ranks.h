// tests/fork_ranks.h — run a function as `n` fork()ed rank processes and count the failures
// (the Comm tests, the tensor-parallel forward tests and fd_tp_bench). Header-only; test code only.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <functional>
#include <vector>

namespace fd::testing {

/// fork() `n` processes; process r runs `rank_main(r)` and exits with its return value (an
/// exception: its message on stderr, exit 1; never returns into the caller's code). Waits for all.
/// Returns how many ranks exited non-zero or were killed.
inline int run_forked_ranks(int n, const std::function<int(int)> & rank_main) {
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
    int failed = 0;
    for (pid_t p : pids) {
        int st = 0;
        waitpid(p, &st, 0);
        failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    return failed;
}

}  // namespace fd::testing
