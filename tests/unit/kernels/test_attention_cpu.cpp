// CPU paged-KV ops (kernels/cpu/*.cpp) against deliberately naive loops: kv_store's slots, and
// attention_paged against naive contiguous causal GQA attention, with ops.h's batch-invariance
// guarantee (a query's output bitwise the same in any batch, at any thread count, prefill or
// decode). The other CPU ops are in test_ops_cpu.cpp.
#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/thread_pool.h"

#include "test_util.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
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
    // Groups 1 (head_dim 64: the decode path's 8 key vectors at once; 4 and 12 kv heads: its
    // block-major scores, 8 heads then 4), 2, 3, 4 and 8 (4 and 2, 1 key vectors per pair group),
    // so every score and P·V variant of the decode path is compared.
    for (const Shape sh : {Shape{4, 2, 64, 4100}, Shape{2, 1, 128, 1100}, Shape{4, 4, 24, 700}, Shape{6, 2, 16, 300},
                           Shape{4, 4, 64, 600}, Shape{8, 2, 64, 300}, Shape{8, 1, 32, 500}, Shape{12, 12, 64, 300}}) {
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

}  // TEST_SUITE
