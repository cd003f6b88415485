// Weight control: V1 (SPEC §3) and the legacy FastDeploy pair (SPEC §4). One implementation,
// dispatch_control(), serves both the HTTP routes and the shm mailbox (SPEC §6), so both
// channels give the same answer; every operation is a ControlCommand run by the engine thread.
#include "handlers.h"

#include "fd/shm/names.h"

#include <chrono>
#include <map>
#include <thread>

namespace fd::api {
namespace {

using nlohmann::json;
using engine::ControlCommand;
using engine::ControlOp;
using engine::ControlResult;

void require_dynamic(const ApiContext & ctx, std::string_view what) {
    if (!ctx.cfg.dynamic_load_weight) {
        fail(Errc::not_found, "{} needs dynamic weight loading; start fdrollout with --dynamic-load-weight", what);
    }
}

/// Post `cmd` and wait for the engine's answer (bounded by --control-timeout-s).
ControlResult run(ApiContext & ctx, ControlCommand cmd) {
    auto fut = ctx.engine->control(std::move(cmd));
    if (fut.wait_for(std::chrono::duration<double>(ctx.cfg.control_timeout_s)) != std::future_status::ready) {
        fail(Errc::timeout, "the engine did not finish the control operation within {} s (--control-timeout-s); check /health",
             ctx.cfg.control_timeout_s);
    }
    ControlResult r = fut.get();
    if (r.error) { throw *r.error; }
    return r;
}

json ranks_json(const ControlResult & r) {
    json a = json::array();
    for (const auto & c : r.ranks) {
        a.push_back({{"rank", c.rank}, {"version", c.version}, {"sync_cost", c.sync_s}, {"update_cost", c.update_s}, {"total_cost", c.total_s}});
    }
    return a;
}

json result_json(ControlOp op, const ControlResult & r) {
    json j = {{"is_paused", r.is_paused}, {"elapsed_s", r.elapsed_s}};
    switch (op) {
        case ControlOp::pause: j["aborted"] = r.n_aborted; break;
        case ControlOp::resume: break;
        case ControlOp::sleep: {
            json freed = json::object();
            if (r.freed_weight_bytes >= 0) { freed["weight"] = r.freed_weight_bytes; }
            if (r.freed_kv_bytes >= 0) { freed["kv_cache"] = r.freed_kv_bytes; }
            j.update({{"tags", r.tags_done}, {"skipped", r.tags_skipped}, {"freed_bytes", freed}, {"aborted", r.n_aborted},
                      {"rss_before_bytes", r.rss_before_bytes}, {"rss_after_bytes", r.rss_after_bytes}});
            break;
        }
        case ControlOp::wakeup:
            j.update({{"tags", r.tags_done}, {"skipped", r.tags_skipped}, {"version", r.version}, {"bytes", r.bytes}, {"ranks", ranks_json(r)}});
            break;
        case ControlOp::update_weights:
            j.update({{"version", r.version}, {"bytes", r.bytes}, {"checksum_verified", r.checksum_verified}, {"ranks", ranks_json(r)}});
            break;
    }
    return j;
}

ControlReply ok_reply(const json & result) { return {200, "application/json", dump(json{{"status", "success"}, {"result", result}})}; }

ControlReply run_op(ApiContext & ctx, ControlCommand cmd) {
    const ControlOp op = cmd.op;
    return ok_reply(result_json(op, run(ctx, std::move(cmd))));
}

ControlReply is_paused_reply(ApiContext & ctx) {
    const auto st = ctx.engine->stats().state;
    json sleeping = json::array();
    if (st.weight_asleep) { sleeping.push_back("weight"); }
    if (st.kv_asleep) { sleeping.push_back("kv_cache"); }
    return {200, "application/json", dump(json{{"is_paused", st.paused}, {"sleeping_tags", sleeping}, {"weights_valid", st.weights_valid},
                                               {"weight_version", st.weight_version}})};
}

// --- legacy ---

using shm::WeightsStatus;

ControlReply legacy_msg(int status, const std::string & msg, const std::string & detail = {}) {
    json j = {{"msg", msg}};
    if (!detail.empty()) { j["error"] = detail; }
    return {status, "application/json", dump(j)};
}

/// Move the status word `from` → `to`, then wait (legacy_timeout_s) until the engine settles it
/// at `target`. Returns true on success; false on timeout or when the engine settled elsewhere.
bool legacy_drive(ApiContext & ctx, WeightsStatus from, WeightsStatus to, WeightsStatus target) {
    if (!ctx.engine->legacy_transition(from, to)) { return false; }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(ctx.cfg.legacy_timeout_s);
    while (std::chrono::steady_clock::now() < deadline) {
        const auto s = ctx.engine->legacy_status();
        if (s != to) { return s == target; }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
}

ControlReply legacy_clear(ApiContext & ctx) {
    if (ctx.cfg.v1_update_weights) { return run_op(ctx, {.op = ControlOp::sleep, .tags = {true, true}}); }
    switch (ctx.engine->legacy_status()) {
        case WeightsStatus::cleared: return legacy_msg(200, "model weight is cleared");
        case WeightsStatus::clearing: return legacy_msg(400, "worker is clearing model weight already");
        case WeightsStatus::updating: return legacy_msg(403, "worker is updating model weight, cannot clear now");
        case WeightsStatus::normal: break;
    }
    if (legacy_drive(ctx, WeightsStatus::normal, WeightsStatus::clearing, WeightsStatus::cleared)) {
        return legacy_msg(200, "clear model weight successfully");
    }
    return legacy_msg(404, "clear model weight timeout", ctx.engine->stats().state.last_control_error);
}

ControlReply legacy_update(ApiContext & ctx) {
    if (ctx.cfg.v1_update_weights) { return run_op(ctx, {.op = ControlOp::wakeup, .tags = {true, true}}); }
    switch (ctx.engine->legacy_status()) {
        case WeightsStatus::normal: return legacy_msg(200, "model weight is updated");
        case WeightsStatus::updating: return legacy_msg(400, "worker is updating model weight already");
        case WeightsStatus::clearing: return legacy_msg(403, "worker is clearing model weight, cannot update now");
        case WeightsStatus::cleared: break;
    }
    if (legacy_drive(ctx, WeightsStatus::cleared, WeightsStatus::updating, WeightsStatus::normal)) {
        return legacy_msg(200, "update model weight successfully");
    }
    return legacy_msg(404, "update model weight timeout", ctx.engine->stats().state.last_control_error);
}

ControlReply dispatch_or_throw(ApiContext & ctx, const shm::MailboxCommand & m) {
    const std::string & op = m.op;
    if (op == "pause") { return run_op(ctx, {.op = ControlOp::pause}); }
    if (op == "resume") { return run_op(ctx, {.op = ControlOp::resume}); }
    if (op == "is_paused") { return is_paused_reply(ctx); }
    if (op == "status") { return {200, "application/json", dump(health_json(ctx))}; }
    if (op == "sleep" || op == "wakeup") {
        require_dynamic(ctx, "/v1/" + op);
        ControlCommand c;
        c.op   = op == "sleep" ? ControlOp::sleep : ControlOp::wakeup;
        c.tags = engine::parse_tags(m.tags);
        return run_op(ctx, c);
    }
    if (op == "update_weights") {
        require_dynamic(ctx, "/v1/update_weights");
        if (m.version && !shm::is_valid_version(*m.version)) {
            throw Error(Errc::invalid_argument,
                        fmt::format("version '{}' must match [A-Za-z0-9._-]{{1,128}} and not be '.' or '..'", *m.version), "version");
        }
        ControlCommand c;
        c.op              = ControlOp::update_weights;
        c.version         = m.version;
        c.verify_checksum = m.verify_checksum;
        return run_op(ctx, c);
    }
    if (op == "clear_load_weight" || op == "update_model_weight") {
        if (!ctx.cfg.dynamic_load_weight) { return {404, "text/plain", "Dynamic Load Weight Disabled."}; }
        return op == "clear_load_weight" ? legacy_clear(ctx) : legacy_update(ctx);
    }
    throw Error(Errc::invalid_argument, fmt::format("unknown control command '{}'", op));
}

/// HTTP path → mailbox command name.
const std::map<std::string, std::string> kRouteOps = {
    {"/v1/pause", "pause"},   {"/v1/resume", "resume"}, {"/v1/is_paused", "is_paused"},
    {"/v1/sleep", "sleep"},   {"/v1/wakeup", "wakeup"}, {"/v1/update_weights", "update_weights"},
    {"/clear_load_weight", "clear_load_weight"},        {"/update_model_weight", "update_model_weight"},
};

}  // namespace

void write_control_error(httplib::Response & res, const Error & e) {
    res.status = errc_http_status(e.code());
    res.set_content(dump(json{{"status", "error"}, {"error", {{"type", errc_name(e.code())}, {"message", e.what()}}}}), "application/json");
}

ControlReply dispatch_control(ApiContext & ctx, const shm::MailboxCommand & cmd) {
    try {
        return dispatch_or_throw(ctx, cmd);
    } catch (const std::exception & e) {
        const Error err = dynamic_cast<const Error *>(&e) ? *dynamic_cast<const Error *>(&e) : Error(Errc::internal, e.what());
        return {errc_http_status(err.code()), "application/json",
                dump(json{{"status", "error"}, {"error", {{"type", errc_name(err.code())}, {"message", err.what()}}}})};
    }
}

void control_route(ApiContext & ctx, const httplib::Request & req, httplib::Response & res) {
    shm::MailboxCommand cmd;
    cmd.op = kRouteOps.at(req.path);
    for (const auto & [key, value] : req.params) {
        if (key != "tags" || (cmd.op != "sleep" && cmd.op != "wakeup")) {  // e.g. vLLM's ?level=1: say so, do not guess
            throw Error(Errc::invalid_argument, fmt::format("unknown query parameter '{}' for {} (sleep and wakeup take tags=weight,kv_cache)",
                                                            key, req.path), key);
        }
    }
    if (req.has_param("tags")) { cmd.tags = req.get_param_value("tags"); }
    if (cmd.op == "update_weights" && !req.body.empty()) {
        json j;
        try {
            j = json::parse(req.body);
        } catch (const json::exception & e) {
            throw Error(Errc::invalid_argument, fmt::format("request body is not valid JSON: {}", e.what()));
        }
        if (!j.is_object()) { throw Error(Errc::invalid_argument, "request body must be a JSON object"); }
        if (j.contains("version") && !j["version"].is_null()) {
            if (!j["version"].is_string()) { throw Error(Errc::invalid_argument, "'version' must be a string", "version"); }
            cmd.version = j["version"].get<std::string>();
        }
        if (j.contains("verify_checksum") && !j["verify_checksum"].is_null()) {
            if (!j["verify_checksum"].is_boolean()) { throw Error(Errc::invalid_argument, "'verify_checksum' must be a boolean", "verify_checksum"); }
            cmd.verify_checksum = j["verify_checksum"].get<bool>();
        }
    }
    const ControlReply r = dispatch_control(ctx, cmd);
    res.status = r.http_status;
    res.set_content(r.body, r.content_type);
}

}  // namespace fd::api
