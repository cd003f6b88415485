#include "fd/engine/control.h"

namespace fd::engine {

std::string_view to_string(ControlOp op) {
    switch (op) {
        case ControlOp::pause: return "pause";
        case ControlOp::resume: return "resume";
        case ControlOp::sleep: return "sleep";
        case ControlOp::wakeup: return "wakeup";
        case ControlOp::update_weights: return "update_weights";
    }
    return "?";
}

TagSet parse_tags(std::string_view text) {
    TagSet t;
    size_t pos = 0;
    while (pos <= text.size()) {
        size_t end = text.find(',', pos);
        if (end == std::string_view::npos) { end = text.size(); }
        std::string_view tag = text.substr(pos, end - pos);
        while (!tag.empty() && (tag.front() == ' ' || tag.front() == '\t')) { tag.remove_prefix(1); }
        while (!tag.empty() && (tag.back() == ' ' || tag.back() == '\t')) { tag.remove_suffix(1); }
        if (tag == "weight") {
            t.weight = true;
        } else if (tag == "kv_cache") {
            t.kv_cache = true;
        } else if (!tag.empty()) {
            throw Error(Errc::invalid_argument, fmt::format("unknown tag '{}': use weight, kv_cache or both (comma-separated)", tag), "tags");
        }
        pos = end + 1;
    }
    if (t.empty()) { t.weight = t.kv_cache = true; }
    return t;
}

}  // namespace fd::engine
