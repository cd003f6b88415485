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
        case ControlOp::commit_weights: return "commit_weights";
        case ControlOp::drop_staged_weights: return "drop_staged_weights";
        case ControlOp::flush_cache: return "flush_cache";
        case ControlOp::abort_request: return "abort_request";
        case ControlOp::is_paused: return "is_paused";
        case ControlOp::status: return "status";
        case ControlOp::clear_load_weight: return "clear_load_weight";
        case ControlOp::update_model_weight: return "update_model_weight";
    }
    return "?";
}

std::string_view wire_name(ControlOp op) { return op == ControlOp::abort_request ? "abort" : to_string(op); }

bool is_engine_op(ControlOp op) {
    switch (op) {
        case ControlOp::is_paused:
        case ControlOp::status:
        case ControlOp::clear_load_weight:
        case ControlOp::update_model_weight: return false;
        default: return true;
    }
}

void HeldEvents::release() {
    std::vector<Item> items;
    {
        std::lock_guard lk(mu_);
        items.swap(items_);
    }
    for (auto & [channel, ev] : items) { channel->push(std::move(ev)); }
}

std::string_view to_string(PauseMode m) {
    switch (m) {
        case PauseMode::abort: return "abort";
        case PauseMode::wait: return "wait";
        case PauseMode::keep: return "keep";
    }
    return "?";
}

PauseMode parse_pause_mode(std::string_view text) {
    if (text.empty() || text == "abort") { return PauseMode::abort; }
    if (text == "wait") { return PauseMode::wait; }
    if (text == "keep") { return PauseMode::keep; }
    throw Error(Errc::invalid_argument, fmt::format("unknown pause mode '{}' (abort, wait or keep); nothing was done", text), "mode");
}

TagSet parse_tags(std::string_view text) {
    TagSet t;
    for (const auto & tag : shm::parse_tag_list(text)) { (tag == "weight" ? t.weight : tag == "kv_cache" ? t.kv_cache : t.cuda_graph) = true; }
    return t;
}

std::string TagSet::text() const {
    std::string out;
    for (const auto & [on, name] : {std::pair{weight, "weight"}, std::pair{kv_cache, "kv_cache"}, std::pair{cuda_graph, "cuda_graph"}}) {
        if (on) { out += (out.empty() ? "" : ",") + std::string(name); }
    }
    return out;
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
