// regex.h — a compiled PCRE2 pattern (UTF + UCP, JIT where available) that lists its matches;
// the split patterns of tokenizer.json (GPT-2 / Llama-3 / Qwen2: Unicode classes, lookahead,
// (?i:...) groups) run on it. Private to daemon/src/tokenizer.
//
// UCP semantics: \s is Perl space (tab, LF, VT, FF, CR and Unicode Z), \p{L}/\p{N} come from
// PCRE2's Unicode tables. Matching is const and thread-safe (per-thread match data and JIT stack).
#pragma once

#include <cstddef>
#include <utility>
#include <vector>
#include <string>
#include <string_view>

namespace fd::tokenizer {

class Regex {
public:
    /// Compile `pattern`. Errors: fd::Error{invalid_checkpoint} "<where>: regex error at
    /// offset N: message".
    Regex(const std::string & pattern, const std::string & where);
    ~Regex();
    Regex(const Regex &)             = delete;
    Regex & operator=(const Regex &) = delete;

    /// Append to `out` the [begin, end) byte offsets of each non-overlapping match in `text`
    /// (which must be valid UTF-8), left to right; an empty match advances one character, as
    /// JavaScript's matchAll and Rust's find_iter do.
    void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>> & out) const;

private:
    void * code_ = nullptr;   ///< pcre2_code_8
    bool   jit_  = false;
};

}  // namespace fd::tokenizer
