#include "added_tokens.h"

#include "fd/utf8.h"

#include <utf8proc.h>

namespace fd::tokenizer {

void AddedTrie::insert(const std::string & s, int32_t index) {
    int32_t node = -1;
    for (size_t i = 0; i < s.size(); ++i) {
        const auto b = static_cast<unsigned char>(s[i]);
        int32_t    child;
        if (node < 0) {
            if (root_[b] < 0) { root_[b] = new_node(); }
            child = root_[b];
        } else {
            child = find_child(node, b);
            if (child < 0) {
                child = new_node();
                nodes_[node].kids.emplace_back(b, child);
            }
        }
        node = child;
    }
    if (node >= 0 && nodes_[node].index < 0) { nodes_[node].index = index; }
}

std::pair<int32_t, size_t> AddedTrie::match(std::string_view text, size_t i) const {
    int32_t node = root_[static_cast<unsigned char>(text[i])];
    std::pair<int32_t, size_t> best{-1, 0};
    for (size_t k = i + 1; node >= 0; ++k) {
        if (nodes_[node].index >= 0) { best = {nodes_[node].index, k - i}; }
        if (k >= text.size()) { break; }
        node = find_child(node, static_cast<unsigned char>(text[k]));
    }
    return best;
}

int32_t AddedTrie::new_node() {
    nodes_.emplace_back();
    return int32_t(nodes_.size() - 1);
}

int32_t AddedTrie::find_child(int32_t node, unsigned char b) const {
    for (const auto & [c, n] : nodes_[node].kids) { if (c == b) { return n; } }
    return -1;
}

namespace {

/// Unicode White_Space (what HF tokenizers' lstrip/rstrip trim).
bool is_space(uint32_t cp) {
    if ((cp >= 9 && cp <= 13) || cp == 0x85) { return true; }
    const auto c = utf8proc_category(utf8proc_int32_t(cp));
    return c == UTF8PROC_CATEGORY_ZS || c == UTF8PROC_CATEGORY_ZL || c == UTF8PROC_CATEGORY_ZP;
}

}  // namespace

std::string_view trim_end(std::string_view s) {
    while (!s.empty()) {
        size_t b = s.size() - 1;
        while (b > 0 && utf8::is_continuation(static_cast<unsigned char>(s[b]))) { --b; }
        size_t i = b;
        if (!is_space(utf8::next(s, i))) { break; }
        s = s.substr(0, b);
    }
    return s;
}

std::string_view trim_start(std::string_view s) {
    size_t i = 0;
    while (i < s.size()) {
        size_t j = i;
        if (!is_space(utf8::next(s, j))) { break; }
        i = j;
    }
    return s.substr(i);
}

}  // namespace fd::tokenizer
