// fd_delta_floor_bench: the floor of a sparse weight update on this machine (issue #25) — the
// in-place write of a delta (sorted flat indices, new values swapped in, the old ones kept as the
// undo log, the shard's lines prefetched 64 elements ahead, as weights::write_piece does) against
// a memcpy of the whole shard in the same run, with no wire, no daemon and no plan.
//
//   build/fd_delta_floor_bench [--shard-mib 195] [--densities 0.01,0.05] [--procs 2] [--reps 4]
//
// --procs N forks N processes that run at once (the ranks of a tp=N daemon share the machine's
// cores and memory). Each process: a shard of f32 [shard_mib MiB / 4] on 2 MiB transparent huge
// pages, filled by memcpy from another (timed: the reference), then per density the first
// scatter after the fill and a repeat. Prints one JSON object per process, with
// scatter ÷ memcpy per density (median over --reps). The delta stream bench's landed full update
// (delta_stream_bench.py --land) moves the same shard bytes over loopback TCP: dividing these
// scatter times by that update's time gives the share of the ≤ 0.1 / ≤ 0.2 budget the write alone takes.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <vector>

namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

/// `bytes` of anonymous memory, 2 MiB-aligned and advised MADV_HUGEPAGE (as fd::Arena).
float * huge_floats(size_t bytes) {
    constexpr size_t kHuge = size_t{2} << 20;
    void * p = mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        std::perror("mmap");
        std::exit(1);
    }
    auto * q = reinterpret_cast<char *>((reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1));
    madvise(q, bytes, MADV_HUGEPAGE);
    return reinterpret_cast<float *>(q);
}

/// Swap vals[k] with w[idx[k]] for every k (vals then holds the undo log), prefetching ahead.
void scatter_swap(float * w, const std::vector<uint32_t> & idx, std::vector<float> & vals) {
    const size_t n = idx.size();
    for (size_t k = 0; k < n; ++k) {
        if (k + 64 < n) { __builtin_prefetch(w + idx[k + 64], 1); }
        const float old = w[idx[k]];
        w[idx[k]]       = vals[k];
        vals[k]         = old;
    }
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

nlohmann::json run_one(int proc, size_t shard_bytes, const std::vector<double> & densities, int reps) {
    const size_t n = shard_bytes / 4;
    float * w = huge_floats(shard_bytes), * src = huge_floats(shard_bytes);
    std::memset(w, 1, shard_bytes);
    std::memset(src, 2, shard_bytes);
    nlohmann::json out = {{"proc", proc}, {"shard_bytes", shard_bytes}, {"densities", nlohmann::json::array()}};
    std::vector<double> fills;
    for (const double dens : densities) {
        std::mt19937_64 g(static_cast<uint64_t>(1000 * dens) + static_cast<uint64_t>(proc));
        std::bernoulli_distribution pick(dens);
        std::vector<uint32_t> idx;
        idx.reserve(static_cast<size_t>(static_cast<double>(n) * dens * 1.1));
        for (size_t i = 0; i < n; ++i) {
            if (pick(g)) { idx.push_back(static_cast<uint32_t>(i)); }
        }
        std::vector<float> vals(idx.size(), 3.0f);
        std::vector<double> first, repeat;
        for (int r = 0; r < reps; ++r) {
            const double t0 = now_s();
            std::memcpy(w, src, shard_bytes);  // the reference: a full copy of the shard, as a full update lands it
            const double t1 = now_s();
            scatter_swap(w, idx, vals);
            const double t2 = now_s();
            scatter_swap(w, idx, vals);  // puts the values back: the undo
            const double t3 = now_s();
            fills.push_back(t1 - t0);
            first.push_back(t2 - t1);
            repeat.push_back(t3 - t2);
        }
        const double fill = median(fills);
        out["densities"].push_back({{"density", dens},
                                    {"elements", idx.size()},
                                    {"scatter_first_s", median(first)},
                                    {"scatter_repeat_s", median(repeat)},
                                    {"memcpy_s", fill},
                                    {"scatter_first_over_memcpy", median(first) / fill},
                                    {"scatter_repeat_over_memcpy", median(repeat) / fill}});
    }
    out["memcpy_gb_per_s"] = static_cast<double>(shard_bytes) / median(fills) / 1e9;
    return out;
}

}  // namespace

int main(int argc, char ** argv) {
    CLI::App app{"The in-place write of a sparse delta against a memcpy of the shard (issue #25's floor)"};
    double shard_mib = 195;
    std::vector<double> densities = {0.01, 0.05};
    int procs = 2, reps = 4;
    app.add_option("--shard-mib", shard_mib, "f32 shard size per process in MiB (409 MB model at tp=2: 195)")->check(CLI::Range(1.0, 65536.0));
    app.add_option("--densities", densities, "fractions of elements changed")->delimiter(',')->check(CLI::Range(1e-6, 1.0));
    app.add_option("--procs", procs, "processes at once (the ranks)")->check(CLI::Range(1, 64));
    app.add_option("--reps", reps, "repetitions (medians)")->check(CLI::Range(1, 100));
    CLI11_PARSE(app, argc, argv);
    const size_t shard_bytes = static_cast<size_t>(shard_mib * 1048576.0) / 64 * 64;
    std::vector<pid_t> kids;
    for (int p = 0; p < procs; ++p) {
        const pid_t pid = fork();
        if (pid == 0) {
            const nlohmann::json j = run_one(p, shard_bytes, densities, reps);
            std::cout << j.dump() + "\n" << std::flush;
            std::_Exit(0);
        }
        kids.push_back(pid);
    }
    int failed = 0;
    for (const pid_t k : kids) {
        int st = 0;
        waitpid(k, &st, 0);
        failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    return failed ? 1 : 0;
}
