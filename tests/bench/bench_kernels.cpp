// fd_bench's kernel-level measurements (see bench_kernels.h).
#include "bench_kernels.h"

#include "bench_util.h"
#include "fd/arena.h"
#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/thread_pool.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>

extern "C" void openblas_set_num_threads(int);
extern "C" char * openblas_get_corename(void);

namespace fd::bench {

using json = nlohmann::ordered_json;

void openblas_linear(float * y, const float * a, const float * w, int64_t m, int64_t n, int64_t k) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, a,
                static_cast<int>(k), w, static_cast<int>(k), 0.0f, y, static_cast<int>(n));
}

json linear_vs_openblas(const std::vector<int64_t> & ms, int64_t n, int64_t k, double min_s) {
    namespace K = fd::kernels;
    std::mt19937 rng(42);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int64_t m_max = *std::max_element(ms.begin(), ms.end());
    std::vector<float> a(m_max * k), w(n * k), c_blas(m_max * n), c_fd(m_max * n);
    std::vector<uint16_t> w16(n * k);
    for (auto & v : a) { v = nd(rng); }
    for (size_t i = 0; i < w.size(); ++i) {
        uint32_t bits;
        const float f = nd(rng) / std::sqrt(static_cast<float>(k));
        std::memcpy(&bits, &f, 4);
        w16[i] = static_cast<uint16_t>(bits >> 16);
        bits   = static_cast<uint32_t>(w16[i]) << 16;
        std::memcpy(&w[i], &bits, 4);  // the f32 weights hold the bf16 values: same products
    }
    openblas_set_num_threads(1);
    json out = json::array();
    for (const int64_t m : ms) {
        const double flop = 2.0 * m * n * k;
        auto blas = [&] {
            openblas_linear(c_blas.data(), a.data(), w.data(), m, n, k);
        };
        auto f32  = [&] { K::linear(c_fd.data(), a.data(), w.data(), K::WType::f32, nullptr, m, n, k, nullptr); };
        auto bf16 = [&] { K::linear(c_fd.data(), a.data(), w16.data(), K::WType::bf16, nullptr, m, n, k, nullptr); };
        blas(); f32(); bf16();  // warm up
        const Timing tb = time_repeated(min_s, 3, blas);
        const Timing th = time_repeated(min_s, 3, bf16);
        const Timing tf = time_repeated(min_s, 3, f32);
        double max_diff = 0.0;
        for (int64_t i = 0; i < m * n; ++i) { max_diff = std::max<double>(max_diff, std::fabs(c_fd[i] - c_blas[i])); }
        json j;
        j["shape"] = {{"M", m}, {"N", n}, {"K", k}};
        j["openblas_sgemm_gflops"] = round_to(flop / tb.best / 1e9, 1);
        j["fd_f32_gflops"] = round_to(flop / tf.best / 1e9, 1);
        j["fd_bf16_gflops"] = round_to(flop / th.best / 1e9, 1);
        j["fd_f32_vs_openblas"] = round_to(tb.best / tf.best, 3);
        j["fd_bf16_vs_fd_f32"] = round_to(tf.best / th.best, 3);
        // The same by process CPU time (steadier on a shared machine; 1 thread, so comparable).
        j["cpu_time"] = {{"openblas_sgemm_gflops", round_to(flop / tb.best_cpu / 1e9, 1)},
                         {"fd_f32_gflops", round_to(flop / tf.best_cpu / 1e9, 1)},
                         {"fd_bf16_gflops", round_to(flop / th.best_cpu / 1e9, 1)},
                         {"fd_f32_vs_openblas", round_to(tb.best_cpu / tf.best_cpu, 3)},
                         {"fd_bf16_vs_fd_f32", round_to(tf.best_cpu / th.best_cpu, 3)}};
        j["max_abs_diff"] = max_diff;
        out.push_back(j);
    }
    json r;
    r["threads"] = 1;
    r["openblas_core"] = openblas_get_corename();
    if (const char * forced = std::getenv("FD_BENCH_OPENBLAS_FORCED")) { r["openblas_core_forced_from"] = forced; }
    r["runs"] = out;
    return r;
}

json linear_thread_scaling(const std::vector<int64_t> & ms, int64_t n, int64_t k, int n_threads, double min_s) {
    namespace K = fd::kernels;
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int64_t m_max = *std::max_element(ms.begin(), ms.end());
    std::vector<float> a(m_max * k), w(n * k), c(m_max * n);
    for (auto & v : a) { v = nd(rng); }
    for (auto & v : w) { v = nd(rng) / std::sqrt(static_cast<float>(k)); }
    K::ThreadPool pool(n_threads);
    json out = json::array();
    for (const int64_t m : ms) {
        const double flop = 2.0 * m * n * k;
        auto blas = [&] {
            openblas_linear(c.data(), a.data(), w.data(), m, n, k);
        };
        auto fd1 = [&] { K::linear(c.data(), a.data(), w.data(), K::WType::f32, nullptr, m, n, k, nullptr); };
        auto fdn = [&] { K::linear(c.data(), a.data(), w.data(), K::WType::f32, nullptr, m, n, k, &pool); };
        openblas_set_num_threads(1);
        blas(); fd1();
        const Timing b1 = time_repeated(min_s, 3, blas);
        const Timing f1 = time_repeated(min_s, 3, fd1);
        openblas_set_num_threads(n_threads);
        blas(); fdn();
        const Timing bn = time_repeated(min_s, 3, blas);
        const Timing fn = time_repeated(min_s, 3, fdn);
        openblas_set_num_threads(1);
        json j;
        j["shape"] = {{"M", m}, {"N", n}, {"K", k}};
        j["openblas_gflops_1t"] = round_to(flop / b1.best / 1e9, 1);
        j["openblas_gflops_nt"] = round_to(flop / bn.best / 1e9, 1);
        j["fd_gflops_1t"] = round_to(flop / f1.best / 1e9, 1);
        j["fd_gflops_nt"] = round_to(flop / fn.best / 1e9, 1);
        j["openblas_scaling"] = round_to(b1.best / bn.best, 3);
        j["fd_scaling"] = round_to(f1.best / fn.best, 3);
        j["fd_vs_openblas_nt"] = round_to(bn.best / fn.best, 3);
        out.push_back(j);
    }
    json r;
    r["threads"] = n_threads;
    r["runs"] = out;
    return r;
}

DecodeLinears make_decode_linears(const fd::model::ModelConfig & c, bool with_lm_head) {
    const int64_t h = c.hidden_size, q_dim = c.q_dim(), kv_dim = c.kv_dim(), qkv = q_dim + 2 * kv_dim;
    const int64_t ff = c.intermediate_size;
    DecodeLinears d;
    for (int il = 0; il < c.n_layers; ++il) {
        d.lins.push_back({qkv, h, nullptr});
        d.lins.push_back({h, q_dim, nullptr});
        d.lins.push_back({2 * ff, h, nullptr});
        d.lins.push_back({h, ff, nullptr});
    }
    if (with_lm_head) { d.lins.push_back({c.vocab_size, h, nullptr}); }
    int64_t floats = 0;
    for (const auto & l : d.lins) {
        floats += fd::Arena::footprint_floats(l.n_out * l.n_in) / 4;
        d.weight_bytes += l.n_out * l.n_in * 4;
    }
    d.mem = std::make_unique<Mapping>(static_cast<size_t>(floats) * sizeof(float), /*huge=*/true);  // as fd::Arena maps the weights
    for (size_t i = 0; i < d.mem->count(); ++i) { d.mem->p[i] = static_cast<float>((i * 2654435761u) & 1023) * 1e-4f - 0.05f; }
    float * cur = d.mem->p;
    for (auto & l : d.lins) {
        l.w = cur;
        cur += fd::Arena::footprint_floats(l.n_out * l.n_in) / 4;
    }
    return d;
}

json decode_contexts(const fd::model::ModelConfig & c, const std::vector<int> & batches, const std::vector<int> & ctxs,
                     int n_threads, double read_bw_gbs, double min_s, int64_t kv_budget_bytes, double read_bw_cpu_gbs,
                     const std::vector<fd::kernels::WType> & kv_dtypes, int32_t block_size, fd::kernels::ComputeType compute) {
    namespace K = fd::kernels;
    const int64_t h = c.hidden_size, q_dim = c.q_dim(), kv_dim = c.kv_dim(), qkv = q_dim + 2 * kv_dim;
    const int64_t ff = c.intermediate_size;
    const DecodeLinears dl = make_decode_linears(c, /*with_lm_head=*/true);
    const auto &        lins = dl.lins;
    const bool          bf16_mode = compute == K::ComputeType::bf16;
    // bf16 compute: the same weights rounded to bf16, each layer on its own 64-byte boundary
    std::vector<const uint16_t *> w16(lins.size());
    std::unique_ptr<Mapping>      mem16;
    if (bf16_mode) {
        int64_t n = 0;
        for (const auto & l : lins) { n += (l.n_out * l.n_in + 31) / 32 * 32; }
        mem16 = std::make_unique<Mapping>(static_cast<size_t>(n) * 2, /*huge=*/true);
        auto * cur = reinterpret_cast<uint16_t *>(mem16->p);
        for (size_t i = 0; i < lins.size(); ++i) {
            const int64_t e = lins[i].n_out * lins[i].n_in;
            for (int64_t k = 0; k < e; ++k) { cur[k] = K::f32_to_bf16_rne(lins[i].w[k]); }
            w16[i] = cur;
            cur += (e + 31) / 32 * 32;
        }
    }
    const int64_t weight_bytes = bf16_mode ? dl.weight_bytes / 2 : dl.weight_bytes;
    K::ThreadPool pool(n_threads);
    const int bmax = *std::max_element(batches.begin(), batches.end());
    std::vector<float> x(static_cast<size_t>(bmax) * std::max({h, q_dim, ff}), 0.01f);
    std::vector<float> y(static_cast<size_t>(bmax) * std::max<int64_t>({2 * ff, qkv, c.vocab_size}));
    std::vector<float> q(static_cast<size_t>(bmax) * q_dim, 0.02f), att(static_cast<size_t>(bmax) * q_dim);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    const int32_t bs = block_size;

    json out = json::array();
    for (const int B : batches) {
        for (const int ctx : ctxs) {
          double f32_step = 0, f32_att = 0;  // this (B, ctx)'s f32-KV times, for the bf16 ratios
          for (const K::WType kvt : kv_dtypes) {
            const int64_t eb        = K::kv_elem_bytes(kvt);
            const int32_t bps       = (ctx + bs - 1) / bs;
            const int64_t layer_fl  = int64_t(B) * bps * bs * kv_dim;  // K (or V) elements of one layer
            const int64_t pool_b    = 2 * layer_fl * eb;
            const int     n_pools   = static_cast<int>(std::clamp<int64_t>(kv_budget_bytes / pool_b, 1, c.n_layers));
            Mapping kvmem(static_cast<size_t>(n_pools) * pool_b, /*huge=*/true);  // as the daemon's KV arena
            auto * kv16 = reinterpret_cast<uint16_t *>(kvmem.p);
            for (size_t i = 0; i < kvmem.bytes / eb; ++i) {
                const float v = static_cast<float>(i & 255) * 1e-3f;
                if (kvt == K::WType::bf16) { kv16[i] = K::f32_to_bf16_rne(v); } else { kvmem.p[i] = v; }
            }
            // Sequences' blocks interleaved across the pool, as a busy KvCache hands them out.
            std::vector<int32_t> tables(static_cast<size_t>(B) * bps);
            for (int32_t s = 0; s < B; ++s) {
                for (int32_t j = 0; j < bps; ++j) { tables[static_cast<size_t>(s) * bps + j] = j * B + s; }
            }
            std::vector<K::AttnQuery> queries(B);
            for (int i = 0; i < B; ++i) { queries[i] = {&tables[static_cast<size_t>(i) * bps], ctx}; }
            auto linear = [&] {
                for (size_t i = 0; i < lins.size(); ++i) {
                    const auto & l = lins[i];
                    if (bf16_mode) {
                        K::linear_bf16(y.data(), x.data(), w16[i], K::WType::bf16, nullptr, B, l.n_out, l.n_in, &pool);
                    } else {
                        K::linear(y.data(), x.data(), l.w, K::WType::f32, nullptr, B, l.n_out, l.n_in, &pool);
                    }
                }
            };
            auto attention = [&] {
                for (int il = 0; il < c.n_layers; ++il) {
                    std::byte * base = reinterpret_cast<std::byte *>(kvmem.p) + static_cast<size_t>(il % n_pools) * pool_b;
                    const K::PagedKv kv{base, base + layer_fl * eb, bs, c.n_kv_heads, c.head_dim, kvt};
                    K::attention_paged(att.data(), q.data(), queries.data(), B, c.n_heads, kv, scale, &pool);
                }
            };
            linear(); attention();
            const Timing tl = time_repeated(min_s / 2, 2, linear);
            const Timing ta = time_repeated(min_s / 2, 2, attention);
            const double step_s   = tl.best + ta.best;
            const double kv_bytes = static_cast<double>(B) * ctx * kv_dim * 2 * eb * c.n_layers;
            const double gbs      = (static_cast<double>(weight_bytes) + kv_bytes) / step_s / 1e9;
            json e;
            e["batch"] = B;
            e["ctx"] = ctx;
            e["kv_dtype"] = kvt == K::WType::bf16 ? "bfloat16" : "float32";
            e["compute_dtype"] = K::compute_type_name(compute);
            e["block_size"] = bs;
            e["ms_per_step"] = round_to(step_s * 1e3, 3);
            e["tok_s"] = round_to(B / step_s, 1);
            e["linear_ms"] = round_to(tl.best * 1e3, 3);
            e["attention_ms"] = round_to(ta.best * 1e3, 3);
            e["weight_mb"] = round_to(weight_bytes / 1e6, 1);
            e["kv_mb_read"] = round_to(kv_bytes / 1e6, 1);
            e["kv_pools"] = n_pools;
            e["bytes_read_gbs"] = round_to(gbs, 2);
            e["ratio_vs_read_bw"] = round_to(gbs / read_bw_gbs, 3);
            e["attention_kv_gbs"] = round_to(kv_bytes / ta.best / 1e9, 2);
            e["kv_ratio_vs_read_bw"] = round_to(kv_bytes / ta.best / 1e9 / read_bw_gbs, 3);
            if (kvt == K::WType::f32) {
                f32_step = step_s;
                f32_att  = ta.best;
            } else if (f32_step > 0) {
                e["step_vs_f32_kv"] = round_to(step_s / f32_step, 3);
                e["attention_vs_f32_kv"] = round_to(ta.best / f32_att, 3);
            }
            if (read_bw_cpu_gbs > 0) {  // per process CPU second: steadier on a shared machine
                const double gbs_cpu = (static_cast<double>(weight_bytes) + kv_bytes) / (tl.best_cpu + ta.best_cpu) / 1e9;
                e["bytes_read_gbs_cpu"] = round_to(gbs_cpu, 2);
                e["ratio_vs_read_bw_cpu"] = round_to(gbs_cpu / read_bw_cpu_gbs, 3);
                e["attention_kv_gbs_cpu"] = round_to(kv_bytes / ta.best_cpu / 1e9, 2);
            }
            out.push_back(e);
          }
        }
    }
    return out;
}

}  // namespace fd::bench
