// fd/utf8.h: RFC 3629's well-formed byte sequences (Table 3-7 of the Unicode standard).
#include "fd/utf8.h"

namespace fd {

size_t utf8_sequence_length(std::string_view s, size_t at) {
    const auto b = [&](size_t i) { return at + i < s.size() ? static_cast<unsigned char>(s[at + i]) : 0x100u; };
    const unsigned c = b(0);
    const auto cont = [&](size_t i, unsigned lo = 0x80, unsigned hi = 0xBF) { return b(i) >= lo && b(i) <= hi; };
    if (c < 0x80) { return 1; }
    if (c >= 0xC2 && c <= 0xDF) { return cont(1) ? 2 : 0; }
    if (c == 0xE0) { return cont(1, 0xA0) && cont(2) ? 3 : 0; }
    if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) { return cont(1) && cont(2) ? 3 : 0; }
    if (c == 0xED) { return cont(1, 0x80, 0x9F) && cont(2) ? 3 : 0; }  // no surrogates
    if (c == 0xF0) { return cont(1, 0x90) && cont(2) && cont(3) ? 4 : 0; }
    if (c >= 0xF1 && c <= 0xF3) { return cont(1) && cont(2) && cont(3) ? 4 : 0; }
    if (c == 0xF4) { return cont(1, 0x80, 0x8F) && cont(2) && cont(3) ? 4 : 0; }  // up to U+10FFFF
    return 0;
}

std::string utf8_replace_invalid(std::string_view s) {
    std::string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size();) {
        const size_t n = utf8_sequence_length(s, i);
        if (n == 0) {
            out += "\xEF\xBF\xBD";
            ++i;
        } else {
            out.append(s.substr(i, n));
            i += n;
        }
    }
    return out;
}

}  // namespace fd
