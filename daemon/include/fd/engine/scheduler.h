// fd/engine/scheduler.h — continuous batching over the paged KV cache.
//
// Each step decides which sequences advance and by how many tokens, under a token budget
// (max_num_batched_tokens) and max_num_seqs: running sequences first, in arrival order (decode
// = 1 token, an unfinished prefill = its next chunk), then waiting ones (FIFO) while blocks and
// budget last, so prefill and decode share a step. When KV blocks run out, the most recently
// admitted running sequence is preempted and returns to the front of the queue:
//   - by swap, when the KV cache has a host swap pool (--swap-space) with room for its computed
//     blocks: the decision lists the device → host copies (swap_out), the sequence keeps its
//     n_computed, and when it is admitted again it gets fresh device blocks and the host → device
//     copies (swap_in) before its next step;
//   - by recompute otherwise (no swap pool, pool full, nothing computed yet): its blocks are
//     released and it prefills all its tokens again.
// The engine runs a decision's copies before the step's forward pass. A decision never holds
// both swap_out and swap_in (admission, the only swap-in, is skipped in a step that preempted),
// so a host block freed by a swap-in is never the target of a swap-out in the same step.
// With prefix caching and a host pool the decision also lists the host KV tier's copies
// (tier_out: evicted prefix blocks saved to the host; tier_in: host-tier prefix hits loaded
// back; tier_bg: the write-ahead offloads of reused blocks about to be evicted, run in the
// background); the engine runs every device → host copy (swap_out, tier_out) before every host →
// device one (swap_in, tier_in), then KvCache::copies_done() (fd/kv/kv_cache.h), and starts
// tier_bg last. A waiting sequence whose prefix hits the host tier is only matched (its host
// blocks loaded) when it is sure to be admitted (KvCache::admit_sure).
// Speculative decoding: a running sequence with one token left to compute may ask to verify
// n_draft draft tokens in the same step (the engine proposes them before schedule()); they are
// granted (ScheduledSeq::n_draft) when the budget and free KV blocks allow, never by preempting
// another sequence (then the step runs without them), and count against the token budget.
// A sequence may cap its chunk (max_chunk) and skip the prefix cache (no_prefix_cache: scoring
// wants every prompt row).
//
// Sequence states:  waiting --admit / swap in--> running --finish--> (removed)
//                       ^                           |
//                       +--preempt (swap out or recompute)
// Engine thread only. Holds non-owning pointers; the engine owns the sequences.
#pragma once

#include "fd/kv/kv_cache.h"

#include <cstdint>
#include <deque>
#include <vector>

namespace fd::engine {

/// The scheduling view of one sequence (the engine's Sequence derives from it).
struct SchedSeq {
    kv::SeqId            id = 0;
    std::vector<int32_t> tokens;           ///< prompt + generated so far
    int64_t              n_computed  = 0;  ///< tokens whose KV is in the cache
    int32_t              n_cached    = -1; ///< prompt tokens found in the prefix cache at first admission (-1 = not yet admitted)
    int32_t              n_host_cached = 0; ///< of n_cached, the tokens copied back from the host KV tier
    int32_t              n_preempted = 0;
    bool                 no_prefix_cache = false;  ///< every prompt row is computed (its logits are wanted)
    int32_t              max_chunk       = 0;      ///< > 0: at most this many tokens per step
    uint64_t             prefix_salt     = 0;      ///< prefix-cache namespace (vLLM's cache_salt, hashed; 0 = none)
    int32_t              n_draft         = 0;      ///< draft tokens to verify this step (set by the engine before schedule())

    int64_t n_remaining() const { return static_cast<int64_t>(tokens.size()) - n_computed; }
};

struct SchedulerConfig {
    int32_t max_num_seqs           = 64;    ///< sequences in the running batch, >= 1
    int32_t max_num_batched_tokens = 2048;  ///< tokens per step (prefill chunks + decodes), >= 1
};

struct ScheduledSeq {
    SchedSeq * seq      = nullptr;
    int32_t    n_tokens = 0;  ///< tokens to compute this step, starting at seq->n_computed
    int32_t    n_draft  = 0;  ///< draft tokens granted after them (n_tokens == 1); KV blocks held for all
};

struct ScheduleDecision {
    std::vector<ScheduledSeq>  run;         ///< in batch order
    std::vector<SchedSeq *>    preempted;   ///< released this step (recompute), back in the queue
    std::vector<SchedSeq *>    swapped;     ///< preempted this step by swap (KV to the host pool), back in the queue
    std::vector<SchedSeq *>    swapped_in;  ///< admitted again this step from the host pool (also in `run`)
    std::vector<SchedSeq *>    rejected;    ///< can never fit the KV pool; removed from the queue
    std::vector<kv::BlockCopy> swap_out;    ///< device → host copies to run before this step
    std::vector<kv::BlockCopy> swap_in;     ///< host → device copies to run before this step
    std::vector<kv::BlockCopy> tier_out;    ///< host KV tier: evicted prefix blocks, device → host
    std::vector<kv::BlockCopy> tier_in;     ///< host KV tier: prefix hits, host → device
    std::vector<kv::BlockCopy> tier_bg;     ///< host KV tier: write-ahead offloads, device → host, in the background

    size_t n_preempted() const { return preempted.size() + swapped.size(); }
};

class Scheduler {
public:
    explicit Scheduler(const SchedulerConfig & cfg) : cfg_(cfg) {}

    void add(SchedSeq * s) { waiting_.push_back(s); }
    /// Remove `s` from whichever queue holds it (does not touch the KV cache).
    void remove(SchedSeq * s);

    /// Decide this step; allocates (and on preemption releases) KV blocks in `kv`.
    ScheduleDecision schedule(kv::KvCache & kv);

    const std::deque<SchedSeq *> &  waiting() const { return waiting_; }
    const std::vector<SchedSeq *> & running() const { return running_; }

private:
    void preempt(SchedSeq * s, kv::KvCache & kv, ScheduleDecision & d);

    SchedulerConfig         cfg_;
    std::deque<SchedSeq *>  waiting_;
    std::vector<SchedSeq *> running_;
};

}  // namespace fd::engine
