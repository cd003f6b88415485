// Scheduler (daemon/src/engine/scheduler.cpp) driven step by step against a real KvCache.
//
// The harness plays the engine: after each step it adds n_tokens to n_computed, and a sequence
// whose prefill is complete gets one generated token appended. Expected outcomes are tables of
// (sequence, n_tokens) per step.
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
using fd::kv::KvCache;
using fd::kv::KvCacheConfig;

namespace {

struct Expected {
    std::vector<std::pair<std::string, int32_t>> run;  ///< (name, n_tokens) in batch order
    std::vector<std::string>                     preempted = {};
    std::vector<std::string>                     rejected  = {};
};

struct Sim {
    KvCache                                            kv;
    Scheduler                                          sched;
    std::map<std::string, std::unique_ptr<SchedSeq>>   seqs;
    std::map<const SchedSeq *, std::string>            names;
    int64_t                                            next_id = 1;

    Sim(KvCacheConfig kc, SchedulerConfig sc) : kv(kc), sched(sc) {}

    SchedSeq * add(const std::string & name, int n_prompt) {
        auto s = std::make_unique<SchedSeq>();
        s->id = next_id++;
        s->tokens.resize(static_cast<size_t>(n_prompt));
        std::iota(s->tokens.begin(), s->tokens.end(), 10 * int32_t(s->id));
        SchedSeq * p = s.get();
        names[p] = name;
        seqs[name] = std::move(s);
        sched.add(p);
        return p;
    }

    SchedSeq & operator[](const std::string & name) { return *seqs.at(name); }

    /// The engine finished `name`: drop it from the scheduler and free its blocks.
    void finish(const std::string & name) {
        SchedSeq * s = seqs.at(name).get();
        sched.remove(s);
        kv.release(s->id);
    }

    ScheduleDecision step() {
        ScheduleDecision d = sched.schedule(kv);
        for (const auto & r : d.run) {
            r.seq->n_computed += r.n_tokens;
            REQUIRE(r.seq->n_computed <= static_cast<int64_t>(r.seq->tokens.size()));
            // Every scheduled token has a KV slot.
            REQUIRE(static_cast<int64_t>(kv.block_table(r.seq->id).size()) * kv.block_size() >= r.seq->n_computed);
            if (r.seq->n_computed == static_cast<int64_t>(r.seq->tokens.size())) { r.seq->tokens.push_back(7); }
        }
        REQUIRE(kv.n_blocks_free() + kv.n_blocks_used() == kv.n_blocks_total());
        return d;
    }

    std::vector<std::string> names_of(const std::vector<SchedSeq *> & v) const {
        std::vector<std::string> out;
        for (auto * s : v) { out.push_back(names.at(s)); }
        return out;
    }

    void expect(const Expected & e, int step_no) {
        CAPTURE(step_no);
        const ScheduleDecision d = step();
        std::vector<std::pair<std::string, int32_t>> got;
        for (const auto & r : d.run) { got.emplace_back(names.at(r.seq), r.n_tokens); }
        CHECK(got == e.run);
        CHECK(names_of(d.preempted) == e.preempted);
        CHECK(names_of(d.rejected) == e.rejected);
    }

    std::vector<std::string> waiting() const {
        return names_of(std::vector<SchedSeq *>(sched.waiting().begin(), sched.waiting().end()));
    }
    std::vector<std::string> running() const { return names_of(sched.running()); }
};

}  // namespace

TEST_SUITE("engine::scheduler") {

TEST_CASE("a decode and a new prefill share one step, running sequences first") {
    Sim sim({.n_blocks = 16, .block_size_tokens = 4}, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    sim.add("A", 5);
    sim.expect({{{"A", 5}}}, 1);
    sim.add("B", 7);
    sim.expect({{{"A", 1}, {"B", 7}}}, 2);
    sim.expect({{{"A", 1}, {"B", 1}}}, 3);
    CHECK(sim["A"].tokens.size() == 8);
    CHECK(sim["A"].n_computed == 7);
    CHECK(sim["B"].n_computed == 8);
    CHECK(sim["A"].n_cached == 0);
    CHECK(sim.running() == std::vector<std::string>{"A", "B"});
    CHECK(sim.waiting().empty());
}

TEST_CASE("max_num_batched_tokens chunks a long prefill over several steps") {
    Sim sim({.n_blocks = 32, .block_size_tokens = 4}, {.max_num_seqs = 8, .max_num_batched_tokens = 8});
    sim.add("A", 20);
    sim.expect({{{"A", 8}}}, 1);
    CHECK(sim.kv.block_table(sim["A"].id).size() == 2);  // blocks only for the chunk
    sim.expect({{{"A", 8}}}, 2);
    sim.add("B", 10);
    // A's last 4 prompt tokens, then B takes the remaining budget.
    sim.expect({{{"A", 4}, {"B", 4}}}, 3);
    CHECK(sim["A"].tokens.size() == 21);                 // prefill done: first token generated
    CHECK(sim["B"].tokens.size() == 10);                 // still prefilling
    sim.expect({{{"A", 1}, {"B", 6}}}, 4);
    sim.expect({{{"A", 1}, {"B", 1}}}, 5);
}

TEST_CASE("the token budget is spent on running sequences before new ones are admitted") {
    Sim sim({.n_blocks = 32, .block_size_tokens = 4}, {.max_num_seqs = 8, .max_num_batched_tokens = 3});
    sim.add("A", 2);
    sim.add("B", 2);
    sim.add("C", 5);
    sim.expect({{{"A", 2}, {"B", 1}}}, 1);
    sim.expect({{{"A", 1}, {"B", 1}, {"C", 1}}}, 2);
    sim.expect({{{"A", 1}, {"B", 1}, {"C", 1}}}, 3);
    CHECK(sim.waiting().empty());
}

TEST_CASE("max_num_seqs limits admission until a running sequence finishes") {
    Sim sim({.n_blocks = 32, .block_size_tokens = 4}, {.max_num_seqs = 2, .max_num_batched_tokens = 100});
    sim.add("A", 3);
    sim.add("B", 3);
    sim.add("C", 3);
    sim.expect({{{"A", 3}, {"B", 3}}}, 1);
    CHECK(sim.waiting() == std::vector<std::string>{"C"});
    sim.expect({{{"A", 1}, {"B", 1}}}, 2);
    sim.finish("A");
    sim.expect({{{"B", 1}, {"C", 3}}}, 3);
    CHECK(sim.running() == std::vector<std::string>{"B", "C"});
    CHECK(sim.waiting().empty());
}

TEST_CASE("when blocks run out the newest running sequence is preempted and requeued at the front") {
    // 4 blocks of 4 tokens. A and B take 2 blocks each; A's 9th token needs a third.
    Sim sim({.n_blocks = 4, .block_size_tokens = 4}, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    sim.add("A", 7);
    sim.add("B", 7);
    sim.expect({{{"A", 7}, {"B", 7}}}, 1);
    sim.expect({{{"A", 1}, {"B", 1}}}, 2);   // 8 tokens each: still 2 blocks
    CHECK(sim.kv.n_blocks_free() == 0);
    sim.add("C", 2);                          // waits behind the preempted B
    sim.expect({{{"A", 1}}, {"B"}}, 3);
    CHECK(sim["B"].n_computed == 0);
    CHECK(sim["B"].n_preempted == 1);
    CHECK(sim["B"].tokens.size() == 9);       // generated tokens are kept and recomputed
    CHECK(sim.kv.block_table(sim["B"].id).empty());
    CHECK(sim.running() == std::vector<std::string>{"A"});
    CHECK(sim.waiting() == std::vector<std::string>{"B", "C"});
    // B needs 3 blocks but only 1 is free: the FIFO head blocks C as well.
    sim.expect({{{"A", 1}}}, 4);
    CHECK(sim.waiting() == std::vector<std::string>{"B", "C"});
    sim.finish("A");
    // B is re-admitted first and prefills all 9 of its tokens again, then C.
    sim.expect({{{"B", 9}, {"C", 2}}}, 5);
    CHECK(sim["B"].n_cached == 0);
    CHECK(sim.kv.n_blocks_used() == 4);
}

TEST_CASE("preemption takes victims from the newest end until the allocation fits") {
    Sim sim({.n_blocks = 6, .block_size_tokens = 4}, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    sim.add("A", 8);   // 2 blocks, its 9th token needs a 3rd
    sim.add("B", 3);   // 1 block
    sim.add("C", 3);   // 1 block
    sim.add("D", 8);   // 2 blocks
    sim.expect({{{"A", 8}, {"B", 3}, {"C", 3}, {"D", 8}}}, 1);
    CHECK(sim.kv.n_blocks_free() == 0);
    // A needs one block: D (newest) is preempted; that frees 2, so B and C keep running.
    sim.expect({{{"A", 1}, {"B", 1}, {"C", 1}}, {"D"}}, 2);
    CHECK(sim.waiting() == std::vector<std::string>{"D"});
    CHECK(sim.running() == std::vector<std::string>{"A", "B", "C"});
    // B (5 tokens) and C now need a second block each, A is fine: 1 free block, so C goes.
    sim.expect({{{"A", 1}, {"B", 1}}, {"C"}}, 3);
    CHECK(sim.waiting() == std::vector<std::string>{"C", "D"});
    CHECK(sim["C"].n_preempted == 1);
    CHECK(sim["D"].n_preempted == 1);
}

TEST_CASE("a sequence that outgrows the whole pool preempts itself and is then rejected") {
    Sim sim({.n_blocks = 4, .block_size_tokens = 4}, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    sim.add("A", 15);  // (15 + 1) tokens fit exactly in 4 blocks
    sim.expect({{{"A", 15}}}, 1);
    sim.expect({{{"A", 1}}}, 2);
    CHECK(sim["A"].tokens.size() == 17);
    sim.expect({{}, {"A"}}, 3);                 // the 17th token needs a 5th block
    CHECK(sim.kv.n_blocks_free() == 4);
    sim.expect({{}, {}, {"A"}}, 4);             // 17 + 1 tokens can never fit
    CHECK(sim.waiting().empty());
    CHECK(sim.running().empty());
}

TEST_CASE("a prompt too long for the whole pool is rejected and the queue moves on") {
    Sim sim({.n_blocks = 4, .block_size_tokens = 4}, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    sim.add("big", 16);     // 16 + 1 tokens need 5 blocks
    sim.add("fits", 15);    // 15 + 1 tokens need 4
    sim.expect({{{"fits", 15}}, {}, {"big"}}, 1);
    CHECK(sim.waiting().empty());
    CHECK(sim.running() == std::vector<std::string>{"fits"});
}

TEST_CASE("a waiting sequence whose prefix is cached starts after the cached tokens") {
    Sim sim({.n_blocks = 16, .block_size_tokens = 4, .enable_prefix_caching = true},
            {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    SchedSeq * a = sim.add("A", 10);
    sim.expect({{{"A", 10}}}, 1);
    sim.kv.commit_full_blocks(a->id, a->tokens, a->n_computed);  // the engine publishes A's blocks
    SchedSeq * b = sim.add("B", 10);
    b->tokens = std::vector<int32_t>(a->tokens.begin(), a->tokens.begin() + 10);
    sim.expect({{{"A", 1}, {"B", 2}}}, 2);     // (10 - 1) / 4 = 2 cached blocks = 8 tokens
    CHECK(b->n_cached == 8);
    CHECK(b->n_computed == 10);
}

TEST_CASE("a scoring sequence (no_prefix_cache) computes every row, max_chunk tokens per step") {
    Sim sim({.n_blocks = 16, .block_size_tokens = 4, .enable_prefix_caching = true},
            {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    SchedSeq * a = sim.add("A", 10);
    sim.expect({{{"A", 10}}}, 1);
    sim.kv.commit_full_blocks(a->id, a->tokens, a->n_computed);
    SchedSeq * b = sim.add("B", 10);
    b->tokens          = std::vector<int32_t>(a->tokens.begin(), a->tokens.begin() + 10);
    b->no_prefix_cache = true;
    b->max_chunk       = 4;
    sim.expect({{{"A", 1}, {"B", 4}}}, 2);
    CHECK(b->n_cached == 0);
    sim.expect({{{"A", 1}, {"B", 4}}}, 3);
    sim.expect({{{"A", 1}, {"B", 2}}}, 4);
    CHECK(b->n_computed == 10);
}

}  // TEST_SUITE

TEST_CASE("scheduler: drafts ride on a decode within budget and free blocks, never by preemption") {
    // 8 blocks of 4 tokens; budget 8.
    KvCache   kv(KvCacheConfig{.n_blocks = 8, .block_size_tokens = 4});
    Scheduler sched(SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 8});
    SchedSeq  a, b;
    a.id = 1;
    a.tokens = {1, 2, 3, 4, 5};
    b.id = 2;
    b.tokens = {6, 7, 8};
    sched.add(&a);
    sched.add(&b);
    auto d = sched.schedule(kv);  // prefills: a 5 tokens (2 blocks), b 3 (1 block)
    REQUIRE(d.run.size() == 2);
    a.n_computed = 5;
    b.n_computed = 3;
    a.tokens.push_back(9);
    b.tokens.push_back(10);
    // a asks for 3 drafts: positions 5..8 need blocks 1 (held) and 2 (new): granted.
    a.n_draft = 3;
    b.n_draft = 0;
    d = sched.schedule(kv);
    REQUIRE(d.run.size() == 2);
    CHECK(d.run[0].seq == &a);
    CHECK(d.run[0].n_tokens == 1);
    CHECK(d.run[0].n_draft == 3);
    CHECK(kv.block_table(a.id).size() == 3);
    CHECK(d.run[1].n_draft == 0);
    // The budget caps drafts: 8 tokens, b's decode first this time needs 1, so a may take 1 + 6 at most.
    kv.trim(a.id, 6);  // the engine's rollback: a's tokens are 6, drafts rejected
    CHECK(kv.block_table(a.id).size() == 2);
    a.n_draft = 20;
    d = sched.schedule(kv);
    CHECK(d.run[0].n_draft == 7);  // 1 decode + 7 drafts = the whole budget; blocks 2, 3 taken
    CHECK(kv.block_table(a.id).size() == 4);
    CHECK(d.run.size() == 1);      // nothing left of the budget for b
    kv.trim(a.id, 6);
    // No free block for the drafts: the step runs without them and preempts nobody.
    a.n_draft = 0;
    b.n_draft = 8;
    SchedSeq c;
    c.id = 3;
    REQUIRE(kv.n_blocks_free() == 5);
    REQUIRE(kv.allocate(c.id, 20));  // every free block
    d = sched.schedule(kv);
    REQUIRE(d.run.size() == 2);
    CHECK(d.n_preempted() == 0);
    CHECK(d.run[1].seq == &b);
    CHECK(d.run[1].n_tokens == 1);
    CHECK(d.run[1].n_draft == 0);
}
