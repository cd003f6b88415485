// fd/utf8.h — UTF-8 helpers: the tokenizers' validation and decoding, and well-formed UTF-8 for
// what the daemon writes out (JSON log lines, Prometheus labels: lossy()).
// Validation and replacement follow the Unicode Standard §3.9 (Table 3-7, well-formed byte
// sequences) and its "substitution of maximal subparts" practice, which is what the WHATWG
// TextDecoder (the reference, @lenml/tokenizers) and Rust's String::from_utf8_lossy do.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace fd::utf8 {

inline bool is_continuation(unsigned char c) { return (c & 0xC0) == 0x80; }

/// Length of the well-formed sequence starting at s[i], or 0 when s[i..] does not start one
/// (then `*n_subpart` is the length of the maximal subpart to replace by one U+FFFD, >= 1).
inline size_t sequence_length(std::string_view s, size_t i, size_t * n_subpart = nullptr) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) { return 1; }
    size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) { need = 1; }
    else if (b0 == 0xE0) { need = 2; lo = 0xA0; }
    else if (b0 >= 0xE1 && b0 <= 0xEC) { need = 2; }
    else if (b0 == 0xED) { need = 2; hi = 0x9F; }
    else if (b0 >= 0xEE && b0 <= 0xEF) { need = 2; }
    else if (b0 == 0xF0) { need = 3; lo = 0x90; }
    else if (b0 >= 0xF1 && b0 <= 0xF3) { need = 3; }
    else if (b0 == 0xF4) { need = 3; hi = 0x8F; }
    else {
        if (n_subpart) { *n_subpart = 1; }
        return 0;
    }
    size_t k = 1;
    for (; k <= need; ++k) {
        if (i + k >= s.size()) { break; }
        const auto b = static_cast<unsigned char>(s[i + k]);
        if (b < lo || b > hi) { break; }
        lo = 0x80; hi = 0xBF;
    }
    if (k > need) { return need + 1; }
    if (n_subpart) { *n_subpart = k; }
    return 0;
}

inline bool valid(std::string_view s) {
    for (size_t i = 0; i < s.size();) {
        const size_t n = sequence_length(s, i);
        if (n == 0) { return false; }
        i += n;
    }
    return true;
}

/// Append `bytes` to `out`, each maximal ill-formed subpart replaced by U+FFFD.
inline void append_lossy(std::string & out, std::string_view bytes) {
    size_t i = 0;
    while (i < bytes.size()) {
        size_t       bad = 0;
        const size_t n   = sequence_length(bytes, i, &bad);
        if (n) {
            out.append(bytes.data() + i, n);
            i += n;
        } else {
            out += "\xEF\xBF\xBD";
            i += bad;
        }
    }
}

inline std::string lossy(std::string_view bytes) {
    if (valid(bytes)) { return std::string(bytes); }
    std::string out;
    out.reserve(bytes.size() + 8);
    append_lossy(out, bytes);
    return out;
}

/// Decode the code point at s[i] (which must be well-formed) and advance i.
inline uint32_t next(std::string_view s, size_t & i) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) { ++i; return b0; }
    if (b0 < 0xE0) { const uint32_t c = ((b0 & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu); i += 2; return c; }
    if (b0 < 0xF0) {
        const uint32_t c = ((b0 & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu);
        i += 3;
        return c;
    }
    const uint32_t c = ((b0 & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3Fu);
    i += 4;
    return c;
}

inline void append(std::string & out, uint32_t c) {
    if (c < 0x80) { out += char(c); }
    else if (c < 0x800) { out += char(0xC0 | (c >> 6)); out += char(0x80 | (c & 0x3F)); }
    else if (c < 0x10000) {
        out += char(0xE0 | (c >> 12)); out += char(0x80 | ((c >> 6) & 0x3F)); out += char(0x80 | (c & 0x3F));
    } else {
        out += char(0xF0 | (c >> 18)); out += char(0x80 | ((c >> 12) & 0x3F));
        out += char(0x80 | ((c >> 6) & 0x3F)); out += char(0x80 | (c & 0x3F));
    }
}

}  // namespace fd::utf8
