#include "fd/engine/request.h"

namespace fd::engine {

const char * to_string(FinishReason r) {
    switch (r) {
        case FinishReason::none: return "";
        case FinishReason::stop: return "stop";
        case FinishReason::length: return "length";
        case FinishReason::abort: return "abort";
        case FinishReason::error: return "error";
    }
    return "";
}

void ResultChannel::push(ChoiceEvent ev) {
    const bool wake = wake_each_ || ev.finish != FinishReason::none;
    std::function<void()> notify;
    {
        std::lock_guard lk(mu_);
        q_.push_back(std::move(ev));
        if (wake) { notify = notify_; }
    }
    if (wake) { cv_.notify_one(); }
    if (notify) { notify(); }
}

void ResultChannel::set_notify(std::function<void()> fn) {
    std::lock_guard lk(mu_);
    notify_ = std::move(fn);
}

std::vector<ChoiceEvent> ResultChannel::pop_all(std::chrono::milliseconds wait) {
    std::unique_lock lk(mu_);
    // Without wake_each_, wait for a finishing event (or the timeout), not for any event.
    cv_.wait_for(lk, wait, [&] {
        if (wake_each_) { return !q_.empty(); }
        for (const auto & ev : q_) {
            if (ev.finish != FinishReason::none) { return true; }
        }
        return false;
    });
    std::vector<ChoiceEvent> out(std::make_move_iterator(q_.begin()), std::make_move_iterator(q_.end()));
    q_.clear();
    for (const auto & ev : out) {
        if (ev.finish != FinishReason::none) { --n_open_; }
    }
    return out;
}

bool ResultChannel::done() const {
    std::lock_guard lk(mu_);
    return n_open_ <= 0 && q_.empty();
}

}  // namespace fd::engine
