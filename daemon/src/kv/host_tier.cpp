#include "fd/kv/host_tier.h"

#include "fd/status.h"

#include <algorithm>

namespace fd::kv {

HostTier::HostTier(int64_t n_blocks, int32_t block_size_tokens) : block_size_(block_size_tokens), blocks_(static_cast<size_t>(n_blocks)) {
    FD_CHECK(n_blocks >= 0 && block_size_tokens > 0, "host KV tier of {} blocks x {} tokens", n_blocks, block_size_tokens);
    free_.reserve(blocks_.size());
    for (int64_t i = n_blocks - 1; i >= 0; --i) { free_.push_back(static_cast<int32_t>(i)); }
}

int32_t HostTier::take() {
    int32_t id;
    if (!free_.empty()) {
        id = free_.back();
        free_.pop_back();
    } else if (!lru_.empty()) {
        id = lru_.front();
        Block & b = blocks_[id];
        lru_.pop_front();
        if (auto it = by_hash_.find(b.hash); it != by_hash_.end() && it->second == id) { by_hash_.erase(it); }
        b.published = false;
        b.tokens.clear();
        ++n_evictions_;
    } else {
        return -1;
    }
    blocks_[id].ref = 1;
    return id;
}

void HostTier::put(int32_t id) {
    Block & b = blocks_[static_cast<size_t>(id)];
    FD_CHECK(b.ref > 0, "host KV block {} released twice", id);
    if (--b.ref > 0) { return; }
    if (b.published) {
        lru_.push_back(id);
        b.lru_it = std::prev(lru_.end());
    } else {
        free_.push_back(id);
    }
}

void HostTier::hold(int32_t id) {
    Block & b = blocks_[static_cast<size_t>(id)];
    if (b.ref++ == 0) {
        FD_CHECK(b.published, "hold of free host KV block {}", id);
        lru_.erase(b.lru_it);
    }
    held_.push_back(id);
}

void HostTier::end_step() {
    std::vector<int32_t> held;
    held.swap(held_);
    for (int32_t id : held) { put(id); }
}

void HostTier::unpublish(int32_t id) {
    Block & b = blocks_[static_cast<size_t>(id)];
    if (!b.published) { return; }
    if (auto it = by_hash_.find(b.hash); it != by_hash_.end() && it->second == id) { by_hash_.erase(it); }
    b.published = false;
    b.tokens.clear();
    if (b.ref == 0) {
        lru_.erase(b.lru_it);
        free_.push_back(id);
    }
}

void HostTier::publish(int32_t id, uint64_t hash, uint64_t parent_hash, const int32_t * tokens, uint64_t epoch) {
    Block & b = blocks_[static_cast<size_t>(id)];
    FD_CHECK(b.ref > 0 && !b.published, "publish of host KV block {} that is not freshly taken", id);
    if (auto it = by_hash_.find(hash); it != by_hash_.end()) { unpublish(it->second); }
    b.published   = true;
    b.hash        = hash;
    b.parent_hash = parent_hash;
    b.epoch       = epoch;
    b.tokens.assign(tokens, tokens + block_size_);
    by_hash_[hash] = id;
}

int32_t HostTier::find(uint64_t hash, uint64_t parent_hash, const int32_t * tokens, uint64_t epoch) const {
    auto it = by_hash_.find(hash);
    if (it == by_hash_.end()) { return -1; }
    const Block & b = blocks_[static_cast<size_t>(it->second)];
    if (b.epoch != epoch || b.parent_hash != parent_hash || !std::equal(b.tokens.begin(), b.tokens.end(), tokens)) { return -1; }
    return it->second;
}

bool HostTier::contains(uint64_t hash, uint64_t epoch) const {
    auto it = by_hash_.find(hash);
    return it != by_hash_.end() && blocks_[static_cast<size_t>(it->second)].epoch == epoch;
}

int64_t HostTier::flush() {
    std::vector<int32_t> ids;
    ids.reserve(by_hash_.size());
    for (const auto & [h, id] : by_hash_) { ids.push_back(id); }
    for (int32_t id : ids) { unpublish(id); }
    return static_cast<int64_t>(ids.size());
}

int64_t HostTier::drop_other_epochs(uint64_t epoch) {
    std::vector<int32_t> ids;
    for (const auto & [h, id] : by_hash_) {
        if (blocks_[static_cast<size_t>(id)].epoch != epoch) { ids.push_back(id); }
    }
    for (int32_t id : ids) { unpublish(id); }
    return static_cast<int64_t>(ids.size());
}

}  // namespace fd::kv
