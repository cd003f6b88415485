// fd_bench's prefill profile and the sgemm thread-scaling reference (see bench_prefill.h).
#include "bench_prefill.h"

#include "bench_kernels.h"
#include "bench_util.h"
#include "fd/kernels/backend.h"
#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/thread_pool.h"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <thread>

extern "C" void openblas_set_num_threads(int);

namespace fd::bench {
namespace {

using json = nlohmann::ordered_json;
namespace K = fd::kernels;

/// Op classes of the profile, in forward order.
enum Op : int {
    kEmbedding, kRmsNorm, kQkvSplit, kRope, kKvStore, kAttention, kLinQkv, kLinO, kLinGateUp, kLinDown,
    kSiluMul, kResidualAdd, kLmHead, kNumOps
};
constexpr std::array<const char *, kNumOps> kOpNames = {
    "embedding", "rms_norm", "qkv_split", "rope", "kv_store", "attention", "linear_qkv", "linear_o",
    "linear_gate_up", "linear_down", "silu_mul", "residual_add", "lm_head"};

/// Groups reported next to the classes.
struct Group {
    const char *    name;
    std::vector<Op> ops;
};
const std::vector<Group> kGroups = {
    {"linear", {kLinQkv, kLinO, kLinGateUp, kLinDown}},
    {"attention_and_kv_store", {kAttention, kKvStore}},
    {"norms_rope_silu_residual_split", {kRmsNorm, kRope, kSiluMul, kResidualAdd, kQkvSplit}},
    {"embedding", {kEmbedding}},
    {"lm_head", {kLmHead}},
};

/// Backend memory for the model's activations, weights of the norms and the KV of every layer.
struct PrefillModel {
    const fd::model::ModelConfig & c;
    K::Backend &                   be;
    int64_t                        max_len;
    DecodeLinears                  lins;       // per layer qkv, o, gate_up, down; then lm_head
    std::vector<float *>           bufs;       // everything alloc'ed from be
    float * x = nullptr, * xn = nullptr, * qkv = nullptr, * q = nullptr, * k = nullptr, * v = nullptr;
    float * att = nullptr, * gu = nullptr, * gate = nullptr, * rows = nullptr, * logits = nullptr;
    float * norm_w = nullptr, * rope = nullptr;
    std::vector<float *>           k_pool, v_pool;  // [n_layers]
    std::vector<int32_t>           table;

    PrefillModel(const fd::model::ModelConfig & cfg, K::Backend & backend, int64_t len)
        : c(cfg), be(backend), max_len(len), lins(make_decode_linears(cfg, /*with_lm_head=*/true)) {
        const int64_t h = c.hidden_size, q_dim = c.q_dim(), kv_dim = c.kv_dim(), ff = c.intermediate_size;
        x = alloc(len * h); xn = alloc(len * h); qkv = alloc(len * (q_dim + 2 * kv_dim));
        q = alloc(len * q_dim); k = alloc(len * kv_dim); v = alloc(len * kv_dim); att = alloc(len * q_dim);
        gu = alloc(len * 2 * ff); gate = alloc(len * ff); rows = alloc(h); logits = alloc(c.vocab_size);
        norm_w = alloc(std::max<int64_t>(h, c.head_dim));
        for (int64_t i = 0; i < std::max<int64_t>(h, c.head_dim); ++i) { norm_w[i] = 1.0f + 1e-3f * static_cast<float>(i % 7); }
        rope = alloc(len * c.head_dim);
        K::rope_table(rope, len, c.head_dim, c.rope_theta);
        const int64_t n_blocks = (len + kBlock - 1) / kBlock;
        for (int il = 0; il < c.n_layers; ++il) {
            k_pool.push_back(alloc(n_blocks * kBlock * kv_dim));
            v_pool.push_back(alloc(n_blocks * kBlock * kv_dim));
        }
        for (int64_t b = 0; b < n_blocks; ++b) { table.push_back(static_cast<int32_t>(b)); }
    }
    ~PrefillModel() {
        for (float * p : bufs) { be.free(p); }
    }
    PrefillModel(const PrefillModel &) = delete;
    PrefillModel & operator=(const PrefillModel &) = delete;

    static constexpr int32_t kBlock = 16;

    float * alloc(int64_t n) {
        auto * p = static_cast<float *>(be.alloc(n * 4));
        std::fill_n(p, n, 0.01f);
        bufs.push_back(p);
        return p;
    }
};

/// One prefill of `n` tokens, Worker::forward's op sequence (tp 1); ms[op] += each call's time.
void profiled_forward(PrefillModel & m, int64_t n, std::array<double, kNumOps> & ms) {
    const auto & c = m.c;
    K::Backend & be = m.be;
    const int64_t h = c.hidden_size, hd = c.head_dim, n_heads = c.n_heads, n_kv = c.n_kv_heads;
    const int64_t q_dim = n_heads * hd, kv_dim = n_kv * hd, qkv_dim = q_dim + 2 * kv_dim, ff = c.intermediate_size;
    std::vector<int32_t> tokens(n), positions(n);
    std::vector<int64_t> slots(n);
    std::vector<K::AttnQuery> queries(n);
    for (int64_t t = 0; t < n; ++t) {
        tokens[t] = static_cast<int32_t>((t * 7 + 3) % c.vocab_size);
        positions[t] = static_cast<int32_t>(t);
        slots[t] = t;  // blocks 0, 1, ... in order
        queries[t] = {m.table.data(), static_cast<int32_t>(t + 1)};
    }
    const int32_t last = static_cast<int32_t>(n - 1);
    auto timed = [&](Op op, auto && fn) {
        const auto t0 = Clock::now();
        fn();
        ms[op] += seconds_since(t0) * 1e3;
    };
    const float eps = c.rms_norm_eps, scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const float * lm = m.lins.lins.back().w;  // [vocab, hidden]; also the embedding table
    be.begin_step({tokens.data(), positions.data(), slots.data(), queries.data(), n});
    timed(kEmbedding, [&] { be.embedding(m.x, lm, K::WType::f32, tokens.data(), n, h, 0, c.vocab_size); });
    for (int il = 0; il < c.n_layers; ++il) {
        const DecodeLinear * L = &m.lins.lins[static_cast<size_t>(4 * il)];
        timed(kRmsNorm, [&] { be.rms_norm(m.xn, m.x, m.norm_w, n, h, eps); });
        timed(kLinQkv, [&] { be.linear(m.qkv, m.xn, L[0].w, K::WType::f32, nullptr, n, qkv_dim, h); });
        timed(kQkvSplit, [&] {
            be.copy_rows(m.q, q_dim, m.qkv, qkv_dim, n, q_dim);
            be.copy_rows(m.k, kv_dim, m.qkv + q_dim, qkv_dim, n, kv_dim);
            be.copy_rows(m.v, kv_dim, m.qkv + q_dim + kv_dim, qkv_dim, n, kv_dim);
        });
        if (c.qk_norm) {
            timed(kRmsNorm, [&] {
                be.rms_norm(m.q, m.q, m.norm_w, n * n_heads, hd, eps);
                be.rms_norm(m.k, m.k, m.norm_w, n * n_kv, hd, eps);
            });
        }
        timed(kRope, [&] {
            be.rope(m.q, positions.data(), m.rope, n, n_heads, hd);
            be.rope(m.k, positions.data(), m.rope, n, n_kv, hd);
        });
        const K::PagedKv kv{m.k_pool[il], m.v_pool[il], PrefillModel::kBlock, static_cast<int32_t>(n_kv), static_cast<int32_t>(hd)};
        timed(kKvStore, [&] { be.kv_store(kv, m.k, m.v, slots.data(), n); });
        timed(kAttention, [&] { be.attention_paged(m.att, m.q, queries.data(), n, n_heads, kv, scale); });
        timed(kLinO, [&] { be.linear(m.xn, m.att, L[1].w, K::WType::f32, nullptr, n, h, q_dim); });
        timed(kResidualAdd, [&] { be.add(m.x, m.xn, n * h); });
        timed(kRmsNorm, [&] { be.rms_norm(m.xn, m.x, m.norm_w, n, h, eps); });
        timed(kLinGateUp, [&] { be.linear(m.gu, m.xn, L[2].w, K::WType::f32, nullptr, n, 2 * ff, h); });
        timed(kSiluMul, [&] { be.silu_mul(m.gate, m.gu, n, ff); });
        timed(kLinDown, [&] { be.linear(m.xn, m.gate, L[3].w, K::WType::f32, nullptr, n, h, ff); });
        timed(kResidualAdd, [&] { be.add(m.x, m.xn, n * h); });
    }
    timed(kLmHead, [&] {
        be.gather_rows(m.rows, m.x, &last, 1, h);
        be.rms_norm(m.rows, m.rows, m.norm_w, 1, h, eps);
        be.linear(m.logits, m.rows, lm, K::WType::f32, nullptr, 1, c.vocab_size, h);
    });
}

/// Median microseconds of an empty parallel_for of n_threads tasks, `idle_us` apart.
double dispatch_us(K::ThreadPool & pool, int reps, int idle_us) {
    std::vector<double> us;
    const std::function<void(int64_t)> noop = [](int64_t) {};
    for (int r = 0; r < reps; ++r) {
        if (idle_us > 0) { std::this_thread::sleep_for(std::chrono::microseconds(idle_us)); }
        const auto t0 = Clock::now();
        pool.parallel_for(pool.n_threads(), noop);
        us.push_back(seconds_since(t0) * 1e6);
    }
    return median(us);
}

}  // namespace

json prefill_profile(const fd::model::ModelConfig & c, const std::vector<int> & lens, const std::vector<int> & threads,
                     double min_s) {
    const int64_t max_len = *std::max_element(lens.begin(), lens.end());
    std::vector<std::unique_ptr<K::Backend>>   backends;
    std::vector<std::unique_ptr<PrefillModel>> models;
    for (int t : threads) {
        backends.push_back(K::make_cpu_backend(t));
        models.push_back(std::make_unique<PrefillModel>(c, *backends.back(), max_len));
    }
    json out;
    json pools = json::array();
    for (size_t ti = 0; ti < threads.size(); ++ti) {
        K::ThreadPool & pool = *backends[ti]->host_pool();
        dispatch_us(pool, 200, 0);  // warm
        pools.push_back({{"threads", threads[ti]}, {"parallel_for_hot_us", round_to(dispatch_us(pool, 2000, 0), 2)},
                         {"parallel_for_after_2ms_idle_us", round_to(dispatch_us(pool, 200, 2000), 2)}});
    }
    out["pool_handoff"] = pools;
    json runs = json::array();
    for (const int len : lens) {
        json per_t = json::array();
        std::vector<std::array<double, kNumOps>> op_ms(threads.size());
        std::vector<double> total_ms(threads.size()), total_cpu_ms(threads.size());
        // Runs alternate between the thread counts (round robin), so a change in the machine's
        // load during the measurement hits every count alike.
        struct Acc {
            std::vector<std::array<double, kNumOps>> per_run;
            std::vector<double> totals, cpus, jobs, waits;
            double spent = 0.0;
        };
        std::vector<Acc> acc(threads.size());
        for (size_t ti = 0; ti < threads.size(); ++ti) {
            std::array<double, kNumOps> warm{};
            profiled_forward(*models[ti], len, warm);
        }
        auto more = [&] {
            for (const auto & a : acc) { if (a.per_run.size() < 3 || a.spent < min_s) { return true; } }
            return false;
        };
        while (more()) {
            for (size_t ti = 0; ti < threads.size(); ++ti) {
                K::ThreadPool & pool = *backends[ti]->host_pool();
                Acc & a = acc[ti];
                std::array<double, kNumOps> ms{};
                pool.reset_stats();
                const auto   t0 = Clock::now();
                const double c0 = process_cpu_seconds();
                profiled_forward(*models[ti], len, ms);
                const double s = seconds_since(t0);
                a.cpus.push_back((process_cpu_seconds() - c0) * 1e3);
                a.spent += s;
                a.totals.push_back(s * 1e3);
                a.per_run.push_back(ms);
                a.jobs.push_back(static_cast<double>(pool.stats().jobs));
                a.waits.push_back(pool.stats().wait_s * 1e3);
            }
        }
        for (size_t ti = 0; ti < threads.size(); ++ti) {
            const auto & per_run = acc[ti].per_run;
            const auto & totals = acc[ti].totals;
            const auto & cpus = acc[ti].cpus;
            const auto & jobs = acc[ti].jobs;
            const auto & waits = acc[ti].waits;
            json e;
            e["threads"] = threads[ti];
            e["runs"] = per_run.size();
            total_ms[ti] = median(totals);
            e["total_ms"] = round_to(total_ms[ti], 3);
            e["tok_s"] = round_to(len / total_ms[ti] * 1e3, 1);
            // Process CPU time (all threads). The pool's threads spin while they wait (up to
            // kSpinNs), so on a machine shared with other work cpu_ms / threads estimates the
            // wall time the forward would take alone (high where a thread spun while its partner
            // was preempted, low where a wait outlasted the spin and slept); the wall figures
            // then mostly measure the share of the CPUs we got.
            total_cpu_ms[ti] = median(cpus);
            e["cpu_ms"] = round_to(total_cpu_ms[ti], 3);
            e["cpu_ms_per_thread"] = round_to(total_cpu_ms[ti] / threads[ti], 3);
            json ops;
            for (int op = 0; op < kNumOps; ++op) {
                std::vector<double> v;
                for (const auto & r : per_run) { v.push_back(r[op]); }
                op_ms[ti][op] = median(v);
                ops[kOpNames[op]] = round_to(op_ms[ti][op], 3);
            }
            e["op_ms"] = ops;
            e["pool_parallel_for_calls"] = median(jobs);
            e["pool_caller_wait_ms"] = round_to(median(waits), 3);
            per_t.push_back(e);
        }
        // Shares and scaling against the first thread count.
        json table = json::array();
        auto row = [&](const std::string & name, const std::vector<Op> & ops) {
            json r;
            r["op"] = name;
            std::vector<double> ms(threads.size(), 0.0);
            for (size_t ti = 0; ti < threads.size(); ++ti) {
                for (Op op : ops) { ms[ti] += op_ms[ti][op]; }
                r["ms_t" + std::to_string(threads[ti])] = round_to(ms[ti], 3);
                r["share_t" + std::to_string(threads[ti])] = round_to(ms[ti] / total_ms[ti], 4);
            }
            for (size_t ti = 1; ti < threads.size(); ++ti) {
                r["scaling_t" + std::to_string(threads[0]) + "_to_t" + std::to_string(threads[ti])] =
                    ms[ti] > 0 ? round_to(ms[0] / ms[ti], 3) : 0.0;
            }
            table.push_back(r);
        };
        for (const auto & g : kGroups) { row(std::string("group:") + g.name, g.ops); }
        for (int op = 0; op < kNumOps; ++op) { row(kOpNames[op], {static_cast<Op>(op)}); }
        json run;
        run["tokens"] = len;
        run["per_threads"] = per_t;
        run["ops"] = table;
        for (size_t ti = 1; ti < threads.size(); ++ti) {
            const std::string key = "t" + std::to_string(threads[0]) + "_to_t" + std::to_string(threads[ti]);
            run["total_scaling_" + key] = round_to(total_ms[0] / total_ms[ti], 3);
            run["cpu_time_scaling_estimate_" + key] = round_to(total_cpu_ms[0] / threads[0] / (total_cpu_ms[ti] / threads[ti]), 3);
        }
        // Human-readable summary on stderr.
        std::fprintf(stderr, "prefill profile, %d tokens:", len);
        for (size_t ti = 0; ti < threads.size(); ++ti) {
            std::fprintf(stderr, "  t%d %.1f ms (cpu %.1f ms per thread)", threads[ti], total_ms[ti], total_cpu_ms[ti] / threads[ti]);
        }
        std::fprintf(stderr, "\n");
        for (const auto & r : table) {
            std::fprintf(stderr, "  %-40s", r["op"].get<std::string>().c_str());
            for (size_t ti = 0; ti < threads.size(); ++ti) {
                const std::string t = std::to_string(threads[ti]);
                std::fprintf(stderr, " t%s %9.3f ms (%5.1f%%)", t.c_str(), r["ms_t" + t].get<double>(), 100 * r["share_t" + t].get<double>());
            }
            if (threads.size() > 1) {
                const auto key = "scaling_t" + std::to_string(threads[0]) + "_to_t" + std::to_string(threads[1]);
                std::fprintf(stderr, "  x%.2f", r[key].get<double>());
            }
            std::fprintf(stderr, "\n");
        }
        runs.push_back(run);
    }
    out["runs"] = runs;
    return out;
}

json sgemm_thread_scaling(const fd::model::ModelConfig & c, int64_t m, const std::vector<int> & threads, double min_s) {
    const int64_t h = c.hidden_size, q_dim = c.q_dim(), kv_dim = c.kv_dim(), ff = c.intermediate_size;
    struct Shape {
        const char * name;
        int64_t      n, k;
    };
    const std::vector<Shape> shapes = {{"qkv", q_dim + 2 * kv_dim, h}, {"o", h, q_dim}, {"gate_up", 2 * ff, h}, {"down", h, ff}};
    int64_t max_nk = 0, max_k = 0, max_n = 0;
    for (const auto & s : shapes) { max_nk = std::max(max_nk, s.n * s.k); max_k = std::max(max_k, s.k); max_n = std::max(max_n, s.n); }
    std::vector<float> a(static_cast<size_t>(m * max_k)), w(static_cast<size_t>(max_nk)), y(static_cast<size_t>(m * max_n));
    for (size_t i = 0; i < a.size(); ++i) { a[i] = static_cast<float>((i * 2654435761u) & 1023) * 1e-3f - 0.5f; }
    for (size_t i = 0; i < w.size(); ++i) { w[i] = static_cast<float>((i * 40503u) & 1023) * 1e-4f - 0.05f; }
    double flop = 0.0;
    for (const auto & s : shapes) { flop += 2.0 * m * s.n * s.k; }
    json per_t = json::array();
    std::vector<double> blas_s, fd_s;
    for (const int t : threads) {
        openblas_set_num_threads(t);
        K::ThreadPool pool(t);
        double tb = 0.0, tf = 0.0;
        json sh = json::array();
        for (const auto & s : shapes) {
            auto blas = [&] {
                openblas_linear(y.data(), a.data(), w.data(), m, s.n, s.k);
            };
            auto fdl = [&] { K::linear(y.data(), a.data(), w.data(), K::WType::f32, nullptr, m, s.n, s.k, &pool); };
            blas(); fdl();
            const Timing b = time_repeated(min_s / 8, 3, blas);
            const Timing f = time_repeated(min_s / 8, 3, fdl);
            tb += b.best;
            tf += f.best;
            const double fl = 2.0 * m * s.n * s.k;
            sh.push_back({{"shape", s.name}, {"N", s.n}, {"K", s.k}, {"openblas_gflops", round_to(fl / b.best / 1e9, 1)},
                          {"fd_linear_gflops", round_to(fl / f.best / 1e9, 1)}});
        }
        blas_s.push_back(tb);
        fd_s.push_back(tf);
        per_t.push_back({{"threads", t}, {"openblas_gflops", round_to(flop / tb / 1e9, 1)},
                         {"fd_linear_gflops", round_to(flop / tf / 1e9, 1)}, {"shapes", sh}});
    }
    openblas_set_num_threads(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // OpenBLAS's idle threads spin a while
    json out;
    out["M"] = m;
    out["per_threads"] = per_t;
    for (size_t ti = 1; ti < threads.size(); ++ti) {
        const std::string key = "t" + std::to_string(threads[0]) + "_to_t" + std::to_string(threads[ti]);
        const double sb = blas_s[0] / blas_s[ti], sf = fd_s[0] / fd_s[ti];
        out["openblas_scaling_" + key] = round_to(sb, 3);
        out["fd_linear_scaling_" + key] = round_to(sf, 3);
        out["fd_over_openblas_scaling_" + key] = round_to(sf / sb, 3);
    }
    return out;
}

}  // namespace fd::bench
