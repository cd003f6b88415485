// parse_command — the one place a control command is validated, whatever carried it — and the
// mailbox's block fields in wire form.
#include "fd/control/request.h"

#include "fd/shm/names.h"

#include <cstring>

namespace fd::control {

using engine::ControlOp;

ControlOp parse_op(std::string_view name) {
    for (int i = 0; i <= static_cast<int>(ControlOp::update_model_weight); ++i) {
        if (engine::wire_name(static_cast<ControlOp>(i)) == name) { return static_cast<ControlOp>(i); }
    }
    throw Error(Errc::invalid_argument, fmt::format("unknown control command '{}'", name), "op");
}

shm::MailboxCommand read_mailbox(const shm::MailboxSlot & b) {
    shm::MailboxCommand cmd;
    cmd.op   = std::string(b.cmd_op, strnlen(b.cmd_op, sizeof b.cmd_op));
    cmd.tags = std::string(b.cmd_tags, strnlen(b.cmd_tags, sizeof b.cmd_tags));
    if (b.cmd_has_version) { cmd.version = std::string(b.cmd_version, strnlen(b.cmd_version, sizeof b.cmd_version)); }
    cmd.verify_checksum = b.cmd_verify_checksum != 0;
    cmd.commit          = b.cmd_stage_only == 0;
    cmd.request_id      = std::string(b.cmd_request_id, strnlen(b.cmd_request_id, sizeof b.cmd_request_id));
    cmd.abort_all       = b.cmd_abort_all != 0;
    if (cmd.op == "flush_cache") {
        cmd.mode = b.cmd_pause_mode == 1 ? "device" : "";  // 1: keep the host KV tier
    } else if (b.cmd_pause_mode != 0) {
        cmd.mode = b.cmd_pause_mode == 1 ? "wait" : b.cmd_pause_mode == 2 ? "keep" : "?";
    }
    return cmd;
}

engine::ControlCommand parse_command(const shm::MailboxCommand & wire) {
    engine::ControlCommand r;
    r.op = parse_op(wire.op);
    const bool takes_tags = r.op == ControlOp::sleep || r.op == ControlOp::wakeup;
    if (!wire.tags.empty() && !takes_tags) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no tags (only sleep and wakeup do)", wire.op), "tags");
    }
    if (takes_tags) { r.tags = engine::parse_tags(wire.tags); }
    const bool update = r.op == ControlOp::update_weights;
    if (wire.version && !update && r.op != ControlOp::commit_weights) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no version (only update_weights and commit_weights do)", wire.op), "version");
    }
    if (!update && (wire.verify_checksum || !wire.commit)) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no {} (only update_weights does)", wire.op, wire.verify_checksum ? "verify_checksum" : "commit"),
                    wire.verify_checksum ? "verify_checksum" : "commit");
    }
    if (wire.version && !shm::is_valid_version(*wire.version)) {
        throw Error(Errc::invalid_argument,
                    fmt::format("version '{}' must match [A-Za-z0-9._-]{{1,128}} and not start with '.'", *wire.version), "version");
    }
    if (!wire.mode.empty() && r.op != ControlOp::pause && r.op != ControlOp::flush_cache) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no mode (only pause and flush_cache do)", wire.op), "mode");
    }
    if (r.op == ControlOp::flush_cache) {
        if (wire.mode != "" && wire.mode != "all" && wire.mode != "device") {
            throw Error(Errc::invalid_argument,
                        fmt::format("flush_cache mode '{}' must be 'all' (device prefix cache and host KV tier, the default) or 'device' "
                                    "(keep the host tier); nothing was flushed", wire.mode), "mode");
        }
        r.keep_host_tier = wire.mode == "device";
    } else {
        r.pause_mode = engine::parse_pause_mode(wire.mode);
    }
    if (wire.keep_prefix_cache && r.op != ControlOp::pause) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no clear_cache (only pause does)", wire.op), "clear_cache");
    }
    r.keep_prefix_cache = wire.keep_prefix_cache;
    if (r.op == ControlOp::abort_request) {
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
    if (!wire.weight_delta.empty() && ((wire.weight_dir.empty() && !wire.weight_land) || wire.weight_delta.front() != '/')) {
        throw Error(Errc::invalid_argument, "weight_delta needs weight_dir (the serving checkpoint dir; or weight_land: the landed weights) "
                                            "and an absolute path", "weight_delta");
    }
    if ((!wire.land_host.empty() || wire.weight_land) && !update) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' takes no landing (only update_weights does)", wire.op), "land");
    }
    r.land_host       = wire.land_host;
    r.weight_land     = wire.weight_land;
    r.land_timeout_s  = wire.land_timeout_s;
    r.land_delta      = wire.land_delta;
    r.weight_dir      = wire.weight_dir;
    r.weight_delta    = wire.weight_delta;
    r.reload_base     = wire.reload_base;
    r.request_id      = wire.request_id;
    r.abort_all       = wire.abort_all;
    r.version         = wire.version;
    r.verify_checksum = wire.verify_checksum;
    r.commit          = wire.commit;
    return r;
}

}  // namespace fd::control
