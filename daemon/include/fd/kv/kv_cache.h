// fd/kv/kv_cache.h — paged KV block bookkeeping and the prefix cache. Metadata only: the K/V
// memory itself is the Worker's pool, indexed by the block ids handed out here.
//
// Owns: a free list of block ids, per-block ref counts, per-sequence block tables, and (with
// prefix caching) a map from the hash chain of a full block's tokens to its block id. A cached
// block whose ref count drops to 0 stays reusable until the allocator evicts it (LRU) for new
// blocks. Engine thread only.
//
// The host swap tier (--swap-space): a second pool of n_host_blocks blocks. swap_out() moves a
// sequence's computed blocks to host blocks (its device blocks are released), swap_in() gives it
// fresh device blocks and frees the host ones; each returns the block copies the Worker must run
// (fd/kv/block_copy.h). A sequence's blocks reside on the device or on the host, never both.
//
// The multi-level prefix cache (prefix caching on and a host tier): the same host pool
// (fd/kv/host_tier.h) also keeps the prefix blocks the device pool evicts. Only blocks likely to
// be reused go there: a prompt block (what GRPO's later samples and the next turn of a
// conversation send again) or a block some lookup has hit (match_prefix attached it to another
// sequence), never a generated block only its own sequence used (a GRPO sample's tokens).
//   Write-ahead, in the background: plan_background_offloads() (after the step is scheduled)
//   picks such blocks among the oldest unreferenced device blocks, the next ones an eviction
//   takes, and queues their device → host copies; the engine starts them with the step's
//   swap_kv (they run while the step computes) and, before it schedules again, waits for them
//   with its next swap_kv call and calls background_done(). Until then the device blocks stay
//   pinned (take_block never hands one out) and the host blocks held (never evicted, never
//   read: find() skips them), so no block is ever torn.
//   At eviction: take_block() evicting such a block that the host tier lacks queues its copy
//   for this step (synchronous: it runs before the forward rewrites the block).
// match_prefix() continues a device-cache hit with host-tier hits, each copied back
// (host → device) into a fresh device block instead of being recomputed. These copies are
// collected with take_tier_copies() and must run in the step that scheduled them, every
// device → host copy before every host → device copy and both before the forward (the engine's
// swap_kv does exactly that); copies_done() then releases the blocks they held, so no block a
// pending copy reads or writes is handed out again in the same step. admit_sure() tells the
// scheduler whether a sequence would fit with its host hits, so that host blocks are only
// loaded for a sequence that is admitted. Host entries are keyed by weight epoch
// (set_weight_epoch: entries of other epochs are dropped, never matched). set_transfers_paused()
// stops both directions (pause; the engine also waits for the background copies in flight);
// what was copied stays.
//
// Invariants: n_blocks_free() + n_blocks_used() == n_blocks_total();
//             n_host_blocks_free() + n_host_blocks_used() == n_host_blocks_total().
#pragma once

#include "fd/kv/block_copy.h"
#include "fd/kv/host_tier.h"

#include <cstdint>
#include <list>
#include <optional>
#include <unordered_map>
#include <vector>

namespace fd::kv {

using SeqId = int64_t;

struct KvCacheConfig {
    int64_t n_blocks              = 0;      ///< total blocks in the pool
    int32_t block_size_tokens     = 16;     ///< tokens per block
    bool    enable_prefix_caching = false;  ///< reuse full blocks of identical token prefixes
    int64_t n_host_blocks         = 0;      ///< host swap pool blocks (--swap-space); 0 = no swap tier
};

/// Where a sequence's KV blocks are.
enum class Residence { none, device, host };

class KvCache {
public:
    explicit KvCache(const KvCacheConfig & cfg);

    /// With prefix caching: attach the cached full blocks that hold a prefix of tokens[0, n-1)
    /// (the last token is always recomputed so its logits exist) to `seq`, whose table must be
    /// empty: device hits first, then host-tier hits (each takes a device block and queues a
    /// host → device copy). Returns the number of tokens whose KV is now present (a multiple of
    /// block size); `*n_from_host` (if given) receives how many of them came from the host tier.
    /// Only blocks committed with the same `salt` match (vLLM's cache_salt; 0 = none).
    int32_t match_prefix(SeqId seq, const std::vector<int32_t> & tokens, uint64_t salt = 0, int32_t * n_from_host = nullptr);

    /// Whether a sequence asking match_prefix(tokens, salt) would then find enough free blocks
    /// for the `n_more` tokens after its prefix hits (`n_more(n_cached)` of them, n_cached being
    /// the tokens the device and host hits cover): true without host-tier hits (match_prefix
    /// loads nothing then), so only host loads wait for a sure admission. Changes nothing.
    template <class NMore>
    bool admit_sure(const std::vector<int32_t> & tokens, uint64_t salt, NMore && n_more) const {
        const PrefixProbe p = probe_prefix(tokens, salt);
        if (p.n_host == 0) { return true; }
        const int64_t bs = cfg_.block_size_tokens, cached = (p.n_device + p.n_host) * bs;
        const int64_t total = (cached + static_cast<int64_t>(n_more(cached)) + bs - 1) / bs;
        return total - p.n_device <= n_blocks_free() - p.n_device_idle;
    }

    /// Blocks `seq` still needs to hold `n_tokens` tokens.
    int64_t n_blocks_needed(SeqId seq, int64_t n_tokens) const;

    /// Grow `seq`'s table to hold `n_tokens` tokens. Returns false (and changes nothing) when not
    /// enough blocks are free.
    bool allocate(SeqId seq, int64_t n_tokens);

    /// With prefix caching: publish `seq`'s full blocks among tokens[0, n_computed) so later
    /// sequences can reuse them (those asking with the same `salt`). The first `n_prompt` tokens
    /// are the prompt (-1: all of them): a block wholly inside it is worth the host tier even
    /// before a lookup hit it (prompts are what RL sends again), a generated one only once hit.
    void commit_full_blocks(SeqId seq, const std::vector<int32_t> & tokens, int64_t n_computed, uint64_t salt = 0,
                            int64_t n_prompt = -1);

    /// Speculative decoding's rollback: give back `seq`'s device blocks past the ones that hold
    /// its first `n_tokens` tokens (blocks allocated for draft tokens the target rejected; their
    /// slots are rewritten when those positions are computed again). Blocks published with
    /// commit_full_blocks hold computed tokens only and are never among them (FD_CHECK).
    void trim(SeqId seq, int64_t n_tokens);

    /// Drop `seq`'s blocks, device and host (cached ones stay reusable until evicted).
    void release(SeqId seq);

    /// Move the blocks holding `seq`'s first `n_tokens` tokens to the host pool: appends one copy
    /// (device → host) per block to `copies`, then releases every device block of `seq`.
    /// Returns false (and changes nothing) when n_tokens is 0, `seq` holds no device blocks or
    /// the host pool lacks free blocks. The copies must run before the released blocks are
    /// written again (the engine runs them before the step's forward).
    bool swap_out(SeqId seq, int64_t n_tokens, std::vector<BlockCopy> & copies);

    /// Give host-resident `seq` device blocks for `n_tokens` tokens (at least what it swapped
    /// out): appends one copy (host → device) per host block to `copies`, frees the host blocks.
    /// Returns false (and changes nothing) when not enough device blocks are free.
    /// Requires  residence(seq) == host.
    bool swap_in(SeqId seq, int64_t n_tokens, std::vector<BlockCopy> & copies);

    Residence residence(SeqId seq) const;

    /// Forget every cached prefix of the device pool (blocks still in use stay with their sequences).
    void flush_prefix_cache();
    /// Forget every prefix block of the host tier (swapped-out sequences keep theirs). Returns blocks dropped.
    int64_t flush_host_tier();
    /// The device pool was released and mapped again: every device block is free, no sequence
    /// holds any; the host tier's prefix entries stay (their bytes are in the kv_swap region).
    /// Requires  no sequence is swapped out.
    void reset_device();

    /// The weight epoch new KV is computed under; host entries of any other epoch are dropped.
    /// Returns the host blocks dropped.
    int64_t set_weight_epoch(uint64_t epoch);
    uint64_t weight_epoch() const { return epoch_; }
    /// While paused no tier copy is queued (evicted blocks are dropped, lookups stop at the device).
    void set_transfers_paused(bool paused) { transfers_paused_ = paused; }
    bool transfers_paused() const { return transfers_paused_; }
    /// Whether prefix blocks go to the host tier (prefix caching on and a host pool).
    bool tier_enabled() const { return cfg_.enable_prefix_caching && cfg_.n_host_blocks > 0; }
    /// Append (and forget) the tier copies queued since the last call: device → host to `out`,
    /// host → device to `in`.
    void take_tier_copies(std::vector<BlockCopy> & out, std::vector<BlockCopy> & in);
    /// This step's copies ran: the blocks they held are released.
    void copies_done();
    /// Write-ahead (see the header): append to `bg` the device → host copies of up to
    /// `max_blocks` reused blocks among the oldest `window` unreferenced device blocks that the
    /// host tier lacks; their blocks stay pinned / held until background_done(). Nothing while
    /// paused, without a tier or while earlier ones are in flight. Returns the copies appended.
    int64_t plan_background_offloads(std::vector<BlockCopy> & bg, int64_t window, int64_t max_blocks);
    /// The background copies planned so far landed (the engine waited for them): unpin / release.
    void background_done();
    /// Background copies planned and not yet background_done() (blocks).
    int64_t n_background_in_flight() const { return static_cast<int64_t>(bg_dev_pinned_.size()); }

    /// Block ids of `seq`, in token order.  Shape [ceil(n_tokens / block_size)].
    const std::vector<int32_t> & block_table(SeqId seq) const;

    int64_t n_blocks_total() const { return cfg_.n_blocks; }
    int64_t n_blocks_free() const { return static_cast<int64_t>(free_.size() + lru_.size()); }
    int64_t n_blocks_used() const { return n_blocks_total() - n_blocks_free(); }
    int64_t n_blocks_cached() const { return static_cast<int64_t>(by_hash_.size()); }
    int32_t block_size() const { return cfg_.block_size_tokens; }
    int64_t n_host_blocks_total() const { return cfg_.n_host_blocks; }
    int64_t n_host_blocks_free() const { return host_.n_available(); }
    int64_t n_host_blocks_used() const { return n_host_blocks_total() - n_host_blocks_free(); }
    /// Sequences whose blocks are in the host pool.
    int64_t n_seqs_swapped() const { return static_cast<int64_t>(host_tables_.size()); }
    /// Host blocks holding prefix entries (reusable; counted in n_host_blocks_free()).
    int64_t n_host_blocks_cached() const { return host_.n_cached(); }

    /// Tier counters since construction (blocks).
    struct TierCounters {
        int64_t offloaded   = 0;  ///< device → host prefix copies queued (at eviction + background)
        int64_t offloaded_background = 0;  ///< of which write-ahead, in the background
        int64_t loaded      = 0;  ///< host → device prefix copies queued (host-tier hits)
        int64_t evicted     = 0;  ///< host prefix entries evicted (LRU) to make room
        int64_t invalidated = 0;  ///< host prefix entries dropped by a weight change or a flush
    };
    TierCounters tier_counters() const;

private:
    struct Block {
        int32_t  ref    = 0;
        bool     cached = false;          ///< present in by_hash_
        uint64_t hash   = 0;
        int32_t  parent = -1;             ///< previous block of the chain (-1 = first)
        uint64_t salt   = 0;              ///< the committing sequence's prefix salt, to verify hash hits
        uint64_t parent_hash = 0;         ///< previous block's chain hash (0 = first)
        uint64_t epoch  = 0;              ///< weight epoch the block's KV was computed under
        int32_t  hits   = 0;              ///< lookups that attached it to another sequence (or a host hit brought it back)
        bool     in_prompt = false;       ///< every token of it is a prompt token
        bool     pinned = false;          ///< a background copy reads it: never handed out
        std::vector<int32_t> tokens;      ///< the block's tokens, to verify hash hits
        std::list<int32_t>::iterator lru_it;
    };

    struct PrefixProbe {
        int64_t n_device = 0;       ///< device-cache hits (blocks)
        int64_t n_device_idle = 0;  ///< of which unreferenced (counted free until attached)
        int64_t n_host = 0;         ///< host-tier hits after them (blocks)
    };
    /// What match_prefix would find, without attaching or loading anything.
    PrefixProbe probe_prefix(const std::vector<int32_t> & tokens, uint64_t salt) const;
    /// A device block worth keeping in the host tier: computed under this epoch, reused, absent there.
    bool worth_offloading(const Block & b) const;
    int32_t  take_block();
    void     offload(int32_t id);
    void     unref(int32_t id);
    uint64_t chain_hash(uint64_t parent_hash, const int32_t * tokens) const;

    KvCacheConfig                                   cfg_;
    std::vector<Block>                              blocks_;
    std::vector<int32_t>                            free_;     ///< never-cached free blocks
    std::list<int32_t>                              lru_;      ///< cached blocks with ref 0, oldest first
    std::unordered_map<uint64_t, int32_t>           by_hash_;
    std::unordered_map<SeqId, std::vector<int32_t>> tables_;
    std::unordered_map<SeqId, int64_t>              n_committed_blocks_;
    HostTier                                        host_;
    std::unordered_map<SeqId, std::vector<int32_t>> host_tables_;  ///< swapped-out sequences' host blocks, in token order
    uint64_t                                        epoch_ = 0;
    bool                                            transfers_paused_ = false;
    std::vector<BlockCopy>                          tier_out_, tier_in_;  ///< queued tier copies
    std::vector<int32_t>                            dev_held_;  ///< device blocks a queued host → device copy writes
    std::vector<int32_t>                            bg_dev_pinned_, bg_host_held_;  ///< blocks of background copies in flight
    TierCounters                                    counters_;
};

}  // namespace fd::kv
