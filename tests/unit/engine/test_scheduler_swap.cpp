// Scheduler (daemon/src/engine/scheduler.cpp) with the host swap tier: which sequences are
// swapped out or recomputed, the block copies a decision lists, and swap-in on re-admission.
// The harness plays the engine like test_scheduler.cpp's, and also plays the Worker: it keeps a
// "content" per device and host block (the token positions the block holds, owner-tagged) and
// applies each decision's copies before the step, so a resumed sequence is checked to find
// exactly its own KV in its new blocks.
#include "fd/engine/scheduler.h"
#include "fd/kv/kv_cache.h"

#include <doctest/doctest.h>

#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

using fd::engine::ScheduleDecision;
using fd::engine::SchedSeq;
using fd::engine::Scheduler;
using fd::engine::SchedulerConfig;
using fd::kv::BlockCopy;
using fd::kv::KvCache;
using fd::kv::KvCacheConfig;
using fd::kv::Residence;

namespace {

struct Sim {
    KvCache                                            kv;
    Scheduler                                          sched;
    std::map<std::string, std::unique_ptr<SchedSeq>>   seqs;
    std::map<const SchedSeq *, std::string>            names;
    std::vector<int64_t>                               device, host;  ///< per block: owner id * 1000 + first position (-1 = nothing)

    Sim(KvCacheConfig kc, SchedulerConfig sc)
        : kv(kc), sched(sc), device(static_cast<size_t>(kc.n_blocks), -1), host(static_cast<size_t>(kc.n_host_blocks), -1) {}

    SchedSeq * add(const std::string & name, int n_prompt) {
        auto s = std::make_unique<SchedSeq>();
        s->id = static_cast<int64_t>(seqs.size()) + 1;
        s->tokens.resize(static_cast<size_t>(n_prompt));
        std::iota(s->tokens.begin(), s->tokens.end(), 10 * int32_t(s->id));
        SchedSeq * p = s.get();
        names[p] = name;
        seqs[name] = std::move(s);
        sched.add(p);
        return p;
    }
    SchedSeq & operator[](const std::string & name) { return *seqs.at(name); }
    std::vector<std::string> names_of(const std::vector<SchedSeq *> & v) const {
        std::vector<std::string> out;
        for (auto * s : v) { out.push_back(names.at(s)); }
        return out;
    }

    /// One step: decide, run the copies (out, then in), "compute" the scheduled tokens into
    /// their blocks, and check that every running sequence's blocks hold its own KV.
    ScheduleDecision step() {
        ScheduleDecision d = sched.schedule(kv);
        REQUIRE((d.swap_out.empty() || d.swap_in.empty()));
        for (const BlockCopy & c : d.swap_out) { host[c.dst] = device[c.src]; }
        for (const BlockCopy & c : d.swap_in) { device[c.dst] = host[c.src]; }
        const int32_t bs = kv.block_size();
        for (const auto & r : d.run) {
            const auto & table = kv.block_table(r.seq->id);
            // What is already computed must be this sequence's, block by block.
            for (int64_t b = 0; b * bs < r.seq->n_computed; ++b) { REQUIRE(device[table[b]] == r.seq->id * 1000 + b * bs); }
            for (int64_t p = r.seq->n_computed; p < r.seq->n_computed + r.n_tokens; ++p) {
                device[table[p / bs]] = r.seq->id * 1000 + p / bs * bs;
            }
            r.seq->n_computed += r.n_tokens;
            if (r.seq->n_computed == static_cast<int64_t>(r.seq->tokens.size())) { r.seq->tokens.push_back(7); }
        }
        REQUIRE(kv.n_blocks_free() + kv.n_blocks_used() == kv.n_blocks_total());
        REQUIRE(kv.n_host_blocks_free() + kv.n_host_blocks_used() == kv.n_host_blocks_total());
        return d;
    }
};

}  // namespace

TEST_SUITE("engine::scheduler swap") {

TEST_CASE("with room in the host pool the victim is swapped out, keeps its progress and is swapped back in") {
    // 4 device blocks of 4 tokens, 4 host blocks. A and B take 2 blocks each; A's 9th token needs a third.
    Sim sim({.n_blocks = 4, .block_size_tokens = 4, .n_host_blocks = 4}, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    sim.add("A", 7);
    sim.add("B", 7);
    sim.step();
    sim.step();                                       // 8 computed tokens each: still 2 blocks
    const std::vector<int32_t> b_blocks = sim.kv.block_table(sim["B"].id);
    REQUIRE(b_blocks.size() == 2);
    const ScheduleDecision d = sim.step();            // A needs a 3rd block: B goes to the host
    CHECK(sim.names_of(d.swapped) == std::vector<std::string>{"B"});
    CHECK(d.preempted.empty());
    REQUIRE(d.swap_out.size() == 2);                  // B's 8 computed tokens = 2 blocks, in token order
    CHECK(d.swap_out[0].src == b_blocks[0]);
    CHECK(d.swap_out[1].src == b_blocks[1]);
    CHECK(d.swap_out[0].dst != d.swap_out[1].dst);
    CHECK(d.swap_in.empty());
    CHECK(sim["B"].n_computed == 8);                  // nothing to recompute
    CHECK(sim["B"].n_preempted == 1);
    CHECK(sim.kv.residence(sim["B"].id) == Residence::host);
    CHECK(sim.kv.n_host_blocks_used() == 2);
    CHECK(sim.kv.n_seqs_swapped() == 1);
    CHECK(sim.sched.waiting().front() == &sim["B"]);

    // A finishes: B comes back with one decode token (not a 9-token prefill), its KV copied in.
    sim.sched.remove(&sim["A"]);
    sim.kv.release(sim["A"].id);
    const ScheduleDecision r = sim.step();
    REQUIRE(r.run.size() == 1);
    CHECK(r.run[0].seq == &sim["B"]);
    CHECK(r.run[0].n_tokens == 1);
    CHECK(sim.names_of(r.swapped_in) == std::vector<std::string>{"B"});
    REQUIRE(r.swap_in.size() == 2);
    CHECK(r.swap_in[0].src == d.swap_out[0].dst);     // host blocks in the same token order
    CHECK(r.swap_in[1].src == d.swap_out[1].dst);
    CHECK(r.swap_in[0].dst == sim.kv.block_table(sim["B"].id)[0]);
    CHECK(r.swap_in[1].dst == sim.kv.block_table(sim["B"].id)[1]);
    CHECK(sim.kv.block_table(sim["B"].id).size() == 3);  // + a block for the 9th token
    CHECK(sim.kv.residence(sim["B"].id) == Residence::device);
    CHECK(sim.kv.n_host_blocks_used() == 0);
    CHECK(sim["B"].n_computed == 9);
    sim.step();                                       // and keeps decoding from its own KV
}

TEST_CASE("a full host pool falls back to recompute, per victim") {
    // Host pool of 2 blocks: the first victim (2 blocks) fits, the second does not.
    Sim sim({.n_blocks = 6, .block_size_tokens = 4, .n_host_blocks = 2}, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    sim.add("A", 8);   // 2 blocks, its 9th token needs a 3rd
    sim.add("B", 3);   // 1 block
    sim.add("C", 3);   // 1 block
    sim.add("D", 8);   // 2 blocks
    sim.step();
    CHECK(sim.kv.n_blocks_free() == 0);
    const ScheduleDecision d2 = sim.step();          // A needs a block: D (newest) goes to the host
    CHECK(sim.names_of(d2.swapped) == std::vector<std::string>{"D"});
    CHECK(d2.swap_out.size() == 2);
    CHECK(sim.kv.n_host_blocks_free() == 0);
    const ScheduleDecision d3 = sim.step();          // C needs to go too: the host pool is full
    CHECK(sim.names_of(d3.preempted) == std::vector<std::string>{"C"});
    CHECK(d3.swapped.empty());
    CHECK(d3.swap_out.empty());
    CHECK(sim["C"].n_computed == 0);
    CHECK(sim.kv.residence(sim["C"].id) == Residence::none);
    CHECK(sim["D"].n_computed == 8);
    CHECK(sim.kv.residence(sim["D"].id) == Residence::host);
    // The queue keeps its order: C (recompute) then D (swapped).
    CHECK(sim.sched.waiting().size() == 2);
    CHECK(sim.sched.waiting()[0] == &sim["C"]);
    CHECK(sim.sched.waiting()[1] == &sim["D"]);
}

TEST_CASE("without a host pool (or with nothing computed) preemption is recompute, as before") {
    Sim sim({.n_blocks = 4, .block_size_tokens = 4}, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    sim.add("A", 7);
    sim.add("B", 7);
    sim.step();
    sim.step();
    const ScheduleDecision d = sim.step();
    CHECK(sim.names_of(d.preempted) == std::vector<std::string>{"B"});
    CHECK(d.swapped.empty());
    CHECK(d.swap_out.empty());
    CHECK(sim["B"].n_computed == 0);

    KvCache kv({.n_blocks = 4, .block_size_tokens = 4, .n_host_blocks = 4});
    std::vector<BlockCopy> copies;
    REQUIRE(kv.allocate(1, 5));
    CHECK_FALSE(kv.swap_out(1, 0, copies));           // nothing computed: nothing worth keeping
    CHECK_FALSE(kv.swap_out(2, 4, copies));           // holds no blocks
    CHECK(copies.empty());
    CHECK(kv.n_host_blocks_used() == 0);
    CHECK(kv.residence(1) == Residence::device);
}

TEST_CASE("a swapped-out sequence that finishes or is aborted frees its host blocks") {
    Sim sim({.n_blocks = 4, .block_size_tokens = 4, .n_host_blocks = 4}, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    sim.add("A", 7);
    sim.add("B", 7);
    sim.step();
    sim.step();
    sim.step();
    REQUIRE(sim.kv.residence(sim["B"].id) == Residence::host);
    sim.sched.remove(&sim["B"]);                      // the engine reaps a cancelled sequence
    sim.kv.release(sim["B"].id);
    CHECK(sim.kv.n_host_blocks_used() == 0);
    CHECK(sim.kv.n_seqs_swapped() == 0);
    CHECK(sim.kv.residence(sim["B"].id) == Residence::none);
}

TEST_CASE("swap-in waits (FIFO head) until enough device blocks are free, changing nothing") {
    Sim sim({.n_blocks = 4, .block_size_tokens = 4, .n_host_blocks = 4}, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    sim.add("A", 7);
    sim.add("B", 7);
    sim.step();
    sim.step();
    sim.step();                                       // B swapped out (2 host blocks); A holds 3 device blocks
    sim.add("C", 2);
    const ScheduleDecision d = sim.step();            // B needs 3 blocks, 1 is free: nobody is admitted
    CHECK(d.swap_in.empty());
    CHECK(d.run.size() == 1);
    CHECK(sim.kv.residence(sim["B"].id) == Residence::host);
    CHECK(sim.kv.n_host_blocks_used() == 2);
    CHECK(sim.sched.waiting().size() == 2);
    std::vector<BlockCopy> copies;
    CHECK_FALSE(sim.kv.swap_in(sim["B"].id, 9, copies));
    CHECK(copies.empty());
}

TEST_CASE("with prefix caching a swapped-in sequence's fresh blocks are published again") {
    Sim sim({.n_blocks = 4, .block_size_tokens = 4, .enable_prefix_caching = true, .n_host_blocks = 4},
            {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    SchedSeq * a = sim.add("A", 7);
    SchedSeq * b = sim.add("B", 7);
    sim.step();
    sim.step();
    sim.step();
    REQUIRE(sim.kv.residence(b->id) == Residence::host);
    sim.sched.remove(a);
    sim.kv.release(a->id);
    sim.kv.flush_prefix_cache();
    sim.step();                                       // B swapped in
    REQUIRE(sim.kv.residence(b->id) == Residence::device);
    sim.kv.commit_full_blocks(b->id, b->tokens, b->n_computed);
    CHECK(sim.kv.n_blocks_cached() == 2);             // its 8 computed tokens = 2 full blocks
}

}  // TEST_SUITE

TEST_SUITE("engine::scheduler swap") {

TEST_CASE("a swapped-out sequence that outgrows the whole pool is rejected, not retried forever") {
    Sim sim({.n_blocks = 4, .block_size_tokens = 4, .n_host_blocks = 8}, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    sim.add("A", 15);  // (15 + 1) tokens fit exactly in 4 blocks
    sim.step();
    sim.step();
    const ScheduleDecision d = sim.step();            // the 17th token needs a 5th block: A swaps itself out
    CHECK(sim.names_of(d.swapped) == std::vector<std::string>{"A"});
    CHECK(d.swap_out.size() == 4);
    CHECK(sim.kv.n_blocks_free() == 4);
    const ScheduleDecision r = sim.step();            // 17 + 1 tokens can never fit
    CHECK(sim.names_of(r.rejected) == std::vector<std::string>{"A"});
    CHECK(r.swap_in.empty());
    CHECK(sim.sched.waiting().empty());
    CHECK(sim.kv.n_host_blocks_used() == 4);          // until the engine releases the rejected sequence
    sim.kv.release(sim["A"].id);
    CHECK(sim.kv.n_host_blocks_used() == 0);
}

}  // TEST_SUITE
