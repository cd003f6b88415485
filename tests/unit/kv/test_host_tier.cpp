// The host KV tier (daemon/src/kv/host_tier.cpp and its use by daemon/src/kv/kv_cache.cpp):
// evicted device prefix blocks are copied to the host, host hits are copied back, entries are
// keyed by weight epoch, and no block a queued copy reads or writes is handed out again in the
// same step. A simulator keeps a "content" per device and host block (the weight epoch and the
// token prefix a block's KV was computed for), applies the copy lists exactly as the engine
// does (every device → host copy, then every host → device copy, before the forward) and checks
// that every block a sequence reuses holds the KV computed from scratch for its prefix.
#include "fd/kv/kv_cache.h"
#include "fd/status.h"

#include <doctest/doctest.h>

#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

using fd::kv::BlockCopy;
using fd::kv::HostTier;
using fd::kv::KvCache;
using fd::kv::KvCacheConfig;

namespace {

struct Content {
    uint64_t             epoch = 0;
    std::vector<int32_t> prefix;  ///< tokens [0, end of block)
    bool operator==(const Content &) const = default;
};

struct Sim {
    KvCache              kv;
    std::vector<Content> device, host;
    uint64_t             epoch = 0;
    struct Pending { fd::kv::SeqId seq; std::vector<int32_t> tokens; int32_t cached; };
    std::vector<Pending> admitted;
    int64_t              n_verified = 0, n_host_hits = 0;
    /// The engine's write-ahead offloads (plan_background_offloads after the step's copies):
    /// they land only at the next fence(), AFTER the step's forward wrote its blocks, so a
    /// pinned block handed out and rewritten meanwhile would reach the host torn.
    bool                   background = false;
    std::vector<BlockCopy> bg;
    int64_t                n_bg = 0;

    explicit Sim(const KvCacheConfig & c)
        : kv(c), device(static_cast<size_t>(c.n_blocks)), host(static_cast<size_t>(c.n_host_blocks)) {}

    Content expected(const std::vector<int32_t> & t, int64_t block) const {
        const int64_t end = std::min<int64_t>((block + 1) * kv.block_size(), static_cast<int64_t>(t.size()));
        return {epoch, std::vector<int32_t>(t.begin(), t.begin() + end)};
    }

    /// The engine's fence before it schedules (or runs a control op): the background copies land.
    void fence() {
        for (const BlockCopy & c : bg) { host[c.dst] = device[c.src]; }
        bg.clear();
        kv.background_done();
        CHECK(kv.n_background_in_flight() == 0);
    }

    /// Scheduler-style admission: match, allocate (release on failure, as the scheduler does).
    bool admit(fd::kv::SeqId seq, const std::vector<int32_t> & tokens) {
        fence();
        int32_t from_host = -1;
        const int32_t cached = kv.match_prefix(seq, tokens, 0, &from_host);
        REQUIRE(from_host >= 0);
        REQUIRE(from_host <= cached);
        n_host_hits += from_host;
        if (!kv.allocate(seq, static_cast<int64_t>(tokens.size()))) {
            kv.release(seq);
            return false;
        }
        admitted.push_back({seq, tokens, cached});
        return true;
    }

    /// The engine's step: the copies (out, then in), then the forward, then commit.
    void run_step() {
        std::vector<BlockCopy> out, in;
        kv.take_tier_copies(out, in);
        std::set<int32_t> host_dst;
        for (const BlockCopy & c : out) {
            REQUIRE(host_dst.insert(c.dst).second);  // no host block written twice in one step
            host[c.dst] = device[c.src];
        }
        std::set<int32_t> dev_dst;
        for (const BlockCopy & c : in) {
            REQUIRE(dev_dst.insert(c.dst).second);
            device[c.dst] = host[c.src];
        }
        kv.copies_done();
        if (background) {
            const int64_t n = kv.plan_background_offloads(bg, 16, 16);
            CHECK(n == static_cast<int64_t>(bg.size()));
            n_bg += n;
            for (const BlockCopy & c : bg) {  // no block of this step's forward is read by a background copy
                for (const auto & p : admitted) {
                    for (int32_t d : kv.block_table(p.seq)) { REQUIRE(d != c.src); }
                }
            }
        }
        for (const auto & p : admitted) {
            const auto & table = kv.block_table(p.seq);
            const int64_t bs = kv.block_size();
            for (int64_t i = 0; i < p.cached / bs; ++i) {  // reused: must equal the KV computed from scratch
                CHECK(device[table[i]] == expected(p.tokens, i));
                ++n_verified;
            }
            for (int64_t i = p.cached / bs; i < static_cast<int64_t>(table.size()); ++i) { device[table[i]] = expected(p.tokens, i); }
            kv.commit_full_blocks(p.seq, p.tokens, static_cast<int64_t>(p.tokens.size()));
        }
        admitted.clear();
    }

    void check_invariants() const {
        CHECK(kv.n_blocks_free() + kv.n_blocks_used() == kv.n_blocks_total());
        CHECK(kv.n_host_blocks_free() + kv.n_host_blocks_used() == kv.n_host_blocks_total());
        CHECK(kv.n_host_blocks_cached() <= kv.n_host_blocks_total());
    }
};

std::vector<int32_t> ramp(int n, int32_t start) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    std::iota(v.begin(), v.end(), start);
    return v;
}

}  // namespace

TEST_SUITE("kv::host_tier") {

TEST_CASE("an evicted prefix block goes to the host tier and comes back instead of being recomputed") {
    Sim sim({.n_blocks = 4, .block_size_tokens = 4, .enable_prefix_caching = true, .n_host_blocks = 8});
    const auto a = ramp(13, 100), b = ramp(13, 500);
    REQUIRE(sim.admit(1, a));
    sim.run_step();
    sim.kv.release(1);                                    // 3 full blocks stay cached on the device
    REQUIRE(sim.admit(2, b));                             // needs all 4 blocks: a's 3 cached ones are evicted...
    std::vector<BlockCopy> out, in;
    sim.kv.take_tier_copies(out, in);
    CHECK(out.size() == 3);                               // ...and saved to the host
    CHECK(in.empty());
    for (const BlockCopy & c : out) { sim.host[c.dst] = sim.device[c.src]; }
    sim.kv.copies_done();
    sim.run_step();
    CHECK(sim.kv.n_host_blocks_cached() == 3);
    CHECK(sim.kv.tier_counters().offloaded == 3);
    sim.kv.release(2);

    int32_t from_host = 0;
    CHECK(sim.kv.match_prefix(3, a, 0, &from_host) == 12);  // all of a's full blocks, from the host
    CHECK(from_host == 12);
    REQUIRE(sim.kv.allocate(3, 13));
    sim.admitted.push_back({3, a, 12});
    sim.run_step();                                       // checks the loaded blocks hold a's KV
    CHECK(sim.n_verified == 3);
    CHECK(sim.kv.tier_counters().loaded == 3);
    sim.kv.release(3);
    // Now on the device again: a device hit, nothing from the host.
    CHECK(sim.kv.match_prefix(4, a, 0, &from_host) == 12);
    CHECK(from_host == 0);
    sim.check_invariants();
}

TEST_CASE("host entries are keyed by weight epoch; a flush, a pause and a device reset act as documented") {
    Sim sim({.n_blocks = 4, .block_size_tokens = 4, .enable_prefix_caching = true, .n_host_blocks = 8});
    const auto a = ramp(13, 100), b = ramp(13, 500);
    auto fill = [&] {  // a's blocks end up in the host tier only
        REQUIRE(sim.admit(1, a));
        sim.run_step();
        sim.kv.release(1);
        REQUIRE(sim.admit(2, b));
        sim.run_step();
        sim.kv.release(2);
        sim.kv.flush_prefix_cache();
    };
    fill();
    REQUIRE(sim.kv.n_host_blocks_cached() == 3);
    int32_t from_host = 0;

    SUBCASE("a new epoch drops the old entries: never matched again") {
        sim.epoch = 1;
        CHECK(sim.kv.set_weight_epoch(1) == 3);
        CHECK(sim.kv.n_host_blocks_cached() == 0);
        CHECK(sim.kv.match_prefix(3, a, 0, &from_host) == 0);
        CHECK(sim.kv.tier_counters().invalidated == 3);
    }
    SUBCASE("flush_host_tier forgets them") {
        CHECK(sim.kv.flush_host_tier() == 3);
        CHECK(sim.kv.match_prefix(3, a, 0, &from_host) == 0);
    }
    SUBCASE("paused transfers: no lookup reaches the host, no eviction is copied") {
        sim.kv.set_transfers_paused(true);
        CHECK(sim.kv.match_prefix(3, a, 0, &from_host) == 0);
        sim.kv.release(3);
        REQUIRE(sim.admit(4, ramp(13, 900)));
        sim.run_step();
        sim.kv.release(4);
        REQUIRE(sim.admit(5, ramp(13, 1300)));           // evicts 900's blocks: dropped, not copied
        std::vector<BlockCopy> out, in;
        sim.kv.take_tier_copies(out, in);
        CHECK(out.empty());
        sim.kv.copies_done();
        sim.kv.set_transfers_paused(false);
        sim.run_step();
        sim.kv.release(5);
        CHECK(sim.kv.match_prefix(6, a, 0, &from_host) == 12);  // what was copied before the pause stays
    }
    SUBCASE("reset_device (sleep kv_cache, pool kept) keeps the host entries") {
        sim.kv.reset_device();
        std::fill(sim.device.begin(), sim.device.end(), Content{});
        CHECK(sim.kv.n_blocks_free() == 4);
        CHECK(sim.kv.match_prefix(3, a, 0, &from_host) == 12);
        CHECK(from_host == 12);
        REQUIRE(sim.kv.allocate(3, 13));
        sim.admitted.push_back({3, a, 12});
        sim.run_step();
        CHECK(sim.n_verified == 3);
    }
    sim.check_invariants();
}

TEST_CASE("a host block a queued copy reads is not handed out again in the same step") {
    // 2 host blocks. a's prefix goes to the host; a lookup of a then loads from the host while its
    // own allocation evicts b's device blocks, which need host blocks: never the ones being read.
    Sim sim({.n_blocks = 3, .block_size_tokens = 4, .enable_prefix_caching = true, .n_host_blocks = 2});
    const auto a = ramp(9, 100), b = ramp(9, 500);
    REQUIRE(sim.admit(1, a));
    sim.run_step();
    sim.kv.release(1);
    REQUIRE(sim.admit(2, b));  // 3 blocks: a's 2 cached ones evicted (to the host)
    sim.run_step();
    sim.kv.release(2);
    REQUIRE(sim.kv.n_host_blocks_cached() == 2);
    REQUIRE(sim.admit(3, a));  // loads a's 2 blocks, evicting b's 2 cached ones: the host has no free block
    std::vector<BlockCopy> out, in;
    sim.kv.take_tier_copies(out, in);
    CHECK(in.size() == 2);
    CHECK(out.empty());        // both host blocks are being read: b's blocks are dropped, not copied over them
    for (const BlockCopy & i : in) { sim.device[i.dst] = sim.host[i.src]; }
    sim.kv.copies_done();
    sim.run_step();
    CHECK(sim.n_verified == 2);
    sim.check_invariants();
}

TEST_CASE("random traffic: every reused block holds the KV computed from scratch for its prefix") {
  for (const bool background : {false, true}) {
    CAPTURE(background);
    int64_t n_bg = 0;
    for (uint32_t seed = 1; seed <= 20; ++seed) {
        CAPTURE(seed);
        std::mt19937 rng(seed);
        Sim sim({.n_blocks = 8, .block_size_tokens = 4, .enable_prefix_caching = true, .n_host_blocks = 6});
        sim.background = background;
        std::vector<std::vector<int32_t>> bases;
        for (int i = 0; i < 5; ++i) { bases.push_back(ramp(12, 1000 * (i + 1))); }
        std::vector<fd::kv::SeqId> live;
        fd::kv::SeqId next = 1;
        for (int step = 0; step < 300; ++step) {
            // Between steps: some finish; rarely the weights change (paused: nothing live).
            while (!live.empty() && rng() % 3 == 0) {
                const size_t k = rng() % live.size();
                sim.kv.release(live[k]);
                live.erase(live.begin() + static_cast<long>(k));
            }
            if (rng() % 40 == 0) {
                sim.fence();  // a control op waits for the background copies first
                for (auto s : live) { sim.kv.release(s); }
                live.clear();
                sim.kv.flush_prefix_cache();
                sim.kv.set_weight_epoch(++sim.epoch);
            }
            const int n_admit = 1 + static_cast<int>(rng() % 3);
            for (int j = 0; j < n_admit; ++j) {
                auto t = bases[rng() % bases.size()];
                t.resize(4 + rng() % 9);
                const int extra = static_cast<int>(rng() % 6);
                for (int e = 0; e < extra; ++e) { t.push_back(static_cast<int32_t>(rng() % 50)); }
                if (sim.admit(next, t)) { live.push_back(next); }
                ++next;
            }
            sim.run_step();
            sim.check_invariants();
        }
        CHECK(sim.n_host_hits > 0);      // the host tier was really exercised
        CHECK(sim.n_verified > 100);
        n_bg += sim.n_bg;
    }
    CHECK((n_bg > 0) == background);  // the background path was really exercised
  }
}

TEST_CASE("only blocks likely to be reused go to the host: prompt blocks, and generated blocks once hit") {
    Sim sim({.n_blocks = 4, .block_size_tokens = 4, .enable_prefix_caching = true, .n_host_blocks = 8});
    // a: 8 prompt tokens and 5 generated ones: blocks 0-1 are prompt blocks, block 2 generated.
    const auto a = ramp(13, 100), b = ramp(13, 500);
    REQUIRE(sim.kv.match_prefix(1, a) == 0);
    REQUIRE(sim.kv.allocate(1, 13));
    sim.kv.commit_full_blocks(1, a, 13, 0, /*n_prompt=*/8);
    sim.kv.release(1);
    SUBCASE("an unreused generated block is dropped at eviction") {
        REQUIRE(sim.kv.match_prefix(2, b) == 0);
        REQUIRE(sim.kv.allocate(2, 13));  // evicts a's 3 blocks
        std::vector<BlockCopy> out, in;
        sim.kv.take_tier_copies(out, in);
        CHECK(out.size() == 2);           // the two prompt blocks, not the generated one
        sim.kv.copies_done();
        CHECK(sim.kv.tier_counters().offloaded == 2);
    }
    SUBCASE("a generated block a lookup hit is kept") {
        REQUIRE(sim.kv.match_prefix(3, a) == 12);  // a again (a next turn): all 3 blocks hit on the device
        sim.kv.release(3);
        REQUIRE(sim.kv.match_prefix(2, b) == 0);
        REQUIRE(sim.kv.allocate(2, 13));
        std::vector<BlockCopy> out, in;
        sim.kv.take_tier_copies(out, in);
        CHECK(out.size() == 3);
        sim.kv.copies_done();
    }
}

TEST_CASE("write-ahead: reused blocks near eviction are copied in the background, pinned until the fence") {
    Sim sim({.n_blocks = 4, .block_size_tokens = 4, .enable_prefix_caching = true, .n_host_blocks = 8});
    const auto a = ramp(13, 100), b = ramp(5, 500), c = ramp(13, 900);
    REQUIRE(sim.admit(1, a));
    sim.run_step();
    sim.kv.release(1);                                    // a's 3 full blocks cached, unreferenced (the LRU); its 4th free
    std::vector<BlockCopy> bg;
    CHECK(sim.kv.plan_background_offloads(bg, 16, 2) == 2);  // at most max_blocks, the oldest first
    REQUIRE(bg.size() == 2);
    CHECK(sim.kv.n_background_in_flight() == 2);
    std::vector<BlockCopy> more;
    CHECK(sim.kv.plan_background_offloads(more, 16, 16) == 0);  // one batch in flight at a time
    // While in flight an allocation never takes a pinned block: b gets the free block and a's third.
    REQUIRE(sim.kv.match_prefix(2, b) == 0);
    REQUIRE(sim.kv.allocate(2, 5));
    for (int32_t d : sim.kv.block_table(2)) {
        for (const BlockCopy & g : bg) { CHECK(d != g.src); }
    }
    sim.admitted.push_back({2, b, 0});
    sim.run_step();                                       // the evicted third block is copied now; b's forward
    sim.bg = bg;
    sim.fence();                                          // then the background copies land (host := device)
    sim.kv.release(2);
    CHECK(sim.kv.tier_counters().offloaded == 3);
    CHECK(sim.kv.tier_counters().offloaded_background == 2);
    // c takes every block: a's two written ahead need no copy at eviction (the host has them).
    REQUIRE(sim.admit(3, c));
    sim.run_step();
    sim.kv.release(3);
    CHECK(sim.kv.tier_counters().offloaded == 4);         // + b's one prompt block, not a's again
    // a comes back from the host, every block equal to its KV computed from scratch.
    REQUIRE(sim.admit(4, a));
    CHECK(sim.admitted.back().cached == 12);
    sim.run_step();
    CHECK(sim.n_verified == 3);
    sim.check_invariants();
}

TEST_CASE("admit_sure: host blocks are only loaded for a sequence that then fits") {
    Sim sim({.n_blocks = 6, .block_size_tokens = 4, .enable_prefix_caching = true, .n_host_blocks = 8});
    const auto a = ramp(13, 100), b = ramp(21, 500);
    REQUIRE(sim.admit(1, a));
    sim.run_step();
    sim.kv.release(1);
    REQUIRE(sim.admit(2, b));                             // 6 blocks: a's 3 go to the host
    sim.run_step();
    REQUIRE(sim.kv.n_host_blocks_cached() == 3);
    // b holds every device block: a (3 host hits + 1 block) cannot fit now.
    auto rest = [&](int64_t n_cached) { return 13 - n_cached; };
    CHECK_FALSE(sim.kv.admit_sure(a, 0, rest));
    CHECK(sim.kv.admit_sure(ramp(13, 3000), 0, rest));    // no host hit: nothing to hold back
    sim.kv.release(2);                                    // b's blocks are free (cached) again
    CHECK(sim.kv.admit_sure(a, 0, rest));
    int32_t from_host = 0;
    CHECK(sim.kv.match_prefix(3, a, 0, &from_host) == 12);
    CHECK(from_host == 12);
    CHECK(sim.kv.allocate(3, 13));
}

TEST_CASE("HostTier: take evicts the oldest unreferenced entry; held and in-use blocks are never taken") {
    HostTier t(3, 2);
    const int32_t tok[2] = {1, 2};
    const int32_t a = t.take(), b = t.take(), c = t.take();
    CHECK(t.take() == -1);                 // all in use
    t.publish(a, 11, 0, tok, 0);
    t.publish(b, 22, 11, tok, 0);
    t.put(a);
    t.put(b);                              // a then b on the LRU; c stays in use (a swapped sequence)
    CHECK(t.n_available() == 2);
    CHECK(t.find(22, 11, tok, 0) == b);
    CHECK(t.find(22, 99, tok, 0) == -1);   // other parent chain
    CHECK(t.find(22, 11, tok, 1) == -1);   // other epoch
    const int32_t other[2] = {1, 3};
    CHECK(t.find(22, 11, other, 0) == -1); // other tokens
    t.hold(a);                             // a copy reads a this step
    CHECK(t.take() == b);                  // b is evicted, not a
    CHECK(t.n_evictions_total() == 1);
    CHECK(t.find(22, 11, tok, 0) == -1);
    CHECK(t.take() == -1);
    t.end_step();
    CHECK(t.take() == a);                  // now it may go
    CHECK(t.n_cached() == 0);
    t.put(c);
    CHECK(t.n_available() == 1);
}

}  // TEST_SUITE
