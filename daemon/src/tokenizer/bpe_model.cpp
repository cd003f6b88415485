#include "bpe_model.h"

#include "json_field.h"
#include "fd/utf8.h"

#include <algorithm>
#include <atomic>
#include <queue>

namespace fd::tokenizer {

namespace {

constexpr size_t kNaiveMaxSymbols   = 24;      ///< longer words use the heap
constexpr size_t kCacheMaxWordBytes = 64;      ///< longer words are not memoized
constexpr size_t kCacheMaxWords     = 65536;   ///< the per-thread cache is dropped when this full

struct ByteTables {
    std::array<uint32_t, 256> to_cp{};
    std::unordered_map<uint32_t, int32_t> to_byte;
    ByteTables() {
        // GPT-2 bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68
        // bytes for U+0100.. in byte order.
        uint32_t n = 0;
        for (int b = 0; b < 256; ++b) {
            const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            to_cp[b] = printable ? uint32_t(b) : 256 + n++;
            to_byte[to_cp[b]] = b;
        }
    }
};

const ByteTables & byte_tables() {
    static const ByteTables t;
    return t;
}

}  // namespace

uint32_t byte_to_codepoint(uint8_t b) { return byte_tables().to_cp[b]; }

int32_t codepoint_to_byte(uint32_t cp) {
    const auto & m  = byte_tables().to_byte;
    auto         it = m.find(cp);
    return it == m.end() ? -1 : it->second;
}

void BpeModel::MergeMap::reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) { cap <<= 1; }
    slots.assign(cap, Slot{});
    mask = cap - 1;
}

static inline uint64_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

void BpeModel::MergeMap::insert(uint64_t key, Merge m) {
    for (uint64_t i = mix(key) & mask;; i = (i + 1) & mask) {
        if (slots[i].key == key) { return; }   // a repeated merge keeps its first (lowest) rank
        if (slots[i].key == ~uint64_t(0)) {
            slots[i] = {key, m};
            return;
        }
    }
}

BpeModel::Merge BpeModel::MergeMap::find(int32_t a, int32_t b) const {
    const uint64_t key = pair_key(a, b);
    for (uint64_t i = mix(key) & mask;; i = (i + 1) & mask) {
        const Slot & s = slots[i];
        if (s.key == key) { return s.val; }
        if (s.key == ~uint64_t(0)) { return {}; }
    }
}

BpeModel::BpeModel(const nlohmann::json & model, const std::string & file, bool byte_level) : byte_level_(byte_level) {
    static std::atomic<uint64_t> next_instance{1};
    instance_id_ = next_instance++;
    const std::string type = field_or<std::string>(model, "type", "BPE", file, "model");
    if (type != "BPE") { bad_field(file, "model.type", "'" + type + "' is not supported (only BPE)"); }
    if (!model.contains("vocab") || !model["vocab"].is_object()) { bad_field(file, "model.vocab", "missing or not an object"); }
    if (!model.contains("merges") || !model["merges"].is_array()) { bad_field(file, "model.merges", "missing or not a list"); }
    for (const char * key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
        if (!field_or<std::string>(model, key, "", file, "model").empty()) {
            bad_field(file, std::string("model.") + key, "a non-empty value is not supported");
        }
    }
    if (!model.value("dropout", nlohmann::json()).is_null() && model["dropout"].get<double>() != 0.0) {
        bad_field(file, "model.dropout", "BPE dropout is not supported");
    }
    byte_fallback_ = field_or<bool>(model, "byte_fallback", false, file, "model");
    ignore_merges_ = field_or<bool>(model, "ignore_merges", false, file, "model");
    fuse_unk_      = field_or<bool>(model, "fuse_unk", false, file, "model");

    const auto & vocab = model["vocab"];
    vocab_.reserve(vocab.size());
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
        if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() > INT32_MAX) {
            bad_field(file, "model.vocab[\"" + it.key() + "\"]", "the id must be a non-negative integer");
        }
        const auto id = it.value().get<int32_t>();
        if (size_t(id) >= tokens_.size()) { tokens_.resize(size_t(id) + 1); }
        if (!tokens_[id].empty()) { bad_field(file, "model.vocab[\"" + it.key() + "\"]", fmt::format("id {} is used twice", id)); }
        tokens_[id] = it.key();
        vocab_.emplace(it.key(), id);
        size_t i = 0;
        if (!it.key().empty() && utf8::valid(it.key())) {
            const uint32_t cp = utf8::next(it.key(), i);
            if (i == it.key().size()) { char_id_.emplace(cp, id); }
        }
    }
    if (const std::string unk = field_or<std::string>(model, "unk_token", "", file, "model"); !unk.empty()) {
        if (auto id = find(unk)) { unk_id_ = *id; }
    }
    byte_id_.fill(-1);
    fallback_id_.fill(-1);
    for (int b = 0; b < 256; ++b) {
        std::string c;
        utf8::append(c, byte_to_codepoint(uint8_t(b)));
        if (auto id = find(c)) { byte_id_[b] = *id; }
        if (auto id = find(fmt::format("<0x{:02X}>", b))) { fallback_id_[b] = *id; }
    }
    if (byte_level_) {
        token_bytes_.resize(tokens_.size());
        for (size_t id = 0; id < tokens_.size(); ++id) {
            const std::string & t = tokens_[id];
            std::string          raw;
            bool                 ok = utf8::valid(t);
            for (size_t i = 0; ok && i < t.size();) {
                const int32_t b = codepoint_to_byte(utf8::next(t, i));
                if (b < 0) { ok = false; } else { raw += char(b); }
            }
            if (ok && !raw.empty()) {
                bytes_vocab_.emplace(raw, int32_t(id));
                token_bytes_[id] = std::move(raw);
            }
        }
    }

    const auto & merges = model["merges"];
    merges_.reserve(merges.size());
    for (size_t rank = 0; rank < merges.size(); ++rank) {
        const auto & m    = merges[rank];
        const auto   path = fmt::format("model.merges[{}]", rank);
        std::string  a, b;
        if (m.is_string()) {   // "a b" (tokenizers < 0.20)
            const std::string & s  = m.get_ref<const std::string &>();
            const size_t        sp = s.find(' ');
            if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
                bad_field(file, path, "'" + s + "' is not two tokens separated by one space");
            }
            a = s.substr(0, sp);
            b = s.substr(sp + 1);
        } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {   // ["a", "b"]
            a = m[0].get<std::string>();
            b = m[1].get<std::string>();
        } else {
            bad_field(file, path, "a merge must be \"a b\" or [\"a\", \"b\"]");
        }
        const auto ia = find(a), ib = find(b), im = find(a + b);
        if (!ia) { bad_field(file, path, "'" + a + "' is not in model.vocab"); }
        if (!ib) { bad_field(file, path, "'" + b + "' is not in model.vocab"); }
        if (!im) { bad_field(file, path, "the merged token '" + a + b + "' is not in model.vocab"); }
        merges_.insert(pair_key(*ia, *ib), Merge{int32_t(rank), *im});
    }
}

const std::string & BpeModel::token(int32_t id) const {
    static const std::string empty;
    return id >= 0 && size_t(id) < tokens_.size() ? tokens_[id] : empty;
}

const std::string & BpeModel::token_bytes(int32_t id) const {
    static const std::string empty;
    return id >= 0 && size_t(id) < token_bytes_.size() ? token_bytes_[id] : empty;
}

std::optional<int32_t> BpeModel::find(std::string_view t) const {
    auto it = vocab_.find(t);
    return it == vocab_.end() ? std::nullopt : std::optional<int32_t>(it->second);
}

void BpeModel::initial_symbols(std::string_view word, std::vector<int32_t> & syms) const {
    bool last_unk = false;
    auto push_unk = [&] {
        if (unk_id_ < 0) { return; }   // no unknown token: the character is dropped (as HF does)
        if (fuse_unk_ && last_unk) { return; }
        syms.push_back(unk_id_);
        last_unk = true;
    };
    if (byte_level_) {
        for (unsigned char b : word) {
            if (byte_id_[b] >= 0) { syms.push_back(byte_id_[b]); last_unk = false; } else { push_unk(); }
        }
        return;
    }
    for (size_t i = 0; i < word.size();) {
        const size_t start = i;
        const uint32_t cp = utf8::next(word, i);
        auto it = char_id_.find(cp);
        if (it != char_id_.end()) {
            syms.push_back(it->second);
            last_unk = false;
            continue;
        }
        bool all = byte_fallback_;
        for (size_t k = start; all && k < i; ++k) { all = fallback_id_[static_cast<unsigned char>(word[k])] >= 0; }
        if (all) {
            for (size_t k = start; k < i; ++k) { syms.push_back(fallback_id_[static_cast<unsigned char>(word[k])]); }
            last_unk = false;
        } else {
            push_unk();
        }
    }
}

void BpeModel::merge_naive(std::vector<int32_t> & syms) const {
    while (syms.size() > 1) {
        int32_t best_rank = INT32_MAX, best_id = -1;
        size_t  best_pos  = 0;
        for (size_t i = 0; i + 1 < syms.size(); ++i) {
            const Merge m = merges_.find(syms[i], syms[i + 1]);
            if (m.rank >= 0 && m.rank < best_rank) {
                best_rank = m.rank;
                best_id   = m.new_id;
                best_pos  = i;
            }
        }
        if (best_id < 0) { return; }
        syms[best_pos] = best_id;
        syms.erase(syms.begin() + long(best_pos) + 1);
    }
}

void BpeModel::merge_heap(std::vector<int32_t> & syms) const {
    struct Cand {
        int32_t rank, pos, new_id;
        bool operator>(const Cand & o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    const int32_t        n = int32_t(syms.size());
    std::vector<int32_t> prev(n), next(n);
    std::vector<char>    alive(n, 1);
    for (int32_t i = 0; i < n; ++i) {
        prev[i] = i - 1;
        next[i] = i + 1 < n ? i + 1 : -1;
    }
    std::priority_queue<Cand, std::vector<Cand>, std::greater<>> heap;
    auto consider = [&](int32_t pos) {
        if (pos < 0 || next[pos] < 0) { return; }
        const Merge m = merges_.find(syms[pos], syms[next[pos]]);
        if (m.rank >= 0) { heap.push({m.rank, pos, m.new_id}); }
    };
    for (int32_t i = 0; i + 1 < n; ++i) { consider(i); }
    while (!heap.empty()) {
        const Cand c = heap.top();
        heap.pop();
        if (!alive[c.pos] || next[c.pos] < 0) { continue; }
        const int32_t r = next[c.pos];
        const Merge   m = merges_.find(syms[c.pos], syms[r]);
        if (m.rank != c.rank || m.new_id != c.new_id) { continue; }   // stale: the pair changed
        syms[c.pos] = c.new_id;
        alive[r]    = 0;
        next[c.pos] = next[r];
        if (next[r] >= 0) { prev[next[r]] = c.pos; }
        consider(prev[c.pos]);
        consider(c.pos);
    }
    size_t k = 0;
    for (int32_t i = 0; i >= 0 && i < n; i = next[i]) { syms[k++] = syms[i]; }
    syms.resize(k);
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t> & out) const {
    if (word.empty()) { return; }
    if (ignore_merges_) {
        const TokenMap & m = byte_level_ ? bytes_vocab_ : vocab_;
        if (auto it = m.find(word); it != m.end()) {
            out.push_back(it->second);
            return;
        }
    }
    struct WordCache {
        uint64_t                                                                      owner = 0;
        std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> words;
    };
    thread_local WordCache cache;
    const bool cacheable = word.size() <= kCacheMaxWordBytes;
    if (cacheable) {
        if (cache.owner != instance_id_) {
            cache.words.clear();
            cache.owner = instance_id_;
        }
        if (auto it = cache.words.find(word); it != cache.words.end()) {
            out.insert(out.end(), it->second.begin(), it->second.end());
            return;
        }
    }
    thread_local std::vector<int32_t> syms;
    syms.clear();
    initial_symbols(word, syms);
    if (syms.size() <= kNaiveMaxSymbols) { merge_naive(syms); } else { merge_heap(syms); }
    out.insert(out.end(), syms.begin(), syms.end());
    if (cacheable) {
        if (cache.words.size() >= kCacheMaxWords) { cache.words.clear(); }
        cache.words.emplace(std::string(word), syms);
    }
}

}  // namespace fd::tokenizer
