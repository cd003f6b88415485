// fd_linear_bf16_bench: the linears of a BF16 model in both compute modes, kernel alone (issue 28).
// For each shape (n_out x n_in) and row count M it times
//   f32 mode:  kernels::linear       (bf16 weights widened to f32, f32 FMAs)
//   bf16 mode: kernels::linear_bf16  (x rounded to bf16, vdpbf16ps), and its two parts apart:
//              round_to_bf16 of x alone (the rounding's share) and the whole call;
// M = 1 streams a stack of copies of the matrix larger than the last-level cache (decode: bytes
// bound), reported as weight bytes per second ÷ this run's read bandwidth, two probes over the
// same number of bytes: `read_bw_gbs` a 16-wide vector sum read front to back (one stream, the
// probe of every earlier record: *_of_bw), and `read_bw_streams_gbs` the best of that and the same
// sum over 2, 4 and 8 parts read side by side (one core reads several streams faster than one:
// 1.2-1.3x on the AMD EPYC of issue 28; *_of_bw_streams, the figure to judge a kernel by). Both
// probes run before the shapes and again after them, each keeping its best (other programs'
// memory traffic changes during a run; the best is the least disturbed);
// M > 1 reuses one matrix (compute bound), reported as GFLOP/s.
// Weights and probe buffer are 2 MiB-aligned anonymous mappings advised MADV_HUGEPAGE, as the
// daemon's weight arena (fd::Arena); --huge-pages 0: plain 4 KiB pages (records before issue 28
// "B=1 GEMV on AVX2" ran on std::vector memory).
// Every figure is the best of --reps runs by process CPU time (other programs share the machine;
// the best CPU-time run is the one least disturbed). Prints one JSON object.
// Linked against any build's fd_kernels (public API only), so main's kernels and a branch's can
// be compared in the same session (docs/benchmarks.md, issue 28 "bf16 GEMM pass").
#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/thread_pool.h"

#include "bench_util.h"  // sum_streams

#include <nlohmann/json.hpp>

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace k = fd::kernels;
using json  = nlohmann::ordered_json;

namespace {
using fd::bench::sum_streams;

double cpu_now() {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// Best CPU seconds per call of `fn` over `reps` runs of at least `min_s` each.
double best_per_call(const std::function<void()> & fn, int reps, double min_s) {
    fn();  // warm
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
        int64_t      n  = 0;
        const double t0 = cpu_now();
        double       dt = 0;
        do {
            fn();
            ++n;
            dt = cpu_now() - t0;
        } while (dt < min_s);
        best = std::min(best, dt / static_cast<double>(n));
    }
    return best;
}

uint16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/// `bytes` of anonymous memory, 2 MiB-aligned; `huge`: advised MADV_HUGEPAGE (as fd::Arena does
/// for the daemon's weights). Zero-filled, every page touched. Unmapped on destruction.
struct Buffer {
    char * p = nullptr;
    void * base = nullptr;
    size_t mapped = 0;
    Buffer(size_t bytes, bool huge) {
        constexpr size_t kAlign = size_t{2} << 20;
        mapped = bytes + kAlign;
        base   = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (base == MAP_FAILED) {
            std::fprintf(stderr, "mmap of %zu bytes failed\n", mapped);
            std::exit(1);
        }
        p = reinterpret_cast<char *>((reinterpret_cast<uintptr_t>(base) + kAlign - 1) / kAlign * kAlign);
        madvise(p, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
        std::memset(p, 0, bytes);
    }
    ~Buffer() { munmap(base, mapped); }
    Buffer(const Buffer &) = delete;
    Buffer & operator=(const Buffer &) = delete;
};

/// Bytes per second of reading `bytes` front to back with a 16-float-wide sum (one stream: the
/// probe of the earlier records) and the best of that and 2, 4, 8 streams side by side.
std::pair<double, double> read_bandwidth(size_t bytes, int reps, bool huge) {
    Buffer         mem(bytes, huge);
    float *        buf = reinterpret_cast<float *>(mem.p);
    const size_t   n   = bytes / 4;
    volatile float sink = 0;
    for (size_t i = 0; i < n; ++i) { buf[i] = 1.0f; }
    const double one = best_per_call(
        [&] {
            float acc[16] = {};
            for (size_t i = 0; i + 16 <= n; i += 16) {
                for (int l = 0; l < 16; ++l) { acc[l] += buf[i + l]; }
            }
            float t = 0;
            for (float v : acc) { t += v; }
            sink = t;
        },
        reps, 0.3);
    double best = one;
    best = std::min(best, best_per_call([&] { sink = sum_streams<2>(buf, n); }, reps, 0.3));
    best = std::min(best, best_per_call([&] { sink = sum_streams<4>(buf, n); }, reps, 0.3));
    best = std::min(best, best_per_call([&] { sink = sum_streams<8>(buf, n); }, reps, 0.3));
    (void)sink;
    return {static_cast<double>(bytes) / one, static_cast<double>(bytes) / best};
}

std::vector<int64_t> parse_list(const std::string & s) {
    std::vector<int64_t> v;
    size_t               p = 0;
    while (p < s.size()) {
        const size_t q = s.find(',', p);
        v.push_back(std::stoll(s.substr(p, q == std::string::npos ? std::string::npos : q - p)));
        p = q == std::string::npos ? s.size() : q + 1;
    }
    return v;
}

}  // namespace

int main(int argc, char ** argv) {
    // Arguments: --threads N --reps R --min-s S --ms 1,8,64,512 --stream-mib MiB --shapes OUTxIN,...
    //            --weights bf16|f32 --huge-pages 1|0
    int         threads = 1, reps = 5;
    bool        huge = true;
    bool        f32_weights = false;  // --weights f32: an F32 checkpoint (bf16 mode rounds each weight as read)
    double      min_s   = 0.2;
    int64_t     stream_mib = 192;
    std::string ms_s = "1,8,64,512", shapes_s = "3072x512,512x1536,8192x512";
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string a = argv[i], v = argv[i + 1];
        if (a == "--threads") { threads = std::stoi(v); }
        else if (a == "--reps") { reps = std::stoi(v); }
        else if (a == "--min-s") { min_s = std::stod(v); }
        else if (a == "--ms") { ms_s = v; }
        else if (a == "--stream-mib") { stream_mib = std::stoll(v); }
        else if (a == "--shapes") { shapes_s = v; }
        else if (a == "--weights") { f32_weights = v == "f32"; }
        else if (a == "--huge-pages") { huge = v != "0"; }
        else { std::fprintf(stderr, "unknown argument %s\n", a.c_str()); return 2; }
    }
    k::ThreadPool pool(threads);
    auto [bw, bw_streams] = read_bandwidth(static_cast<size_t>(stream_mib) << 20, reps, huge);
    json          out;
    out["threads"]           = threads;
    out["bf16_isa"]          = k::bf16_isa_name(k::bf16_best_isa());
    out["huge_pages"]        = huge;

    out["weights"]           = f32_weights ? "f32" : "bf16";
    std::mt19937 rng(28);
    std::normal_distribution<float> nd(0.0f, 0.05f);
    size_t p = 0;
    while (p < shapes_s.size()) {
        const size_t      q  = shapes_s.find(',', p);
        const std::string sh = shapes_s.substr(p, q == std::string::npos ? std::string::npos : q - p);
        p                    = q == std::string::npos ? shapes_s.size() : q + 1;
        const int64_t n_out = std::stoll(sh.substr(0, sh.find('x'))), n_in = std::stoll(sh.substr(sh.find('x') + 1));
        const int64_t es = f32_weights ? 4 : 2, mat_bytes = n_out * n_in * es;
        const int64_t copies    = std::max<int64_t>(1, (stream_mib << 20) / mat_bytes);
        Buffer        wmem(static_cast<size_t>(copies * mat_bytes), huge);
        uint16_t *    w  = reinterpret_cast<uint16_t *>(wmem.p);  // bf16 weights, or the first copy's values before widening
        float *       wf = reinterpret_cast<float *>(wmem.p);
        std::vector<uint16_t> w0(static_cast<size_t>(n_out * n_in));
        for (auto & v : w0) { v = to_bf16(nd(rng)); }
        if (f32_weights) {  // the same values, stored as f32
            k::bf16_to_f32(wf, w0.data(), n_out * n_in);
        } else {
            std::memcpy(w, w0.data(), static_cast<size_t>(mat_bytes));
        }
        for (int64_t c = 1; c < copies; ++c) { std::memcpy(wmem.p + c * mat_bytes, wmem.p, static_cast<size_t>(mat_bytes)); }
        const k::WType wt   = f32_weights ? k::WType::f32 : k::WType::bf16;
        const char *   wsrc = wmem.p;
        for (int64_t m : parse_list(ms_s)) {
            std::vector<float> x(static_cast<size_t>(m * n_in)), y(static_cast<size_t>(m * n_out));
            std::vector<uint16_t> xb(static_cast<size_t>(m * n_in));
            for (float & v : x) { v = nd(rng) * 20.0f; }
            json row;
            row["shape"] = sh;
            row["m"]     = m;
            if (m == 1) {  // stream the stack of copies: bytes bound
                int64_t c = 0;
                auto f32 = [&] { k::linear(y.data(), x.data(), wsrc + (c++ % copies) * mat_bytes, wt, nullptr, 1, n_out, n_in, &pool); };
                auto b16 = [&] { k::linear_bf16(y.data(), x.data(), wsrc + (c++ % copies) * mat_bytes, wt, nullptr, 1, n_out, n_in, &pool); };
                const double tf = best_per_call(f32, reps, min_s), tb = best_per_call(b16, reps, min_s);
                row["f32_mode_us"]       = tf * 1e6;
                row["bf16_mode_us"]      = tb * 1e6;
                row["weight_bytes"]      = mat_bytes;  // the ratios to the probes: after the last shape
            } else {
                const double flop = 2.0 * static_cast<double>(m * n_out * n_in);
                auto f32 = [&] { k::linear(y.data(), x.data(), wsrc, wt, nullptr, m, n_out, n_in, &pool); };
                auto b16 = [&] { k::linear_bf16(y.data(), x.data(), wsrc, wt, nullptr, m, n_out, n_in, &pool); };
                auto rnd = [&] { k::round_to_bf16(xb.data(), x.data(), m * n_in, k::bf16_best_isa()); };
                const double tf = best_per_call(f32, reps, min_s), tb = best_per_call(b16, reps, min_s);
                const double tr = best_per_call(rnd, reps, min_s / 4);
                row["f32_mode_gflops"]  = flop / tf / 1e9;
                row["bf16_mode_gflops"] = flop / tb / 1e9;
                row["round_x_share"]    = tr / tb;
            }
            row["bf16_over_f32_speed"] = row.contains("f32_mode_us") ? row["f32_mode_us"].get<double>() / row["bf16_mode_us"].get<double>()
                                                                      : row["bf16_mode_gflops"].get<double>() / row["f32_mode_gflops"].get<double>();
            out["rows"].push_back(row);
            std::fprintf(stderr, "%s\n", row.dump().c_str());
        }
    }
    const auto [bw2, bw_streams2] = read_bandwidth(static_cast<size_t>(stream_mib) << 20, reps, huge);
    bw = std::max(bw, bw2), bw_streams = std::max(bw_streams, bw_streams2);
    out["read_bw_gbs"]         = bw / 1e9;
    out["read_bw_streams_gbs"] = bw_streams / 1e9;
    for (json & row : out["rows"]) {
        if (!row.contains("weight_bytes")) { continue; }
        const double b = row["weight_bytes"].get<double>(), tf = row["f32_mode_us"].get<double>() * 1e-6,
                     tb = row["bf16_mode_us"].get<double>() * 1e-6;
        row["f32_mode_of_bw"]          = b / tf / bw;
        row["bf16_mode_of_bw"]         = b / tb / bw;
        row["f32_mode_of_bw_streams"]  = b / tf / bw_streams;
        row["bf16_mode_of_bw_streams"] = b / tb / bw_streams;
    }
    std::printf("%s\n", out.dump(1).c_str());
    return 0;
}
