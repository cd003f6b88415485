// The one-row (decode) linear in both compute modes (kernels/cpu/matmul.cpp strip(),
// kernels/cpu/linear_bf16_avx2.cpp outputs_one_row()). On AVX2 a task's outputs are cut into 4
// parts read as 4 sequential streams, each tile taking the next rows of every part (issue 28,
// docs/benchmarks.md "B=1 GEMV on AVX2"), so the edges are new: a last part shorter than the
// others or empty (n_out 1, 2, 3, 5, 6, 7, 9, 13), a part whose row count is not a multiple of
// the 2 rows a tile or block takes (33, 66, 67, 131; 31: whole blocks), tasks split between
// threads (1000 outputs), and k tails (7, 40, 1061). Each output must be bitwise another path's:
// the f32 mode's many-row packed path (row 0 of 9 rows: linear_packed.cpp), the bf16 mode's
// portable path and its many-row AVX2 tiles; and nothing may be written past n_out (the columns
// past a part's end compute a valid row again, unstored).
#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/thread_pool.h"

#include "fd/status.h"
#include "test_util.h"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

namespace k = fd::kernels;

namespace {

using fd::test::bits_equal;
using fd::test::random_vec;

constexpr uint32_t kSentinel = 0x7FC0DEADu;  ///< a NaN no kernel produces: marks untouched floats
constexpr int64_t  kPad      = 16;           ///< sentinel floats after each output row

float sentinel() {
    float f;
    std::memcpy(&f, &kSentinel, 4);
    return f;
}

/// Whether the `kPad` floats after `n` outputs still hold the sentinel.
bool pad_untouched(const std::vector<float> & out, int64_t n) {
    for (int64_t i = n; i < n + kPad; ++i) {
        uint32_t u;
        std::memcpy(&u, &out[size_t(i)], 4);
        if (u != kSentinel) { return false; }
    }
    return true;
}

/// Whether linear_bf16's avx2 path runs here (it refuses a CPU without AVX2 + FMA).
bool avx2_runs() {
    uint16_t    b = 0;
    const float one = 1.0f;
    try {
        k::round_to_bf16(&b, &one, 1, k::Bf16Isa::avx2);
        return true;
    } catch (const fd::Error &) {
        return false;
    }
}

/// Weights [n_out, n_in] in `wt`: f32 values, or bf16 patterns of ordinary numbers.
std::vector<char> weights(std::mt19937 & rng, k::WType wt, int64_t n_out, int64_t n_in) {
    const auto f = random_vec(rng, size_t(n_out * n_in));
    if (wt == k::WType::f32) {
        std::vector<char> w(f.size() * 4);
        std::memcpy(w.data(), f.data(), w.size());
        return w;
    }
    std::vector<char> w(f.size() * 2);
    for (size_t i = 0; i < f.size(); ++i) {
        uint32_t u;
        std::memcpy(&u, &f[i], 4);
        const auto h = static_cast<uint16_t>(u >> 16);
        std::memcpy(w.data() + 2 * i, &h, 2);
    }
    return w;
}

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("one-row linear, both modes: stream parts uneven or empty, partial blocks, k tails, threads: bitwise the other paths, nothing past n_out") {
    std::mt19937  rng(2828);
    k::ThreadPool pool2(2), pool3(3);
    const bool    avx2 = avx2_runs();
    int64_t       compared = 0;
    for (k::WType wt : {k::WType::f32, k::WType::bf16}) {
        for (int64_t n_out : {1, 2, 3, 5, 6, 7, 9, 13, 31, 33, 66, 67, 131, 1000}) {
            for (int64_t n_in : {7, 32, 40, 512, 1061}) {
                if (n_out == 1000 && n_in != 512) { continue; }  // the thread split: one k is enough
                const auto w    = weights(rng, wt, n_out, n_in);
                const auto bias = random_vec(rng, size_t(n_out));
                const auto x9   = random_vec(rng, size_t(9 * n_in), -3.0f, 3.0f);  // row 0: the decode row
                // References, one per mode: f32 the packed path's row 0 of 9; bf16 the portable path.
                std::vector<float> ref_f32(size_t(9 * n_out));
                std::vector<float> ref_bf16(static_cast<size_t>(n_out));
                k::linear(ref_f32.data(), x9.data(), w.data(), wt, bias.data(), 9, n_out, n_in, nullptr);
                k::linear_bf16(ref_bf16.data(), x9.data(), w.data(), wt, bias.data(), 1, n_out, n_in, nullptr, k::Bf16Isa::portable);
                if (avx2) {  // the bf16 mode's many-row AVX2 tiles agree with the portable path too
                    std::vector<float> many(size_t(9 * n_out));
                    k::linear_bf16(many.data(), x9.data(), w.data(), wt, bias.data(), 9, n_out, n_in, nullptr, k::Bf16Isa::avx2);
                    CHECK(bits_equal(many.data(), ref_bf16.data(), size_t(n_out)));
                }
                for (k::ThreadPool * pl : {static_cast<k::ThreadPool *>(nullptr), &pool2, &pool3}) {
                    CAPTURE(int(wt)); CAPTURE(n_out); CAPTURE(n_in); CAPTURE(pl ? pl->n_threads() : 0);
                    std::vector<float> out(size_t(n_out + kPad), sentinel());
                    k::linear(out.data(), x9.data(), w.data(), wt, bias.data(), 1, n_out, n_in, pl);
                    CHECK(bits_equal(out.data(), ref_f32.data(), size_t(n_out)));
                    CHECK(pad_untouched(out, n_out));
                    if (avx2) {
                        std::vector<float> ob(size_t(n_out + kPad), sentinel());
                        k::linear_bf16(ob.data(), x9.data(), w.data(), wt, bias.data(), 1, n_out, n_in, pl, k::Bf16Isa::avx2);
                        CHECK(bits_equal(ob.data(), ref_bf16.data(), size_t(n_out)));
                        CHECK(pad_untouched(ob, n_out));
                    }
                    ++compared;
                }
            }
        }
    }
    CHECK(compared == 2 * (13 * 5 + 1) * 3);
}

}  // TEST_SUITE
