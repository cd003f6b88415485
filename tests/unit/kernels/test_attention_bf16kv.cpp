// The bf16 KV cache (--kv-cache-dtype bfloat16) in the CPU kernels (kernels/cpu/attention.cpp):
// kv_store rounds K and V to bf16 (nearest even), and attention_paged over a bf16 pool is
// bitwise attention_paged over an f32 pool holding the same rounded values (same FMA chains,
// same order; only the loads widen), at every block size, head_dim, batch and thread count.
// Batch invariance within the bf16 mode is checked the way test_ops_cpu.cpp checks the f32 mode.
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

uint32_t bits_of(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
float from_bits(uint32_t u) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}
/// The f32 value of bf16 bits.
float widen(uint16_t h) { return from_bits(uint32_t(h) << 16); }

/// Round-to-nearest-even written out the long way (the exact halfway test on the dropped 16
/// bits), independent of the kernel's add-and-shift form; NaN kept a NaN.
uint16_t rne_reference(float x) {
    const uint32_t u = bits_of(x);
    if (std::isnan(x)) { return uint16_t((u >> 16) | 0x40); }
    uint32_t hi = u >> 16;
    const uint32_t lo = u & 0xFFFF;
    if (lo > 0x8000 || (lo == 0x8000 && (hi & 1))) { ++hi; }
    return uint16_t(hi);
}

/// A paged pool of `n_blocks` blocks of `bs` tokens holding `n_seq` sequences at shuffled,
/// interleaved blocks, twice: a bf16 pool written by kv_store from f32 K/V, and an f32 pool
/// written by kv_store from the same K/V already rounded to bf16 (the reference).
struct TwinPools {
    int bs, n_kv, hd;
    std::vector<uint16_t> k16, v16;
    std::vector<float> k32, v32;
    std::vector<std::vector<int32_t>> tables;
    std::vector<int> lens;
    k::PagedKv kv16{}, kv32{};

    TwinPools(std::mt19937 & rng, int block, int n_kv_heads, int head_dim, std::vector<int> seq_lens)
        : bs(block), n_kv(n_kv_heads), hd(head_dim), lens(std::move(seq_lens)) {
        const int row = n_kv * hd;
        int n_blocks = 0;
        for (const int n : lens) { n_blocks += (n + bs - 1) / bs; }
        std::vector<int32_t> ids(static_cast<size_t>(n_blocks));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng);
        const size_t elems = size_t(n_blocks) * bs * row;
        k16.assign(elems, 0x7FC0);  // unwritten slots are NaN: a read of one poisons the result
        v16.assign(elems, 0x7FC0);
        k32.assign(elems, std::numeric_limits<float>::quiet_NaN());
        v32.assign(elems, std::numeric_limits<float>::quiet_NaN());
        kv16 = {k16.data(), v16.data(), bs, n_kv, hd, k::WType::bf16};
        kv32 = {k32.data(), v32.data(), bs, n_kv, hd, k::WType::f32};
        size_t next = 0;
        for (const int n : lens) {
            std::vector<int32_t> table;
            for (int b = 0; b < (n + bs - 1) / bs; ++b) { table.push_back(ids[next++]); }
            const auto kr = random_vec(rng, size_t(n) * row, -2.0f, 2.0f), vr = random_vec(rng, size_t(n) * row);
            std::vector<float> kq(kr.size()), vq(vr.size());
            for (size_t i = 0; i < kr.size(); ++i) { kq[i] = widen(rne_reference(kr[i])); }
            for (size_t i = 0; i < vr.size(); ++i) { vq[i] = widen(rne_reference(vr[i])); }
            std::vector<int64_t> slots(static_cast<size_t>(n));
            for (int t = 0; t < n; ++t) { slots[t] = int64_t(table[t / bs]) * bs + t % bs; }
            k::kv_store(kv16, kr.data(), vr.data(), slots.data(), n);
            k::kv_store(kv32, kq.data(), vq.data(), slots.data(), n);
            tables.push_back(std::move(table));
        }
    }
};

}  // namespace

TEST_SUITE("kernels::attention_bf16kv") {

TEST_CASE("f32_to_bf16_rne: nearest even on known bit patterns, Inf and NaN, and agrees with the long-hand rule on 1M values") {
    CHECK(k::f32_to_bf16_rne(1.0f) == 0x3F80);
    CHECK(k::f32_to_bf16_rne(from_bits(0x3F808000)) == 0x3F80);  // halfway, 0x3F80 even: down
    CHECK(k::f32_to_bf16_rne(from_bits(0x3F818000)) == 0x3F82);  // halfway, 0x3F81 odd: up
    CHECK(k::f32_to_bf16_rne(from_bits(0x3F808001)) == 0x3F81);  // past halfway: up
    CHECK(k::f32_to_bf16_rne(from_bits(0x3F807FFF)) == 0x3F80);  // below halfway: down
    CHECK(k::f32_to_bf16_rne(-2.5f) == 0xC020);
    CHECK(k::f32_to_bf16_rne(from_bits(0x7F7FFFFF)) == 0x7F80);  // FLT_MAX rounds to +Inf
    CHECK(k::f32_to_bf16_rne(-INFINITY) == 0xFF80);
    CHECK(k::f32_to_bf16_rne(from_bits(0x00000001)) == 0x0000);  // smallest subnormal: to +0
    const uint16_t nan = k::f32_to_bf16_rne(from_bits(0x7F800001));  // signalling NaN with only low bits set
    CHECK((nan & 0x7F80) == 0x7F80);
    CHECK((nan & 0x007F) != 0);  // still a NaN, not Inf
    std::mt19937 rng(3);
    int bad = 0;
    for (int i = 0; i < 1 << 20; ++i) {
        const float x = from_bits(uint32_t(rng()));
        bad += std::isnan(x) ? !std::isnan(widen(k::f32_to_bf16_rne(x))) : k::f32_to_bf16_rne(x) != rne_reference(x);
    }
    CHECK(bad == 0);
}

TEST_CASE("kv_store into a bf16 pool writes each value rounded to nearest even at the f32 pool's positions") {
    std::mt19937 rng(8);
    for (const int block : {4, 16}) {
        CAPTURE(block);
        TwinPools p(rng, block, 2, 24, {37, 5});
        int bad = 0, written = 0;
        // K and V have different layouts (K transposed per block): each against its f32 twin.
        for (const auto & [p16, p32] : {std::pair{&p.k16, &p.k32}, std::pair{&p.v16, &p.v32}}) {
            for (size_t i = 0; i < p32->size(); ++i) {
                const bool set = !std::isnan((*p32)[i]);
                written += set;
                bad += set ? !(widen((*p16)[i]) == (*p32)[i]) : (*p16)[i] != 0x7FC0;
            }
        }
        CHECK(written == 2 * (37 + 5) * 2 * 24);
        CHECK(bad == 0);
    }
}

TEST_CASE("attention_paged over a bf16 pool is bitwise attention_paged over the f32 pool of the rounded K/V") {
    struct Shape { int n_heads, n_kv, head_dim, block; };
    for (const Shape sh : {Shape{8, 4, 8, 4}, Shape{8, 4, 24, 16}, Shape{8, 4, 64, 4}, Shape{8, 4, 64, 16}, Shape{4, 2, 128, 32},
                           Shape{6, 2, 16, 16}, Shape{4, 4, 64, 16}}) {
        CAPTURE(sh.head_dim);
        CAPTURE(sh.block);
        std::mt19937 rng(uint32_t(sh.head_dim * 7 + sh.block));
        TwinPools p(rng, sh.block, sh.n_kv, sh.head_dim, {300, 47, 1, 70});
        const int per = sh.n_heads * sh.head_dim;
        const float scale = 1.0f / std::sqrt(float(sh.head_dim));
        // Every token of every sequence as one prefill batch (tiles of up to 64: packed V), plus
        // decode-style single queries below.
        std::vector<k::AttnQuery> queries;
        for (size_t s = 0; s < p.lens.size(); ++s) {
            for (int n = 1; n <= p.lens[s]; ++n) { queries.push_back({p.tables[s].data(), n}); }
        }
        const auto q = random_vec(rng, queries.size() * per, -2.0f, 2.0f);
        std::vector<float> o16(q.size(), 999.0f), o32(q.size(), -999.0f);
        for (const int threads : {0, 1, 2, 3}) {
            CAPTURE(threads);
            k::ThreadPool pool(std::max(1, threads));
            k::ThreadPool * tp = threads == 0 ? nullptr : &pool;
            k::attention_paged(o16.data(), q.data(), queries.data(), int64_t(queries.size()), sh.n_heads, p.kv16, scale, tp);
            k::attention_paged(o32.data(), q.data(), queries.data(), int64_t(queries.size()), sh.n_heads, p.kv32, scale, tp);
            CHECK(bits_equal(o16.data(), o32.data(), o16.size()));
        }
        int mismatches = 0;
        std::vector<float> a16(static_cast<size_t>(per)), a32(static_cast<size_t>(per));
        for (size_t i = 0; i < queries.size(); i += 13) {
            k::attention_paged(a16.data(), q.data() + i * per, &queries[i], 1, sh.n_heads, p.kv16, scale, nullptr);
            k::attention_paged(a32.data(), q.data() + i * per, &queries[i], 1, sh.n_heads, p.kv32, scale, nullptr);
            mismatches += !bits_equal(a16.data(), a32.data(), a16.size());
            mismatches += !bits_equal(a16.data(), o16.data() + i * per, a16.size());  // decode == inside the prefill
        }
        CHECK(mismatches == 0);
        // The output is finite (no NaN slot was read) and differs from f32 attention over the
        // unrounded K/V only by the rounding: not bitwise the f32 mode's.
        CHECK(std::all_of(o16.begin(), o16.end(), [](float x) { return std::isfinite(x); }));
    }
}

TEST_CASE("attention_paged over a bf16 pool: a query's output is bitwise the same in any batch composition and thread count") {
    std::mt19937 rng(21);
    for (const int block : {4, 16}) {
        for (const int head_dim : {24, 64}) {
            CAPTURE(block);
            CAPTURE(head_dim);
            const int nh = 8;
            TwinPools p(rng, block, 4, head_dim, {90, 10, 1, 33});
            const int per = nh * head_dim;
            const float scale = 1.0f / std::sqrt(float(head_dim));
            std::vector<k::AttnQuery> all;
            for (size_t s = 0; s < p.lens.size(); ++s) {
                for (int n = 1; n <= p.lens[s]; ++n) { all.push_back({p.tables[s].data(), n}); }
            }
            const auto q = random_vec(rng, all.size() * per, -2.0f, 2.0f);
            std::vector<std::vector<float>> alone(all.size(), std::vector<float>(size_t(per)));
            for (size_t i = 0; i < all.size(); ++i) {
                k::attention_paged(alone[i].data(), q.data() + i * per, &all[i], 1, nh, p.kv16, scale, nullptr);
            }
            k::ThreadPool p1(1), p2(2), p3(3);
            int mismatches = 0, compared = 0;
            for (int trial = 0; trial < 12; ++trial) {
                std::vector<size_t> order(all.size());
                std::iota(order.begin(), order.end(), size_t(0));
                if (trial >= 4) { std::shuffle(order.begin(), order.end(), rng); }
                if (trial >= 4 && trial % 2 == 1) { order.resize(2 + rng() % 20); }
                std::vector<float> qb(order.size() * per), out(order.size() * per);
                std::vector<k::AttnQuery> qs(order.size());
                for (size_t b = 0; b < order.size(); ++b) {
                    std::copy(q.begin() + order[b] * per, q.begin() + (order[b] + 1) * per, qb.begin() + b * per);
                    qs[b] = all[order[b]];
                }
                k::ThreadPool * pool = trial % 4 == 0 ? nullptr : trial % 4 == 1 ? &p1 : trial % 4 == 2 ? &p2 : &p3;
                k::attention_paged(out.data(), qb.data(), qs.data(), int64_t(order.size()), nh, p.kv16, scale, pool);
                for (size_t b = 0; b < order.size(); ++b) {
                    mismatches += !bits_equal(out.data() + b * per, alone[order[b]].data(), size_t(per));
                    ++compared;
                }
            }
            CHECK(compared > 2 * int(all.size()));
            CHECK(mismatches == 0);
        }
    }
}

}  // TEST_SUITE
