// fd/kv/host_tier.h — the host KV tier (--swap-space): one pool of host blocks shared by the
// KV of swapped-out sequences and the prefix blocks the device pool evicts (FastDeploy's
// multi-level cache, SGLang's HiCache host layer). Metadata only: the bytes are the Worker's
// kv_swap region (pinned host memory on CUDA), indexed by the ids handed out here; the copies
// themselves are fd::kv::BlockCopy lists the KvCache hands the engine.
//
// A host block is in exactly one state:
//   free      in free_, holds nothing;
//   in use    ref > 0: a swapped-out sequence's block, or held until this step's copies ran;
//   cached    ref == 0 and published: a prefix block (chain hash, parent chain hash, tokens,
//             weight epoch) on the LRU list, reusable by a lookup until take() evicts it.
// A cached block may also be held (ref > 0) while a copy reads or writes it; it then leaves the
// LRU until end_step(). Entries are keyed by weight epoch: find() only answers entries of the
// epoch asked for, and drop_other_epochs() forgets the rest (no KV of older weights is reused).
//
// Invariants: n_available() + n_in_use() == n_total(); n_cached() <= n_total().
// Engine thread only.
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

namespace fd::kv {

class HostTier {
public:
    HostTier() = default;
    /// `n_blocks` host blocks (>= 0) of `block_size_tokens` tokens each.
    HostTier(int64_t n_blocks, int32_t block_size_tokens);

    /// A block to write into: a free one, else the least recently used unreferenced cached one
    /// (its entry is forgotten: an eviction). Returns -1 when every block is in use.
    /// The block comes back with ref 1 and no entry.
    int32_t take();
    /// Drop one reference; at 0 a published block goes to the LRU's newest end, else it is free.
    void put(int32_t id);
    /// Take a reference until end_step() (a copy this step reads or writes the block).
    void hold(int32_t id);
    /// Hand an existing reference over to end_step() (e.g. the blocks a swap-in reads).
    void put_after_step(int32_t id) { held_.push_back(id); }
    /// This step's copies ran: every hold is put.
    void end_step();

    /// Publish block `id` (held or in use) as the prefix block with chain hash `hash` whose
    /// previous block has chain hash `parent_hash` (0 = first block), holding `tokens`
    /// [block_size] computed under weight `epoch`. Replaces an older entry of the same hash.
    void publish(int32_t id, uint64_t hash, uint64_t parent_hash, const int32_t * tokens, uint64_t epoch);
    /// The cached block with that chain hash, parent chain hash, tokens and epoch; -1 = none.
    int32_t find(uint64_t hash, uint64_t parent_hash, const int32_t * tokens, uint64_t epoch) const;
    /// Whether an entry with this chain hash and epoch exists (an eviction need not copy it again).
    bool contains(uint64_t hash, uint64_t epoch) const;
    /// Forget every prefix entry (blocks in use stay with their owners). Returns entries dropped.
    int64_t flush();
    /// Forget the entries of any other weight epoch. Returns entries dropped.
    int64_t drop_other_epochs(uint64_t epoch);

    int64_t n_total() const { return static_cast<int64_t>(blocks_.size()); }
    /// Blocks take() can hand out now: free + unreferenced cached.
    int64_t n_available() const { return static_cast<int64_t>(free_.size() + lru_.size()); }
    int64_t n_in_use() const { return n_total() - n_available(); }
    int64_t n_cached() const { return static_cast<int64_t>(by_hash_.size()); }
    int64_t n_evictions_total() const { return n_evictions_; }

private:
    struct Block {
        int32_t              ref       = 0;
        bool                 published = false;
        uint64_t             hash = 0, parent_hash = 0, epoch = 0;
        std::vector<int32_t> tokens;
        std::list<int32_t>::iterator lru_it;
    };
    void unpublish(int32_t id);

    int32_t                               block_size_ = 0;
    std::vector<Block>                    blocks_;
    std::vector<int32_t>                  free_;
    std::list<int32_t>                    lru_;      ///< published blocks with ref 0, oldest first
    std::unordered_map<uint64_t, int32_t> by_hash_;
    std::vector<int32_t>                  held_;
    int64_t                               n_evictions_ = 0;
};

}  // namespace fd::kv
