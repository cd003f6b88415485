// /proc/PID/stat readers (fd/process.h).
#include "fd/process.h"

#include <fmt/format.h>
#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace fd {
namespace {

/// Process `pid`'s state letter and start ticks from /proc/PID/stat; false if unreadable.
bool read_proc_stat(int64_t pid, char & state, int64_t & start_ticks) {
    if (pid <= 0) { return false; }
    std::FILE * f = std::fopen(fmt::format("/proc/{}/stat", pid).c_str(), "r");
    if (f == nullptr) { return false; }
    char buf[1024];
    const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    const char * p = std::strrchr(buf, ')');  // comm may hold spaces and parentheses: fields follow the last ')'
    if (p == nullptr) { return false; }
    // After ") ": field 3 (state), then fields 4..; starttime is field 22.
    unsigned long long ticks = 0;
    char st = 0;
    if (std::sscanf(p + 1, " %c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu", &st, &ticks) != 2) { return false; }
    state       = st;
    start_ticks = static_cast<int64_t>(ticks);
    return true;
}

}  // namespace

char process_state(int64_t pid) {
    char state = 0;
    int64_t ticks = -1;
    return read_proc_stat(pid, state, ticks) ? state : 0;
}

int64_t process_start_ticks(int64_t pid) {
    char state = 0;
    int64_t ticks = -1;
    return read_proc_stat(pid, state, ticks) ? ticks : -1;
}

bool pid_alive(int64_t pid, int64_t start_ticks) {
    if (pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM)) { return false; }
    char state = 0;
    int64_t ticks = -1;
    if (!read_proc_stat(pid, state, ticks)) { return true; }  // no /proc: existence is all we know
    if (state == 'Z' || state == 'X') { return false; }      // killed, not reaped yet: it answers nothing
    return start_ticks <= 0 || ticks == start_ticks;
}

}  // namespace fd
