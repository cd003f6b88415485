// added_tokens.h — Hugging Face's added-token split, shared by both tokenizers. Private to
// daemon/src/tokenizer.
//
// Added and special tokens ("<s>", "<|im_end|>") written in the input are matched in the raw text
// first, longest match at the leftmost position, and never split; the text between them is
// encoded section by section. A token's lstrip/rstrip eats the Unicode whitespace on its left/right
// (HF tokenizers' AddedVocabulary::split_with_indices, transformers' PreTrainedTokenizer.tokenize).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fd::tokenizer {

struct AddedToken {
    std::string content;
    int32_t     id      = -1;
    bool        special = false;
    bool        lstrip  = false;
    bool        rstrip  = false;
};

/// Byte trie over the added tokens' contents: longest match starting at a position.
class AddedTrie {
public:
    AddedTrie() { root_.fill(-1); }
    void insert(const std::string & s, int32_t index);
    /// Index of the longest token starting at text[i] and its length, or {-1, 0}.
    std::pair<int32_t, size_t> match(std::string_view text, size_t i) const;

private:
    struct Node {
        std::vector<std::pair<unsigned char, int32_t>> kids;
        int32_t                                        index = -1;
    };
    int32_t new_node();
    int32_t find_child(int32_t node, unsigned char b) const;
    std::array<int32_t, 256> root_{};
    std::vector<Node>        nodes_;
};

/// `s` without its trailing / leading Unicode White_Space (what lstrip/rstrip trim).
std::string_view trim_end(std::string_view s);
std::string_view trim_start(std::string_view s);

/// Walk `text`: `section(s, first)` for each non-empty run of text between matched tokens (after
/// lstrip/rstrip trimming; `first` when it starts the text, untrimmed: Metaspace's
/// prepend_scheme "first"), `token(index)` for each matched token, in order.
template <class Section, class Token>
void split_on_added(std::string_view text, const std::vector<AddedToken> & added, const AddedTrie & trie,
                    Section && section, Token && token) {
    size_t section_begin = 0;
    bool   strip_next    = false;   ///< the previous token rstrips
    auto   flush = [&](size_t end, bool lstrip) {
        std::string_view s = text.substr(section_begin, end - section_begin);
        if (strip_next) { s = trim_start(s); }
        if (lstrip) { s = trim_end(s); }
        if (!s.empty()) { section(s, section_begin == 0 && !strip_next); }
    };
    for (size_t i = 0; i < text.size();) {
        const auto [idx, len] = added.empty() ? std::pair<int32_t, size_t>{-1, 0} : trie.match(text, i);
        if (idx < 0) {
            ++i;
            continue;
        }
        const AddedToken & t = added[size_t(idx)];
        flush(i, t.lstrip);
        token(idx);
        i             = i + len;
        section_begin = i;
        strip_next    = t.rstrip;
    }
    flush(text.size(), false);
}

}  // namespace fd::tokenizer
