#include "fd/engine/control.h"

#include "fd/shm/names.h"

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
    for (const auto & tag : shm::parse_tag_list(text)) { (tag == "weight" ? t.weight : t.kv_cache) = true; }
    return t;
}


bool LocalStartGate::start() {
    if (std::chrono::steady_clock::now() >= deadline_) {
        cancel();
        return false;
    }
    int expected = pending;
    return state_.compare_exchange_strong(expected, started);
}

bool LocalStartGate::cancel() {
    int expected = pending;
    return state_.compare_exchange_strong(expected, cancelled) || expected == cancelled;
}

}  // namespace fd::engine
