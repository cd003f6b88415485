// Mixture-of-experts kernels (fd/kernels/moe.h, Backend::moe_experts): routing against a
// double-precision softmax → top-k reference, the grouped plan, and the grouped expert GEMMs
// against an independent double-precision loop over each token's experts; bitwise batch
// invariance (a token's output alone equals its row in any batch, on 1 or 3 threads) and
// reading only the experts the batch routes to (the others' weights are null pointers).
#include "fd/kernels/backend.h"
#include "fd/kernels/moe.h"

#include "test_util.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

namespace k = fd::kernels;
using fd::test::bits_equal;
using fd::test::random_vec;

namespace {

/// Independent routing reference: double softmax, full sort (descending, lower id on ties).
void route_ref(std::vector<int32_t> & ids, std::vector<double> & w, const float * x, int64_t E, int k, bool renorm) {
    std::vector<double> p(static_cast<size_t>(E));
    double m = x[0], s = 0;
    for (int64_t e = 0; e < E; ++e) { m = std::max(m, double(x[e])); }
    for (int64_t e = 0; e < E; ++e) { s += p[e] = std::exp(double(x[e]) - m); }
    for (auto & v : p) { v /= s; }
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    ids.assign(order.begin(), order.begin() + k);
    w.clear();
    double sum = 0;
    for (int i = 0; i < k; ++i) { sum += p[ids[i]]; w.push_back(p[ids[i]]); }
    if (renorm) { for (auto & v : w) { v /= sum; } }
}

struct Experts {
    int64_t E, h, ff;
    std::vector<std::vector<float>> gate_up, down;  // [E] of [2ff, h] and [h, ff]
    Experts(std::mt19937 & rng, int64_t E_, int64_t h_, int64_t ff_) : E(E_), h(h_), ff(ff_) {
        for (int64_t e = 0; e < E; ++e) {
            gate_up.push_back(random_vec(rng, size_t(2 * ff * h), -0.3f, 0.3f));
            down.push_back(random_vec(rng, size_t(h * ff), -0.3f, 0.3f));
        }
    }
    std::vector<k::ExpertWeights> weights() const {
        std::vector<k::ExpertWeights> w(static_cast<size_t>(E));
        for (int64_t e = 0; e < E; ++e) { w[e] = {gate_up[e].data(), k::WType::f32, down[e].data(), k::WType::f32}; }
        return w;
    }
};

/// Double-precision expert output of one token: Σ_k w_k · down(silu(gate x) * up x).
std::vector<double> expert_ref(const Experts & X, const float * x, const int32_t * ids, const float * w, int k) {
    std::vector<double> out(static_cast<size_t>(X.h), 0.0);
    for (int j = 0; j < k; ++j) {
        const auto & gu = X.gate_up[ids[j]];
        const auto & dn = X.down[ids[j]];
        std::vector<double> act(static_cast<size_t>(X.ff));
        for (int64_t f = 0; f < X.ff; ++f) {
            double g = 0, u = 0;
            for (int64_t c = 0; c < X.h; ++c) {
                g += double(gu[f * X.h + c]) * x[c];
                u += double(gu[(X.ff + f) * X.h + c]) * x[c];
            }
            act[f] = g / (1 + std::exp(-g)) * u;
        }
        for (int64_t o = 0; o < X.h; ++o) {
            double y = 0;
            for (int64_t f = 0; f < X.ff; ++f) { y += double(dn[o * X.ff + f]) * act[f]; }
            out[o] += w[j] * y;
        }
    }
    return out;
}

/// moe_route + moe_plan + moe_experts on `be` for n tokens of x.
std::vector<float> run_moe(k::Backend & be, const Experts & X, const std::vector<k::ExpertWeights> & w, const float * x,
                           const int32_t * ids, const float * wts, int64_t n, int k_) {
    const k::MoePlan plan = k::moe_plan(ids, wts, n, k_, X.E);
    std::vector<float> out(size_t(n * X.h), std::nanf(""));
    std::vector<float> work(size_t(k::Backend::moe_work_floats(plan.max_rows, X.h, X.ff)));
    be.moe_experts(out.data(), x, plan, w.data(), n, X.h, X.ff, work.data());
    return out;
}

}  // namespace

TEST_SUITE("kernels::moe") {

TEST_CASE("moe_route: softmax → top-k (descending, lower id on ties) → renormalise, against a double reference") {
    std::mt19937 rng(7);
    const int64_t n = 9, E = 16;
    for (int k : {1, 4, 16}) {
        for (bool renorm : {false, true}) {
            std::vector<float> logits = random_vec(rng, size_t(n * E), -3.0f, 3.0f);
            std::vector<int32_t> ids(static_cast<size_t>(n * k));
            std::vector<float> w(static_cast<size_t>(n * k));
            k::moe_route(ids.data(), w.data(), logits.data(), n, E, k, renorm);
            for (int64_t t = 0; t < n; ++t) {
                std::vector<int32_t> rid;
                std::vector<double> rw;
                route_ref(rid, rw, logits.data() + t * E, E, k, renorm);
                CAPTURE(t);
                CAPTURE(k);
                for (int j = 0; j < k; ++j) {
                    CHECK(ids[t * k + j] == rid[j]);
                    CHECK(w[t * k + j] == doctest::Approx(rw[j]).epsilon(1e-6));
                }
            }
        }
    }
    // ties: equal logits go to the lower id first
    std::vector<float> tie = {0.5f, 2.0f, 2.0f, 0.1f, 2.0f};
    std::vector<int32_t> ids(2);
    std::vector<float> w(2);
    k::moe_route(ids.data(), w.data(), tie.data(), 1, 5, 2, true);
    CHECK(ids == std::vector<int32_t>{1, 2});
    CHECK(w[0] == 0.5f);
    CHECK(w[1] == 0.5f);
}

TEST_CASE("moe_plan groups (token, slot) pairs by expert, experts and tokens ascending, unused experts absent") {
    const std::vector<int32_t> ids = {3, 0, 0, 5, 3, 5};  // 3 tokens, top-2
    const std::vector<float> w = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f};
    const k::MoePlan p = k::moe_plan(ids.data(), w.data(), 3, 2, 8);
    CHECK(p.experts == std::vector<int32_t>{0, 3, 5});
    CHECK(p.begin == std::vector<int64_t>{0, 2, 4, 6});
    CHECK(p.rows == std::vector<int32_t>{0, 1, 0, 2, 1, 2});
    CHECK(p.weights == std::vector<float>{0.2f, 0.3f, 0.1f, 0.5f, 0.4f, 0.6f});
    CHECK(p.max_rows == 2);
}

TEST_CASE("moe_experts equals a double-precision loop over each token's experts (f32 and bf16 weights)") {
    std::mt19937 rng(11);
    const int64_t E = 8, h = 48, ff = 40, n = 13;
    const int k_ = 3;
    Experts X(rng, E, h, ff);
    auto be = k::make_cpu_backend(2);
    const std::vector<float> x = random_vec(rng, size_t(n * h));
    const std::vector<float> logits = random_vec(rng, size_t(n * E), -2.0f, 2.0f);
    std::vector<int32_t> ids(static_cast<size_t>(n * k_));
    std::vector<float> wts(static_cast<size_t>(n * k_));
    k::moe_route(ids.data(), wts.data(), logits.data(), n, E, k_, true);
    const std::vector<float> got = run_moe(*be, X, X.weights(), x.data(), ids.data(), wts.data(), n, k_);
    for (int64_t t = 0; t < n; ++t) {
        const std::vector<double> want = expert_ref(X, x.data() + t * h, ids.data() + t * k_, wts.data() + t * k_, k_);
        for (int64_t o = 0; o < h; ++o) { CHECK(got[t * h + o] == doctest::Approx(want[o]).epsilon(1e-4).scale(1.0)); }
    }
    // bf16 weights: the reference reads the bf16-rounded values
    Experts B = X;
    std::vector<std::vector<uint16_t>> gu16, dn16;
    for (int64_t e = 0; e < E; ++e) {
        for (auto * v : {&B.gate_up[e], &B.down[e]}) {
            for (float & f : *v) {
                uint32_t u;
                std::memcpy(&u, &f, 4);
                u &= 0xFFFF0000u;
                std::memcpy(&f, &u, 4);
            }
        }
        auto bits = [](const std::vector<float> & v) {
            std::vector<uint16_t> o(v.size());
            for (size_t i = 0; i < v.size(); ++i) {
                uint32_t u;
                std::memcpy(&u, &v[i], 4);
                o[i] = uint16_t(u >> 16);
            }
            return o;
        };
        gu16.push_back(bits(B.gate_up[e]));
        dn16.push_back(bits(B.down[e]));
    }
    std::vector<k::ExpertWeights> w16(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) { w16[e] = {gu16[e].data(), k::WType::bf16, dn16[e].data(), k::WType::bf16}; }
    const std::vector<float> got16 = run_moe(*be, B, w16, x.data(), ids.data(), wts.data(), n, k_);
    for (int64_t t = 0; t < n; ++t) {
        const std::vector<double> want = expert_ref(B, x.data() + t * h, ids.data() + t * k_, wts.data() + t * k_, k_);
        for (int64_t o = 0; o < h; ++o) { CHECK(got16[t * h + o] == doctest::Approx(want[o]).epsilon(1e-4).scale(1.0)); }
    }
}

TEST_CASE("moe_experts is batch invariant bitwise: a token alone equals its row in any batch, 1 or 3 threads") {
    std::mt19937 rng(5);
    const int64_t E = 6, h = 64, ff = 72, n = 17;
    const int k_ = 2;
    Experts X(rng, E, h, ff);
    const std::vector<float> x = random_vec(rng, size_t(n * h));
    const std::vector<float> logits = random_vec(rng, size_t(n * E), -2.0f, 2.0f);
    std::vector<int32_t> ids(static_cast<size_t>(n * k_));
    std::vector<float> wts(static_cast<size_t>(n * k_));
    k::moe_route(ids.data(), wts.data(), logits.data(), n, E, k_, false);
    auto be1 = k::make_cpu_backend(1);
    auto be3 = k::make_cpu_backend(3);
    const std::vector<float> batch1 = run_moe(*be1, X, X.weights(), x.data(), ids.data(), wts.data(), n, k_);
    const std::vector<float> batch3 = run_moe(*be3, X, X.weights(), x.data(), ids.data(), wts.data(), n, k_);
    CHECK(bits_equal(batch1, batch3));
    for (int64_t t = 0; t < n; ++t) {
        CAPTURE(t);
        const std::vector<float> alone = run_moe(*be1, X, X.weights(), x.data() + t * h, ids.data() + t * k_, wts.data() + t * k_, 1, k_);
        CHECK(bits_equal(alone.data(), batch1.data() + t * h, size_t(h)));
        // and the route alone equals the route in the batch
        std::vector<int32_t> id1(static_cast<size_t>(k_));
        std::vector<float> w1(static_cast<size_t>(k_));
        k::moe_route(id1.data(), w1.data(), logits.data() + t * E, 1, E, k_, false);
        CHECK(std::equal(id1.begin(), id1.end(), ids.begin() + t * k_));
        CHECK(bits_equal(w1.data(), wts.data() + t * k_, size_t(k_)));
    }
    // a batch of the first 5 tokens reversed: each row still equals its own
    std::vector<float> xr;
    std::vector<int32_t> idr;
    std::vector<float> wr;
    for (int64_t t = 4; t >= 0; --t) {
        xr.insert(xr.end(), x.begin() + t * h, x.begin() + (t + 1) * h);
        idr.insert(idr.end(), ids.begin() + t * k_, ids.begin() + (t + 1) * k_);
        wr.insert(wr.end(), wts.begin() + t * k_, wts.begin() + (t + 1) * k_);
    }
    const std::vector<float> rev = run_moe(*be3, X, X.weights(), xr.data(), idr.data(), wr.data(), 5, k_);
    for (int64_t i = 0; i < 5; ++i) { CHECK(bits_equal(rev.data() + i * h, batch1.data() + (4 - i) * h, size_t(h))); }
}

TEST_CASE("moe_experts reads only the experts the batch routes to") {
    std::mt19937 rng(3);
    const int64_t E = 32, h = 16, ff = 8, n = 4;
    const int k_ = 2;
    Experts X(rng, E, h, ff);
    const std::vector<int32_t> ids = {7, 30, 30, 2, 7, 2, 19, 7};
    const std::vector<float> wts = {0.6f, 0.4f, 0.5f, 0.5f, 0.9f, 0.1f, 0.3f, 0.7f};
    std::vector<k::ExpertWeights> w = X.weights();
    for (int64_t e = 0; e < E; ++e) {
        if (e != 2 && e != 7 && e != 19 && e != 30) { w[e] = {nullptr, k::WType::f32, nullptr, k::WType::f32}; }  // never read
    }
    const std::vector<float> x = random_vec(rng, size_t(n * h));
    auto be = k::make_cpu_backend(1);
    const std::vector<float> got = run_moe(*be, X, w, x.data(), ids.data(), wts.data(), n, k_);
    for (int64_t t = 0; t < n; ++t) {
        const std::vector<double> want = expert_ref(X, x.data() + t * h, ids.data() + t * k_, wts.data() + t * k_, k_);
        for (int64_t o = 0; o < h; ++o) { CHECK(got[t * h + o] == doctest::Approx(want[o]).epsilon(1e-4).scale(1.0)); }
    }
}

}  // TEST_SUITE
