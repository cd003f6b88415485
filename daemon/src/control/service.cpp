// The control service (SPEC §3, §4, §6): every control command from every transport runs here,
// as an engine ControlCommand through the engine inbox, and comes back as the one reply shape.
#include "fd/control/service.h"

#include "fd/arena.h"
#include "fd/engine/engine.h"
#include "fd/progress.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <thread>

namespace fd::control {
namespace {

using nlohmann::json;
using engine::ControlCommand;
using engine::ControlOp;
using engine::ControlResult;
using shm::WeightsStatus;

std::string dump(const json & j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json ranks_json(const ControlResult & r) {
    json a = json::array();
    for (const auto & c : r.ranks) {
        json j = {{"rank", c.rank}, {"rss_bytes", c.rss_bytes}};
        if (c.freed_bytes >= 0) {
            j["freed_bytes"] = c.freed_bytes;  // sleep
            if (c.device_freed_bytes >= 0) { j["device_bytes_freed"] = c.device_freed_bytes; }  // a CUDA rank's cudaMemGetInfo delta
        } else {
            j.update({{"version", c.version}, {"bytes", c.bytes}, {"sync_cost", c.sync_s}, {"update_cost", c.update_s}, {"total_cost", c.total_s}});
        }
        a.push_back(std::move(j));
    }
    return a;
}

json result_json(ControlOp op, const ControlResult & r) {
    json j = {{"is_paused", r.is_paused}, {"elapsed_s", r.elapsed_s}};
    switch (op) {
        case ControlOp::pause:
            j.update({{"mode", engine::to_string(r.pause_mode)}, {"aborted", r.n_aborted}, {"tier_copies_waited", r.n_tier_copies_waited}});
            if (r.pause_mode == engine::PauseMode::keep) { j["kept"] = r.n_kept; }
            if (r.pause_mode == engine::PauseMode::wait) { j["drained"] = r.n_drained; }
            break;
        case ControlOp::abort_request: j["aborted"] = r.n_aborted; break;
        case ControlOp::resume: break;
        case ControlOp::sleep: {
            json freed = json::object();
            if (r.freed_weight_bytes >= 0) { freed["weight"] = r.freed_weight_bytes; }
            if (r.freed_kv_bytes >= 0) { freed["kv_cache"] = r.freed_kv_bytes; }
            if (r.freed_swap_bytes >= 0) { freed["kv_swap"] = r.freed_swap_bytes; }
            j.update({{"tags", r.tags_done}, {"skipped", r.tags_skipped}, {"freed_bytes", freed}, {"aborted", r.n_aborted},
                      {"rss_before_bytes", r.rss_before_bytes}, {"rss_after_bytes", r.rss_after_bytes}, {"ranks", ranks_json(r)}});
            if (r.device_freed_bytes >= 0) { j["device_bytes_freed"] = r.device_freed_bytes; }
            break;
        }
        case ControlOp::wakeup:
            j.update({{"tags", r.tags_done}, {"skipped", r.tags_skipped}, {"version", r.version}, {"bytes", r.bytes}, {"ranks", ranks_json(r)}});
            break;
        case ControlOp::update_weights:
            j.update({{"version", r.version}, {"bytes", r.bytes}, {"checksum_verified", r.checksum_verified}, {"staged", r.staged},
                      {"ranks", ranks_json(r)}});
            break;
        case ControlOp::commit_weights: j.update({{"version", r.version}, {"ranks", ranks_json(r)}}); break;
        case ControlOp::drop_staged_weights: j["dropped_version"] = r.version.empty() ? json(nullptr) : json(r.version); break;
        case ControlOp::flush_cache: j["host_blocks_flushed"] = r.n_host_blocks_flushed; break;
    }
    return j;
}

ControlReply json_reply(const json & body, int status = 200) { return {status, "application/json", dump(body)}; }

ControlReply legacy_msg(int status, const std::string & msg, const std::string & detail = {}) {
    json j = {{"msg", msg}};
    if (!detail.empty()) { j["error"] = detail; }
    return json_reply(j, status);
}

json sleeping_tags(const engine::EngineState & st) {
    json sleeping = json::array();
    if (st.weight_asleep) { sleeping.push_back("weight"); }
    if (st.kv_asleep) { sleeping.push_back("kv_cache"); }
    return sleeping;
}

/// Post `cmd` and wait for the engine's answer. At the gate's deadline a command not yet
/// started is withdrawn (the gate's CAS decides, so the answer is the truth); one that started is
/// waited for until `timeout_s` after `received`.
ControlResult run_engine(engine::Engine & engine, ControlCommand cmd, std::chrono::steady_clock::time_point received, double timeout_s) {
    const auto gate  = cmd.gate;
    const auto what  = std::string(to_string(cmd.op));
    // (+2 s: a pause mode=wait answers `timeout` itself at the gate's deadline; that answer wins)
    const auto limit = std::max(gate->deadline() + std::chrono::seconds(2),
                                received + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s)));
    auto fut = engine.control(std::move(cmd));
    if (fut.wait_until(gate->deadline()) != std::future_status::ready) {
        if (gate->cancel()) {
            fail(Errc::timeout, "{} was not started before the request's deadline (X-Request-Timeout / X-Request-Deadline, else "
                                "--control-timeout-s {} s): withdrawn, it will not run; nothing changed", what, timeout_s);
        }
        if (fut.wait_until(limit) != std::future_status::ready) {
            fail(Errc::timeout, "{} started but did not finish within {} s (--control-timeout-s): it is still running and may still "
                                "take effect; check /health", what, timeout_s);
        }
    }
    ControlResult r = fut.get();
    if (r.error) { throw *r.error; }
    return r;
}

/// Move the status word `from` → `to`, then wait (at most `timeout_s`) until the engine settles
/// it at `target`. Returns true on success; false on timeout or when the engine settled elsewhere.
bool legacy_drive(engine::Engine & engine, WeightsStatus from, WeightsStatus to, WeightsStatus target, double timeout_s) {
    if (!engine.legacy_transition(from, to)) { return false; }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::chrono::steady_clock::now() < deadline) {
        const auto s = engine.legacy_status();
        if (s != to) { return s == target; }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
}

}  // namespace

ControlReply error_reply(const Error & e) {
    return json_reply(json{{"status", "error"}, {"error", {{"type", errc_name(e.code())}, {"message", e.what()}}}}, errc_http_status(e.code()));
}

ControlService::ControlService(ControlConfig cfg, engine::Engine & engine) : cfg_(std::move(cfg)), engine_(engine) {}

ControlReply ControlService::handle(const shm::MailboxCommand & wire, std::shared_ptr<engine::StartGate> gate) {
    try {
        ControlRequest req = ControlRequest::parse(wire);
        req.gate = std::move(gate);
        return handle(req);
    } catch (const Error & e) {
        return error_reply(e);
    }
}

ControlReply ControlService::handle(const ControlRequest & req) {
    try {
        return run(req);
    } catch (const Error & e) {
        return error_reply(e);
    } catch (const std::exception & e) {
        return error_reply(Error(Errc::internal, e.what()));
    }
}

namespace {

/// /health `progress`: bytes done / total of the long phase running now (fd/progress.h), else null.
/// Its `op` is the one the phase recorded when it began, not the engine state read a moment
/// earlier (that read can predate the operation's start: `op` would be null).
json progress_json() {
    const auto p = Progress::current().snapshot();
    if (!p) { return nullptr; }
    return {{"op", p->op.empty() ? json(nullptr) : json(p->op)}, {"phase", p->phase}, {"bytes_done", p->bytes_done},
            {"bytes_total", p->bytes_total > 0 ? json(p->bytes_total) : json(nullptr)}, {"elapsed_s", p->elapsed_s}};
}

/// /health `device_memory`: null on cpu; on cuda every rank's device, its memory (cudaMemGetInfo
/// in the rank's process) and what the rank's allocator holds per tag, as measured at most ~1 s
/// before (age_s) or at the last control call.
json device_memory_json(const std::vector<runtime::RankDevice> & devs) {
    if (devs.empty()) { return nullptr; }
    const auto now = std::chrono::steady_clock::now();
    json ranks = json::array();
    for (const auto & d : devs) {
        ranks.push_back({{"rank", d.rank}, {"device", d.device}, {"total_bytes", d.total_bytes}, {"free_bytes", d.free_bytes},
                         {"used_bytes", d.total_bytes - d.free_bytes},
                         {"held_bytes", {{"weight", d.held_bytes[0]}, {"kv_cache", d.held_bytes[1]}, {"staging", d.held_bytes[2]},
                                         {"kv_swap", d.held_bytes[3]}}},
                         {"comm_connected", d.comm_connected},
                         {"nccl_comms", {{"live", d.nccl_comms_live}, {"created", d.nccl_comms_created}}},
                         {"age_s", std::chrono::duration<double>(now - d.measured).count()}});
    }
    return {{"ranks", std::move(ranks)}};
}

/// /health's speculative-decoding view: the method, k, and the serving version's acceptance
/// (null rate before any draft was verified under it).
json speculative_json(const engine::EngineStats & st) {
    if (st.spec_method == "none") { return {{"method", "none"}}; }
    const auto it = st.spec_by_version.find(st.state.weight_version);
    const spec::DraftCounters c = it == st.spec_by_version.end() ? spec::DraftCounters{} : it->second;
    return {{"method", st.spec_method},
            {"num_speculative_tokens", st.num_speculative_tokens},
            {"weight_version", st.state.weight_version},
            {"num_drafts", c.n_drafts},
            {"num_draft_tokens", c.n_draft_tokens},
            {"num_accepted_tokens", c.n_accepted_tokens},
            {"acceptance_rate", c.n_draft_tokens > 0 ? json(c.acceptance_rate()) : json(nullptr)},
            {"mean_accepted_length", c.n_drafts > 0 ? json(c.mean_accepted_length()) : json(nullptr)},
            {"disabled_steps", st.n_spec_steps_off_total}};
}

}  // namespace

json ControlService::status_json() const {
    const auto st = engine_.stats();
    const auto & es = st.state;
    const bool draining = engine_.draining();
    const json sleeping = sleeping_tags(es);
    const char * state = draining ? "draining" : es.degraded ? "degraded" : !sleeping.empty() ? "sleeping" : es.paused ? "paused" : "serving";
    return {{"status", draining ? "draining" : es.degraded ? "degraded" : "ok"},
            {"degraded_ranks", es.failed_ranks},
            {"executor", es.executor_backend},
            {"tensor_parallel_size", es.tensor_parallel_size},
            {"comm_group", {{"backend", es.comm_backend}, {"state", es.comm_group}}},
            {"state", state},
            {"is_paused", es.paused},
            {"pause_mode", es.paused ? json(engine::to_string(es.pause_mode)) : json(nullptr)},
            {"kept_requests", es.n_kept},
            {"sleeping_tags", sleeping},
            {"weights_valid", es.weights_valid},
            {"weight_version", es.weight_version},
            {"staged_weight_version", es.staged_version.empty() ? json(nullptr) : json(es.staged_version)},
            {"model_weights_status", static_cast<int>(es.model_weights_status)},
            {"control_in_flight", es.control_in_flight.empty() ? json(nullptr) : json(es.control_in_flight)},
            {"last_control_error", es.last_control_error.empty() ? json(nullptr) : json(es.last_control_error)},
            {"model", cfg_.served_model_name},
            {"num_requests_running", st.n_running},
            {"num_requests_waiting", st.n_waiting},
            {"kv_blocks", {{"used", st.n_kv_blocks_used}, {"free", st.n_kv_blocks_free}, {"total", st.n_kv_blocks_total}}},
            {"kv_swap_blocks", {{"used", st.n_swap_blocks_used}, {"free", st.n_swap_blocks_total - st.n_swap_blocks_used},
                                {"total", st.n_swap_blocks_total}}},
            {"num_requests_swapped", st.n_swapped},
            {"kv_host_tier", {{"enabled", st.host_tier_enabled},
                              {"cached_blocks", st.n_host_tier_blocks_cached},
                              {"cached_bytes", st.n_host_tier_blocks_cached * st.host_tier_block_bytes},
                              {"capacity_bytes", st.n_swap_blocks_total * st.host_tier_block_bytes},
                              {"weight_version", st.host_tier_weight_version},
                              {"transfers_paused", st.host_tier_transfers_paused},
                              {"transfers_in_flight_blocks", st.n_host_tier_in_flight}}},
            {"rss_bytes", process_rss_bytes() + engine_.rank_processes_rss_bytes()},  // the daemon and its rank processes
            {"device_memory", device_memory_json(engine_.rank_devices())},
            {"progress", progress_json()},
            {"speculative", speculative_json(st)}};
}

ControlReply ControlService::run(const ControlRequest & req) {
    const auto received = std::chrono::steady_clock::now();
    const auto gate = req.gate ? req.gate
                               : std::make_shared<engine::LocalStartGate>(received + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                                                        std::chrono::duration<double>(cfg_.control_timeout_s)));
    auto op = [&](ControlCommand cmd) {
        const ControlOp o = cmd.op;
        cmd.gate = gate;
        return json_reply(json{{"status", "success"}, {"result", result_json(o, run_engine(engine_, std::move(cmd), received, cfg_.control_timeout_s))}});
    };
    auto require_dynamic = [&] {
        if (!cfg_.dynamic_load_weight) {
            fail(Errc::not_found, "/v1/{} needs dynamic weight loading; start fdrollout with --dynamic-load-weight", to_string(req.verb));
        }
    };
    switch (req.verb) {
        case ControlVerb::pause: return op({.op = ControlOp::pause, .pause_mode = req.pause_mode, .keep_prefix_cache = req.keep_prefix_cache});
        case ControlVerb::abort: return op({.op = ControlOp::abort_request, .request_id = req.request_id, .abort_all = req.abort_all});
        case ControlVerb::resume: return op({.op = ControlOp::resume});
        case ControlVerb::is_paused: {
            // Both FastDeploy forms at once: its docs' top-level {"is_paused"} and its CI client's
            // {"status": "success", "result": {"is_paused"}} (issue #13).
            const auto st = engine_.stats().state;
            json j = {{"is_paused", st.paused}, {"sleeping_tags", sleeping_tags(st)}, {"weights_valid", st.weights_valid},
                      {"weight_version", st.weight_version}};
            j["result"] = j;
            j["status"] = "success";
            return json_reply(j);
        }
        case ControlVerb::status: return json_reply(status_json());
        case ControlVerb::sleep: require_dynamic(); return op({.op = ControlOp::sleep, .tags = req.tags});
        case ControlVerb::wakeup: require_dynamic(); return op({.op = ControlOp::wakeup, .tags = req.tags});
        case ControlVerb::update_weights:
            require_dynamic();
            return op({.op = ControlOp::update_weights, .version = req.version, .verify_checksum = req.verify_checksum, .commit = req.commit,
                       .weight_dir = req.weight_dir, .reload_base = req.reload_base});
        case ControlVerb::commit_weights: require_dynamic(); return op({.op = ControlOp::commit_weights, .version = req.version});
        case ControlVerb::drop_staged_weights: require_dynamic(); return op({.op = ControlOp::drop_staged_weights});
        case ControlVerb::flush_cache: return op({.op = ControlOp::flush_cache, .keep_host_tier = req.keep_host_tier});
        case ControlVerb::clear_load_weight:
        case ControlVerb::update_model_weight: break;
    }
    // The legacy pair (SPEC §4).
    // FastDeploy's message, in its JSON error body (ErrorResponse: {"error": {message, type, param, code}}).
    if (!cfg_.dynamic_load_weight) {
        return json_reply(json{{"error", {{"message", "Dynamic Load Weight Disabled."}, {"type", "not_found"}, {"param", nullptr},
                                          {"code", "dynamic_load_weight_disabled"}}}}, 404);
    }
    const bool clear = req.verb == ControlVerb::clear_load_weight;
    if (cfg_.v1_update_weights) { return op({.op = clear ? ControlOp::sleep : ControlOp::wakeup, .tags = {true, true}}); }
    // The legacy pair moves the status word itself: same rule, it starts only before the deadline.
    if (!gate->start()) {
        fail(Errc::timeout, "{} was not started before the request's deadline: withdrawn, nothing changed", to_string(req.verb));
    }
    const auto cur = engine_.legacy_status();
    if (clear) {
        switch (cur) {
            case WeightsStatus::cleared: return legacy_msg(200, "model weight is cleared");
            case WeightsStatus::clearing: return legacy_msg(400, "worker is clearing model weight already");
            case WeightsStatus::updating: return legacy_msg(403, "worker is updating model weight, cannot clear now");
            case WeightsStatus::normal: break;
        }
        if (legacy_drive(engine_, WeightsStatus::normal, WeightsStatus::clearing, WeightsStatus::cleared, cfg_.legacy_timeout_s)) {
            return legacy_msg(200, "clear model weight successfully");
        }
        return legacy_msg(404, "clear model weight timeout", engine_.stats().state.last_control_error);
    }
    switch (cur) {
        case WeightsStatus::normal: return legacy_msg(200, "model weight is updated");
        case WeightsStatus::updating: return legacy_msg(400, "worker is updating model weight already");
        case WeightsStatus::clearing: return legacy_msg(403, "worker is clearing model weight, cannot update now");
        case WeightsStatus::cleared: break;
    }
    if (legacy_drive(engine_, WeightsStatus::cleared, WeightsStatus::updating, WeightsStatus::normal, cfg_.legacy_timeout_s)) {
        return legacy_msg(200, "update model weight successfully");
    }
    return legacy_msg(404, "update model weight timeout", engine_.stats().state.last_control_error);
}

}  // namespace fd::control
