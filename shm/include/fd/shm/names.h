// fd/shm/names.h — the syntax of what clients send: weight versions, request ids and memory tags (SPEC §3).
// Shared by the daemon (which enforces it) and fdctl (which checks before sending anything).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace fd::shm {

/// `[A-Za-z0-9._-]{1,128}`, not starting with '.': a version never escapes a directory nor takes
/// a name the rsync store or staging dir keeps for itself (.tmp-*, .pull.lock, .hold-*, .incoming-*).
bool is_valid_version(std::string_view v);

/// A request id a client may send (X-Request-Id, an abort's request_id): 1..128 printable ASCII
/// characters, no spaces. Fits ControlBlock::cmd_request_id.
bool is_valid_request_id(std::string_view id);

/// Split a `tags` list ("weight, kv_cache"): comma-separated, spaces trimmed, empty items
/// dropped; the empty text = weight and kv_cache. The names: weight, kv_cache, cuda_graph
/// (engine::TagSet says what each frees). Returns the distinct tags in the order weight,
/// kv_cache, cuda_graph.
/// Errors  fd::Error{invalid_argument} naming an unknown tag, or for a non-empty text that names
///         none (",,", " "): a malformed list never means "release everything".
std::vector<std::string> parse_tag_list(std::string_view text);

}  // namespace fd::shm
