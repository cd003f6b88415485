// KvCache (daemon/src/kv/kv_cache.cpp): block accounting, block tables and the prefix cache.
#include "fd/kv/kv_cache.h"
#include "fd/status.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <vector>

using fd::kv::KvCache;
using fd::kv::KvCacheConfig;

namespace {

std::vector<int32_t> ramp(int n, int32_t start = 100) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    std::iota(v.begin(), v.end(), start);
    return v;
}

/// The distinct blocks the live sequences' tables hold (seq ids of these tests are < 64), each
/// checked to be a block id of the pool: an independent count of the blocks in use (a shared
/// prefix block counted once).
int64_t held_blocks(const KvCache & kv) {
    std::set<int32_t> held;
    for (fd::kv::SeqId s = 0; s < 64; ++s) {
        for (int32_t b : kv.block_table(s)) {
            CHECK(b >= 0);
            CHECK(b < kv.n_blocks_total());
            held.insert(b);
        }
    }
    return static_cast<int64_t>(held.size());
}

/// The pool's accounting against the tables: used == the blocks the sequences hold.
void check_invariant(const KvCache & kv) {
    CHECK(kv.n_blocks_used() == held_blocks(kv));
    CHECK(kv.n_blocks_free() >= 0);
    CHECK(kv.n_blocks_free() <= kv.n_blocks_total());
}

/// Admit `seq` the way the scheduler does: match the prefix, allocate the rest, compute, commit.
int32_t admit_and_commit(KvCache & kv, fd::kv::SeqId seq, const std::vector<int32_t> & tokens, uint64_t salt = 0) {
    const int32_t cached = kv.match_prefix(seq, tokens, salt);
    REQUIRE(kv.allocate(seq, static_cast<int64_t>(tokens.size())));
    kv.commit_full_blocks(seq, tokens, static_cast<int64_t>(tokens.size()), salt);
    return cached;
}

}  // namespace

TEST_SUITE("kv::kv_cache") {

TEST_CASE("allocate hands out distinct blocks and fails without side effects when exhausted") {
    KvCache kv({.n_blocks = 5, .block_size_tokens = 4});
    CHECK(kv.n_blocks_free() == 5);
    CHECK(kv.n_blocks_needed(1, 9) == 3);
    REQUIRE(kv.allocate(1, 9));                 // 3 blocks
    CHECK(kv.block_table(1).size() == 3);
    CHECK(kv.n_blocks_needed(1, 12) == 0);      // still fits in 3 blocks
    CHECK(kv.n_blocks_needed(1, 13) == 1);
    REQUIRE(kv.allocate(1, 12));
    CHECK(kv.block_table(1).size() == 3);
    CHECK(kv.n_blocks_free() == 2);
    check_invariant(kv);

    const auto table_before = kv.block_table(1);
    CHECK_FALSE(kv.allocate(2, 13));            // needs 4, only 2 free
    CHECK(kv.block_table(2).empty());
    CHECK(kv.n_blocks_free() == 2);
    CHECK_FALSE(kv.allocate(1, 24));            // grow by 3, only 2 free
    CHECK(kv.block_table(1) == table_before);
    CHECK(kv.n_blocks_free() == 2);
    check_invariant(kv);

    REQUIRE(kv.allocate(2, 8));
    CHECK(kv.n_blocks_free() == 0);
    CHECK_FALSE(kv.allocate(3, 1));
    std::set<int32_t> ids(kv.block_table(1).begin(), kv.block_table(1).end());
    ids.insert(kv.block_table(2).begin(), kv.block_table(2).end());
    CHECK(ids.size() == 5);
    CHECK(*ids.begin() == 0);
    CHECK(*ids.rbegin() == 4);
    check_invariant(kv);
}

TEST_CASE("release returns a sequence's blocks and a second release is a no-op") {
    KvCache kv({.n_blocks = 6, .block_size_tokens = 16});
    REQUIRE(kv.allocate(7, 33));
    REQUIRE(kv.allocate(8, 16));
    CHECK(kv.n_blocks_used() == 4);
    kv.release(7);
    CHECK(kv.n_blocks_used() == 1);
    CHECK(kv.block_table(7).empty());
    kv.release(7);
    CHECK(kv.n_blocks_used() == 1);
    check_invariant(kv);
    REQUIRE(kv.allocate(9, 16 * 5));
    CHECK(kv.n_blocks_free() == 0);
    kv.release(8);
    kv.release(9);
    CHECK(kv.n_blocks_free() == 6);
    check_invariant(kv);
}

TEST_CASE("block_table grows to ceil(n_tokens / block_size) entries") {
    KvCache kv({.n_blocks = 10, .block_size_tokens = 16});
    CHECK(kv.block_table(1).empty());
    const std::vector<std::pair<int64_t, size_t>> steps = {{1, 1}, {16, 1}, {17, 2}, {32, 2}, {33, 3}, {100, 7}};
    for (auto [n_tokens, n_blocks] : steps) {
        CAPTURE(n_tokens);
        REQUIRE(kv.allocate(1, n_tokens));
        CHECK(kv.block_table(1).size() == n_blocks);
        check_invariant(kv);
    }
}

TEST_CASE("constructing a cache without blocks is an internal error") {
    CHECK_THROWS_AS(KvCache({.n_blocks = 0, .block_size_tokens = 16}), fd::Error);
    CHECK_THROWS_AS(KvCache({.n_blocks = 4, .block_size_tokens = 0}), fd::Error);
}

TEST_CASE("a new sequence with the same prefix reuses the full blocks of tokens[0, n-1)") {
    KvCache kv({.n_blocks = 16, .block_size_tokens = 16, .enable_prefix_caching = true});
    const auto tokens = ramp(40);
    CHECK(admit_and_commit(kv, 1, tokens) == 0);
    CHECK(kv.n_blocks_cached() == 2);           // 40 tokens = 2 full blocks + 8
    const auto first = kv.block_table(1);

    // (40 - 1) / 16 = 2 full blocks = 32 tokens.
    CHECK(kv.match_prefix(2, tokens) == 32);
    REQUIRE(kv.block_table(2).size() == 2);
    CHECK(kv.block_table(2)[0] == first[0]);
    CHECK(kv.block_table(2)[1] == first[1]);
    CHECK(kv.n_blocks_used() == 3);             // shared blocks are counted once
    REQUIRE(kv.allocate(2, 40));
    CHECK(kv.block_table(2).size() == 3);
    CHECK(kv.block_table(2)[2] != first[2]);    // the partial block is private
    CHECK(kv.n_blocks_used() == 4);
    check_invariant(kv);

    // A longer prompt sharing only the first 20 tokens: 1 block.
    auto other = ramp(50);
    other[20] = 7;
    CHECK(kv.match_prefix(3, other) == 16);
    check_invariant(kv);
}

TEST_CASE("a different token in block 0 gives no prefix match") {
    KvCache kv({.n_blocks = 16, .block_size_tokens = 16, .enable_prefix_caching = true});
    const auto tokens = ramp(40);
    admit_and_commit(kv, 1, tokens);
    auto changed = tokens;
    changed[3] = 1;
    CHECK(kv.match_prefix(2, changed) == 0);
    CHECK(kv.block_table(2).empty());
    // Same blocks in a different order do not match either (the hash is a chain).
    std::vector<int32_t> swapped(tokens.begin() + 16, tokens.begin() + 32);
    swapped.insert(swapped.end(), tokens.begin(), tokens.begin() + 16);
    swapped.push_back(5);
    CHECK(kv.match_prefix(3, swapped) == 0);
}

TEST_CASE("a prefix salt (vLLM's cache_salt) shares blocks only between equal salts") {
    KvCache kv({.n_blocks = 16, .block_size_tokens = 16, .enable_prefix_caching = true});
    const auto tokens = ramp(40);
    CHECK(admit_and_commit(kv, 1, tokens, 0x1234) == 0);
    CHECK(kv.match_prefix(2, tokens) == 0);           // unsalted: none of salt 0x1234's blocks
    CHECK(kv.match_prefix(3, tokens, 0x9999) == 0);   // another salt: none
    CHECK(kv.match_prefix(4, tokens, 0x1234) == 32);  // the same salt: both full blocks
    // An unsalted sequence commits its own copies; each salt then finds its own.
    CHECK(admit_and_commit(kv, 5, tokens) == 0);
    CHECK(kv.n_blocks_cached() == 4);
    CHECK(kv.match_prefix(6, tokens) == 32);
    CHECK(kv.block_table(6)[0] != kv.block_table(4)[0]);
    check_invariant(kv);
}

TEST_CASE("a prompt exactly two blocks long only matches one block") {
    KvCache kv({.n_blocks = 8, .block_size_tokens = 16, .enable_prefix_caching = true});
    const auto tokens = ramp(32);
    admit_and_commit(kv, 1, tokens);
    CHECK(kv.n_blocks_cached() == 2);
    // The last token must be recomputed so its logits exist.
    CHECK(kv.match_prefix(2, tokens) == 16);
    CHECK(kv.block_table(2).size() == 1);
    // With one more token both blocks match.
    auto longer = tokens;
    longer.push_back(1);
    CHECK(kv.match_prefix(3, longer) == 32);
    // A 1-token prompt never matches.
    CHECK(kv.match_prefix(4, {tokens[0]}) == 0);
}

TEST_CASE("cached blocks with ref 0 count as free and are reused by a later match") {
    KvCache kv({.n_blocks = 4, .block_size_tokens = 4, .enable_prefix_caching = true});
    const auto tokens = ramp(9);  // 2 full blocks + 1
    admit_and_commit(kv, 1, tokens);
    CHECK(kv.n_blocks_used() == 3);
    kv.release(1);
    CHECK(kv.n_blocks_free() == 4);             // 2 of them still cached
    CHECK(kv.n_blocks_used() == 0);
    CHECK(kv.n_blocks_cached() == 2);
    check_invariant(kv);
    CHECK(kv.match_prefix(2, tokens) == 8);
    CHECK(kv.n_blocks_used() == 2);
    CHECK(kv.n_blocks_free() == 2);
    check_invariant(kv);
}

TEST_CASE("cached free blocks are evicted least recently used first when new blocks are needed") {
    KvCache kv({.n_blocks = 4, .block_size_tokens = 4, .enable_prefix_caching = true});
    const auto a = ramp(5, 100);   // 1 full block cached
    const auto b = ramp(5, 200);
    admit_and_commit(kv, 1, a);
    kv.release(1);                 // a's block: cached, ref 0 (older)
    admit_and_commit(kv, 2, b);
    kv.release(2);                 // b's block: cached, ref 0 (newer)
    CHECK(kv.n_blocks_cached() == 2);
    CHECK(kv.n_blocks_free() == 4);

    // 2 never-cached free blocks remain; taking 3 must evict exactly one cached block: a's.
    REQUIRE(kv.allocate(3, 12));
    CHECK(kv.n_blocks_free() == 1);
    CHECK(kv.n_blocks_cached() == 1);
    check_invariant(kv);
    CHECK(kv.match_prefix(4, a) == 0);
    CHECK(kv.match_prefix(5, b) == 4);
    check_invariant(kv);

    // Now every block is in use (3 by seq 3, b's by seq 5): nothing left to take.
    CHECK(kv.n_blocks_free() == 0);
    CHECK_FALSE(kv.allocate(7, 1));
    CHECK(kv.block_table(7).empty());
    check_invariant(kv);
}

TEST_CASE("flush_prefix_cache makes later matches 0 and keeps in-use blocks") {
    KvCache kv({.n_blocks = 8, .block_size_tokens = 4, .enable_prefix_caching = true});
    const auto a = ramp(13, 10);   // 3 full blocks
    const auto b = ramp(9, 50);    // 2 full blocks
    admit_and_commit(kv, 1, a);
    admit_and_commit(kv, 2, b);
    kv.release(2);
    CHECK(kv.n_blocks_cached() == 5);
    const auto table1 = kv.block_table(1);
    kv.flush_prefix_cache();
    CHECK(kv.n_blocks_cached() == 0);
    CHECK(kv.block_table(1) == table1);
    CHECK(kv.n_blocks_used() == 4);
    CHECK(kv.n_blocks_free() == 4);
    check_invariant(kv);
    CHECK(kv.match_prefix(3, a) == 0);
    CHECK(kv.match_prefix(4, b) == 0);
    kv.release(1);
    CHECK(kv.n_blocks_free() == 8);
    check_invariant(kv);
}

TEST_CASE("with prefix caching disabled match_prefix is always 0") {
    KvCache kv({.n_blocks = 8, .block_size_tokens = 4, .enable_prefix_caching = false});
    const auto a = ramp(13);
    CHECK(admit_and_commit(kv, 1, a) == 0);
    CHECK(kv.n_blocks_cached() == 0);
    kv.release(1);
    CHECK(kv.match_prefix(2, a) == 0);
    CHECK(kv.block_table(2).empty());
    CHECK(kv.n_blocks_free() == 8);
}

TEST_CASE("the used count equals the blocks the tables hold over a random workload with prefix caching") {
    KvCache kv({.n_blocks = 12, .block_size_tokens = 4, .enable_prefix_caching = true});
    uint32_t state = 12345;
    auto rnd = [&](uint32_t n) { state = state * 1664525u + 1013904223u; return (state >> 8) % n; };
    std::vector<std::vector<int32_t>> live(6);
    int max_used = 0;
    for (int step = 0; step < 400; ++step) {
        const fd::kv::SeqId s = rnd(6);
        auto & toks = live[s];
        if (toks.empty()) {
            // Prompts drawn from 3 shared prefixes so matches happen.
            toks = ramp(1 + int(rnd(14)), 1000 * int32_t(rnd(3)));
            kv.match_prefix(s, toks);
            if (!kv.allocate(s, int64_t(toks.size()))) { kv.release(s); toks.clear(); }
            else { kv.commit_full_blocks(s, toks, int64_t(toks.size())); }
        } else if (rnd(3) == 0) {
            kv.release(s);
            toks.clear();
        } else {
            toks.push_back(int32_t(rnd(50)));
            if (kv.allocate(s, int64_t(toks.size()))) { kv.commit_full_blocks(s, toks, int64_t(toks.size())); }
            else { kv.release(s); toks.clear(); }
        }
        REQUIRE(kv.n_blocks_used() == held_blocks(kv));
        REQUIRE(kv.n_blocks_free() >= 0);
        max_used = std::max<int>(max_used, int(kv.n_blocks_used()));
        // Every live sequence holds exactly the blocks its tokens need.
        for (size_t i = 0; i < live.size(); ++i) {
            const size_t want = (live[i].size() + 3) / 4;
            REQUIRE(kv.block_table(int64_t(i)).size() == want);
        }
    }
    CHECK(max_used > 6);
    for (size_t i = 0; i < live.size(); ++i) { kv.release(int64_t(i)); }
    CHECK(kv.n_blocks_free() == 12);
}


TEST_CASE("swap tier: blocks move to the host pool and back, counts stay consistent") {
    KvCache kv({.n_blocks = 4, .block_size_tokens = 4, .n_host_blocks = 3});
    std::vector<fd::kv::BlockCopy> out, in;
    REQUIRE(kv.allocate(1, 10));                      // 3 device blocks
    const std::vector<int32_t> dev = kv.block_table(1);
    CHECK_THROWS_AS(kv.swap_out(1, 13, out), fd::Error);  // more tokens than its blocks hold: a bug, refused...
    CHECK(out.empty());                               // ...changing nothing
    CHECK(kv.residence(1) == fd::kv::Residence::device);
    REQUIRE(kv.swap_out(1, 9, out));                  // 9 computed tokens = 3 blocks
    REQUIRE(out.size() == 3);
    for (size_t i = 0; i < 3; ++i) { CHECK(out[i].src == dev[i]); }
    std::set<int32_t> host;
    for (const auto & c : out) { host.insert(c.dst); }
    CHECK(host.size() == 3);
    CHECK(*host.rbegin() < 3);
    CHECK(kv.residence(1) == fd::kv::Residence::host);
    CHECK(kv.block_table(1).empty());
    CHECK(kv.n_blocks_free() == 4);
    CHECK(kv.n_host_blocks_used() == 3);
    REQUIRE(kv.allocate(2, 8));                       // another sequence takes 2 device blocks
    CHECK_FALSE(kv.swap_in(1, 10, in));               // 3 needed, 2 free: refused, nothing changes
    CHECK(in.empty());
    CHECK(kv.n_host_blocks_used() == 3);
    CHECK_FALSE(kv.swap_out(2, 8, out));              // the host pool is full
    kv.release(2);
    REQUIRE(kv.swap_in(1, 13, in));                   // + room for 4 more tokens: a 4th block
    REQUIRE(in.size() == 3);
    const auto & table = kv.block_table(1);
    CHECK(table.size() == 4);
    for (size_t i = 0; i < 3; ++i) {
        CHECK(in[i].src == out[i].dst);               // token order kept
        CHECK(in[i].dst == table[i]);
    }
    CHECK(kv.n_host_blocks_used() == 0);
    CHECK(kv.n_blocks_used() == 4);
    CHECK_THROWS_AS(kv.swap_in(1, 13, in), fd::Error);  // not swapped out
    check_invariant(kv);
}

}  // TEST_SUITE
