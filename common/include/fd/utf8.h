// fd/utf8.h — well-formed UTF-8 for what the daemon writes out (JSON log lines, Prometheus labels).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace fd {

/// The length (1..4) of the well-formed UTF-8 sequence that starts `s` at `at` (RFC 3629: no
/// overlongs, no surrogates, nothing past U+10FFFF), or 0 when the bytes there are not one.
size_t utf8_sequence_length(std::string_view s, size_t at);

/// `s` with each byte that starts no well-formed sequence replaced by U+FFFD (as nlohmann's
/// error_handler_t::replace does for /health): always valid UTF-8; `s` itself when it was.
std::string utf8_replace_invalid(std::string_view s);

}  // namespace fd
