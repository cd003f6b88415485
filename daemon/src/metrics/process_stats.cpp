#include "fd/metrics/process_stats.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

namespace fd::metrics {
namespace {

/// Seconds since the epoch at boot (`btime` of /proc/stat); 0 if unknown.
int64_t boot_time_s() {
    std::ifstream in("/proc/stat");
    std::string key;
    int64_t v = 0;
    while (in >> key) {
        if (key == "btime") {
            in >> v;
            return v;
        }
        in.ignore(1 << 20, '\n');
    }
    return 0;
}

}  // namespace

ProcessStats read_process_stats() {
    ProcessStats s;
    const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
    const int64_t page = ::sysconf(_SC_PAGESIZE);
    std::string line;
    if (std::ifstream in("/proc/self/stat"); std::getline(in, line)) {  // closed before the fds are counted
        // Field 2 (comm) may hold spaces and parentheses: parse after the last ')'.
        const size_t rp = line.rfind(')');
        if (rp != std::string::npos) {
            std::istringstream f(line.substr(rp + 2));
            std::string tok;
            // Fields from 3 (state) on; utime 14, stime 15, starttime 22, vsize 23, rss 24.
            double cpu_ticks = 0;  // utime + stime, divided once (as ps and the kernel's own sum do)
            for (int field = 3; f >> tok && field <= 24; ++field) {
                if (field == 14 || field == 15) { cpu_ticks += std::stod(tok); }
                if (field == 22) { s.start_time_seconds = static_cast<double>(boot_time_s()) + std::stod(tok) / ticks; }
                if (field == 23) { s.virtual_memory_bytes = std::stoll(tok); }
                if (field == 24) { s.resident_memory_bytes = std::stoll(tok) * page; }
            }
            s.cpu_seconds_total = cpu_ticks / ticks;
        }
    }
    if (DIR * d = ::opendir("/proc/self/fd")) {
        while (const dirent * e = ::readdir(d)) {
            if (e->d_name[0] != '.') { ++s.open_fds; }
        }
        ::closedir(d);
        --s.open_fds;  // the directory stream's own descriptor
    }
    rlimit rl{};
    if (::getrlimit(RLIMIT_NOFILE, &rl) == 0) { s.max_fds = static_cast<int64_t>(rl.rlim_cur); }
    return s;
}

}  // namespace fd::metrics
