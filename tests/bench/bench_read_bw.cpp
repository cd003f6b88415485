// tests/bench/bench_read_bw.cpp — fd_bench's read-bandwidth probes (bench_read_bw.h): one
// stream per thread (read_bw_probe), several streams on one thread (read_bw_streams_probe), and
// memcpy. Moved out of fd_bench.cpp with the streams probe added (issue 28's B=1 and long-context
// ratios are judged against it too).
#include "bench_read_bw.h"

#include "bench_util.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <thread>
#include <utility>
#include <vector>

namespace fd::bench {

namespace {

using json = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------
// Memory bandwidth
// ---------------------------------------------------------------------------------------------

#if defined(__AVX512F__)
typedef float v16f __attribute__((vector_size(64)));

/// Sum of p[0, n) with 8 independent vector accumulators (n a multiple of 128).
float sum_floats(const float * p, size_t n) {
    v16f a0{}, a1{}, a2{}, a3{}, a4{}, a5{}, a6{}, a7{};
    for (size_t i = 0; i + 128 <= n; i += 128) {
        v16f x[8];
        std::memcpy(x, p + i, sizeof x);
        a0 += x[0]; a1 += x[1]; a2 += x[2]; a3 += x[3];
        a4 += x[4]; a5 += x[5]; a6 += x[6]; a7 += x[7];
    }
    const v16f s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
    float r = 0.0f;
    for (int j = 0; j < 16; ++j) { r += s[j]; }
    return r;
}
#else
typedef float v8f __attribute__((vector_size(32)));

/// Sum of p[0, n) with 8 independent 8-lane accumulators (n a multiple of 128). Without AVX-512
/// a 64-byte GCC vector is two ymm registers: 8 accumulators plus the loaded values spilled,
/// and the loop called memcpy per 512 bytes (on a Zen 3 EPYC it read 10 GB/s where this loop,
/// one vaddps with a memory operand per 32 bytes, reads 16-19 GB/s).
float sum_floats(const float * p, size_t n) {
    v8f a[8] = {};
    for (size_t i = 0; i + 128 <= n; i += 128) {
        for (int j = 0; j < 8; ++j) {
            v8f x, y;
            std::memcpy(&x, p + i + 16 * j, sizeof x);
            std::memcpy(&y, p + i + 16 * j + 8, sizeof y);
            a[j] += x;
            a[j] += y;
        }
    }
    const v8f s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    float r = 0.0f;
    for (int j = 0; j < 8; ++j) { r += s[j]; }
    return r;
}
#endif

volatile float g_sink = 0.0f;

/// GB/s of one sum_streams<S> pass over m (the floats it reads).
template <int S>
double streams_gbs(const Mapping & m) {
    const size_t n  = m.count();
    const auto   t0 = Clock::now();
    g_sink = g_sink + sum_streams<S>(m.p, n);
    return static_cast<double>(n / S / 128 * 128 * S) * sizeof(float) / seconds_since(t0) / 1e9;
}

}  // namespace

json read_bw_probe(const Mapping & m, int n_threads, int passes) {
    const size_t n     = m.count();
    const size_t chunk = n / static_cast<size_t>(n_threads) / 128 * 128;
    const int    n_cpu = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    std::vector<double> wall, cpu;
    for (int r = 0; r < passes; ++r) {
        std::vector<float>  part(n_threads, 0.0f);
        std::vector<double> tcpu(n_threads, 0.0);
        std::atomic<int>    ready{0};
        std::atomic<bool>   go{false};
        std::vector<std::thread> th;
        for (int t = 0; t < n_threads; ++t) {
            th.emplace_back([&, t] {
                cpu_set_t set;
                CPU_ZERO(&set);
                CPU_SET(t % n_cpu, &set);
                pthread_setaffinity_np(pthread_self(), sizeof set, &set);
                ready.fetch_add(1);
                while (!go.load(std::memory_order_acquire)) { std::this_thread::yield(); }
                timespec c0{}, c1{};
                clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
                part[t] = sum_floats(m.p + t * chunk, chunk);
                clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
                tcpu[t] = static_cast<double>(c1.tv_sec - c0.tv_sec) + 1e-9 * static_cast<double>(c1.tv_nsec - c0.tv_nsec);
            });
        }
        while (ready.load() < n_threads) { std::this_thread::yield(); }
        const auto t0 = Clock::now();
        go.store(true, std::memory_order_release);
        for (auto & x : th) { x.join(); }
        wall.push_back(seconds_since(t0));
        cpu.push_back(*std::max_element(tcpu.begin(), tcpu.end()));
        for (float v : part) { g_sink = g_sink + v; }
    }
    const double bytes = static_cast<double>(chunk) * n_threads * sizeof(float);
    auto gbs = [&](std::vector<double> secs) {  // sorted best (fastest) first
        std::sort(secs.begin(), secs.end());
        std::vector<double> g;
        for (double x : secs) { g.push_back(bytes / x / 1e9); }
        return g;
    };
    const std::vector<double> w = gbs(wall), c = gbs(cpu);
    json j;
    j["best"] = round_to(w.front(), 2);
    j["median"] = round_to(w[w.size() / 2], 2);
    j["worst"] = round_to(w.back(), 2);
    j["best_cpu_time"] = round_to(c.front(), 2);
    j["median_cpu_time"] = round_to(c[c.size() / 2], 2);
    j["passes"] = passes;
    j["threads_pinned"] = true;
    return j;
}

json read_bw_streams_probe(const Mapping & m, int passes) {
    double best = 0.0;
    int    best_s = 0;
    for (int r = 0; r < passes; ++r) {
        for (const auto & [s, gbs] : {std::pair{2, streams_gbs<2>(m)}, std::pair{4, streams_gbs<4>(m)}, std::pair{8, streams_gbs<8>(m)}}) {
            if (gbs > best) { best = gbs, best_s = s; }
        }
    }
    json j;
    j["best"] = round_to(best, 2);
    j["streams"] = best_s;
    j["passes"] = passes;
    return j;
}

json memory_bandwidth(size_t bytes, int n_threads) {
    Mapping src(bytes, /*huge=*/true);  // as the daemon's weight and KV arenas
    // Touch every page (and give the sum something to add).
    for (size_t i = 0; i < src.count(); ++i) { src.p[i] = static_cast<float>(i & 1023) * 1e-3f; }
    json j;
    j["buffer_mib"] = bytes >> 20;
    // Two untimed passes first (page tables, frequency), then the probes.
    read_bw_probe(src, n_threads, 2);
    j["single_thread_probe"] = read_bw_probe(src, 1, 9);
    j["single_thread"] = j["single_thread_probe"]["best"];
    j["single_thread_streams_probe"] = read_bw_streams_probe(src, 3);
    j["single_thread_streams"] = j["single_thread_streams_probe"]["best"];
    if (n_threads > 1) {
        j["multi_thread_probe"] = read_bw_probe(src, n_threads, 9);
        j["multi_thread"] = j["multi_thread_probe"]["best"];
    }
    // memcpy of half the buffer into a second (touched) buffer; GB/s of bytes copied.
    Mapping dst(bytes / 2);
    std::memset(dst.p, 0, dst.bytes);
    double best = 1e300;
    for (int r = 0; r < 3; ++r) {
        const auto t0 = Clock::now();
        std::memcpy(dst.p, src.p, dst.bytes);
        best = std::min(best, seconds_since(t0));
        g_sink = g_sink + dst.p[r * 4099];
    }
    j["memcpy_single_thread"] = round_to(static_cast<double>(dst.bytes) / best / 1e9, 2);
    return j;
}

}  // namespace fd::bench
