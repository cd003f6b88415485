#include "fd/kv/kv_cache.h"

#include "fd/status.h"

#include <algorithm>
#include <functional>
#include <string_view>

namespace fd::kv {

KvCache::KvCache(const KvCacheConfig & cfg) : cfg_(cfg), blocks_(static_cast<size_t>(cfg.n_blocks)) {
    FD_CHECK(cfg.n_blocks > 0 && cfg.block_size_tokens > 0, "KV cache needs blocks ({} x {})", cfg.n_blocks, cfg.block_size_tokens);
    free_.reserve(blocks_.size());
    for (int64_t i = cfg.n_blocks - 1; i >= 0; --i) { free_.push_back(static_cast<int32_t>(i)); }
    FD_CHECK(cfg.n_host_blocks >= 0, "host swap pool of {} blocks", cfg.n_host_blocks);
    host_ = HostTier(cfg.n_host_blocks, cfg.block_size_tokens);
}

void KvCache::reset_device() {
    FD_CHECK(host_tables_.empty(), "reset_device with {} sequence(s) swapped out", host_tables_.size());
    copies_done();
    background_done();  // (the Worker waited for every background copy before its pool went)
    tier_out_.clear();
    tier_in_.clear();
    blocks_.assign(static_cast<size_t>(cfg_.n_blocks), Block{});
    free_.clear();
    for (int64_t i = cfg_.n_blocks - 1; i >= 0; --i) { free_.push_back(static_cast<int32_t>(i)); }
    lru_.clear();
    by_hash_.clear();
    tables_.clear();
    n_committed_blocks_.clear();
}

uint64_t KvCache::chain_hash(uint64_t parent_hash, const int32_t * tokens) const {
    const std::string_view bytes(reinterpret_cast<const char *>(tokens), sizeof(int32_t) * cfg_.block_size_tokens);
    const uint64_t h = std::hash<std::string_view>{}(bytes);
    return parent_hash ^ (h + 0x9e3779b97f4a7c15ULL + (parent_hash << 6) + (parent_hash >> 2));
}

int32_t KvCache::take_block() {
    int32_t id;
    if (!free_.empty()) {
        id = free_.back();
        free_.pop_back();
    } else {
        auto it = lru_.begin();  // the oldest one no background copy reads
        while (it != lru_.end() && blocks_[*it].pinned) { ++it; }
        FD_CHECK(it != lru_.end(), "no KV block left to take ({} pinned by background copies)", bg_dev_pinned_.size());
        id = *it;
        lru_.erase(it);
        offload(id);
        Block & b = blocks_[id];
        by_hash_.erase(b.hash);
        b.cached = false;
        b.tokens.clear();
    }
    blocks_[id].ref       = 1;
    blocks_[id].hits      = 0;
    blocks_[id].in_prompt = false;
    return id;
}

bool KvCache::worth_offloading(const Block & b) const {
    return b.cached && (b.in_prompt || b.hits > 0) && b.epoch == epoch_ && !host_.contains(b.hash, epoch_);
}

// An evicted reused device prefix block lives on in the host tier: queue its device → host copy
// (it runs before anything writes the device block again: the step's copies precede its forward).
void KvCache::offload(int32_t id) {
    const Block & b = blocks_[id];
    if (!tier_enabled() || transfers_paused_ || !worth_offloading(b)) { return; }
    const int32_t h = host_.take();
    if (h < 0) { return; }  // every host block is in use: the prefix is dropped
    host_.publish(h, b.hash, b.parent_hash, b.tokens.data(), b.epoch);
    host_.put_after_step(h);  // written by this step's copy: not handed out again before it ran
    tier_out_.push_back({id, h});
    ++counters_.offloaded;
}

void KvCache::unref(int32_t id) {
    Block & b = blocks_[id];
    FD_CHECK(b.ref > 0, "KV block {} released twice", id);
    if (--b.ref > 0) { return; }
    if (b.cached) {
        lru_.push_back(id);
        b.lru_it = std::prev(lru_.end());
    } else {
        free_.push_back(id);
    }
}

int32_t KvCache::match_prefix(SeqId seq, const std::vector<int32_t> & tokens, uint64_t salt, int32_t * n_from_host) {
    if (n_from_host) { *n_from_host = 0; }
    auto & table = tables_[seq];
    FD_CHECK(table.empty(), "match_prefix on seq {} that already holds blocks", seq);
    if (!cfg_.enable_prefix_caching || tokens.empty()) { return 0; }
    const int64_t bs       = cfg_.block_size_tokens;
    const int64_t n_full   = (static_cast<int64_t>(tokens.size()) - 1) / bs;
    uint64_t      h        = salt;  // the chain starts at the salt: another salt's blocks hash elsewhere
    int32_t       parent   = -1;
    int64_t       i        = 0;
    uint64_t      h_parent = 0;
    for (; i < n_full; ++i) {
        const uint64_t hi = chain_hash(h, tokens.data() + i * bs);
        auto it = by_hash_.find(hi);
        if (it == by_hash_.end()) { break; }
        Block & b = blocks_[it->second];
        if (b.parent != parent || b.salt != salt || !std::equal(b.tokens.begin(), b.tokens.end(), tokens.begin() + i * bs)) { break; }
        if (b.ref++ == 0) { lru_.erase(b.lru_it); }
        ++b.hits;
        table.push_back(it->second);
        parent = it->second;
        h      = hi;
    }
    // The device cache missed at block i: the host tier may hold it (and what follows). Not
    // while background copies are in flight (a host block they write is not readable yet).
    const int64_t n_device = i;
    for (; tier_enabled() && !transfers_paused_ && bg_host_held_.empty() && i < n_full && n_blocks_free() > 0; ++i) {
        const int32_t * blk = tokens.data() + i * bs;
        h_parent            = h;
        const uint64_t hi   = chain_hash(h, blk);
        const int32_t  hb   = host_.find(hi, h_parent, blk, epoch_);
        if (hb < 0) { break; }
        host_.hold(hb);                  // first: the eviction below may need a host block, never this one
        const int32_t d = take_block();  // (may itself offload an older prefix block)
        Block & b = blocks_[d];
        b.hash        = hi;
        b.parent      = parent;
        b.parent_hash = h_parent;  // block 0's is the salt: host hits are verified against it
        b.salt        = salt;
        b.epoch       = epoch_;
        b.hits        = 1;  // it was reused: worth keeping on the host again
        if (by_hash_.count(hi) == 0) {
            b.tokens.assign(blk, blk + bs);
            b.cached     = true;
            by_hash_[hi] = d;
        }
        ++b.ref;  // held until the copy ran: never evicted (and overwritten) before it is written
        dev_held_.push_back(d);
        tier_in_.push_back({hb, d});
        ++counters_.loaded;
        table.push_back(d);
        parent = d;
        h      = hi;
    }
    if (n_from_host) { *n_from_host = static_cast<int32_t>((i - n_device) * bs); }
    n_committed_blocks_[seq] = static_cast<int64_t>(table.size());
    return static_cast<int32_t>(table.size() * bs);
}

KvCache::PrefixProbe KvCache::probe_prefix(const std::vector<int32_t> & tokens, uint64_t salt) const {
    PrefixProbe p;
    if (!cfg_.enable_prefix_caching || tokens.empty()) { return p; }
    const int64_t bs     = cfg_.block_size_tokens;
    const int64_t n_full = (static_cast<int64_t>(tokens.size()) - 1) / bs;
    uint64_t      h      = salt;
    int32_t       parent = -1;
    int64_t       i      = 0;
    for (; i < n_full; ++i) {  // as match_prefix's device part
        const uint64_t hi = chain_hash(h, tokens.data() + i * bs);
        auto it = by_hash_.find(hi);
        if (it == by_hash_.end()) { break; }
        const Block & b = blocks_[it->second];
        if (b.parent != parent || b.salt != salt || !std::equal(b.tokens.begin(), b.tokens.end(), tokens.begin() + i * bs)) { break; }
        p.n_device_idle += b.ref == 0 ? 1 : 0;
        parent = it->second;
        h      = hi;
    }
    p.n_device = i;
    for (; tier_enabled() && !transfers_paused_ && bg_host_held_.empty() && i < n_full; ++i) {  // and its host part
        const int32_t * blk = tokens.data() + i * bs;
        const uint64_t  hi  = chain_hash(h, blk);
        if (host_.find(hi, h, blk, epoch_) < 0) { break; }
        ++p.n_host;
        h = hi;
    }
    return p;
}

int64_t KvCache::n_blocks_needed(SeqId seq, int64_t n_tokens) const {
    auto it = tables_.find(seq);
    const int64_t have = it == tables_.end() ? 0 : static_cast<int64_t>(it->second.size());
    const int64_t need = (n_tokens + cfg_.block_size_tokens - 1) / cfg_.block_size_tokens;
    return std::max<int64_t>(0, need - have);
}

bool KvCache::allocate(SeqId seq, int64_t n_tokens) {
    const int64_t n_new = n_blocks_needed(seq, n_tokens);
    if (n_new > n_blocks_free()) { return false; }
    auto & table = tables_[seq];
    for (int64_t i = 0; i < n_new; ++i) { table.push_back(take_block()); }
    return true;
}

void KvCache::commit_full_blocks(SeqId seq, const std::vector<int32_t> & tokens, int64_t n_computed, uint64_t salt, int64_t n_prompt) {
    if (!cfg_.enable_prefix_caching) { return; }
    auto & table = tables_.at(seq);
    int64_t & done = n_committed_blocks_[seq];
    const int64_t bs     = cfg_.block_size_tokens;
    const int64_t n_full = std::min<int64_t>(n_computed / bs, static_cast<int64_t>(table.size()));
    uint64_t h = done > 0 ? blocks_[table[done - 1]].hash : salt;
    for (int64_t i = done; i < n_full; ++i) {
        Block & b = blocks_[table[i]];
        const uint64_t h_prev = h;
        h = chain_hash(h, tokens.data() + i * bs);
        b.parent_hash = h_prev;
        b.hash   = h;
        b.parent = i > 0 ? table[i - 1] : -1;
        b.salt   = salt;
        b.epoch  = epoch_;
        b.in_prompt = n_prompt < 0 || (i + 1) * bs <= n_prompt;
        if (!b.cached && by_hash_.count(h) == 0) {
            b.tokens.assign(tokens.begin() + i * bs, tokens.begin() + (i + 1) * bs);
            b.cached = true;
            by_hash_[h] = table[i];
        }
    }
    done = std::max(done, n_full);
}

void KvCache::trim(SeqId seq, int64_t n_tokens) {
    auto it = tables_.find(seq);
    if (it == tables_.end()) { return; }
    auto &        table = it->second;
    const int64_t keep  = (std::max<int64_t>(n_tokens, 0) + cfg_.block_size_tokens - 1) / cfg_.block_size_tokens;
    const auto    done  = n_committed_blocks_.find(seq);
    FD_CHECK(done == n_committed_blocks_.end() || done->second <= keep, "trim of seq {} to {} tokens would drop {} committed blocks", seq,
             n_tokens, done == n_committed_blocks_.end() ? 0 : done->second);
    while (static_cast<int64_t>(table.size()) > keep) {
        unref(table.back());
        table.pop_back();
    }
}

void KvCache::release(SeqId seq) {
    if (auto h = host_tables_.find(seq); h != host_tables_.end()) {
        for (auto b = h->second.rbegin(); b != h->second.rend(); ++b) { host_.put(*b); }
        host_tables_.erase(h);
    }
    auto it = tables_.find(seq);
    if (it == tables_.end()) { return; }
    // Release in reverse so a chain's tail is evicted before its head.
    for (auto b = it->second.rbegin(); b != it->second.rend(); ++b) { unref(*b); }
    tables_.erase(it);
    n_committed_blocks_.erase(seq);
}

bool KvCache::swap_out(SeqId seq, int64_t n_tokens, std::vector<BlockCopy> & copies) {
    auto it = tables_.find(seq);
    if (n_tokens <= 0 || it == tables_.end() || host_tables_.count(seq)) { return false; }
    const int64_t n = (n_tokens + cfg_.block_size_tokens - 1) / cfg_.block_size_tokens;
    FD_CHECK(n <= static_cast<int64_t>(it->second.size()), "swap_out of {} tokens from seq {} holding {} blocks", n_tokens, seq,
             it->second.size());
    if (n > n_host_blocks_free()) { return false; }
    auto & host = host_tables_[seq];
    host.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
        const int32_t h = host_.take();
        host.push_back(h);
        copies.push_back({it->second[i], h});
    }
    // The device blocks go back like a release (cached ones stay matchable until evicted).
    for (auto b = it->second.rbegin(); b != it->second.rend(); ++b) { unref(*b); }
    tables_.erase(it);
    n_committed_blocks_.erase(seq);
    return true;
}

bool KvCache::swap_in(SeqId seq, int64_t n_tokens, std::vector<BlockCopy> & copies) {
    auto h = host_tables_.find(seq);
    FD_CHECK(h != host_tables_.end() && block_table(seq).empty(), "swap_in of seq {} that is not swapped out", seq);
    const int64_t n_host = static_cast<int64_t>(h->second.size());
    const int64_t need   = std::max<int64_t>(n_host, (n_tokens + cfg_.block_size_tokens - 1) / cfg_.block_size_tokens);
    if (need > n_blocks_free()) { return false; }
    auto & table = tables_[seq];
    for (int64_t i = 0; i < need; ++i) { table.push_back(take_block()); }
    for (int64_t i = 0; i < n_host; ++i) { copies.push_back({h->second[i], table[i]}); }
    // With the tier a device → host copy may be queued in this step too: the blocks read here
    // stay taken until copies_done() (without it the decision holds no swap-out, as before).
    for (auto b = h->second.rbegin(); b != h->second.rend(); ++b) {
        if (tier_enabled()) {
            host_.put_after_step(*b);
        } else {
            host_.put(*b);
        }
    }
    host_tables_.erase(h);
    n_committed_blocks_[seq] = 0;  // fresh blocks: commit_full_blocks publishes them again
    return true;
}

Residence KvCache::residence(SeqId seq) const {
    if (host_tables_.count(seq)) { return Residence::host; }
    auto it = tables_.find(seq);
    return it != tables_.end() && !it->second.empty() ? Residence::device : Residence::none;
}

void KvCache::flush_prefix_cache() {
    for (auto & [h, id] : by_hash_) {
        Block & b = blocks_[id];
        b.cached = false;
        b.tokens.clear();
        if (b.ref == 0) {
            lru_.erase(b.lru_it);
            free_.push_back(id);
        }
    }
    by_hash_.clear();
}

int64_t KvCache::flush_host_tier() {
    const int64_t n = host_.flush();
    counters_.invalidated += n;
    return n;
}

int64_t KvCache::set_weight_epoch(uint64_t epoch) {
    epoch_ = epoch;
    const int64_t n = host_.drop_other_epochs(epoch);
    counters_.invalidated += n;
    return n;
}

void KvCache::take_tier_copies(std::vector<BlockCopy> & out, std::vector<BlockCopy> & in) {
    out.insert(out.end(), tier_out_.begin(), tier_out_.end());
    in.insert(in.end(), tier_in_.begin(), tier_in_.end());
    tier_out_.clear();
    tier_in_.clear();
}

void KvCache::copies_done() {
    host_.end_step();
    std::vector<int32_t> held;
    held.swap(dev_held_);
    for (int32_t d : held) { unref(d); }
}

int64_t KvCache::plan_background_offloads(std::vector<BlockCopy> & bg, int64_t window, int64_t max_blocks) {
    // Nothing to write ahead while the never-used free blocks cover the window: no eviction is near.
    if (!tier_enabled() || transfers_paused_ || !bg_dev_pinned_.empty() || static_cast<int64_t>(free_.size()) >= window) { return 0; }
    int64_t n = 0, seen = 0;
    for (auto it = lru_.begin(); it != lru_.end() && seen < window && n < max_blocks; ++it, ++seen) {
        Block & b = blocks_[*it];
        if (!worth_offloading(b)) { continue; }
        const int32_t h = host_.take();
        if (h < 0) { break; }  // every host block is in use
        host_.publish(h, b.hash, b.parent_hash, b.tokens.data(), b.epoch);
        bg_host_held_.push_back(h);
        b.pinned = true;
        bg_dev_pinned_.push_back(*it);
        bg.push_back({*it, h});
        ++n;
    }
    counters_.offloaded += n;
    counters_.offloaded_background += n;
    return n;
}

void KvCache::background_done() {
    for (int32_t d : bg_dev_pinned_) { blocks_[d].pinned = false; }
    for (int32_t h : bg_host_held_) { host_.put(h); }
    bg_dev_pinned_.clear();
    bg_host_held_.clear();
}

KvCache::TierCounters KvCache::tier_counters() const {
    TierCounters c = counters_;
    c.evicted      = host_.n_evictions_total();
    return c;
}

const std::vector<int32_t> & KvCache::block_table(SeqId seq) const {
    static const std::vector<int32_t> kEmpty;
    auto it = tables_.find(seq);
    return it == tables_.end() ? kEmpty : it->second;
}

}  // namespace fd::kv
