// fd/cpus.h: the cgroup quota parsers (v2 cpu.max text, v1 quota / period) round up and treat
// "no limit" as none; usable_cpus() is the affinity mask's count capped by this machine's quota.
#include "fd/cpus.h"

#include <doctest/doctest.h>

#include <sched.h>

TEST_CASE("cpus: cgroup quotas in CPUs, rounded up; no limit is none") {
    CHECK_FALSE(fd::parse_cpu_max("max 100000\n").has_value());
    CHECK(fd::parse_cpu_max("150000 100000\n") == 2);
    CHECK(fd::parse_cpu_max("200000 100000") == 2);
    CHECK(fd::parse_cpu_max("50000 100000") == 1);  // half a CPU is still one thread's worth
    CHECK_FALSE(fd::parse_cpu_max("").has_value());
    CHECK_FALSE(fd::parse_cpu_max("abc 100000").has_value());
    CHECK_FALSE(fd::cpu_quota_v1(-1, 100000).has_value());  // v1: -1 = no quota
    CHECK(fd::cpu_quota_v1(250000, 100000) == 3);
    CHECK_FALSE(fd::cpu_quota_v1(100000, 0).has_value());
}

TEST_CASE("cpus: usable_cpus is the affinity mask's count, capped by the quota") {
    cpu_set_t set;
    CPU_ZERO(&set);
    REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
    CHECK(fd::affinity_cpus() == CPU_COUNT(&set));
    const auto q = fd::cgroup_cpu_quota();
    CHECK(fd::usable_cpus() == (q ? std::min(*q, CPU_COUNT(&set)) : CPU_COUNT(&set)));
    CHECK(fd::usable_cpus() >= 1);
}
