// CPUs this process may use (fd/cpus.h): the affinity mask capped by the cgroup CPU quota.
#include "fd/cpus.h"

#include <sched.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace fd {
namespace {

std::optional<std::string> read_small(const std::string & path) {
    std::ifstream in(path);
    if (!in) { return std::nullopt; }
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
}

std::optional<int64_t> to_int(std::string_view s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) { s.remove_suffix(1); }
    int64_t v = 0;
    const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || p != s.data() + s.size()) { return std::nullopt; }
    return v;
}

/// This process's cgroup v2 path ("0::/a/b" in /proc/self/cgroup), or "" when not on v2.
std::string cgroup_v2_path() {
    const auto text = read_small("/proc/self/cgroup");
    if (!text) { return ""; }
    std::istringstream lines(*text);
    for (std::string line; std::getline(lines, line);) {
        if (line.rfind("0::", 0) == 0) { return line.substr(3); }
    }
    return "";
}

}  // namespace

std::optional<int32_t> parse_cpu_max(std::string_view text) {
    const size_t sp = text.find(' ');
    if (sp == std::string_view::npos) { return std::nullopt; }
    const std::string_view quota = text.substr(0, sp);
    if (quota == "max") { return std::nullopt; }
    const auto q = to_int(quota), p = to_int(text.substr(sp + 1));
    if (!q || !p) { return std::nullopt; }
    return cpu_quota_v1(*q, *p);
}

std::optional<int32_t> cpu_quota_v1(int64_t quota_us, int64_t period_us) {
    if (quota_us <= 0 || period_us <= 0) { return std::nullopt; }
    return static_cast<int32_t>(std::max<int64_t>(1, (quota_us + period_us - 1) / period_us));
}

std::optional<int32_t> cgroup_cpu_quota() {
    const std::string path = cgroup_v2_path();
    for (const std::string & dir : {std::string("/sys/fs/cgroup") + (path == "/" ? "" : path), std::string("/sys/fs/cgroup")}) {
        if (const auto text = read_small(dir + "/cpu.max")) { return parse_cpu_max(*text); }
    }
    const auto q = read_small("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), p = read_small("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
    if (!q || !p) { return std::nullopt; }
    const auto qv = to_int(*q), pv = to_int(*p);
    if (!qv || !pv) { return std::nullopt; }
    return cpu_quota_v1(*qv, *pv);
}

int32_t affinity_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0) { return std::max(1, CPU_COUNT(&set)); }
    return static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
}

int32_t usable_cpus() {
    const int32_t n = affinity_cpus();
    const auto q = cgroup_cpu_quota();
    return q ? std::max(1, std::min(n, *q)) : n;
}

}  // namespace fd
