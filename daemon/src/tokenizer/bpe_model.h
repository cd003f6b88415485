// bpe_model.h — the BPE model of a Hugging Face tokenizer.json ("model": {"type": "BPE"}):
// vocabulary, ranked merges, byte fallback, unknown token, ignore_merges. Private to
// daemon/src/tokenizer.
//
// Algorithm (Sennrich et al. 2016; HF tokenizers models/bpe/word.rs; transformers.js BPE): a
// word starts as one symbol per character; repeatedly the adjacent pair with the lowest merge
// rank is merged, the leftmost first on ties, until no pair has a merge. Merge ranks live in an
// open-addressing hash map keyed by the pair of ids; words longer than a few dozen symbols use a
// binary heap (Llama-2's tokenizer.json has no pre-tokenizer: a whole sentence is one word).
// Words up to 64 bytes are memoized in a per-thread cache (bounded; transformers.js and HF
// tokenizers cache words too), so repeated words cost one hash lookup.
//
// Byte-level mode (a ByteLevel pre-tokenizer is present): words arrive as raw bytes and each
// byte starts as the id of its GPT-2 bytes_to_unicode character, so no text is ever remapped.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace fd::tokenizer {

/// GPT-2's bytes_to_unicode: the code point standing for byte `b` in byte-level vocabularies.
uint32_t byte_to_codepoint(uint8_t b);
/// The inverse; -1 for code points that stand for no byte.
int32_t codepoint_to_byte(uint32_t cp);

struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
public:
    /// `model` is tokenizer.json's "model" object; `file` names the file in errors.
    /// Errors  fd::Error{invalid_checkpoint} naming the file and the field (e.g.
    ///         "model.merges[17]: 'a' is not in model.vocab").
    BpeModel(const nlohmann::json & model, const std::string & file, bool byte_level);

    /// Append the ids of one pre-tokenized word (raw bytes in byte-level mode, else UTF-8).
    void encode_word(std::string_view word, std::vector<int32_t> & out) const;

    /// Vocabulary string of `id` ("" for ids the vocabulary does not hold).
    const std::string & token(int32_t id) const;
    std::optional<int32_t> find(std::string_view token) const;
    /// Largest vocabulary id + 1.
    int32_t size() const { return int32_t(tokens_.size()); }
    /// Raw bytes a byte-level token stands for (byte-level mode only; "" if it has none).
    const std::string & token_bytes(int32_t id) const;
    bool byte_level() const { return byte_level_; }
    bool byte_fallback() const { return byte_fallback_; }

private:
    struct Merge {
        int32_t rank   = -1;
        int32_t new_id = -1;
    };
    /// Open-addressing map (id_left, id_right) → merge; linear probing, power-of-two size; key
    /// and value share a 16-byte slot (one cache line touch per probe).
    struct MergeMap {
        struct Slot {
            uint64_t key = ~uint64_t(0);
            Merge    val;
        };
        std::vector<Slot> slots;
        uint64_t          mask = 0;
        void  reserve(size_t n);
        void  insert(uint64_t key, Merge m);
        Merge find(int32_t a, int32_t b) const;
    };
    static uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

    void initial_symbols(std::string_view word, std::vector<int32_t> & syms) const;
    void merge_naive(std::vector<int32_t> & syms) const;
    void merge_heap(std::vector<int32_t> & syms) const;

    std::vector<std::string>               tokens_;
    TokenMap                               vocab_;
    TokenMap                               bytes_vocab_;     ///< byte-level: raw bytes → id
    std::vector<std::string>               token_bytes_;     ///< byte-level: id → raw bytes
    std::unordered_map<uint32_t, int32_t>  char_id_;         ///< single-code-point tokens
    std::array<int32_t, 256>               byte_id_{};       ///< byte-level initial ids
    std::array<int32_t, 256>               fallback_id_{};   ///< <0xXX> ids (byte_fallback)
    MergeMap                               merges_;
    uint64_t                               instance_id_   = 0;   ///< keys the per-thread word cache
    bool                                   byte_level_    = false;
    bool                                   byte_fallback_ = false;
    bool                                   ignore_merges_ = false;
    bool                                   fuse_unk_      = false;
    int32_t                                unk_id_        = -1;
};

}  // namespace fd::tokenizer
