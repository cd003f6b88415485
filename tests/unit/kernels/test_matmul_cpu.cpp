// linear (kernels/cpu/matmul.cpp; its many-row path in linear_packed.cpp) against a naive
// double loop, plus the batch-invariance guarantee of ops.h for it: a row's result is bitwise
// the same whatever else is in the batch, wherever it sits, and whatever the thread count —
// in both compute modes (f32: linear; bf16: linear_bf16, --compute-dtype bfloat16).
#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/thread_pool.h"

#include "test_util.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <utility>
#include <vector>

namespace k = fd::kernels;

namespace {

using fd::test::bits_equal;
using fd::test::random_vec;

/// A weight in the requested storage dtype, and the f32 values it really holds (bf16 rounds).
struct StoredWeight {
    std::vector<float>    values;  ///< [n_out, n_in] what the kernel sees
    std::vector<uint16_t> bf16;    ///< storage when bf16
    const void * data(k::WType t) const { return t == k::WType::f32 ? static_cast<const void *>(values.data()) : bf16.data(); }
};

StoredWeight stored(std::vector<float> w, k::WType t) {
    StoredWeight s;
    if (t == k::WType::bf16) {
        for (float & v : w) {
            uint32_t u;
            std::memcpy(&u, &v, 4);
            s.bf16.push_back(static_cast<uint16_t>(u >> 16));  // truncate: any bf16 value will do
            u &= 0xffff0000u;
            std::memcpy(&v, &u, 4);
        }
    }
    s.values = std::move(w);
    return s;
}

/// The two compute modes' linear (the same contract, shapes and invariance).
enum class Mode { f32, bf16 };
void run_linear(Mode m, float * out, const float * x, const void * w, k::WType wt, const float * bias, int64_t n_rows,
                int64_t n_out, int64_t n_in, k::ThreadPool * pool) {
    if (m == Mode::f32) {
        k::linear(out, x, w, wt, bias, n_rows, n_out, n_in, pool);
    } else {
        k::linear_bf16(out, x, w, wt, bias, n_rows, n_out, n_in, pool);
    }
}

/// Entries of `out` [n_rows, n_out] further than 1e-5 × (sum of |terms|) from the naive double
/// loop x [n_rows, n_in] · w [n_out, n_in]ᵀ (+ bias [n_out] when given).
int naive_linear_mismatches(const std::vector<float> & out, const std::vector<float> & x, const std::vector<float> & w,
                            const float * bias, int64_t n_rows, int64_t n_out, int64_t n_in) {
    int bad = 0;
    for (int64_t t = 0; t < n_rows; ++t) {
        for (int64_t o = 0; o < n_out; ++o) {
            double ref = bias ? bias[o] : 0.0, mag = std::fabs(ref);
            for (int64_t kk = 0; kk < n_in; ++kk) {
                const double term = double(x[t * n_in + kk]) * w[o * n_in + kk];
                ref += term;
                mag += std::fabs(term);
            }
            if (std::fabs(out[t * n_out + o] - ref) > 1e-5 * mag + 1e-30) { ++bad; }
        }
    }
    return bad;
}

}  // namespace

TEST_SUITE("kernels::matmul_cpu") {

TEST_CASE("linear with and without bias matches a naive triple loop over awkward sizes, f32 and bf16 weights") {
    std::mt19937 rng(1234);
    for (k::WType wt : {k::WType::f32, k::WType::bf16}) {
        for (int64_t n_rows : {1, 2, 3, 4, 5, 7, 13, 64}) {
            for (int64_t n_out : {1, 3, 4, 8, 9, 31, 100}) {
                for (int64_t n_in : {1, 7, 16, 17, 64, 65}) {
                    const auto x    = random_vec(rng, size_t(n_rows * n_in));
                    const auto w    = stored(random_vec(rng, size_t(n_out * n_in)), wt);
                    const auto bias = random_vec(rng, size_t(n_out));
                    for (bool with_bias : {false, true}) {
                        CAPTURE(int(wt)); CAPTURE(n_rows); CAPTURE(n_out); CAPTURE(n_in); CAPTURE(with_bias);
                        std::vector<float> out(size_t(n_rows * n_out), 12345.0f);
                        k::linear(out.data(), x.data(), w.data(wt), wt, with_bias ? bias.data() : nullptr, n_rows, n_out, n_in, nullptr);
                        CHECK(naive_linear_mismatches(out, x, w.values, with_bias ? bias.data() : nullptr, n_rows, n_out, n_in) == 0);
                    }
                }
            }
        }
    }
}

TEST_CASE("linear reads the PyTorch [n_out, n_in] layout: output o is the dot product with row o") {
    const int64_t n_out = 9, n_in = 3;
    std::vector<float> w(size_t(n_out * n_in), 0.0f);
    for (int64_t o = 0; o < n_out; ++o) { w[o * n_in + o % n_in] = float(o + 1); }  // row o picks x[o % 3] * (o + 1)
    const std::vector<float> x = {10.0f, 100.0f, 1000.0f};
    for (k::WType wt : {k::WType::f32, k::WType::bf16}) {
        const auto sw = stored(w, wt);
        std::vector<float> out(static_cast<size_t>(n_out));
        k::linear(out.data(), x.data(), sw.data(wt), wt, nullptr, 1, n_out, n_in, nullptr);
        for (int64_t o = 0; o < n_out; ++o) { CHECK(out[o] == x[o % n_in] * float(o + 1)); }
    }
}

TEST_CASE("linear matches the naive loop when k spans several cache chunks and rows several row blocks") {
    std::mt19937 rng(4321);
    for (k::WType wt : {k::WType::f32, k::WType::bf16}) {
        for (int64_t n_in : {511, 512, 513, 1100, 2061}) {
            for (int64_t n_rows : {1, 5, 70, 300}) {
                const int64_t n_out = 53;
                const auto x    = random_vec(rng, size_t(n_rows * n_in));
                const auto w    = stored(random_vec(rng, size_t(n_out * n_in)), wt);
                const auto bias = random_vec(rng, size_t(n_out));
                CAPTURE(int(wt)); CAPTURE(n_rows); CAPTURE(n_in);
                std::vector<float> out(size_t(n_rows * n_out), 12345.0f);
                k::linear(out.data(), x.data(), w.data(wt), wt, bias.data(), n_rows, n_out, n_in, nullptr);
                CHECK(naive_linear_mismatches(out, x, w.values, bias.data(), n_rows, n_out, n_in) == 0);
            }
        }
    }
}

TEST_CASE("linear rows are bitwise identical alone, at any batch position of 2 to 4096 rows and with 1 to 4 threads (f32 and bf16 compute)") {
    std::mt19937 rng(99);
    std::vector<std::unique_ptr<k::ThreadPool>> pools;
    for (int nt : {1, 2, 3, 4}) { pools.push_back(std::make_unique<k::ThreadPool>(nt)); }
    std::vector<k::ThreadPool *> pool_ptrs = {nullptr};
    for (auto & pl : pools) { pool_ptrs.push_back(pl.get()); }
    std::vector<int64_t> row_counts;
    for (int64_t n = 2; n <= 20; ++n) { row_counts.push_back(n); }
    for (int64_t n : {31, 64, 65, 127, 128, 129, 300, 513, 1000, 2048, 4096}) { row_counts.push_back(n); }
    // Shapes big enough that the pool splits the outputs into several tasks; k below, at and
    // above one cache chunk (with partial steps at the end) so rows meet every path.
    for (Mode mode : {Mode::f32, Mode::bf16}) {
    for (k::WType wt : {k::WType::f32, k::WType::bf16}) {
        for (auto [n_out, n_in] : {std::pair<int64_t, int64_t>{1000, 256}, {97, 65}, {33, 7}, {130, 1100}, {50, 2061}}) {
            const auto w    = stored(random_vec(rng, size_t(n_out * n_in)), wt);
            const auto bias = random_vec(rng, size_t(n_out));
            const auto x0   = random_vec(rng, size_t(n_in));
            std::vector<float> alone(static_cast<size_t>(n_out));
            run_linear(mode, alone.data(), x0.data(), w.data(wt), wt, bias.data(), 1, n_out, n_in, nullptr);

            int checked = 0, calls = 0;
            for (int64_t n_rows : row_counts) {
                // x0 at the first rows (every lane of the first row tile), the middle and the end.
                std::vector<int64_t> at = {0, 1, 2, 3, n_rows / 2, n_rows - 1};
                std::sort(at.begin(), at.end());
                at.erase(std::unique(at.begin(), at.end()), at.end());
                while (at.back() >= n_rows) { at.pop_back(); }
                auto x = random_vec(rng, size_t(n_rows * n_in), -3.0f, 3.0f);
                for (int64_t pos : at) { std::copy(x0.begin(), x0.end(), x.begin() + pos * n_in); }
                for (k::ThreadPool * pool : pool_ptrs) {
                    if (n_rows * n_out * n_in > (int64_t(1) << 28) && pool && pool->n_threads() % 2 == 1) { continue; }  // keep the test short
                    std::vector<float> out(size_t(n_rows * n_out));
                    run_linear(mode, out.data(), x.data(), w.data(wt), wt, bias.data(), n_rows, n_out, n_in, pool);
                    ++calls;
                    for (int64_t pos : at) {
                        CAPTURE(int(mode)); CAPTURE(int(wt)); CAPTURE(n_out); CAPTURE(n_in); CAPTURE(n_rows); CAPTURE(pos);
                        CAPTURE(pool ? pool->n_threads() : 0);
                        CHECK(bits_equal(out.data() + pos * n_out, alone.data(), size_t(n_out)));
                        ++checked;
                    }
                }
            }
            CHECK(calls >= int(row_counts.size()) * 3);
            CHECK(checked >= calls);
        }
    }
    }
}

TEST_CASE("linear: every row of 1 to 4096 rows is bitwise its one-row result across weight chunks, row blocks and k chunks (f32 and bf16 compute)") {
    // Shapes whose packed weights span several 1 MiB output chunks, whose rows span several
    // 512 KiB blocks of packed x and whose k spans two 1024-k chunks (400 x 1100), plus awkward
    // edges (13 x 33): each row of each batch is one of 64 pool rows and must equal, bitwise,
    // that pool row computed alone (the decode path), with no pool and on 1 and 2 threads.
    std::mt19937 rng(2026);
    k::ThreadPool pool1(1), pool2(2);
    const std::vector<k::ThreadPool *> pools = {nullptr, &pool1, &pool2};
    constexpr int64_t kPool = 64;
    for (Mode mode : {Mode::f32, Mode::bf16}) {
    for (k::WType wt : {k::WType::f32, k::WType::bf16}) {
        for (auto [n_out, n_in] : {std::pair<int64_t, int64_t>{400, 1100}, {13, 33}}) {
            const auto w    = stored(random_vec(rng, size_t(n_out * n_in)), wt);
            const auto bias = random_vec(rng, size_t(n_out));
            const auto xs   = random_vec(rng, size_t(kPool * n_in), -3.0f, 3.0f);
            std::vector<float> alone(size_t(kPool * n_out));
            for (int64_t p = 0; p < kPool; ++p) {
                run_linear(mode, alone.data() + p * n_out, xs.data() + p * n_in, w.data(wt), wt, bias.data(), 1, n_out, n_in, nullptr);
            }
            for (int64_t n_rows : {1, 7, 64, 511, 512, 2048, 4096}) {
                std::vector<float> x(size_t(n_rows * n_in));
                auto pick = [&](int64_t r) { return (r * 37 + n_rows) % kPool; };
                for (int64_t r = 0; r < n_rows; ++r) {
                    std::copy_n(xs.begin() + pick(r) * n_in, n_in, x.begin() + r * n_in);
                }
                for (k::ThreadPool * pl : pools) {
                    std::vector<float> out(size_t(n_rows * n_out), 12345.0f);
                    run_linear(mode, out.data(), x.data(), w.data(wt), wt, bias.data(), n_rows, n_out, n_in, pl);
                    int64_t bad_rows = 0, first_bad = -1;
                    for (int64_t r = 0; r < n_rows; ++r) {
                        if (!bits_equal(out.data() + r * n_out, alone.data() + pick(r) * n_out, size_t(n_out))) {
                            if (first_bad < 0) { first_bad = r; }
                            ++bad_rows;
                        }
                    }
                    CAPTURE(int(mode)); CAPTURE(int(wt)); CAPTURE(n_out); CAPTURE(n_in); CAPTURE(n_rows); CAPTURE(pl ? pl->n_threads() : 0);
                    CAPTURE(first_bad);
                    CHECK(bad_rows == 0);
                }
            }
        }
    }
    }
}

}  // TEST_SUITE
