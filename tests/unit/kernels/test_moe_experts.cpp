// The CPU backend's expert tiles (kernels/cpu/moe_experts.cpp, CpuBackend::moe_experts): for
// every group size they run (1..16 rows: register tiles of 1..6 rows, one to three per group; 17+:
// kernels::linear), f32 and bf16 weights, k a multiple of the step or with a tail, 1 or 3
// threads:
//  - the output against an independent double-precision loop over each token's experts;
//  - bitwise the per-expert loop the base Backend::moe_experts runs (gather, kernels::linear,
//    silu_mul, kernels::linear, scale_add_rows), the accumulation EP's combine reproduces;
//  - bitwise batch invariance across the new tiling: one token's output is the same whichever
//    group size it meets and whichever row of the group (which tile, which tile row) it lands on.
#include "fd/kernels/backend.h"
#include "fd/kernels/moe.h"

#include "test_util.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace k = fd::kernels;
using fd::test::bits_equal;
using fd::test::random_vec;

namespace {

uint16_t bf16_of(float v) {  // round to nearest even (the checkpoint's rounding)
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
float f32_of(uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}

/// E experts' weights, each expert's gate_up and down in its own dtype (f32, or bf16 stored
/// as bf16 with the f32 values they round to kept for the reference).
struct Weights {
    int64_t h, ff;
    std::vector<std::vector<float>>    gu, dn;      // exact values [E] of [2ff, h] / [h, ff]
    std::vector<std::vector<uint16_t>> gu16, dn16;  // bf16 storage where used
    std::vector<k::ExpertWeights>      w;
    Weights(std::mt19937 & rng, int64_t E, int64_t h_, int64_t ff_, const std::vector<k::WType> & types) : h(h_), ff(ff_) {
        gu16.resize(size_t(E)), dn16.resize(size_t(E));
        for (int64_t e = 0; e < E; ++e) {
            gu.push_back(random_vec(rng, size_t(2 * ff * h), -0.3f, 0.3f));
            dn.push_back(random_vec(rng, size_t(h * ff), -0.3f, 0.3f));
        }
        for (int64_t e = 0; e < E; ++e) {
            const k::WType tg = types[size_t(e) % types.size()], td = types[size_t(e + 1) % types.size()];
            auto store = [](std::vector<float> & v, std::vector<uint16_t> & b, k::WType t) -> const void * {
                if (t == k::WType::f32) { return v.data(); }
                for (float & f : v) { b.push_back(bf16_of(f)), f = f32_of(b.back()); }
                return b.data();
            };
            const void * g = store(gu[e], gu16[e], tg);
            const void * d = store(dn[e], dn16[e], td);
            w.push_back({g, tg, d, td});
        }
    }
};

/// A plan whose used expert i (id ids[i], ascending) takes rows rows_of[i] with weights.
k::MoePlan make_plan(const std::vector<int32_t> & ids, const std::vector<std::vector<int32_t>> & rows_of, std::mt19937 & rng) {
    k::MoePlan p;
    std::uniform_real_distribution<float> u(0.05f, 1.0f);
    p.begin.push_back(0);
    for (size_t i = 0; i < ids.size(); ++i) {
        p.experts.push_back(ids[i]);
        for (int32_t r : rows_of[i]) { p.rows.push_back(r), p.weights.push_back(u(rng)); }
        p.begin.push_back(static_cast<int64_t>(p.rows.size()));
        p.max_rows = std::max<int64_t>(p.max_rows, static_cast<int64_t>(rows_of[i].size()));
    }
    return p;
}

std::vector<float> run(k::Backend & be, const Weights & W, const std::vector<float> & x, int64_t n, const k::MoePlan & p,
                       bool base) {
    std::vector<float> out(size_t(n * W.h), -7.0f), work(size_t(k::Backend::moe_work_floats(p.max_rows, W.h, W.ff)));
    if (base) {
        be.k::Backend::moe_experts(out.data(), x.data(), p, W.w.data(), n, W.h, W.ff, work.data());  // the per-expert loop
    } else {
        be.moe_experts(out.data(), x.data(), p, W.w.data(), n, W.h, W.ff, work.data());
    }
    return out;
}

/// Double reference: out[t] = Σ over the plan's pairs of t, in plan order, w · down(silu(gate x) * up x).
std::vector<double> reference(const Weights & W, const std::vector<float> & x, int64_t n, const k::MoePlan & p) {
    const int64_t h = W.h, ff = W.ff;
    std::vector<double> out(size_t(n * h), 0.0), act(static_cast<size_t>(ff));
    for (size_t i = 0; i < p.experts.size(); ++i) {
        const std::vector<float> &gu = W.gu[size_t(p.experts[i])], &dn = W.dn[size_t(p.experts[i])];
        for (int64_t q = p.begin[i]; q < p.begin[i + 1]; ++q) {
            const float * xr = x.data() + p.rows[size_t(q)] * h;
            for (int64_t f = 0; f < ff; ++f) {
                double g = 0, u = 0;
                for (int64_t c = 0; c < h; ++c) { g += double(gu[f * h + c]) * xr[c], u += double(gu[(ff + f) * h + c]) * xr[c]; }
                act[size_t(f)] = g / (1.0 + std::exp(-g)) * u;
            }
            for (int64_t o = 0; o < h; ++o) {
                double y = 0;
                for (int64_t f = 0; f < ff; ++f) { y += double(dn[o * ff + f]) * act[size_t(f)]; }
                out[size_t(p.rows[size_t(q)] * h + o)] += double(p.weights[size_t(q)]) * y;
            }
        }
    }
    return out;
}

struct Shape { int64_t h, ff; const char * what; };

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("cpu moe_experts tiles: every group size 1..20 against a double loop, bitwise the per-expert linear loop") {
    // h 64 / ff 48: whole bf16 steps for gate_up, a half step of tail for down; h 40 / ff 24: tails
    // in both (f32: 8 of 16, bf16: 8 of 32 and 24 of 32).
    for (const Shape s : {Shape{64, 48, "h 64, ff 48"}, Shape{40, 24, "h 40, ff 24"}}) {
        for (const auto & types : std::vector<std::vector<k::WType>>{{k::WType::f32}, {k::WType::bf16}, {k::WType::bf16, k::WType::f32}}) {
            CAPTURE(s.what);
            CAPTURE(types.size() == 2 ? "mixed" : types[0] == k::WType::f32 ? "f32" : "bf16");
            std::mt19937 rng(11);
            const int64_t E = 21, n = 24;
            const Weights W(rng, E, s.h, s.ff, types);
            const std::vector<float> x = random_vec(rng, size_t(n * s.h));
            // used experts 1, 2, ..., 20 (0 unused): expert e takes e rows, a rotating pick of tokens
            std::vector<int32_t> ids;
            std::vector<std::vector<int32_t>> rows_of;
            for (int32_t e = 1; e <= 20; ++e) {
                ids.push_back(e);
                rows_of.emplace_back();
                for (int32_t r = 0; r < e; ++r) { rows_of.back().push_back((e * 7 + r * 5) % int32_t(n)); }  // distinct: 5 ⊥ 24
                std::sort(rows_of.back().begin(), rows_of.back().end());
            }
            const k::MoePlan p = make_plan(ids, rows_of, rng);
            for (int64_t i = 0; i < 20; ++i) { REQUIRE(p.begin[i + 1] - p.begin[i] == i + 1); }
            const std::vector<double> want = reference(W, x, n, p);
            for (int threads : {1, 3}) {
                CAPTURE(threads);
                auto be = k::make_cpu_backend(threads);
                const std::vector<float> got = run(*be, W, x, n, p, false), loop = run(*be, W, x, n, p, true);
                CHECK(bits_equal(got, loop));
                int bad = 0;
                for (size_t j = 0; j < got.size(); ++j) { bad += std::abs(got[j] - want[j]) > 1e-4 + 1e-4 * std::abs(want[j]); }
                CHECK(bad == 0);
            }
        }
    }
}

TEST_CASE("cpu moe_experts tiles are batch invariant: a token's output is the same at any row of any group size") {
    for (const Shape s : {Shape{64, 48, "h 64, ff 48"}, Shape{40, 24, "h 40, ff 24"}}) {
        for (k::WType t : {k::WType::f32, k::WType::bf16}) {
            CAPTURE(s.what);
            CAPTURE(t == k::WType::f32 ? "f32" : "bf16");
            std::mt19937 rng(12);
            const int64_t n = 20;
            const Weights W(rng, 3, s.h, s.ff, {t});
            const std::vector<float> x = random_vec(rng, size_t(n * s.h));
            auto be = k::make_cpu_backend(1);
            // token 0 alone through expert 1, weight 1: the reference row
            k::MoePlan alone = make_plan({1}, {{0}}, rng);
            alone.weights[0] = 1.0f;
            const std::vector<float> ref = run(*be, W, x, n, alone, false);
            // groups of m = 2..20 rows of expert 1 where token 0 sits at row `at` (the others any
            // tokens): every tile size and row of a tile, the first and the second tile
            for (int64_t m = 2; m <= n; ++m) {
                for (int64_t at = 0; at < m; ++at) {
                    std::vector<int32_t> rows;
                    for (int64_t r = 0; r < m; ++r) { rows.push_back(r == at ? 0 : int32_t(1 + (r + m) % (n - 1))); }
                    k::MoePlan p = make_plan({1}, {rows}, rng);
                    std::vector<float> ws(size_t(m), 0.0f);
                    ws[size_t(at)] = 1.0f;  // only token 0's own pair lands in its row with weight 1
                    p.weights = ws;
                    const std::vector<float> got = run(*be, W, x, n, p, false);
                    CAPTURE(m);
                    CAPTURE(at);
                    CHECK(bits_equal(got.data(), ref.data(), size_t(s.h)));
                }
            }
        }
    }
}

}  // TEST_SUITE
