// linear_bf16 (kernels/cpu/linear_bf16.cpp): the two paths against each other and against the
// hardware. The avx512_bf16 path's instructions (vdpbf16ps, vcvtne2ps2bf16) are the reference
// nobody here wrote: the portable emulation must give their bits over random data that includes
// denormals, signed zeros, ties, infinities and NaN; then linear_bf16 is checked against a
// double-precision sum of the bf16-rounded products and bitwise across its two paths. (Batch and
// thread invariance in bf16 mode: test_matmul_cpu.cpp, beside the f32 mode's.)
#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/thread_pool.h"

#include "fd/status.h"
#include "test_util.h"

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace k = fd::kernels;

namespace {

using fd::test::bits_equal;
using fd::test::random_vec;

float from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
uint32_t to_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

/// A bf16 bit pattern drawn to hit every class: zeros and denormals, tiny normals (whose
/// products underflow), mid-range values, and now and then infinities and NaN.
uint16_t random_bf16(std::mt19937 & rng, bool specials) {
    const uint32_t r = rng(), sign = (r >> 31) << 15, man = rng() & 0x7F;
    switch (r % 8) {
    case 0: return static_cast<uint16_t>(sign | man);                                  // zero / denormal
    case 1: return static_cast<uint16_t>(sign | ((1 + rng() % 30) << 7) | man);        // tiny normal
    case 2: if (specials && rng() % 16 == 0) { return static_cast<uint16_t>(sign | 0x7F80 | (rng() % 2 ? man | 1 : 0)); }
            [[fallthrough]];
    default: return static_cast<uint16_t>(sign | ((97 + rng() % 60) << 7) | man);       // 2^-30 .. 2^29
    }
}

/// An f32 pattern of every class: denormals, tiny normals, ordinary values, exact bf16 ties.
float random_f32(std::mt19937 & rng, bool specials) {
    const uint32_t r = rng(), sign = r & 0x80000000u, man = rng() & 0x7FFFFFu;
    switch (r % 8) {
    case 0: return from_bits(sign | man);                                              // denormal
    case 1: return from_bits(sign | ((1 + rng() % 20) << 23) | man);                   // tiny
    case 2: return from_bits(sign | ((100 + rng() % 50) << 23) | (man & 0x7F0000u) | 0x8000u);  // a tie
    case 3: if (specials && rng() % 8 == 0) { return from_bits(sign | 0x7F800000u | (rng() % 2 ? man | 1 : 0)); }
            [[fallthrough]];
    default: return from_bits(sign | ((100 + rng() % 55) << 23) | man);
    }
}

bool have_avx512_bf16() { return k::bf16_best_isa() == k::Bf16Isa::avx512_bf16; }

/// Whether `isa` runs on this CPU (linear_bf16 refuses one that does not).
bool runs_here(k::Bf16Isa isa) {
    uint16_t out = 0;
    const float one = 1.0f;
    try {
        k::round_to_bf16(&out, &one, 1, isa);
        return true;
    } catch (const fd::Error &) {
        return false;
    }
}

/// NaN == NaN for the comparison of results that may hold NaN (payloads compared too).
bool same_bits(float a, float b) { return to_bits(a) == to_bits(b); }

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("round_to_bf16 portable: round to nearest even, denormals to signed zero, NaN quiet (hand-made cases)") {
    const float in[] = {1.0f, from_bits(0x3F808000u), from_bits(0x3F818000u), from_bits(0x3F808001u), -2.5f,
                        from_bits(0x00000001u), from_bits(0x807FFFFFu), from_bits(0x7F7FFFFFu), from_bits(0x7FC00001u),
                        std::numeric_limits<float>::infinity(), from_bits(0x00800000u)};
    // 1+2^-8 is a tie → even (0x3F80); 1+3*2^-8 a tie → even (0x3F82); a hair above the tie rounds up;
    // FLT_MAX rounds up to +inf (RNE overflow); denormals → ±0.
    const uint16_t want[] = {0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC020, 0x0000, 0x8000, 0x7F80, 0x7FC0, 0x7F80, 0x0080};
    uint16_t out[11];
    k::round_to_bf16(out, in, 11, k::Bf16Isa::portable);
    for (int i = 0; i < 11; ++i) {
        CAPTURE(i);
        CHECK(out[i] == want[i]);
    }
}

TEST_CASE("round_to_bf16: the portable path gives vcvtne2ps2bf16's bits on this CPU (denormals, ties, inf, NaN)") {
    if (!have_avx512_bf16()) {
        MESSAGE("this CPU has no AVX512_BF16: only the portable path runs");
        return;
    }
    std::mt19937 rng(28);
    for (int64_t n : {1, 31, 32, 33, 1000, 4096 + 7}) {
        std::vector<float> x(static_cast<size_t>(n));
        for (auto & v : x) { v = random_f32(rng, true); }
        std::vector<uint16_t> hw(x.size()), emu(x.size());
        k::round_to_bf16(hw.data(), x.data(), n, k::Bf16Isa::avx512_bf16);
        k::round_to_bf16(emu.data(), x.data(), n, k::Bf16Isa::portable);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; ++i) { bad += hw[i] != emu[i]; }
        CAPTURE(n);
        CHECK(bad == 0);
    }
}

TEST_CASE("dpbf16_step: the portable emulation equals vdpbf16ps bitwise over 2 million lanes with denormals and specials") {
    if (!have_avx512_bf16()) {
        MESSAGE("this CPU has no AVX512_BF16: only the portable path runs");
        return;
    }
    std::mt19937 rng(2028);
    int64_t bad = 0, lanes = 0, denormal_acc = 0, flushed = 0;
    for (int it = 0; it < 130000; ++it) {
        uint16_t a[32], b[32];
        float    acc_hw[16], acc_emu[16];
        const bool specials = it % 4 == 0;
        for (int i = 0; i < 32; ++i) { a[i] = random_bf16(rng, specials), b[i] = random_bf16(rng, specials); }
        for (int l = 0; l < 16; ++l) {
            acc_hw[l] = acc_emu[l] = random_f32(rng, specials);
            denormal_acc += std::fpclassify(acc_hw[l]) == FP_SUBNORMAL;
        }
        k::dpbf16_step(acc_hw, a, b, k::Bf16Isa::avx512_bf16);
        k::dpbf16_step(acc_emu, a, b, k::Bf16Isa::portable);
        for (int l = 0; l < 16; ++l) {
            bad += !same_bits(acc_hw[l], acc_emu[l]);
            flushed += acc_hw[l] == 0.0f;
            ++lanes;
        }
    }
    CHECK(lanes > 2000000);
    CHECK(denormal_acc > 10000);  // the data did reach the DAZ / FTZ corners
    CHECK(flushed > 1000);
    CHECK(bad == 0);
}

TEST_CASE("linear_bf16 matches a double sum of the bf16-rounded products (f32 and bf16 weights, bias, awkward k)") {
    std::mt19937 rng(7);
    for (k::WType wt : {k::WType::f32, k::WType::bf16}) {
        for (auto [n_rows, n_out, n_in] : {std::array<int64_t, 3>{1, 37, 100}, {5, 19, 31}, {9, 50, 64}, {70, 13, 1100}}) {
            const auto x  = random_vec(rng, size_t(n_rows * n_in), -3.0f, 3.0f);
            const auto wf = random_vec(rng, size_t(n_out * n_in));
            const auto bias = random_vec(rng, size_t(n_out));
            std::vector<uint16_t> wb(wf.size()), xr(x.size()), wr(wf.size());
            k::round_to_bf16(wb.data(), wf.data(), int64_t(wf.size()), k::Bf16Isa::portable);
            k::round_to_bf16(xr.data(), x.data(), int64_t(x.size()), k::Bf16Isa::portable);
            const void * w = wt == k::WType::bf16 ? static_cast<const void *>(wb.data()) : wf.data();
            for (k::Bf16Isa isa : {k::Bf16Isa::portable, k::bf16_best_isa()}) {
                std::vector<float> out(size_t(n_rows * n_out));
                k::linear_bf16(out.data(), x.data(), w, wt, bias.data(), n_rows, n_out, n_in, nullptr, isa);
                int bad = 0;
                for (int64_t r = 0; r < n_rows; ++r) {
                    for (int64_t o = 0; o < n_out; ++o) {
                        double ref = bias[o], mag = std::fabs(ref);
                        for (int64_t kk = 0; kk < n_in; ++kk) {
                            const double t = double(from_bits(uint32_t(xr[r * n_in + kk]) << 16)) *
                                             double(from_bits(uint32_t(wb[o * n_in + kk]) << 16));
                            ref += t, mag += std::fabs(t);
                        }
                        bad += std::fabs(out[r * n_out + o] - ref) > 1e-5 * mag + 1e-30;
                    }
                }
                CAPTURE(int(wt)); CAPTURE(n_rows); CAPTURE(n_out); CAPTURE(n_in); CAPTURE(k::bf16_isa_name(isa));
                CHECK(bad == 0);
            }
            // And it is not the f32 mode: rounding x changes the results.
            std::vector<float> f32(size_t(n_rows * n_out)), b16(size_t(n_rows * n_out));
            k::linear(f32.data(), x.data(), w, wt, bias.data(), n_rows, n_out, n_in, nullptr);
            k::linear_bf16(b16.data(), x.data(), w, wt, bias.data(), n_rows, n_out, n_in, nullptr);
            CHECK_FALSE(bits_equal(f32, b16));
        }
    }
}

TEST_CASE("linear_bf16: the avx512_bf16 and portable paths give the same bits (1 to 300 rows, tails, with and without bias, 0-3 threads)") {
    if (!have_avx512_bf16()) {
        MESSAGE("this CPU has no AVX512_BF16: only the portable path runs");
        return;
    }
    std::mt19937  rng(11);
    k::ThreadPool pool2(2), pool3(3);
    for (k::WType wt : {k::WType::f32, k::WType::bf16}) {
        // {1000, 512}: a one-row linear split into several tasks per thread (decode_task_outputs)
        for (auto [n_out, n_in] : {std::pair<int64_t, int64_t>{29, 7}, {100, 33}, {48, 256}, {61, 1061}, {1000, 512}}) {
            std::vector<float> wf(size_t(n_out * n_in));
            for (auto & v : wf) { v = random_f32(rng, false); }  // denormal and tiny weights too
            std::vector<uint16_t> wb(wf.size());
            for (auto & v : wb) { v = random_bf16(rng, false); }
            const void * w    = wt == k::WType::bf16 ? static_cast<const void *>(wb.data()) : wf.data();
            const auto   bias = random_vec(rng, size_t(n_out));
            for (int64_t n_rows : {1, 2, 3, 4, 5, 9, 300}) {
                if (n_out == 1000 && n_rows > 2) { continue; }
                std::vector<float> x(size_t(n_rows * n_in));
                for (auto & v : x) { v = random_f32(rng, false); }
                for (const float * b : {bias.data(), static_cast<const float *>(nullptr)}) {  // the tiles' epilogues both ways
                    std::vector<float> emu(size_t(n_rows * n_out));
                    k::linear_bf16(emu.data(), x.data(), w, wt, b, n_rows, n_out, n_in, nullptr, k::Bf16Isa::portable);
                    for (k::ThreadPool * pl : {static_cast<k::ThreadPool *>(nullptr), &pool2, &pool3}) {
                        std::vector<float> hw(size_t(n_rows * n_out), -1.0f);
                        k::linear_bf16(hw.data(), x.data(), w, wt, b, n_rows, n_out, n_in, pl, k::Bf16Isa::avx512_bf16);
                        CAPTURE(int(wt)); CAPTURE(n_out); CAPTURE(n_in); CAPTURE(n_rows); CAPTURE(pl ? pl->n_threads() : 0);
                        CAPTURE(b != nullptr);
                        CHECK(bits_equal(hw, emu));
                    }
                }
            }
        }
    }
}

// The AVX2 path (Bf16Isa::avx2) has no instruction to be checked against: its reference is the
// portable path, bit for bit, which the tests above tie to vdpbf16ps on a CPU that has it.

TEST_CASE("round_to_bf16: the avx2 path gives the portable bits (denormals, ties, inf, NaN, tails)") {
    if (!runs_here(k::Bf16Isa::avx2)) {
        MESSAGE("this CPU has no AVX2 + FMA: only the portable path runs");
        return;
    }
    std::mt19937 rng(282);
    for (int64_t n : {1, 7, 15, 16, 17, 31, 32, 33, 1000, 4096 + 7}) {
        std::vector<float> x(static_cast<size_t>(n));
        for (auto & v : x) { v = random_f32(rng, true); }
        std::vector<uint16_t> avx(x.size()), emu(x.size());
        k::round_to_bf16(avx.data(), x.data(), n, k::Bf16Isa::avx2);
        k::round_to_bf16(emu.data(), x.data(), n, k::Bf16Isa::portable);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; ++i) { bad += avx[i] != emu[i]; }
        CAPTURE(n);
        CHECK(bad == 0);
    }
}

TEST_CASE("dpbf16_step: the avx2 path equals the portable one bitwise over 2 million lanes with denormals and specials") {
    if (!runs_here(k::Bf16Isa::avx2)) {
        MESSAGE("this CPU has no AVX2 + FMA: only the portable path runs");
        return;
    }
    std::mt19937 rng(20282);
    int64_t bad = 0, lanes = 0, denormal_acc = 0, flushed = 0, nan = 0;
    for (int it = 0; it < 130000; ++it) {
        uint16_t a[32], b[32];
        float    acc_avx[16], acc_emu[16];
        const bool specials = it % 4 == 0;
        for (int i = 0; i < 32; ++i) { a[i] = random_bf16(rng, specials), b[i] = random_bf16(rng, specials); }
        for (int l = 0; l < 16; ++l) {
            acc_avx[l] = acc_emu[l] = random_f32(rng, specials);
            denormal_acc += std::fpclassify(acc_avx[l]) == FP_SUBNORMAL;
        }
        k::dpbf16_step(acc_avx, a, b, k::Bf16Isa::avx2);
        k::dpbf16_step(acc_emu, a, b, k::Bf16Isa::portable);
        for (int l = 0; l < 16; ++l) {
            bad += !same_bits(acc_avx[l], acc_emu[l]);
            flushed += acc_emu[l] == 0.0f;
            nan += std::isnan(acc_emu[l]);
            ++lanes;
        }
    }
    CHECK(lanes > 2000000);
    CHECK(denormal_acc > 10000);  // the data did reach the DAZ / FTZ corners and the NaN rules
    CHECK(flushed > 1000);
    CHECK(nan > 1000);
    CHECK(bad == 0);
}

TEST_CASE("dpbf16_step avx2: FTZ as the portable flush, not MXCSR.FTZ (a sum just below 2^-126 that rounds up to it)") {
    if (!runs_here(k::Bf16Isa::avx2)) {
        MESSAGE("this CPU has no AVX2 + FMA: only the portable path runs");
        return;
    }
    // acc = 2^-126; odd pair 1.5 * 2^-75 * -2^-76 = -1.5 * 2^-151. The exact sum 2^-126 - 0.75 * 2^-150
    // rounds to 2^-126 in the denormal format (kept: normal) but to 2^-126 - 2^-150 with an unbounded
    // exponent, which x86 calls tiny: MXCSR.FTZ would give +0. Lane 1: the same with the signs turned,
    // lane 2: a plain denormal result (2^-127), flushed to +0 by both.
    uint16_t a[32] = {}, b[32] = {};
    float    acc[16] = {}, emu[16];
    acc[0] = from_bits(0x00800000u), a[1] = 0x1A40, b[1] = 0x9980;  // 1.5 * 2^-75, -2^-76
    acc[1] = from_bits(0x80800000u), a[3] = 0x1A40, b[3] = 0x1980;
    acc[2] = from_bits(0x00800000u), a[5] = 0x8080, b[5] = 0x3F00;  // -2^-126 * 0.5
    std::memcpy(emu, acc, sizeof acc);
    k::dpbf16_step(emu, a, b, k::Bf16Isa::portable);
    k::dpbf16_step(acc, a, b, k::Bf16Isa::avx2);
    CHECK(to_bits(emu[0]) == 0x00800000u);
    CHECK(to_bits(emu[1]) == 0x80800000u);
    CHECK(to_bits(emu[2]) == 0x00000000u);
    for (int l = 0; l < 16; ++l) {
        CAPTURE(l);
        CHECK(to_bits(acc[l]) == to_bits(emu[l]));
    }
}

TEST_CASE("linear_bf16: the avx2 and portable paths give the same bits (1 to 300 rows, tails, denormal-heavy and NaN/inf data, 0-3 threads)") {
    if (!runs_here(k::Bf16Isa::avx2)) {
        MESSAGE("this CPU has no AVX2 + FMA: only the portable path runs");
        return;
    }
    std::mt19937  rng(112);
    k::ThreadPool pool2(2), pool3(3);
    int64_t       nan_outputs = 0;
    for (bool specials : {false, true}) {
    for (k::WType wt : {k::WType::f32, k::WType::bf16}) {
        for (auto [n_out, n_in] : {std::pair<int64_t, int64_t>{29, 7}, {9, 31}, {100, 33}, {48, 256}, {61, 1061}}) {
            std::vector<float> wf(size_t(n_out * n_in));
            for (auto & v : wf) { v = random_f32(rng, specials && rng() % 64 == 0); }
            std::vector<uint16_t> wb(wf.size());
            for (auto & v : wb) { v = random_bf16(rng, specials && rng() % 64 == 0); }
            const void * w    = wt == k::WType::bf16 ? static_cast<const void *>(wb.data()) : wf.data();
            const auto   bias = random_vec(rng, size_t(n_out));
            for (int64_t n_rows : {1, 2, 3, 4, 5, 9, 300}) {
                std::vector<float> x(size_t(n_rows * n_in));
                for (auto & v : x) { v = random_f32(rng, specials && rng() % 64 == 0); }
                std::vector<float> emu(size_t(n_rows * n_out));
                k::linear_bf16(emu.data(), x.data(), w, wt, bias.data(), n_rows, n_out, n_in, nullptr, k::Bf16Isa::portable);
                for (float v : emu) { nan_outputs += std::isnan(v); }
                for (k::ThreadPool * pl : {static_cast<k::ThreadPool *>(nullptr), &pool2, &pool3}) {
                    std::vector<float> avx(size_t(n_rows * n_out));
                    k::linear_bf16(avx.data(), x.data(), w, wt, bias.data(), n_rows, n_out, n_in, pl, k::Bf16Isa::avx2);
                    CAPTURE(specials); CAPTURE(int(wt)); CAPTURE(n_out); CAPTURE(n_in); CAPTURE(n_rows); CAPTURE(pl ? pl->n_threads() : 0);
                    CHECK(bits_equal(avx, emu));
                }
            }
        }
    }
    }
    CHECK(nan_outputs > 100);  // the NaN fallback ran
}

TEST_CASE("linear_bf16 avx2 many rows: tiles of 4 and 5 rows, 24-output groups, L2 weight blocks, bitwise the portable path") {
    if (!runs_here(k::Bf16Isa::avx2)) {
        MESSAGE("this CPU has no AVX2 + FMA: only the portable path runs");
        return;
    }
    // The many-row avx2 path cuts rows into 4 x 2 and 5 x 2 tiles (3, 6, 7, 11 rows end in a
    // partial tile of 4; 12, 13, 64 mix both), outputs into groups of 24 (49, 100: ragged last
    // group, odd last strip) and weight blocks of ~192 KiB of bf16 (n_in 2048: 48 outputs each,
    // so 100 outputs are 3 blocks; f32 weights are rounded a block at a time; 2080 adds a tail
    // step). Each row's outputs must be the portable bits whatever tiles, groups and blocks hold it.
    std::mt19937  rng(2028);
    k::ThreadPool pool3(3);
    for (k::WType wt : {k::WType::f32, k::WType::bf16}) {
        for (auto [n_out, n_in] : {std::pair<int64_t, int64_t>{100, 2048}, {49, 2080}}) {
            std::vector<float> wf(size_t(n_out * n_in));
            for (auto & v : wf) { v = random_f32(rng, rng() % 512 == 0); }
            std::vector<uint16_t> wb(wf.size());
            for (auto & v : wb) { v = random_bf16(rng, rng() % 512 == 0); }
            const void * w    = wt == k::WType::bf16 ? static_cast<const void *>(wb.data()) : wf.data();
            const auto   bias = random_vec(rng, size_t(n_out));
            for (int64_t n_rows : {3, 6, 7, 11, 12, 13, 64}) {
                std::vector<float> x(size_t(n_rows * n_in));
                for (auto & v : x) { v = random_f32(rng, rng() % 512 == 0); }
                std::vector<float> emu(size_t(n_rows * n_out));
                k::linear_bf16(emu.data(), x.data(), w, wt, bias.data(), n_rows, n_out, n_in, nullptr, k::Bf16Isa::portable);
                for (k::ThreadPool * pl : {static_cast<k::ThreadPool *>(nullptr), &pool3}) {
                    std::vector<float> avx(size_t(n_rows * n_out));
                    k::linear_bf16(avx.data(), x.data(), w, wt, bias.data(), n_rows, n_out, n_in, pl, k::Bf16Isa::avx2);
                    CAPTURE(int(wt)); CAPTURE(n_out); CAPTURE(n_in); CAPTURE(n_rows); CAPTURE(pl ? pl->n_threads() : 0);
                    CHECK(bits_equal(avx, emu));
                }
            }
        }
    }
}

TEST_CASE("linear_bf16 avx2: denormal weights and x read as zero, denormal partial sums flushed (hand-made, 1 to 12 rows)") {
    if (!runs_here(k::Bf16Isa::avx2)) {
        MESSAGE("this CPU has no AVX2 + FMA: only the portable path runs");
        return;
    }
    // Each row the same x; n_in 40 (a whole step and a tail) or 64 (two whole steps), 5 outputs,
    // all in lane 0 (step 0: k = 0 even, k = 1 odd; k = 32, 33: the tail step or the last whole
    // one): x1 * w1 = 0.5 * 2^-125 = 2^-126 (normal, kept). Output 1 adds x0 * w0 with w0 the bf16
    // denormal 2^-127 (read as zero); output 2 has no k = 1 term but a last product x32 * w32 =
    // 0.5 * 2^-126 = 2^-127, a denormal result (flushed to +0; a denormal inside the chain is read
    // as zero by the next FMA, so only the last one tests the final flush); output 4 has a 1.0 at
    // k = 33. Rows 1, 2, 3, 7, 12: the one- and two-row tiles and the many-row half passes (whose
    // last call for each half flushes its lanes: the tail step's with n_in 40, the whole steps'
    // with 64).
    for (int64_t n_in : {40, 64}) {
        for (int64_t n_rows : {1, 2, 3, 7, 12}) {
            const int64_t n_out = 5;
            std::vector<float>    x(size_t(n_rows * n_in), 0.0f);
            std::vector<uint16_t> w(size_t(n_out * n_in), 0);
            for (int64_t r = 0; r < n_rows; ++r) {
                float * xr = x.data() + r * n_in;
                xr[0] = 0.5f, xr[1] = 0.5f, xr[32] = 0.5f, xr[33] = 1.0f;
            }
            for (int64_t o = 0; o < n_out; ++o) { w[size_t(o * n_in + 1)] = 0x0100; }  // 2^-125
            w[size_t(1 * n_in + 0)]  = 0x0040;  // a bf16 denormal (2^-127)
            w[size_t(2 * n_in + 1)]  = 0;
            w[size_t(2 * n_in + 32)] = 0x0080;  // 2^-126
            w[size_t(4 * n_in + 33)] = 0x3F80;  // 1.0
            std::vector<float> out(size_t(n_rows * n_out)), emu(size_t(n_rows * n_out));
            k::linear_bf16(emu.data(), x.data(), w.data(), k::WType::bf16, nullptr, n_rows, n_out, n_in, nullptr, k::Bf16Isa::portable);
            k::linear_bf16(out.data(), x.data(), w.data(), k::WType::bf16, nullptr, n_rows, n_out, n_in, nullptr, k::Bf16Isa::avx2);
            CAPTURE(n_in); CAPTURE(n_rows);
            CHECK(bits_equal(out, emu));
            const float min_normal = from_bits(0x00800000u);
            for (int64_t r = 0; r < n_rows; ++r) {
                const float * e = emu.data() + r * n_out;
                CHECK(e[0] == min_normal);
                CHECK(e[1] == min_normal);  // not 2^-126 + 2^-128
                CHECK(to_bits(e[2]) == 0u);  // not 2^-127
                CHECK(e[3] == min_normal);
                CHECK(e[4] == 1.0f);  // 2^-126 + 1 in the lane
            }
        }
    }
}

}  // TEST_SUITE
