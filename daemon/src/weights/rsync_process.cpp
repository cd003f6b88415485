// The rsync program run as a child of the daemon (rsync_process.h).
#include "rsync_process.h"

#include "fd/liveness.h"
#include "fd/progress.h"
#include "fd/status.h"

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <thread>

extern char ** environ;

namespace fd::weights {
namespace {

using Clock = std::chrono::steady_clock;

/// rsync --info=progress2 lines ("  1,234,567  45%  12.3MB/s  0:00:01 ...", each ended by '\r'
/// or '\n') taken out of the captured output into Progress::current(); everything else kept.
/// The total is done * 100 / percent (rsync prints no total), exact once it reaches 100%.
void take_progress_lines(std::string & out, size_t & scanned) {
    size_t start = scanned;
    while (true) {
        const size_t end = out.find_first_of("\r\n", start);
        if (end == std::string::npos) { break; }
        const std::string line = out.substr(start, end - start);
        int64_t done = 0;
        int     pct  = -1;
        size_t  i    = line.find_first_not_of(' ');
        bool    is_progress = i != std::string::npos && std::isdigit(static_cast<unsigned char>(line[i]));
        for (; is_progress && i < line.size() && (std::isdigit(static_cast<unsigned char>(line[i])) || line[i] == ','); ++i) {
            if (line[i] != ',') { done = done * 10 + (line[i] - '0'); }
        }
        if (is_progress) {
            const size_t p = line.find('%', i);
            is_progress = p != std::string::npos && p > i;
            if (is_progress) { pct = std::atoi(line.c_str() + i); }
        }
        if (is_progress && pct >= 0) {
            Progress::current().set_done(done);
            if (pct > 0) { Progress::current().set_total(done * 100 / pct); }
            out.erase(scanned, end + 1 - scanned);  // drop the line and its terminator
            start = scanned;
        } else {
            start   = end + 1;
            scanned = start;
        }
    }
}

}  // namespace

/// Run argv (no shell) in its own process group with stdout+stderr captured; kill the group
/// with SIGKILL at `timeout_s`. Errors  source_unavailable when the program cannot start.
ProcessResult run_process(const std::vector<std::string> & argv, double timeout_s, bool rsync_progress) {
    int pipefd[2];
    if (::pipe2(pipefd, O_CLOEXEC) != 0) { fail(Errc::source_unavailable, "cannot create a pipe for rsync: {}", std::strerror(errno)); }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
    posix_spawn_file_actions_adddup2(&fa, pipefd[1], 2);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    for (int s : {SIGPIPE, SIGTERM, SIGINT, SIGHUP, SIGCHLD, SIGALRM}) { sigaddset(&defaults, s); }
    posix_spawnattr_setsigmask(&attr, &none);  // the daemon blocks SIGTERM/SIGINT for sigwait
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);
    std::vector<char *> cargv;
    for (const auto & a : argv) { cargv.push_back(const_cast<char *>(a.c_str())); }
    cargv.push_back(nullptr);
    pid_t pid = -1;
    const int rc = ::posix_spawnp(&pid, argv[0].c_str(), &fa, &attr, cargv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    ::close(pipefd[1]);
    if (rc != 0) {
        ::close(pipefd[0]);
        fail(Errc::source_unavailable, "cannot run '{}': {}; install rsync or set \"rsync\" in --rsync-config", argv[0], std::strerror(rc));
    }
    ProcessResult r;
    // A child (rsync, ssh) has its own bound (timeout_s): waiting on it is not a stuck rank (fd/liveness.h).
    liveness::WaitScope waiting;
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
    auto ms_left = [&] {
        return static_cast<int>(std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
    };
    char buf[4096];
    size_t scanned = 0;  // r.output before this holds no progress line
    /// Read what the pipe has within `wait_ms`: 1 data, 0 nothing yet, -1 closed.
    auto read_some = [&](int wait_ms) {
        pollfd p{pipefd[0], POLLIN, 0};
        if (::poll(&p, 1, wait_ms) <= 0) { return 0; }
        const ssize_t got = ::read(pipefd[0], buf, sizeof buf);
        if (got < 0) { return errno == EINTR || errno == EAGAIN ? 0 : -1; }
        if (got == 0) { return -1; }
        r.output.append(buf, static_cast<size_t>(got));
        if (rsync_progress) { take_progress_lines(r.output, scanned); }
        if (r.output.size() > 16384) {
            const size_t cut = r.output.size() - 8192;
            r.output.erase(0, cut);
            scanned = scanned > cut ? scanned - cut : 0;
        }
        return 1;
    };
    // Until the child exits or the deadline: collect its output and poll for its exit (its
    // output may stay open after it exits, e.g. an ssh it started, so EOF alone is not the end).
    int  status = 0;
    bool exited = false, eof = false;
    while (!exited) {
        const int left = ms_left();
        if (left == 0) { break; }
        if (!eof) {
            eof = read_some(std::min(left, 20)) < 0;
        } else {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        const pid_t w = ::waitpid(pid, &status, WNOHANG);
        if (w == pid || (w < 0 && errno != EINTR)) {
            exited = true;
            if (w < 0) { status = -1; }
        }
    }
    while (exited && !eof) {
        const int got = read_some(0);  // what is already buffered, without waiting for more
        eof = got != 1;
    }
    ::close(pipefd[0]);
    if (!exited) {
        r.timed_out = true;
        ::kill(-pid, SIGKILL);  // rsync and whatever it started (its own process group)
        ::kill(pid, SIGKILL);
        const auto kill_deadline = Clock::now() + std::chrono::seconds(10);
        while (::waitpid(pid, &status, WNOHANG) == 0 && Clock::now() < kill_deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        return r;
    }
    if (status != -1 && WIFEXITED(status)) { r.exit_code = WEXITSTATUS(status); }
    return r;
}

/// One line of rsync's output for an error message.
std::string oneline(std::string s) {
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) { s.pop_back(); }
    std::replace(s.begin(), s.end(), '\n', ' ');
    return s.size() > 600 ? "..." + s.substr(s.size() - 600) : s;
}

}  // namespace fd::weights
