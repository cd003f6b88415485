// attention_paged on its two instruction sets (fd::kernels::AttnIsa). Decode: the AVX2 + FMA
// path (kernels/cpu/attention_decode_avx2.cpp) must give bitwise the generic path's output
// (attention_decode.cpp; the reduction order is fixed, only the instructions and the memory walk
// differ), over f32 and bf16 pools, head_dim 16..128, block sizes 16/32/64, contexts that are not
// multiples of 16, GQA groups 1..8 and kv-head ranges split over threads. Prefill: the AVX2 tiles
// (kernels/cpu/attention_prefill_avx2.cpp) bitwise the generic tiles (attention.cpp), prompts of
// 1..300 tokens and continuations, head_dim 20..128, block sizes 12..32, GQA groups 1..4, 1-3
// threads, and each prefill alone bitwise its rows of the batch. Both paths must agree with
// attention computed in double precision from the K/V values (an independent reference).
#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/thread_pool.h"

#include "test_util.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace k = fd::kernels;

namespace {

using fd::test::bits_equal;
using fd::test::random_vec;

float widen(uint16_t h) {
    const uint32_t u = uint32_t(h) << 16;
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}

/// A paged pool of `n_seq` sequences at shuffled blocks (unwritten slots NaN, so reading one
/// poisons the output), f32 or bf16, and the K/V values it holds (bf16: rounded) per sequence:
/// kvals[s][(t * n_kv + g) * hd + d].
struct Pool {
    int bs, n_kv, hd;
    k::WType dtype;
    std::vector<float> k32, v32;
    std::vector<uint16_t> k16, v16;
    std::vector<std::vector<int32_t>> tables;
    std::vector<std::vector<float>> kvals, vvals;
    k::PagedKv kv{};

    Pool(std::mt19937 & rng, k::WType dt, int block, int n_kv_heads, int head_dim, const std::vector<int> & lens)
        : bs(block), n_kv(n_kv_heads), hd(head_dim), dtype(dt) {
        const int row = n_kv * hd;
        int n_blocks = 0;
        for (const int n : lens) { n_blocks += (n + bs - 1) / bs; }
        std::vector<int32_t> ids(static_cast<size_t>(n_blocks));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng);
        const size_t elems = size_t(n_blocks) * bs * row;
        if (dt == k::WType::bf16) {
            k16.assign(elems, 0x7FC0);
            v16.assign(elems, 0x7FC0);
            kv = {k16.data(), v16.data(), bs, n_kv, hd, dt};
        } else {
            k32.assign(elems, std::numeric_limits<float>::quiet_NaN());
            v32.assign(elems, std::numeric_limits<float>::quiet_NaN());
            kv = {k32.data(), v32.data(), bs, n_kv, hd, dt};
        }
        size_t next = 0;
        for (const int n : lens) {
            std::vector<int32_t> table;
            for (int b = 0; b < (n + bs - 1) / bs; ++b) { table.push_back(ids[next++]); }
            auto kr = random_vec(rng, size_t(n) * row, -1.0f, 1.0f), vr = random_vec(rng, size_t(n) * row);
            std::vector<int64_t> slots(static_cast<size_t>(n));
            for (int t = 0; t < n; ++t) { slots[t] = int64_t(table[t / bs]) * bs + t % bs; }
            k::kv_store(kv, kr.data(), vr.data(), slots.data(), n);
            if (dt == k::WType::bf16) {
                for (auto & x : kr) { x = widen(k::f32_to_bf16_rne(x)); }
                for (auto & x : vr) { x = widen(k::f32_to_bf16_rne(x)); }
            }
            tables.push_back(std::move(table));
            kvals.push_back(std::move(kr));
            vvals.push_back(std::move(vr));
        }
    }
};

/// Largest |out - attention in double| over the batch (queries[i] reads sequence seq[i]).
double max_err_vs_double(const Pool & p, const std::vector<int> & seq, const std::vector<k::AttnQuery> & queries,
                         const std::vector<float> & q, const std::vector<float> & out, int n_heads, float scale) {
    const int group = n_heads / p.n_kv, per = n_heads * p.hd;
    double worst = 0;
    for (size_t i = 0; i < queries.size(); ++i) {
        const int n = queries[i].n_ctx;
        const auto & K = p.kvals[size_t(seq[i])];
        const auto & V = p.vvals[size_t(seq[i])];
        for (int h = 0; h < n_heads; ++h) {
            const int g = h / group;
            std::vector<double> s(static_cast<size_t>(n));
            double mx = -1e300;
            for (int t = 0; t < n; ++t) {
                double acc = 0;
                for (int d = 0; d < p.hd; ++d) { acc += double(q[i * per + h * p.hd + d]) * K[(size_t(t) * p.n_kv + g) * p.hd + d]; }
                s[t] = acc * scale;
                mx = std::max(mx, s[t]);
            }
            double sum = 0;
            for (auto & x : s) { sum += (x = std::exp(x - mx)); }
            for (int d = 0; d < p.hd; ++d) {
                double o = 0;
                for (int t = 0; t < n; ++t) { o += s[t] / sum * V[(size_t(t) * p.n_kv + g) * p.hd + d]; }
                if (n == 0) { o = 0; }
                worst = std::max(worst, std::abs(o - double(out[i * per + h * p.hd + d])));
            }
        }
    }
    return worst;
}

}  // namespace

TEST_SUITE("kernels::attention_isa") {

TEST_CASE("attn_isa_name names both paths; asking for avx2 where it is not built is an invalid_argument") {
    CHECK(std::string(k::attn_isa_name(k::AttnIsa::generic)) == "generic");
    CHECK(std::string(k::attn_isa_name(k::AttnIsa::avx2)) == "avx2");
    if (!k::attn_has_avx2()) {
        CHECK(k::attn_best_isa() == k::AttnIsa::generic);
        float out[16], q[16] = {};
        const int32_t table[1] = {0};
        const k::AttnQuery qry{table, 1};
        float kv[16 * 16] = {};
        const k::PagedKv p{kv, kv, 16, 1, 16, k::WType::f32};
        CHECK(fd::test::error_of([&] { k::attention_paged(out, q, &qry, 1, 1, p, 1.0f, nullptr, k::AttnIsa::avx2); }) ==
              fd::Errc::invalid_argument);
    }
}

TEST_CASE("attention_paged decode: the avx2 path is bitwise the generic path (f32 and bf16 KV, head_dim, blocks, GQA, threads)") {
    if (!k::attn_has_avx2()) {
        MESSAGE("this build has no AVX2 path (not compiled for an AVX2 + FMA CPU): nothing to compare");
        return;
    }
    struct Shape { int n_heads, n_kv, head_dim, block; };
    const Shape shapes[] = {
        {12, 12, 64, 16},  // llama-110m: group 1 (4 key vectors per call)
        {8, 2, 128, 16},   // group 4 (4 queries per key vector), two 64-dimension P·V pieces
        {8, 4, 64, 32},    // group 2, two key vectors per block
        {6, 2, 48, 16},    // group 3 (odd: one query per call), P·V 32 + 16 dimensions
        {8, 1, 16, 64},    // group 8 (two passes of 4), head_dim 16, four key vectors per block
        {4, 4, 32, 16},    // P·V 32 dimensions
        {6, 6, 64, 32},    // group 1, two key vectors per block: a call takes one head's from 2 blocks
    };
    // Contexts: 1, short, not multiples of 16, a block boundary, and ones long enough for the V
    // walk's prefetch (2 blocks ahead) to run past the context's end. With 4 key vectors per call
    // taken from 4 / (block / 16) blocks of one kv head, block counts that are not multiples of
    // that (2, 3, 7, 16 + 1, ...) give calls of 2 vectors of one head and calls mixing two heads.
    const std::vector<int> lens = {1, 5, 16, 17, 40, 100, 257, 700, 0};
    int compared = 0;
    for (const Shape sh : shapes) {
        for (const k::WType dt : {k::WType::f32, k::WType::bf16}) {
            CAPTURE(sh.n_heads);
            CAPTURE(sh.n_kv);
            CAPTURE(sh.head_dim);
            CAPTURE(sh.block);
            CAPTURE(dt == k::WType::bf16);
            std::mt19937 rng(uint32_t(sh.head_dim * 131 + sh.block * 7 + sh.n_kv + (dt == k::WType::bf16)));
            std::vector<int> seq_lens(lens);
            seq_lens.back() = 1;  // the n_ctx 0 query reads sequence 0 below; every pool sequence has tokens
            const Pool p(rng, dt, sh.block, sh.n_kv, sh.head_dim, seq_lens);
            const int per = sh.n_heads * sh.head_dim;
            const float scale = 1.0f / std::sqrt(float(sh.head_dim));
            // A decode batch: one query per sequence at its full length, plus shorter prefixes of
            // the long ones and an empty one (n_ctx 0: zeros).
            std::vector<k::AttnQuery> queries;
            std::vector<int> seq;
            for (size_t s = 0; s + 1 < lens.size(); ++s) {
                queries.push_back({p.tables[s].data(), lens[s]});
                seq.push_back(int(s));
            }
            for (const int n : {33, 255, 699}) {
                queries.push_back({p.tables[7].data(), n});
                seq.push_back(7);
            }
            queries.push_back({p.tables[0].data(), 0});
            seq.push_back(0);
            const auto q = random_vec(rng, queries.size() * per, -1.0f, 1.0f);
            for (const int threads : {0, 1, 2, 3}) {
                CAPTURE(threads);
                k::ThreadPool pool(std::max(1, threads));
                k::ThreadPool * tp = threads == 0 ? nullptr : &pool;
                std::vector<float> og(q.size(), 999.0f), oa(q.size(), -999.0f);
                const auto n = int64_t(queries.size());
                k::attention_paged(og.data(), q.data(), queries.data(), n, sh.n_heads, p.kv, scale, tp, k::AttnIsa::generic);
                k::attention_paged(oa.data(), q.data(), queries.data(), n, sh.n_heads, p.kv, scale, tp, k::AttnIsa::avx2);
                CHECK(bits_equal(og, oa));
                ++compared;
                if (threads == 0) {
                    CHECK(max_err_vs_double(p, seq, queries, q, oa, sh.n_heads, scale) < 2e-5);
                    CHECK(std::all_of(oa.end() - per, oa.end(), [](float x) { return x == 0.0f; }));  // n_ctx 0
                }
                // One query alone (a decode step of batch 1: the kv heads split over the threads).
                std::vector<float> a1(static_cast<size_t>(per)), g1(static_cast<size_t>(per));
                k::attention_paged(a1.data(), q.data() + 6 * per, &queries[6], 1, sh.n_heads, p.kv, scale, tp, k::AttnIsa::avx2);
                k::attention_paged(g1.data(), q.data() + 6 * per, &queries[6], 1, sh.n_heads, p.kv, scale, tp, k::AttnIsa::generic);
                CHECK(bits_equal(a1, g1));
                CHECK(bits_equal(a1.data(), oa.data() + 6 * per, size_t(per)));
            }
        }
    }
    CHECK(compared == 7 * 2 * 4);
}

TEST_CASE("attention_paged prefill: the avx2 tiles are bitwise the generic tiles (f32 and bf16 KV, head_dim, blocks, GQA, threads)") {
    if (!k::attn_has_avx2()) {
        MESSAGE("this build has no AVX2 path (not compiled for an AVX2 + FMA CPU): nothing to compare");
        return;
    }
    struct Shape { int n_heads, n_kv, head_dim, block; };
    const Shape shapes[] = {
        {8, 8, 64, 16},    // group 1 (the bench model's shape); pairs of a kv head: 1 per query
        {8, 2, 128, 16},   // group 4, head_dim 128
        {6, 2, 40, 12},    // group 3, head_dim 40 (P·V 16 + 16 + 8 dimensions), keys gathered (block 12)
        {4, 1, 20, 20},    // group 4, head_dim 20 (16 + 4 scalar dimensions), block 20
        {6, 3, 64, 32},    // group 2, block 32 (a 32-key chunk in one block)
    };
    // Sequences; the batch prefills the last `pre` tokens of each (n_ctx = len - pre + 1 .. len):
    // a whole 300-token prompt (tiles of 64, 64, ..., 44 queries), a continuation after a
    // prefix, a decode query, prompts of 5 (V packed: > 4 queries) and 3 (V read in place),
    // and one of 130 (tiles of 64, 64, 2).
    const std::vector<int> lens = {300, 77, 1, 33, 9, 130};
    const std::vector<int> pre  = {300, 37, 1, 5, 3, 130};
    int compared = 0;
    for (const Shape sh : shapes) {
        for (const k::WType dt : {k::WType::f32, k::WType::bf16}) {
            CAPTURE(sh.n_heads);
            CAPTURE(sh.n_kv);
            CAPTURE(sh.head_dim);
            CAPTURE(sh.block);
            CAPTURE(dt == k::WType::bf16);
            std::mt19937 rng(uint32_t(sh.head_dim * 977 + sh.block * 13 + sh.n_kv + (dt == k::WType::bf16)));
            const Pool p(rng, dt, sh.block, sh.n_kv, sh.head_dim, lens);
            const int per = sh.n_heads * sh.head_dim;
            const float scale = 1.0f / std::sqrt(float(sh.head_dim));
            std::vector<k::AttnQuery> queries;
            std::vector<int> seq;
            std::vector<size_t> first;  // each sequence's first query in the batch
            for (size_t s = 0; s < lens.size(); ++s) {
                first.push_back(queries.size());
                for (int n = lens[s] - pre[s] + 1; n <= lens[s]; ++n) {
                    queries.push_back({p.tables[s].data(), n});
                    seq.push_back(int(s));
                }
            }
            const auto n = int64_t(queries.size());
            const auto q = random_vec(rng, queries.size() * per, -2.0f, 2.0f);
            std::vector<float> og(q.size(), 999.0f);
            k::attention_paged(og.data(), q.data(), queries.data(), n, sh.n_heads, p.kv, scale, nullptr, k::AttnIsa::generic);
            CHECK(max_err_vs_double(p, seq, queries, q, og, sh.n_heads, scale) < 2e-5);
            for (const int threads : {0, 1, 2, 3}) {
                CAPTURE(threads);
                k::ThreadPool pool(std::max(1, threads));
                k::ThreadPool * tp = threads == 0 ? nullptr : &pool;
                std::vector<float> oa(q.size(), -999.0f);
                k::attention_paged(oa.data(), q.data(), queries.data(), n, sh.n_heads, p.kv, scale, tp, k::AttnIsa::avx2);
                CHECK(bits_equal(og, oa));
                ++compared;
            }
            // Each prefill alone (its own tiles) and the 300-token prompt's last query as a decode
            // step: still the rows of the batch.
            for (size_t s = 0; s < lens.size(); ++s) {
                CAPTURE(s);
                const size_t off = first[s] * size_t(per), cnt = size_t(pre[s]) * per;
                std::vector<float> alone(cnt);
                k::attention_paged(alone.data(), q.data() + off, &queries[first[s]], pre[s], sh.n_heads, p.kv, scale,
                                   nullptr, k::AttnIsa::avx2);
                CHECK(bits_equal(alone.data(), og.data() + off, cnt));
            }
            std::vector<float> last(static_cast<size_t>(per));
            k::attention_paged(last.data(), q.data() + 299 * per, &queries[299], 1, sh.n_heads, p.kv, scale, nullptr,
                               k::AttnIsa::avx2);
            CHECK(bits_equal(last.data(), og.data() + 299 * per, size_t(per)));
        }
    }
    CHECK(compared == 5 * 2 * 4);
}

}  // TEST_SUITE
