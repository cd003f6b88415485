// CPU ops (kernels/cpu/*.cpp) against deliberately naive loops, plus the batch-invariance
// guarantee of ops.h: a row's result is bitwise the same whatever else is in the batch and
// whatever the thread count. linear (kernels/cpu/matmul.cpp) has its own file, test_matmul_cpu.cpp.
#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/thread_pool.h"

#include "test_util.h"
#include "../../../kernels/cpu/expf_avx2.h"  // detail::silu_exp_path: is the vector exp in use

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

namespace k = fd::kernels;

namespace {

using fd::test::bits_equal;
using fd::test::random_vec;

/// Naive contiguous causal GQA attention for one query vector over ctx rows of K and V.
///   k_rows, v_rows [n_ctx, n_kv_heads, head_dim] in token order.
void naive_attention(double * out, const float * q, const std::vector<float> & k_rows,
                     const std::vector<float> & v_rows, int n_ctx, int n_heads, int n_kv_heads,
                     int head_dim, double scale) {
    const int group = n_heads / n_kv_heads;
    for (int h = 0; h < n_heads; ++h) {
        const int kvh = h / group;
        std::vector<double> s(static_cast<size_t>(n_ctx));
        double mx = -INFINITY;
        for (int t = 0; t < n_ctx; ++t) {
            double dot = 0.0;
            for (int d = 0; d < head_dim; ++d) {
                dot += double(q[h * head_dim + d]) * k_rows[(size_t(t) * n_kv_heads + kvh) * head_dim + d];
            }
            s[t] = dot * scale;
            mx   = std::max(mx, s[t]);
        }
        double sum = 0.0;
        for (int t = 0; t < n_ctx; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
        for (int d = 0; d < head_dim; ++d) {
            double acc = 0.0;
            for (int t = 0; t < n_ctx; ++t) { acc += s[t] / sum * v_rows[(size_t(t) * n_kv_heads + kvh) * head_dim + d]; }
            out[h * head_dim + d] = acc;
        }
    }
}

/// A small paged pool with a few sequences stored at scattered, non-contiguous blocks.
struct AttnFixture {
    static constexpr int kHeads = 8, kKvHeads = 4, kBlocks = 40;
    int kHeadDim;  ///< 8 and 24: one sequential chain per score; 64: the 16-lane path
    int kBlock;    ///< 4: keys gathered per chunk; 16, 32: read straight from the blocks' Kᵀ
    std::vector<float> k_pool, v_pool;
    std::vector<std::vector<int32_t>> tables;   // per sequence
    std::vector<std::vector<float>>   k_rows, v_rows;  // per sequence, contiguous [len, kv, hd]
    std::vector<int> lens;
    k::PagedKv kv{};

    AttnFixture(std::mt19937 & rng, int head_dim, int block = 4) : kHeadDim(head_dim), kBlock(block) {
        const size_t pool_floats = size_t(kBlocks) * kBlock * kKvHeads * kHeadDim;
        k_pool.assign(pool_floats, std::numeric_limits<float>::quiet_NaN());  // unwritten slots poison results
        v_pool.assign(pool_floats, std::numeric_limits<float>::quiet_NaN());
        kv = {k_pool.data(), v_pool.data(), kBlock, kKvHeads, kHeadDim};
        // Scattered block ids, deliberately out of order and interleaved between sequences.
        tables = {{17, 3, 29, 8, 36, 0, 22, 11, 31, 5, 26, 14}, {9, 33, 1}, {24}, {38, 2}};
        lens   = {47, 10, 1, 6};
        const int row = kKvHeads * kHeadDim;
        for (size_t s = 0; s < tables.size(); ++s) {
            k_rows.push_back(random_vec(rng, size_t(lens[s]) * row, -2.0f, 2.0f));
            v_rows.push_back(random_vec(rng, size_t(lens[s]) * row));
            std::vector<int64_t> slots(static_cast<size_t>(lens[s]));
            for (int t = 0; t < lens[s]; ++t) { slots[t] = int64_t(tables[s][t / kBlock]) * kBlock + t % kBlock; }
            k::kv_store(kv, k_rows[s].data(), v_rows[s].data(), slots.data(), lens[s]);
        }
    }
};

struct QueryRef {
    int seq, n_ctx;
    std::vector<float> q;  // [n_heads, head_dim]
};

}  // namespace

TEST_SUITE("kernels::ops_cpu") {

TEST_CASE("ThreadPool::parallel_for runs every task exactly once for 1 to 4 threads, job after job") {
    for (int nt : {1, 2, 3, 4}) {
        k::ThreadPool pool(nt);
        CHECK(pool.n_threads() == nt);
        for (int64_t n_tasks : {0, 1, 2, 3, 7, 64, 1000}) {
            for (int rep = 0; rep < 20; ++rep) {
                std::vector<int> hits(static_cast<size_t>(n_tasks), 0);
                pool.parallel_for(n_tasks, [&](int64_t i) { ++hits[static_cast<size_t>(i)]; });
                CAPTURE(nt); CAPTURE(n_tasks);
                REQUIRE(std::count(hits.begin(), hits.end(), 1) == n_tasks);
            }
        }
    }
}

TEST_CASE("ThreadPool hands jobs over through its sleep paths: workers asleep between jobs, the caller asleep while a worker runs") {
    using namespace std::chrono_literals;
    const auto spin = std::chrono::nanoseconds(k::ThreadPool::kSpinNs);
    for (int nt : {2, 3}) {
        CAPTURE(nt);
        k::ThreadPool pool(nt);
        pool.reset_stats();
        const auto caller = std::this_thread::get_id();
        for (int rep = 0; rep < 5; ++rep) {
            // Idle past the spin: the workers are asleep on the futex when the job comes.
            std::this_thread::sleep_for(3 * spin);
            // Every thread must take a task: each task waits (10 s at most) until nt threads
            // have entered one, which only happens if the sleeping workers were woken.
            std::atomic<int> entered{0}, done{0};
            std::atomic<bool> all_met{true};
            pool.parallel_for(nt, [&](int64_t) {
                entered.fetch_add(1);
                const auto t_end = std::chrono::steady_clock::now() + 10s;
                while (entered.load() < nt && std::chrono::steady_clock::now() < t_end) { std::this_thread::yield(); }
                if (entered.load() < nt) { all_met.store(false); }
                // A worker's task outlasts the caller's spin: the caller sleeps until woken.
                if (std::this_thread::get_id() != caller) { std::this_thread::sleep_for(3 * spin); }
                done.fetch_add(1);
            });
            CHECK(all_met.load());
            CHECK(done.load() == nt);  // parallel_for returned only after every task finished
        }
        CHECK(pool.stats().jobs == 5);
        CHECK(pool.stats().wait_s >= 0.0);
        // Back-to-back tiny jobs (the spinning path), many of them.
        std::atomic<int64_t> total{0};
        for (int rep = 0; rep < 20000; ++rep) {
            pool.parallel_for(3, [&](int64_t i) { total.fetch_add(i + 1); });
        }
        CHECK(total.load() == 20000 * 6);
    }
}

TEST_CASE("rms_norm matches the naive formula and may run in place") {
    std::mt19937 rng(7);
    const int64_t n_rows = 5, n_embd = 67;
    const float eps = 1e-5f;
    const auto x = random_vec(rng, size_t(n_rows * n_embd), -4.0f, 4.0f);
    const auto wt = random_vec(rng, size_t(n_embd), 0.5f, 1.5f);
    std::vector<float> out(x.size());
    k::rms_norm(out.data(), x.data(), wt.data(), n_rows, n_embd, eps);
    for (int64_t t = 0; t < n_rows; ++t) {
        double ss = 0.0;
        for (int64_t i = 0; i < n_embd; ++i) { ss += double(x[t * n_embd + i]) * x[t * n_embd + i]; }
        const double inv = 1.0 / std::sqrt(ss / n_embd + eps);
        for (int64_t i = 0; i < n_embd; ++i) {
            const double ref = x[t * n_embd + i] * inv * wt[i];
            CHECK(out[t * n_embd + i] == doctest::Approx(ref).epsilon(1e-5));
        }
    }
    std::vector<float> inplace = x;
    k::rms_norm(inplace.data(), inplace.data(), wt.data(), n_rows, n_embd, eps);
    CHECK(bits_equal(inplace.data(), out.data(), out.size()));
    // A zero row stays zero (eps keeps it finite).
    std::vector<float> zeros(size_t(n_embd), 0.0f), zout(size_t(n_embd), 1.0f);
    k::rms_norm(zout.data(), zeros.data(), wt.data(), 1, n_embd, eps);
    for (float v : zout) { CHECK(v == 0.0f); }
}

TEST_CASE("silu_mul computes g * sigmoid(g) * up and add_inplace adds elementwise") {
    const std::vector<float> gate = {-20.0f, -1.0f, 0.0f, 0.5f, 3.0f, 20.0f};
    const std::vector<float> up   = {2.0f, -3.0f, 5.0f, 1.0f, 0.25f, -1.0f};
    std::vector<float> out(gate.size());
    k::silu_mul(out.data(), gate.data(), up.data(), int64_t(gate.size()));
    for (size_t i = 0; i < gate.size(); ++i) {
        const double g = gate[i], ref = g / (1.0 + std::exp(-g)) * up[i];
        CHECK(out[i] == doctest::Approx(ref).epsilon(1e-6));
    }
    CHECK(out[2] == 0.0f);
    std::vector<float> acc = {1.0f, 2.0f, 3.0f};
    const std::vector<float> add = {0.5f, -2.0f, 10.0f};
    k::add_inplace(acc.data(), add.data(), 3);
    CHECK(acc == std::vector<float>{1.5f, 0.0f, 13.0f});
}

TEST_CASE("silu_mul: bitwise the one-loop scalar form g / (1 + exp(-g)) * up (chunks of 256, tails, specials)") {
    // silu_mul calls exp a chunk at a time and divides / multiplies in a vectorized loop; each of
    // those is one IEEE operation per element, so the bits must be the plain scalar loop's (the
    // f32 and bf16 modes' numerics are defined by it) for every length, chunk edge and value.
    std::mt19937                          rng(31);
    std::normal_distribution<float>       nd(0.0f, 4.0f);
    const float                           inf = std::numeric_limits<float>::infinity();
    const std::vector<float>              specials = {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), 1e-40f, -1e-40f,
                                                      88.8f, -88.8f, 104.0f, -104.0f, 1e30f, -1e30f};
    for (int64_t n : {int64_t(1), int64_t(7), int64_t(255), int64_t(256), int64_t(257), int64_t(1000), int64_t(1536)}) {
        std::vector<float> gate(static_cast<size_t>(n)), up(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
            gate[size_t(i)] = rng() % 16 == 0 ? specials[rng() % specials.size()] : nd(rng);
            up[size_t(i)]   = rng() % 32 == 0 ? specials[rng() % specials.size()] : nd(rng);
        }
        std::vector<float> out(static_cast<size_t>(n)), ref(static_cast<size_t>(n));
        k::silu_mul(out.data(), gate.data(), up.data(), n);
        for (int64_t i = 0; i < n; ++i) {
            const float g  = gate[size_t(i)];
            ref[size_t(i)] = g / (1.0f + std::exp(-g)) * up[size_t(i)];
        }
        CAPTURE(n);
        CHECK(bits_equal(out, ref));
    }
}

TEST_CASE("silu_mul: the 8-lane exp gives std::exp's bits over a sweep of every 251st f32 (both signs, all exponents)") {
    // silu_mul's exp (kernels/cpu/expf_avx2.h) replays glibc's expf in AVX2 doubles. Over ~17
    // million bit patterns (the main path, the |x| >= 88 fallback, inf, NaN, denormals) the
    // silu_mul outputs must be the scalar form's bits; and where the libm is glibc's (>= 2.28:
    // this algorithm), the vector path must actually be in use (its once-per-process check passed).
    const int path = k::detail::silu_exp_path();
    MESSAGE("silu_mul exp path: " << path << " (0: no AVX2 + FMA build, 1: libm disagreed, 2: vector)");
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 28))
    CHECK(path != 1);  // glibc's expf: the vector code must agree with it wherever it is built
#endif
    const int64_t      n = (int64_t{1} << 32) / 251 + 1;
    std::vector<float> gate(static_cast<size_t>(n)), up(static_cast<size_t>(n), 1.0f);
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t b = static_cast<uint32_t>(i * 251);
        std::memcpy(&gate[size_t(i)], &b, sizeof b);
    }
    std::vector<float> out(static_cast<size_t>(n)), ref(static_cast<size_t>(n));
    k::silu_mul(out.data(), gate.data(), up.data(), n);
    for (int64_t i = 0; i < n; ++i) {
        const float g  = gate[size_t(i)];
        ref[size_t(i)] = g / (1.0f + std::exp(-g)) * up[size_t(i)];
    }
    CHECK(bits_equal(out, ref));
}

TEST_CASE("rope_table holds cos and sin of pos * theta^(-2j/head_dim)") {
    const int64_t n_pos = 64, hd = 8;
    std::vector<float> cs(size_t(n_pos * hd));
    k::rope_table(cs.data(), n_pos, hd, 10000.0f);
    for (int64_t pos = 0; pos < n_pos; ++pos) {
        for (int64_t j = 0; j < hd / 2; ++j) {
            const double ang = double(pos) * std::pow(10000.0, -2.0 * j / hd);
            CHECK(cs[pos * hd + j] == doctest::Approx(std::cos(ang)).epsilon(2e-5));
            CHECK(cs[pos * hd + hd / 2 + j] == doctest::Approx(std::sin(ang)).epsilon(2e-5));
        }
    }
    for (int64_t j = 0; j < hd / 2; ++j) {
        CHECK(cs[j] == 1.0f);
        CHECK(cs[hd / 2 + j] == 0.0f);
    }
}

TEST_CASE("rope_table_inv_freq holds cos and sin of pos * inv_freq[j] for any frequencies (rope_scaling)") {
    const int64_t n_pos = 300, hd = 6;
    const std::vector<float> inv = {1.0f, 0.01f, 3.0e-5f};  // e.g. llama3: low frequencies divided by factor
    std::vector<float> cs(size_t(n_pos * hd));
    k::rope_table_inv_freq(cs.data(), n_pos, hd, inv.data());
    for (int64_t pos = 0; pos < n_pos; ++pos) {
        for (int64_t j = 0; j < hd / 2; ++j) {
            const double ang = double(float(pos) * inv[size_t(j)]);
            CHECK(cs[pos * hd + j] == doctest::Approx(std::cos(ang)).epsilon(1e-6));
            CHECK(cs[pos * hd + hd / 2 + j] == doctest::Approx(std::sin(ang)).epsilon(1e-6));
        }
    }
}

TEST_CASE("rope_rotate_half matches the HF rotate_half formula and position 0 is the identity") {
    std::mt19937 rng(3);
    const int64_t n_tokens = 4, n_heads = 3, hd = 16, n_pos = 128;
    std::vector<float> cs(size_t(n_pos * hd));
    k::rope_table(cs.data(), n_pos, hd, 10000.0f);
    const std::vector<int32_t> positions = {0, 1, 57, 127};
    const auto x0 = random_vec(rng, size_t(n_tokens * n_heads * hd));
    auto x = x0;
    k::rope_rotate_half(x.data(), positions.data(), cs.data(), n_tokens, n_heads, hd);
    const int64_t half = hd / 2;
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float * c = cs.data() + positions[t] * hd;  // cos in [0, half), sin in [half, hd)
        for (int64_t h = 0; h < n_heads; ++h) {
            const float * v = x0.data() + (t * n_heads + h) * hd;
            for (int64_t i = 0; i < hd; ++i) {
                // HF: q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q2, q1);
                // cos/sin are duplicated over both halves (emb = cat(freqs, freqs)).
                const double rot = i < half ? -double(v[i + half]) : double(v[i - half]);
                const double ref = double(v[i]) * c[i % half] + rot * c[half + i % half];
                CHECK(x[(t * n_heads + h) * hd + i] == doctest::Approx(ref).epsilon(1e-6));
            }
        }
    }
    // Position 0 (cos 1, sin 0) leaves the vector bit-for-bit unchanged.
    CHECK(bits_equal(x.data(), x0.data(), size_t(n_heads * hd)));
    // The rotation preserves each (j, j + half) pair's norm.
    const float * r = x.data() + (3 * n_heads + 1) * hd;
    const float * o = x0.data() + (3 * n_heads + 1) * hd;
    for (int64_t j = 0; j < half; ++j) {
        CHECK(r[j] * r[j] + r[j + half] * r[j + half] ==
              doctest::Approx(o[j] * o[j] + o[j + half] * o[j + half]).epsilon(1e-5));
    }
}

TEST_CASE("kv_store writes each token's K (transposed within its block) and V at its slot and nothing else") {
    const int32_t bs = 4, kvh = 2, hd = 3;
    const int64_t row = kvh * hd, n_blocks = 3;
    std::vector<float> kp(size_t(n_blocks * bs * row), -1.0f), vp(kp.size(), -1.0f);
    k::PagedKv kv{kp.data(), vp.data(), bs, kvh, hd};
    std::vector<float> kn(size_t(3 * row)), vn(size_t(3 * row));
    std::iota(kn.begin(), kn.end(), 100.0f);
    std::iota(vn.begin(), vn.end(), 200.0f);
    const std::vector<int64_t> slots = {9, 0, 5};  // block 2 offset 1, block 0 offset 0, block 1 offset 1
    k::kv_store(kv, kn.data(), vn.data(), slots.data(), 3);
    // K of block b is [kv head, head_dim, offset]: element (h, d) of the token at offset o is at
    // b * bs * row + (h * hd + d) * bs + o. Hand-written expected positions for token 0 (slot 9:
    // block 2, offset 1): element 0 at 2 * 24 + 1 = 49, element 4 (head 1, d 1) at 49 + 16 = 65.
    CHECK(kp[49] == 100.0f);
    CHECK(kp[65] == 104.0f);
    CHECK(kp[0] == 106.0f);  // token 1 (slot 0), element 0
    CHECK(kp[4] == 107.0f);  // token 1, element 1: one block_size further
    for (size_t t = 0; t < slots.size(); ++t) {
        for (int64_t e = 0; e < row; ++e) {
            CHECK(kp[size_t(slots[t] / bs * bs * row + e * bs + slots[t] % bs)] == kn[size_t(int64_t(t) * row + e)]);
        }
        CHECK(bits_equal(vp.data() + slots[t] * row, vn.data() + t * row, size_t(row)));
    }
    int untouched = 0;
    for (int64_t s = 0; s < n_blocks * bs; ++s) {
        if (std::find(slots.begin(), slots.end(), s) != slots.end()) { continue; }
        for (int64_t e = 0; e < row; ++e) {
            untouched += kp[size_t(s / bs * bs * row + e * bs + s % bs)] == -1.0f && vp[size_t(s * row + e)] == -1.0f;
        }
    }
    CHECK(untouched == (n_blocks * bs - 3) * row);
}

TEST_CASE("attention_paged over scattered blocks matches naive contiguous GQA attention, bitwise alike at any block size") {
    for (const int head_dim : {8, 24, 64}) {
        std::vector<float> out_bs4;  // block size 4 (gathered keys): 16 and 32 (direct Kᵀ reads) must agree bitwise
        for (const int block : {4, 16, 32}) {
            std::mt19937 rng(42);
            CAPTURE(head_dim);
            CAPTURE(block);
            AttnFixture f(rng, head_dim, block);
            const int hd = f.kHeadDim, nh = AttnFixture::kHeads;
            const float scale = 1.0f / std::sqrt(float(hd));
            // Every causal prefix of every sequence, as one batch.
            std::vector<QueryRef> qs;
            for (size_t s = 0; s < f.lens.size(); ++s) {
                for (int n = 1; n <= f.lens[s]; ++n) { qs.push_back({int(s), n, random_vec(rng, size_t(nh * hd), -2.0f, 2.0f)}); }
            }
            std::vector<float> q(qs.size() * nh * hd);
            std::vector<k::AttnQuery> queries(qs.size());
            for (size_t i = 0; i < qs.size(); ++i) {
                std::copy(qs[i].q.begin(), qs[i].q.end(), q.begin() + i * nh * hd);
                queries[i] = {f.tables[qs[i].seq].data(), qs[i].n_ctx};
            }
            std::vector<float> out(q.size(), 999.0f);
            k::ThreadPool pool(2);
            k::attention_paged(out.data(), q.data(), queries.data(), int64_t(qs.size()), nh, f.kv, scale, &pool);
            int bad = 0;
            std::vector<double> ref(size_t(nh * hd));
            for (size_t i = 0; i < qs.size(); ++i) {
                naive_attention(ref.data(), qs[i].q.data(), f.k_rows[qs[i].seq], f.v_rows[qs[i].seq], qs[i].n_ctx, nh,
                                AttnFixture::kKvHeads, hd, scale);
                for (int e = 0; e < nh * hd; ++e) {
                    if (!(std::fabs(out[i * nh * hd + e] - ref[e]) <= 1e-5 * (1.0 + std::fabs(ref[e])))) { ++bad; }
                }
            }
            CHECK(bad == 0);
            // With one context token the output is exactly that token's V row of the head's kv group.
            for (size_t i = 0; i < qs.size(); ++i) {
                if (qs[i].n_ctx != 1) { continue; }
                for (int h = 0; h < nh; ++h) {
                    const float * v = f.v_rows[qs[i].seq].data() + (h / 2) * hd;
                    CHECK(bits_equal(out.data() + (i * nh + h) * hd, v, size_t(hd)));
                }
            }
            if (block == 4) {
                out_bs4 = out;
            } else {
                CHECK(bits_equal(out.data(), out_bs4.data(), out.size()));
            }
        }
    }
}

TEST_CASE("attention_paged output for a query is bitwise the same in any batch composition") {
    for (const int block : {4, 16}) {
        for (const int head_dim : {8, 24, 64}) {
            std::mt19937 rng(5);
            CAPTURE(head_dim);
            CAPTURE(block);
            AttnFixture f(rng, head_dim, block);
            const int hd = f.kHeadDim, nh = AttnFixture::kHeads, per = nh * hd;
            const float scale = 1.0f / std::sqrt(float(hd));
            std::vector<QueryRef> qs;
            for (size_t s = 0; s < f.lens.size(); ++s) {
                for (int n = 1; n <= f.lens[s]; ++n) { qs.push_back({int(s), n, random_vec(rng, size_t(per), -2.0f, 2.0f)}); }
            }
            // Reference: each query alone, no pool.
            std::vector<std::vector<float>> alone(qs.size(), std::vector<float>(size_t(per)));
            for (size_t i = 0; i < qs.size(); ++i) {
                const k::AttnQuery a{f.tables[qs[i].seq].data(), qs[i].n_ctx};
                k::attention_paged(alone[i].data(), qs[i].q.data(), &a, 1, nh, f.kv, scale, nullptr);
            }
            k::ThreadPool p1(1), p2(2), p3(3);
            int mismatches = 0, compared = 0;
            for (int trial = 0; trial < 12; ++trial) {
                // A random subset in a random order (the full set is large enough for the pool path).
                std::vector<size_t> order(qs.size());
                std::iota(order.begin(), order.end(), size_t(0));
                // Trials 0-3 keep each sequence's queries consecutive, as a prefill batches them (tiles of
                // up to 64 sharing K/V reads); the others shuffle.
                if (trial >= 4) { std::shuffle(order.begin(), order.end(), rng); }
                if (trial >= 4 && trial % 2 == 1) { order.resize(2 + rng() % 20); }
                std::vector<float> q(order.size() * per), out(order.size() * per);
                std::vector<k::AttnQuery> queries(order.size());
                for (size_t b = 0; b < order.size(); ++b) {
                    const auto & r = qs[order[b]];
                    std::copy(r.q.begin(), r.q.end(), q.begin() + b * per);
                    queries[b] = {f.tables[r.seq].data(), r.n_ctx};
                }
                k::ThreadPool * pool = trial % 4 == 0 ? nullptr : trial % 4 == 1 ? &p1 : trial % 4 == 2 ? &p2 : &p3;
                k::attention_paged(out.data(), q.data(), queries.data(), int64_t(order.size()), nh, f.kv, scale, pool);
                for (size_t b = 0; b < order.size(); ++b) {
                    mismatches += !bits_equal(out.data() + b * per, alone[order[b]].data(), size_t(per));
                    ++compared;
                }
            }
            CHECK(compared > 2 * int(qs.size()));
            CHECK(mismatches == 0);
        }
    }
}

TEST_CASE("attention_paged: long prefills (up to 4100 tokens) give each query bitwise its decode output") {
    // One sequence over scattered blocks; every token of it as one prefill batch (tiles of many
    // queries: transposed-K GEMM scores, packed V), against each sampled query attended alone
    // (the decode path) and against a double-precision reference.
    struct Shape { int n_heads, n_kv, head_dim, len; };
    // Groups 1 (head_dim 64: the decode path's 8 key vectors at once), 2, 3, 4 and 8 (4 and 2, 1
    // key vectors per pair group), so every score and P·V variant of the decode path is compared.
    for (const Shape sh : {Shape{4, 2, 64, 4100}, Shape{2, 1, 128, 1100}, Shape{4, 4, 24, 700}, Shape{6, 2, 16, 300},
                           Shape{4, 4, 64, 600}, Shape{8, 2, 64, 300}, Shape{8, 1, 32, 500}}) {
        CAPTURE(sh.n_heads);
        CAPTURE(sh.n_kv);
        CAPTURE(sh.head_dim);
        CAPTURE(sh.len);
        std::mt19937 rng(uint32_t(sh.len));
        const int bs = 16, nb = (sh.len + bs - 1) / bs, row = sh.n_kv * sh.head_dim, per = sh.n_heads * sh.head_dim;
        std::vector<int32_t> table(static_cast<size_t>(nb));
        std::iota(table.begin(), table.end(), 0);
        std::shuffle(table.begin(), table.end(), rng);  // blocks out of order
        std::vector<float> kp(size_t(nb) * bs * row, std::numeric_limits<float>::quiet_NaN()), vp(kp.size(), kp[0]);
        const auto k_rows = random_vec(rng, size_t(sh.len) * row, -2.0f, 2.0f), v_rows = random_vec(rng, size_t(sh.len) * row);
        std::vector<int64_t> slots(size_t(sh.len));
        for (int t = 0; t < sh.len; ++t) { slots[t] = int64_t(table[t / bs]) * bs + t % bs; }
        const k::PagedKv kv{kp.data(), vp.data(), bs, sh.n_kv, sh.head_dim};
        k::kv_store(kv, k_rows.data(), v_rows.data(), slots.data(), sh.len);
        const auto q = random_vec(rng, size_t(sh.len) * per, -2.0f, 2.0f);
        std::vector<k::AttnQuery> queries(size_t(sh.len));
        for (int i = 0; i < sh.len; ++i) { queries[i] = {table.data(), i + 1}; }
        const float scale = 1.0f / std::sqrt(float(sh.head_dim));
        k::ThreadPool pool(2);
        std::vector<float> out(q.size());
        k::attention_paged(out.data(), q.data(), queries.data(), sh.len, sh.n_heads, kv, scale, &pool);
        // A later chunk of the same sequence (chunked prefill: queries 1000.. of it) as its own batch.
        const int c0 = std::min(sh.len / 2, 1000), cn = std::min(100, sh.len - c0);
        std::vector<float> out_chunk(size_t(cn) * per);
        k::attention_paged(out_chunk.data(), q.data() + size_t(c0) * per, queries.data() + c0, cn, sh.n_heads, kv, scale, nullptr);
        CHECK(bits_equal(out_chunk.data(), out.data() + size_t(c0) * per, out_chunk.size()));
        std::vector<int> sample = {0, 1, 15, 16, 31, 32, 33, 63, 64, 65, 127, 128, sh.len / 2, sh.len - 2, sh.len - 1};
        if (sh.len > 4096) { sample.insert(sample.end(), {2047, 2048, 4095, 4096}); }
        int mismatches = 0, bad = 0;
        std::vector<float> alone(static_cast<size_t>(per));
        std::vector<double> ref(static_cast<size_t>(per));
        for (const int i : sample) {
            k::attention_paged(alone.data(), q.data() + size_t(i) * per, &queries[i], 1, sh.n_heads, kv, scale, nullptr);
            mismatches += !bits_equal(alone.data(), out.data() + size_t(i) * per, size_t(per));
            std::vector<float> kc(k_rows.begin(), k_rows.begin() + size_t(i + 1) * row), vc(v_rows.begin(), v_rows.begin() + size_t(i + 1) * row);
            naive_attention(ref.data(), q.data() + size_t(i) * per, kc, vc, i + 1, sh.n_heads, sh.n_kv, sh.head_dim, scale);
            for (int e = 0; e < per; ++e) {
                if (!(std::fabs(out[size_t(i) * per + e] - ref[e]) <= 1e-5 * (1.0 + std::fabs(ref[e])))) { ++bad; }
            }
        }
        CHECK(mismatches == 0);
        CHECK(bad == 0);
    }
}

TEST_CASE("log_softmax exponentiates to a sum of 1, keeps differences and may run in place") {
    std::mt19937 rng(11);
    for (int64_t n : {1, 2, 5, 512}) {
        auto x = random_vec(rng, size_t(n), -30.0f, 30.0f);
        x[0] += 1000.0f;  // a huge logit must not overflow
        std::vector<float> out(x.size());
        k::log_softmax(out.data(), x.data(), n);
        double sum = 0.0;
        for (float v : out) { sum += std::exp(double(v)); CHECK(v <= 0.0f); }
        CHECK(sum == doctest::Approx(1.0).epsilon(1e-5));
        if (n > 1) { CHECK(out[1] - out[n - 1] == doctest::Approx(x[1] - x[n - 1]).epsilon(1e-4)); }
        k::log_softmax(x.data(), x.data(), n);
        CHECK(bits_equal(x.data(), out.data(), size_t(n)));
    }
    const std::vector<float> u = {3.0f, 3.0f, 3.0f, 3.0f};
    std::vector<float> lu(4);
    k::log_softmax(lu.data(), u.data(), 4);
    for (float v : lu) { CHECK(v == doctest::Approx(-std::log(4.0))); }
}

TEST_CASE("argmax returns the lowest index on ties") {
    const std::vector<float> a = {1.0f, 3.0f, 2.0f, 3.0f, 3.0f};
    CHECK(k::argmax(a.data(), 5) == 1);
    const std::vector<float> b = {-INFINITY, -INFINITY, -5.0f, -5.0f};
    CHECK(k::argmax(b.data(), 4) == 2);
    const std::vector<float> c = {0.0f, 0.0f, 0.0f};
    CHECK(k::argmax(c.data(), 3) == 0);
    const std::vector<float> d = {-1.0f, -2.0f, 7.5f};
    CHECK(k::argmax(d.data(), 3) == 2);
    CHECK(k::argmax(d.data(), 1) == 0);
}

TEST_CASE("bf16_to_f32 decodes known bit patterns") {
    const std::vector<uint16_t> in = {0x3F80, 0xC000, 0x477F, 0x0000, 0x8000, 0x0001, 0x7F80, 0xFF80, 0x7FC0, 0x4049};
    std::vector<float> out(in.size());
    k::bf16_to_f32(out.data(), in.data(), int64_t(in.size()));
    CHECK(out[0] == 1.0f);
    CHECK(out[1] == -2.0f);
    CHECK(out[2] == 65280.0f);  // 65504 is not representable in bf16; 0x477F is the f16-max neighbour
    CHECK(out[3] == 0.0f);
    CHECK((out[4] == 0.0f && std::signbit(out[4])));
    CHECK(out[5] == std::ldexp(1.0f, -133));  // smallest bf16 subnormal
    CHECK(out[6] == INFINITY);
    CHECK(out[7] == -INFINITY);
    CHECK(std::isnan(out[8]));
    CHECK(out[9] == 3.140625f);
}

TEST_CASE("f16_to_f32 decodes known bit patterns including subnormals, inf and nan") {
    const std::vector<uint16_t> in = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x03FF, 0x0200, 0x7C00, 0xFC00, 0x7E00, 0x8000, 0x8001, 0x0400};
    std::vector<float> out(in.size());
    k::f16_to_f32(out.data(), in.data(), int64_t(in.size()));
    CHECK(out[0] == 1.0f);
    CHECK(out[1] == -2.0f);
    CHECK(out[2] == 65504.0f);
    CHECK(out[3] == std::ldexp(1.0f, -24));
    CHECK(out[4] == 1023.0f * std::ldexp(1.0f, -24));  // largest subnormal
    CHECK(out[5] == std::ldexp(1.0f, -15));
    CHECK(out[6] == INFINITY);
    CHECK(out[7] == -INFINITY);
    CHECK(std::isnan(out[8]));
    CHECK((out[9] == 0.0f && std::signbit(out[9])));
    CHECK(out[10] == -std::ldexp(1.0f, -24));
    CHECK(out[11] == std::ldexp(1.0f, -14));  // smallest normal
}

TEST_CASE("f16_to_f32 is exact for all 65536 half-precision values") {
    std::vector<uint16_t> in(65536);
    std::iota(in.begin(), in.end(), uint16_t(0));
    std::vector<float> out(in.size());
    k::f16_to_f32(out.data(), in.data(), int64_t(in.size()));
    int bad = 0;
    for (uint32_t h = 0; h < 65536; ++h) {
        const int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
        const double sign = s ? -1.0 : 1.0;
        if (e == 31) {
            bad += m == 0 ? !(std::isinf(out[h]) && std::signbit(out[h]) == bool(s)) : !std::isnan(out[h]);
            continue;
        }
        const double ref = e == 0 ? sign * m * std::ldexp(1.0, -24) : sign * (1.0 + m / 1024.0) * std::ldexp(1.0, e - 15);
        bad += !(double(out[h]) == ref && std::signbit(out[h]) == bool(s));
    }
    CHECK(bad == 0);
}

TEST_CASE("find_nonfinite_* find the first NaN or Inf like a naive std::isfinite loop, for f32, bf16 and f16 bits") {
    std::mt19937 rng(12);
    std::uniform_real_distribution<float> u(-1e4f, 1e4f);
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::quiet_NaN()};
    for (int64_t n : {0, 1, 7, 1023, 1024, 1025, 5000}) {
        for (int64_t at : {int64_t{-1}, int64_t{0}, n / 2, n - 1}) {
            if (n == 0 && at >= 0) { continue; }
            for (float special : specials) {
                std::vector<float> x(static_cast<size_t>(n));
                for (auto & v : x) { v = u(rng); }
                x.empty() || (x[0] = std::numeric_limits<float>::max(), true);  // the largest finite value is finite
                if (at >= 0) { x[at] = special; }
                if (at >= 0 && at + 1 < n) { x[at + 1] = special; }  // the first one is reported
                int64_t naive = -1;
                for (int64_t i = 0; i < n; ++i) {
                    if (!std::isfinite(x[i])) { naive = i; break; }
                }
                CAPTURE(n);
                CAPTURE(at);
                CHECK(fd::kernels::find_nonfinite_f32(x.data(), n) == naive);
                // bf16: the upper half of each f32 (NaN/Inf stay NaN/Inf, FLT_MAX rounds down to a finite bf16)
                std::vector<uint16_t> b(x.size());
                for (size_t i = 0; i < x.size(); ++i) { uint32_t bits; std::memcpy(&bits, &x[i], 4); b[i] = static_cast<uint16_t>(bits >> 16); }
                CHECK(fd::kernels::find_nonfinite_bf16(b.data(), n) == naive);
                // f16: finite values in half range; specials as half NaN / Inf
                std::vector<uint16_t> h(x.size());
                for (size_t i = 0; i < x.size(); ++i) {
                    h[i] = std::isnan(x[i]) ? 0x7e00 : std::isinf(x[i]) ? (x[i] > 0 ? 0x7c00 : 0xfc00) : static_cast<uint16_t>(0x3c00 + (i % 1000));
                }
                std::vector<float> back(x.size());
                fd::kernels::f16_to_f32(back.data(), h.data(), n);
                int64_t naive_h = -1;
                for (int64_t i = 0; i < n; ++i) {
                    if (!std::isfinite(back[i])) { naive_h = i; break; }
                }
                CHECK(naive_h == naive);
                CHECK(fd::kernels::find_nonfinite_f16(h.data(), n) == naive_h);
            }
        }
    }
    // Half's largest finite value (65504 = 0x7bff) and the smallest subnormals are finite.
    const uint16_t edge[] = {0x7bff, 0xfbff, 0x0001, 0x8001, 0x0000, 0x8000};
    CHECK(fd::kernels::find_nonfinite_f16(edge, 6) == -1);
}

}  // TEST_SUITE
