// ControlRequest::parse — the one place a control command is validated, whatever carried it.
#include "fd/control/service.h"

#include "fd/shm/names.h"

#include <array>
#include <utility>

namespace fd::control {
namespace {

constexpr std::array<std::pair<ControlVerb, std::string_view>, 13> kVerbs = {{
    {ControlVerb::pause, "pause"},
    {ControlVerb::resume, "resume"},
    {ControlVerb::is_paused, "is_paused"},
    {ControlVerb::status, "status"},
    {ControlVerb::sleep, "sleep"},
    {ControlVerb::wakeup, "wakeup"},
    {ControlVerb::update_weights, "update_weights"},
    {ControlVerb::commit_weights, "commit_weights"},
    {ControlVerb::drop_staged_weights, "drop_staged_weights"},
    {ControlVerb::flush_cache, "flush_cache"},
    {ControlVerb::abort, "abort"},
    {ControlVerb::clear_load_weight, "clear_load_weight"},
    {ControlVerb::update_model_weight, "update_model_weight"},
}};

}  // namespace

std::string_view to_string(ControlVerb v) {
    for (const auto & [verb, name] : kVerbs) {
        if (verb == v) { return name; }
    }
    return "?";
}

ControlRequest ControlRequest::parse(const shm::MailboxCommand & wire) {
    ControlRequest r;
    bool known = false;
    for (const auto & [verb, name] : kVerbs) {
        if (name == wire.op) { r.verb = verb; known = true; }
    }
    if (!known) { throw Error(Errc::invalid_argument, fmt::format("unknown control command '{}'", wire.op), "op"); }
    const bool takes_tags = r.verb == ControlVerb::sleep || r.verb == ControlVerb::wakeup;
    if (!wire.tags.empty() && !takes_tags) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no tags (only sleep and wakeup do)", wire.op), "tags");
    }
    if (takes_tags) { r.tags = engine::parse_tags(wire.tags); }
    const bool update = r.verb == ControlVerb::update_weights;
    if (wire.version && !update && r.verb != ControlVerb::commit_weights) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no version (only update_weights and commit_weights do)", wire.op), "version");
    }
    if (!update && (wire.verify_checksum || !wire.commit)) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no {} (only update_weights does)", wire.op, wire.verify_checksum ? "verify_checksum" : "commit"),
                    wire.verify_checksum ? "verify_checksum" : "commit");
    }
    if (wire.version && !shm::is_valid_version(*wire.version)) {
        throw Error(Errc::invalid_argument,
                    fmt::format("version '{}' must match [A-Za-z0-9._-]{{1,128}} and not be '.' or '..'", *wire.version), "version");
    }
    if (!wire.mode.empty() && r.verb != ControlVerb::pause && r.verb != ControlVerb::flush_cache) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no mode (only pause and flush_cache do)", wire.op), "mode");
    }
    if (r.verb == ControlVerb::flush_cache) {
        if (wire.mode != "" && wire.mode != "all" && wire.mode != "device") {
            throw Error(Errc::invalid_argument,
                        fmt::format("flush_cache mode '{}' must be 'all' (device prefix cache and host KV tier, the default) or 'device' "
                                    "(keep the host tier); nothing was flushed", wire.mode), "mode");
        }
        r.keep_host_tier = wire.mode == "device";
    } else {
        r.pause_mode = engine::parse_pause_mode(wire.mode);
    }
    if (wire.keep_prefix_cache && r.verb != ControlVerb::pause) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no clear_cache (only pause does)", wire.op), "clear_cache");
    }
    r.keep_prefix_cache = wire.keep_prefix_cache;
    if (r.verb == ControlVerb::abort) {
        if (wire.abort_all == !wire.request_id.empty()) {
            throw Error(Errc::invalid_argument, "abort takes either 'request_id' (a completion id or the client's X-Request-Id) or "
                                                "\"abort_all\": true; nothing was done", "request_id");
        }
        if (!wire.abort_all && !shm::is_valid_request_id(wire.request_id)) {
            throw Error(Errc::invalid_argument, "'request_id' must be 1..128 printable ASCII characters without spaces", "request_id");
        }
    } else if (!wire.request_id.empty() || wire.abort_all) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no request_id (only abort does)", wire.op), "request_id");
    }
    if ((!wire.weight_dir.empty() || wire.reload_base) && !update) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no weight_dir (only update_weights does)", wire.op), "weight_dir");
    }
    if (!wire.weight_dir.empty()) {
        if (wire.reload_base) { throw Error(Errc::invalid_argument, "weight_dir and a reload of the base model exclude each other", "weight_dir"); }
        if (wire.weight_dir.front() != '/') {
            throw Error(Errc::invalid_argument, fmt::format("weight_dir '{}' must be an absolute path", wire.weight_dir), "weight_dir");
        }
        if (wire.weight_dir.size() > 1023) { throw Error(Errc::invalid_argument, "weight_dir is longer than 1023 bytes", "weight_dir"); }
        if (!wire.commit) { throw Error(Errc::invalid_argument, "weight_dir loads are not staged (commit=false); pass commit=true", "commit"); }
    }
    r.weight_dir      = wire.weight_dir;
    r.reload_base     = wire.reload_base;
    r.request_id      = wire.request_id;
    r.abort_all       = wire.abort_all;
    r.version         = wire.version;
    r.verify_checksum = wire.verify_checksum;
    r.commit          = wire.commit;
    return r;
}

}  // namespace fd::control
