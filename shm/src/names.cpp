#include "fd/shm/names.h"

#include "fd/status.h"

namespace fd::shm {

bool is_valid_version(std::string_view v) {
    // No leading '.': ".", ".." and the dot-names the rsync store and staging dir keep for themselves
    // (.tmp-*, .pull.lock, .hold-*, .incoming-*; a version ".pull.lock" once blocked every later pull).
    if (v.empty() || v.size() > 128 || v.front() == '.') { return false; }
    for (char c : v) {
        const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
        if (!ok) { return false; }
    }
    return true;
}

bool is_valid_request_id(std::string_view id) {
    if (id.empty() || id.size() > 128) { return false; }
    for (const char c : id) {
        if (c <= ' ' || c > '~') { return false; }
    }
    return true;
}

std::vector<std::string> parse_tag_list(std::string_view text) {
    bool weight = false, kv = false, graph = false;
    size_t pos = 0;
    while (pos <= text.size()) {
        size_t end = text.find(',', pos);
        if (end == std::string_view::npos) { end = text.size(); }
        std::string_view tag = text.substr(pos, end - pos);
        while (!tag.empty() && (tag.front() == ' ' || tag.front() == '\t')) { tag.remove_prefix(1); }
        while (!tag.empty() && (tag.back() == ' ' || tag.back() == '\t')) { tag.remove_suffix(1); }
        if (tag == "weight") {
            weight = true;
        } else if (tag == "kv_cache") {
            kv = true;
        } else if (tag == "cuda_graph") {
            graph = true;
        } else if (!tag.empty()) {
            throw Error(Errc::invalid_argument,
                        fmt::format("unknown tag '{}': use weight, kv_cache, cuda_graph (comma-separated; none = weight,kv_cache)", tag), "tags");
        }
        pos = end + 1;
    }
    if (!weight && !kv && !graph) {
        // Nothing named: the empty text is the default (weight, kv_cache); separators or spaces
        // alone (",,", " ") are a malformed list, not a request to release everything.
        if (!text.empty()) {
            throw Error(Errc::invalid_argument,
                        fmt::format("tags '{}' name no tag: use weight, kv_cache, cuda_graph (comma-separated), or give none for "
                                    "weight,kv_cache; nothing was done", text), "tags");
        }
        weight = kv = true;
    }
    std::vector<std::string> out;
    if (weight) { out.emplace_back("weight"); }
    if (kv) { out.emplace_back("kv_cache"); }
    if (graph) { out.emplace_back("cuda_graph"); }
    return out;
}

}  // namespace fd::shm
