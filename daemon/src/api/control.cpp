// Weight-control routes: V1 (SPEC §3) and the legacy FastDeploy pair (SPEC §4). Handlers only
// translate: every operation is a ControlCommand run by the engine thread.
#include "handlers.h"

#include "fd/weights/weight_source.h"

#include <chrono>
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

void answer(ApiContext & ctx, ControlCommand cmd, httplib::Response & res) {
    const ControlOp op = cmd.op;
    const ControlResult r = run(ctx, std::move(cmd));
    res.set_content(dump(json{{"status", "success"}, {"result", result_json(op, r)}}), "application/json");
}

ControlCommand tagged(ControlOp op, const httplib::Request & req) {
    ControlCommand c;
    c.op   = op;
    c.tags = engine::parse_tags(req.has_param("tags") ? req.get_param_value("tags") : "");
    return c;
}

}  // namespace

void write_control_error(httplib::Response & res, const Error & e) {
    res.status = errc_http_status(e.code());
    res.set_content(dump(json{{"status", "error"}, {"error", {{"type", errc_name(e.code())}, {"message", e.what()}}}}), "application/json");
}

void post_pause(ApiContext & ctx, const httplib::Request &, httplib::Response & res) { answer(ctx, {ControlOp::pause}, res); }

void post_resume(ApiContext & ctx, const httplib::Request &, httplib::Response & res) { answer(ctx, {ControlOp::resume}, res); }

void get_is_paused(ApiContext & ctx, const httplib::Request &, httplib::Response & res) {
    const auto st = ctx.engine->stats().state;
    json sleeping = json::array();
    if (st.weight_asleep) { sleeping.push_back("weight"); }
    if (st.kv_asleep) { sleeping.push_back("kv_cache"); }
    res.set_content(dump(json{{"is_paused", st.paused}, {"sleeping_tags", sleeping}, {"weights_valid", st.weights_valid},
                              {"weight_version", st.weight_version}}), "application/json");
}

void post_sleep(ApiContext & ctx, const httplib::Request & req, httplib::Response & res) {
    require_dynamic(ctx, "/v1/sleep");
    answer(ctx, tagged(ControlOp::sleep, req), res);
}

void post_wakeup(ApiContext & ctx, const httplib::Request & req, httplib::Response & res) {
    require_dynamic(ctx, "/v1/wakeup");
    answer(ctx, tagged(ControlOp::wakeup, req), res);
}

void post_update_weights(ApiContext & ctx, const httplib::Request & req, httplib::Response & res) {
    require_dynamic(ctx, "/v1/update_weights");
    ControlCommand c;
    c.op = ControlOp::update_weights;
    if (!req.body.empty()) {
        json j;
        try {
            j = json::parse(req.body);
        } catch (const json::exception & e) {
            throw Error(Errc::invalid_argument, fmt::format("request body is not valid JSON: {}", e.what()));
        }
        if (!j.is_object()) { throw Error(Errc::invalid_argument, "request body must be a JSON object"); }
        if (j.contains("version") && !j["version"].is_null()) {
            if (!j["version"].is_string()) { throw Error(Errc::invalid_argument, "'version' must be a string", "version"); }
            c.version = j["version"].get<std::string>();
            if (!weights::is_valid_version(*c.version)) {
                throw Error(Errc::invalid_argument,
                            fmt::format("version '{}' must match [A-Za-z0-9._-]{{1,128}} and not be '.' or '..'", *c.version), "version");
            }
        }
        if (j.contains("verify_checksum") && !j["verify_checksum"].is_null()) {
            if (!j["verify_checksum"].is_boolean()) { throw Error(Errc::invalid_argument, "'verify_checksum' must be a boolean", "verify_checksum"); }
            c.verify_checksum = j["verify_checksum"].get<bool>();
        }
    }
    answer(ctx, std::move(c), res);
}

// --- legacy ---------------------------------------------------------------------------------

namespace {

using shm::WeightsStatus;

void legacy_msg(httplib::Response & res, int status, const std::string & msg, const std::string & detail = {}) {
    json j = {{"msg", msg}};
    if (!detail.empty()) { j["error"] = detail; }
    res.status = status;
    res.set_content(dump(j), "application/json");
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

bool legacy_disabled(const ApiContext & ctx, httplib::Response & res) {
    if (ctx.cfg.dynamic_load_weight) { return false; }
    res.status = 404;
    res.set_content("Dynamic Load Weight Disabled.", "text/plain");
    return true;
}

}  // namespace

void get_clear_load_weight(ApiContext & ctx, const httplib::Request &, httplib::Response & res) {
    if (legacy_disabled(ctx, res)) { return; }
    if (ctx.cfg.v1_update_weights) { return answer(ctx, {ControlOp::sleep, {true, true}}, res); }
    switch (ctx.engine->legacy_status()) {
        case WeightsStatus::cleared: return legacy_msg(res, 200, "model weight is cleared");
        case WeightsStatus::clearing: return legacy_msg(res, 400, "worker is clearing model weight already");
        case WeightsStatus::updating: return legacy_msg(res, 403, "worker is updating model weight, cannot clear now");
        case WeightsStatus::normal:
            if (legacy_drive(ctx, WeightsStatus::normal, WeightsStatus::clearing, WeightsStatus::cleared)) {
                return legacy_msg(res, 200, "clear model weight successfully");
            }
            return legacy_msg(res, 404, "clear model weight timeout", ctx.engine->stats().state.last_control_error);
    }
}

void get_update_model_weight(ApiContext & ctx, const httplib::Request &, httplib::Response & res) {
    if (legacy_disabled(ctx, res)) { return; }
    if (ctx.cfg.v1_update_weights) { return answer(ctx, {ControlOp::wakeup, {true, true}}, res); }
    switch (ctx.engine->legacy_status()) {
        case WeightsStatus::normal: return legacy_msg(res, 200, "model weight is updated");
        case WeightsStatus::updating: return legacy_msg(res, 400, "worker is updating model weight already");
        case WeightsStatus::clearing: return legacy_msg(res, 403, "worker is clearing model weight, cannot update now");
        case WeightsStatus::cleared:
            if (legacy_drive(ctx, WeightsStatus::cleared, WeightsStatus::updating, WeightsStatus::normal)) {
                return legacy_msg(res, 200, "update model weight successfully");
            }
            return legacy_msg(res, 404, "update model weight timeout", ctx.engine->stats().state.last_control_error);
    }
}

}  // namespace fd::api
