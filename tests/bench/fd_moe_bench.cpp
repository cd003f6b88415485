// fd_moe_bench: the mixture-of-experts block's kernels on synthetic weights (issue 23), as
// ratios against references from the same run. Prints one JSON object (docs/benchmarks.md).
//
//   B = 1 (decode of one sequence): a token through `layers` sparse blocks — router linear, host
//     softmax/top-k (moe_route), the plan (moe_plan), Backend::moe_experts — against the read
//     bandwidth: active bytes (top_k experts' gate_up + down, the routers) per second ÷ the
//     1-thread read bandwidth of a vectorized sum over a buffer far larger than the caches. Each
//     run routes a different token (the experts change from run to run, as in decode), and the
//     expert set of every layer is distinct memory (nothing stays cached between layers). The
//     time is split into routing (router + route + plan), moe_experts, and, as a reference for
//     the experts' part, one kernels::linear streaming a single matrix of the same bytes.
//   B = 64 (batched decode): the expert GEMMs' FLOP rate (2 · pairs · 3 · hidden · inter per
//     moe_experts call, pairs = B · top_k) ÷ the dense linears' on the same total rows: gate_up,
//     silu_mul, down of ONE expert's shapes over M = pairs rows.
// Timings are per-run best by process CPU time (1 thread: the time this process ran, so slices
// other processes took do not count — the 2-core guest is shared) and by wall time.
#include "bench_util.h"

#include "fd/kernels/backend.h"
#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/moe.h"

#include <CLI/CLI.hpp>

#include <sys/mman.h>

#include <cstring>
#include <iostream>
#include <random>

namespace K = fd::kernels;
using nlohmann::ordered_json;
using fd::bench::Clock;
using fd::bench::round_to;
using fd::bench::seconds_since;

namespace {

double cpu_now() {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

/// Best wall and best process-CPU seconds of fn() over at least min_s seconds and min_runs runs.
struct Best { double wall = 1e300, cpu = 1e300; int64_t runs = 0; };
template <typename Fn>
Best time_best(double min_s, int64_t min_runs, Fn && fn) {
    Best b;
    double total = 0;
    while (b.runs < min_runs || total < min_s) {
        const auto t0 = Clock::now();
        const double c0 = cpu_now();
        fn();
        const double dt = seconds_since(t0);
        b.wall = std::min(b.wall, dt);
        b.cpu  = std::min(b.cpu, cpu_now() - c0);
        total += dt;
        ++b.runs;
    }
    return b;
}

struct Mem {
    void * p = nullptr;
    size_t bytes = 0;
    explicit Mem(size_t b) : bytes(b) {
        p = mmap(nullptr, b, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) { throw std::runtime_error("mmap failed"); }
        madvise(p, b, MADV_HUGEPAGE);
    }
    ~Mem() { munmap(p, bytes); }
};

volatile float g_sink = 0;

/// 1-thread read bandwidth: best pass (wall and CPU time) of a 16-wide vector sum over `bytes`.
std::pair<double, double> read_bw_gbs(size_t bytes, int passes) {
    Mem m(bytes);
    auto * f = static_cast<float *>(m.p);
    const size_t n = bytes / 4 / 128 * 128;
    for (size_t i = 0; i < n; ++i) { f[i] = static_cast<float>(i & 7); }
    typedef float v16 __attribute__((vector_size(64)));
    auto sum = [&] {
        v16 a[8] = {};
        for (size_t i = 0; i < n; i += 128) {
            v16 x[8];
            std::memcpy(x, f + i, sizeof x);
            for (int j = 0; j < 8; ++j) { a[j] += x[j]; }
        }
        float r = 0;
        for (int j = 0; j < 8; ++j) { for (int l = 0; l < 16; ++l) { r += a[j][l]; } }
        g_sink = g_sink + r;
    };
    const Best b = time_best(0.0, passes, sum);
    return {static_cast<double>(n) * 4 / b.wall / 1e9, static_cast<double>(n) * 4 / b.cpu / 1e9};
}

uint16_t to_bf16(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

struct Opts {
    int threads = 1, layers = 4, experts = 128, top_k = 8, hidden = 512, inter = 192, batch = 64;
    bool f32 = false;
    double seconds = 1.0;
    int bw_mib = 512;
};

/// Every layer's experts (gate_up [2I, H], down [H, I]) and router ([E, H] f32), distinct memory.
struct Model {
    Opts o;
    K::WType t;
    int64_t es;  ///< bytes per element
    std::unique_ptr<Mem> mem;
    std::vector<std::vector<K::ExpertWeights>> experts;  ///< [layers][E]
    std::vector<const float *> router;                    ///< [layers]
    int64_t expert_bytes() const { return 3LL * o.hidden * o.inter * es; }
    explicit Model(const Opts & o_) : o(o_), t(o_.f32 ? K::WType::f32 : K::WType::bf16), es(o_.f32 ? 4 : 2) {
        const int64_t per_layer = o.experts * expert_bytes() + int64_t{o.experts} * o.hidden * 4;
        mem = std::make_unique<Mem>(static_cast<size_t>(per_layer * o.layers + 4096));
        std::mt19937 rng(7);
        std::uniform_real_distribution<float> u(-0.05f, 0.05f);
        auto * base = static_cast<char *>(mem->p);
        int64_t off = 0;
        for (int l = 0; l < o.layers; ++l) {
            experts.emplace_back();
            for (int e = 0; e < o.experts; ++e) {
                K::ExpertWeights w{base + off, t, base + off + 2LL * o.inter * o.hidden * es, t};
                const int64_t n = 3LL * o.inter * o.hidden;
                for (int64_t i = 0; i < n; ++i) {
                    const float v = u(rng);
                    if (o.f32) { reinterpret_cast<float *>(base + off)[i] = v; } else { reinterpret_cast<uint16_t *>(base + off)[i] = to_bf16(v); }
                }
                off += expert_bytes();
                experts.back().push_back(w);
            }
            auto * r = reinterpret_cast<float *>(base + off);
            for (int64_t i = 0; i < int64_t{o.experts} * o.hidden; ++i) { r[i] = u(rng) * 20; }
            router.push_back(r);
            off += int64_t{o.experts} * o.hidden * 4;
        }
    }
};

/// One token (or batch) through every layer's sparse block; `route_s` / `experts_s` add the split.
struct Block {
    const Model & m;
    K::Backend & be;
    std::vector<float> logits, wts, out, work;
    std::vector<int32_t> ids;
    double route_s = 0, experts_s = 0;
    void run(const float * x, int64_t n) {
        const auto & o = m.o;
        logits.resize(static_cast<size_t>(n * o.experts));
        ids.resize(static_cast<size_t>(n * o.top_k));
        wts.resize(ids.size());
        out.resize(static_cast<size_t>(n * o.hidden));
        for (int l = 0; l < o.layers; ++l) {
            const auto t0 = Clock::now();
            be.linear(logits.data(), x, m.router[l], K::WType::f32, nullptr, n, o.experts, o.hidden);
            K::moe_route(ids.data(), wts.data(), logits.data(), n, o.experts, o.top_k, true);
            const K::MoePlan plan = K::moe_plan(ids.data(), wts.data(), n, o.top_k, o.experts);
            work.resize(static_cast<size_t>(K::Backend::moe_work_floats(plan.max_rows, o.hidden, o.inter)));
            const auto t1 = Clock::now();
            be.moe_experts(out.data(), x, plan, m.experts[l].data(), n, o.hidden, o.inter, work.data());
            route_s += std::chrono::duration<double>(t1 - t0).count();
            experts_s += seconds_since(t1);
        }
    }
};

ordered_json bench_b1(const Model & m, K::Backend & be, double bw_wall, double bw_cpu) {
    const auto & o = m.o;
    // 256 distinct tokens: each run routes another one (different experts, as decode does).
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> xs(static_cast<size_t>(256 * o.hidden));
    for (auto & v : xs) { v = nd(rng); }
    Block blk{m, be};
    int64_t next = 0;
    blk.run(xs.data(), 1);  // warm-up (work buffers)
    blk.route_s = blk.experts_s = 0;
    const Best b = time_best(o.seconds, 20, [&] { blk.run(xs.data() + (next++ % 256) * o.hidden, 1); });
    const double active = static_cast<double>(o.layers) * (o.top_k * m.expert_bytes() + int64_t{o.experts} * o.hidden * 4);
    // Reference: one linear streaming a single [top_k * 3 * I, H] matrix of the same expert bytes
    // per layer (distinct memory per run: it walks the expert region).
    const int64_t n_out = int64_t{o.top_k} * 3 * o.inter;
    const int64_t span  = n_out * o.hidden * m.es;
    const int64_t n_spans = static_cast<int64_t>(m.mem->bytes) / span - 1;
    std::vector<float> y(static_cast<size_t>(n_out));
    int64_t s = 0;
    const Best ref = time_best(o.seconds, 20, [&] {
        for (int l = 0; l < o.layers; ++l) {
            be.linear(y.data(), xs.data(), static_cast<const char *>(m.mem->p) + (s++ % n_spans) * span, m.t, nullptr, 1, n_out, o.hidden);
        }
    });
    const double expert_active = static_cast<double>(o.layers) * o.top_k * m.expert_bytes();
    ordered_json j;
    j["runs"] = b.runs;
    j["step_us_best_wall"] = round_to(b.wall * 1e6, 1);
    j["step_us_best_cpu"] = round_to(b.cpu * 1e6, 1);
    j["active_bytes"] = active;
    j["share_routing"] = round_to(blk.route_s / (blk.route_s + blk.experts_s), 3);
    j["share_experts"] = round_to(blk.experts_s / (blk.route_s + blk.experts_s), 3);
    j["active_gbs_cpu"] = round_to(active / b.cpu / 1e9, 3);
    j["ratio_vs_read_bw_cpu"] = round_to(active / b.cpu / 1e9 / bw_cpu, 3);
    j["ratio_vs_read_bw_wall"] = round_to(active / b.wall / 1e9 / bw_wall, 3);
    j["one_matrix_linear_us_best_cpu"] = round_to(ref.cpu * 1e6, 1);
    j["one_matrix_linear_ratio_vs_read_bw_cpu"] = round_to(expert_active / ref.cpu / 1e9 / bw_cpu, 3);
    return j;
}

ordered_json bench_batched(const Model & m, K::Backend & be) {
    const auto & o = m.o;
    const int64_t B = o.batch, H = o.hidden, I = o.inter;
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> x(static_cast<size_t>(B * H));
    for (auto & v : x) { v = nd(rng); }
    // The routes of this batch on layer 0's router (fixed: the GEMMs are what is timed).
    std::vector<float> logits(static_cast<size_t>(B * o.experts)), wts(static_cast<size_t>(B * o.top_k));
    std::vector<int32_t> ids(wts.size());
    be.linear(logits.data(), x.data(), m.router[0], K::WType::f32, nullptr, B, o.experts, H);
    K::moe_route(ids.data(), wts.data(), logits.data(), B, o.experts, o.top_k, true);
    const K::MoePlan plan = K::moe_plan(ids.data(), wts.data(), B, o.top_k, o.experts);
    std::vector<float> out(static_cast<size_t>(B * H)), work(static_cast<size_t>(K::Backend::moe_work_floats(plan.max_rows, H, I)));
    int l = 0;
    const Best e = time_best(o.seconds, 5, [&] {
        be.moe_experts(out.data(), x.data(), plan, m.experts[l].data(), B, H, I, work.data());
        l = (l + 1) % o.layers;
    });
    // Dense reference: the same ops on one expert's shapes over M = pairs rows.
    const int64_t M = B * o.top_k;
    std::vector<float> xm(static_cast<size_t>(M * H)), gu(static_cast<size_t>(M * 2 * I)), act(static_cast<size_t>(M * I)),
        y(static_cast<size_t>(M * H));
    for (auto & v : xm) { v = nd(rng); }
    int d = 0;
    const Best r = time_best(o.seconds, 5, [&] {
        const K::ExpertWeights & w = m.experts[d % o.layers][d % o.experts];
        be.linear(gu.data(), xm.data(), w.gate_up, w.gate_up_type, nullptr, M, 2 * I, H);
        be.silu_mul(act.data(), gu.data(), M, I);
        be.linear(y.data(), act.data(), w.down, w.down_type, nullptr, M, H, I);
        ++d;
    });
    const double flops = 2.0 * static_cast<double>(M) * 3 * H * I;
    ordered_json j;
    j["batch"] = B;
    j["pairs"] = M;
    j["experts_used"] = plan.experts.size();
    j["largest_group"] = plan.max_rows;
    j["moe_experts_ms_best_cpu"] = round_to(e.cpu * 1e3, 3);
    j["moe_experts_gflops_cpu"] = round_to(flops / e.cpu / 1e9, 2);
    j["dense_ms_best_cpu"] = round_to(r.cpu * 1e3, 3);
    j["dense_gflops_cpu"] = round_to(flops / r.cpu / 1e9, 2);
    j["ratio_cpu"] = round_to(r.cpu / e.cpu, 3);
    j["ratio_wall"] = round_to(r.wall / e.wall, 3);
    return j;
}

}  // namespace

int main(int argc, char ** argv) {
    Opts o;
    CLI::App app{"fd_moe_bench: MoE block kernels at B=1 (÷ read bandwidth) and batched (÷ dense linear FLOP rate); one JSON object"};
    app.add_option("--threads", o.threads, "CPU backend threads")->capture_default_str();
    app.add_option("--layers", o.layers, "sparse layers (distinct expert memory each)")->capture_default_str();
    app.add_option("--experts", o.experts, "experts per layer")->capture_default_str();
    app.add_option("--top-k", o.top_k, "experts per token")->capture_default_str();
    app.add_option("--hidden", o.hidden, "hidden size")->capture_default_str();
    app.add_option("--inter", o.inter, "moe_intermediate_size")->capture_default_str();
    app.add_option("--batch", o.batch, "tokens of the batched case")->capture_default_str();
    app.add_flag("--f32", o.f32, "f32 expert weights (default bf16)");
    app.add_option("--seconds", o.seconds, "least seconds per measurement")->capture_default_str();
    app.add_option("--bw-mib", o.bw_mib, "read-bandwidth buffer (MiB)")->capture_default_str();
    CLI11_PARSE(app, argc, argv);
    auto be = K::make_backend({.kind = K::DeviceKind::cpu, .n_threads = o.threads});
    const Model m(o);
    const auto [bw_wall, bw_cpu] = read_bw_gbs(static_cast<size_t>(o.bw_mib) << 20, 9);
    ordered_json j;
    j["bench"] = "fd_moe_bench";
    j["cpu"] = fd::bench::cpu_model();
    j["threads"] = o.threads;
    j["shape"] = {{"layers", o.layers}, {"experts", o.experts}, {"top_k", o.top_k}, {"hidden", o.hidden}, {"inter", o.inter},
                  {"dtype", o.f32 ? "f32" : "bf16"}};
    j["read_bw_gbs_best_wall"] = round_to(bw_wall, 2);
    j["read_bw_gbs_best_cpu"] = round_to(bw_cpu, 2);
    j["b1"] = bench_b1(m, *be, bw_wall, bw_cpu);
    j["batched"] = bench_batched(m, *be);
    std::cout << j.dump(2) << std::endl;
    return 0;
}
