// CPU ops (kernels/cpu/*.cpp) against deliberately naive loops, plus the batch-invariance
// guarantee of ops.h: a row's result is bitwise the same whatever else is in the batch and
// whatever the thread count. linear (kernels/cpu/matmul.cpp) has its own file, test_matmul_cpu.cpp;
// kv_store and attention_paged theirs, test_attention_cpu.cpp.
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
