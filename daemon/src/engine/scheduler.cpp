#include "fd/engine/scheduler.h"

#include <algorithm>

namespace fd::engine {

void Scheduler::remove(SchedSeq * s) {
    running_.erase(std::remove(running_.begin(), running_.end(), s), running_.end());
    waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), s), waiting_.end());
}

void Scheduler::preempt(SchedSeq * s, kv::KvCache & kv, ScheduleDecision & d) {
    ++s->n_preempted;
    running_.erase(std::remove(running_.begin(), running_.end(), s), running_.end());
    waiting_.push_front(s);
    if (kv.swap_out(s->id, s->n_computed, d.swap_out)) {  // keeps n_computed: its KV comes back
        d.swapped.push_back(s);
        return;
    }
    kv.release(s->id);
    s->n_computed = 0;
    d.preempted.push_back(s);
}

namespace {
int64_t chunk(const SchedSeq * s, int64_t budget) {
    const int64_t n = std::min(s->n_remaining(), budget);
    return s->max_chunk > 0 ? std::min<int64_t>(n, s->max_chunk) : n;
}
}  // namespace

ScheduleDecision Scheduler::schedule(kv::KvCache & kv) {
    ScheduleDecision d;
    int64_t budget = cfg_.max_num_batched_tokens;

    // 1. Running sequences, oldest first; preempt from the newest end when blocks run out.
    for (size_t i = 0; i < running_.size() && budget > 0;) {
        SchedSeq *    s = running_[i];
        const int64_t n = chunk(s, budget);
        // Drafts: only on top of a decode, only with blocks already free (never a preemption).
        const int64_t g = s->n_remaining() == 1 && n == 1 ? std::min<int64_t>(s->n_draft, budget - 1) : 0;
        if (g > 0 && kv.allocate(s->id, s->n_computed + n + g)) {
            d.run.push_back({s, static_cast<int32_t>(n), static_cast<int32_t>(g)});
            budget -= n + g;
            ++i;
            continue;
        }
        bool          self_preempted = false;
        while (!kv.allocate(s->id, s->n_computed + n)) {
            SchedSeq * victim = running_.back();
            preempt(victim, kv, d);
            if (victim == s) { self_preempted = true; break; }
        }
        if (self_preempted) { break; }
        d.run.push_back({s, static_cast<int32_t>(n)});
        budget -= n;
        ++i;
    }

    // 2. Waiting sequences, FIFO, unless this step had to preempt.
    while (d.n_preempted() == 0 && !waiting_.empty() && budget > 0 &&
           static_cast<int32_t>(running_.size()) < cfg_.max_num_seqs) {
        SchedSeq * s = waiting_.front();
        const int64_t blocks_min = (static_cast<int64_t>(s->tokens.size()) + 1 + kv.block_size() - 1) / kv.block_size();
        if (blocks_min > kv.n_blocks_total()) {  // (the engine's release frees a swapped-out one's host blocks)
            waiting_.pop_front();
            d.rejected.push_back(s);
            continue;
        }
        if (kv.residence(s->id) == kv::Residence::host) {  // swapped out: its KV comes back, no prefill
            const int64_t n = chunk(s, budget);
            if (!kv.swap_in(s->id, s->n_computed + n, d.swap_in)) { break; }
            waiting_.pop_front();
            running_.push_back(s);
            d.run.push_back({s, static_cast<int32_t>(n)});
            d.swapped_in.push_back(s);
            budget -= n;
            continue;
        }
        // Host-tier hits are loaded only for a sequence that is then sure to fit (else nothing is
        // copied for it, and it waits as it would have).
        if (!s->no_prefix_cache && !kv.admit_sure(s->tokens, s->prefix_salt, [&](int64_t n_cached) {
                const int64_t n = std::min(static_cast<int64_t>(s->tokens.size()) - n_cached, budget);
                return s->max_chunk > 0 ? std::min<int64_t>(n, s->max_chunk) : n;
            })) {
            break;
        }
        int32_t       from_host = 0;
        const int32_t cached    = s->no_prefix_cache ? 0 : kv.match_prefix(s->id, s->tokens, s->prefix_salt, &from_host);
        s->n_computed = cached;
        const int64_t n = chunk(s, budget);
        if (!kv.allocate(s->id, s->n_computed + n)) {
            kv.release(s->id);
            s->n_computed = 0;
            break;
        }
        if (s->n_cached < 0) {
            s->n_cached      = cached;
            s->n_host_cached = from_host;
        }
        waiting_.pop_front();
        running_.push_back(s);
        d.run.push_back({s, static_cast<int32_t>(n)});
        budget -= n;
    }
    kv.take_tier_copies(d.tier_out, d.tier_in);
    // Write-ahead: the reused blocks among the next ones an eviction takes go to the host now,
    // in the background (a window of an eighth of the pool, at least 16 blocks).
    const int64_t window = std::max<int64_t>(16, kv.n_blocks_total() / 8);
    kv.plan_background_offloads(d.tier_bg, window, window);
    return d;
}

}  // namespace fd::engine
