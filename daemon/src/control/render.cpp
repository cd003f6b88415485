// The one render step (fd/control/render.h): typed outcome → the V1 body (HTTP V1 and legacy
// routes, the shm mailbox reply), the /health body and the peers' error shapes.
#include "fd/control/render.h"

#include <nlohmann/json.hpp>

namespace fd::control {
namespace {

using nlohmann::json;
using engine::ControlOp;
using engine::ControlResult;

std::string dump(const json & j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

ControlReply json_reply(const json & body, int status = 200) { return {status, "application/json", dump(body)}; }

json ranks_json(const ControlResult & r) {
    json a = json::array();
    for (const auto & c : r.ranks) {
        json j = {{"rank", c.rank}, {"rss_bytes", c.rss_bytes}};
        if (c.freed_bytes >= 0) {
            j["freed_bytes"] = c.freed_bytes;  // sleep
            if (c.device_freed_bytes >= 0) { j["device_bytes_freed"] = c.device_freed_bytes; }  // a CUDA rank's cudaMemGetInfo delta
        } else {
            // sync: fetching + staging the new weights; update: applying them (a commit's pointer swap,
            // a wakeup's copy into the serving weights). engine_control.cpp folds the reports so.
            const double sync_s = c.fetch_s + c.stage_s, update_s = c.commit_s;
            // A rank that loaded nothing (a kv_cache-only wakeup) serves the version the call reports
            // (a probe: ranks[].version was "" beside "version": "0").
            const std::string version = c.version && !c.version->empty() ? *c.version : r.version;
            j.update({{"version", version}, {"bytes", c.bytes}, {"sync_cost", sync_s}, {"update_cost", update_s},
                      {"total_cost", sync_s + update_s}});
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
        case ControlOp::sleep: {
            json freed = json::object();
            if (r.freed_weight_bytes >= 0) { freed["weight"] = r.freed_weight_bytes; }
            if (r.freed_kv_bytes >= 0) { freed["kv_cache"] = r.freed_kv_bytes; }
            if (r.freed_swap_bytes >= 0) { freed["kv_swap"] = r.freed_swap_bytes; }
            if (r.freed_graph_bytes >= 0) { freed["cuda_graph"] = r.freed_graph_bytes; }
            if (r.freed_ep_buffer_bytes >= 0) { freed["ep_buffer"] = r.freed_ep_buffer_bytes; }
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
            if (!r.tags_done.empty()) { j["tags"] = r.tags_done; }  // loaded while the weights were released: ["weight"] awake again
            break;
        case ControlOp::commit_weights: j.update({{"version", r.version}, {"ranks", ranks_json(r)}}); break;
        case ControlOp::drop_staged_weights: j["dropped_version"] = r.version.empty() ? json(nullptr) : json(r.version); break;
        case ControlOp::flush_cache: j["host_blocks_flushed"] = r.n_host_blocks_flushed; break;
        default: break;  // resume (and the non-engine ops, which have no ControlResult)
    }
    return j;
}

/// /health `progress`: bytes done / total of the long phase running now (fd/progress.h), else null.
json progress_json(const std::optional<ProgressSnapshot> & p) {
    if (!p) { return nullptr; }
    return {{"op", p->op.empty() ? json(nullptr) : json(p->op)}, {"phase", p->phase}, {"bytes_done", p->bytes_done},
            {"bytes_total", p->bytes_total > 0 ? json(p->bytes_total) : json(nullptr)}, {"elapsed_s", p->elapsed_s}};
}

/// /health `device_memory`: null on cpu; on cuda every rank's device, its memory (cudaMemGetInfo
/// in the rank's process) and what the rank's allocator holds per tag, as measured at most ~1 s
/// before (age_s) or at the last control call.
json device_memory_json(const std::vector<runtime::RankDevice> & devs, std::chrono::steady_clock::time_point now) {
    if (devs.empty()) { return nullptr; }
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
    json j = {{"method", st.spec_method},
            {"num_speculative_tokens", st.num_speculative_tokens},
            {"weight_version", st.state.weight_version},
            {"num_drafts", c.n_drafts},
            {"num_draft_tokens", c.n_draft_tokens},
            {"num_accepted_tokens", c.n_accepted_tokens},
            {"acceptance_rate", c.n_draft_tokens > 0 ? json(c.acceptance_rate()) : json(nullptr)},
            {"mean_accepted_length", c.n_drafts > 0 ? json(c.mean_accepted_length()) : json(nullptr)},
            {"disabled_steps", st.n_spec_steps_off_total}};
    if (st.spec_method == "mtp") { j["mtp_cache_bytes"] = st.mtp_cache_bytes; }  // 0 while kv_cache sleeps
    // spec::acceptance_collapsed after an update: both versions and their rates (null: none).
    j["acceptance_collapse"] = nullptr;
    if (!st.spec_collapse_version.empty()) {
        const auto rate = [&](const std::string & v) {
            const auto f = st.spec_by_version.find(v);
            return f == st.spec_by_version.end() ? 0.0 : f->second.acceptance_rate();
        };
        j["acceptance_collapse"] = {{"weight_version", st.spec_collapse_version}, {"acceptance_rate", rate(st.spec_collapse_version)},
                                    {"previous_weight_version", st.spec_collapse_previous},
                                    {"previous_acceptance_rate", rate(st.spec_collapse_previous)}};
    }
    return j;
}

}  // namespace

nlohmann::json rank_reports_json(const engine::ControlResult & r) { return ranks_json(r); }

std::vector<std::string> sleeping_tags(const engine::EngineState & st) {
    std::vector<std::string> tags;
    if (st.weight_asleep) { tags.emplace_back("weight"); }
    if (st.kv_asleep) { tags.emplace_back("kv_cache"); }
    return tags;
}

ControlReply error_reply(const Error & e) {
    return json_reply(json{{"status", "error"}, {"error", {{"type", errc_name(e.code())}, {"message", e.what()}}}}, errc_http_status(e.code()));
}

json status_json(const StatusReport & s) {
    const auto & st = s.stats;
    const auto & es = st.state;
    const json sleeping = sleeping_tags(es);
    // pausing: a pause mode=wait drains (admission stopped, the requests in flight finishing); paused once it ends.
    const char * state = s.draining ? "draining" : es.degraded ? "degraded" : !sleeping.empty() ? "sleeping" : es.paused ? "paused"
                       : es.pause_draining ? "pausing" : "serving";
    return {{"status", s.draining ? "draining" : es.degraded ? "degraded" : "ok"},
            {"degraded_ranks", es.failed_ranks},
            {"executor", es.executor_backend},
            {"tensor_parallel_size", es.tensor_parallel_size},
            {"expert_parallel_size", es.expert_parallel_size},
            {"comm_group", {{"backend", es.comm_backend}, {"state", es.comm_group}}},
            // sleep(weight): the group is kept (expert parallel default) or destroyed; null without a group
            {"comm_group_on_weight_sleep", es.comm_group == "none" ? json(nullptr) : json(es.comm_group_kept_on_sleep ? "kept" : "destroyed")},
            {"state", state},
            {"is_paused", es.paused},
            {"pause_draining", es.pause_draining},
            {"pause_mode", es.paused ? json(engine::to_string(es.pause_mode)) : json(nullptr)},
            {"kept_requests", es.n_kept},
            {"sleeping_tags", sleeping},
            {"weights_valid", es.weights_valid},
            {"weight_version", es.weight_version},
            {"staged_weight_version", es.staged_version.empty() ? json(nullptr) : json(es.staged_version)},
            {"model_weights_status", static_cast<int>(s.model_weights_status)},
            {"control_in_flight", es.control_in_flight.empty() ? json(nullptr) : json(es.control_in_flight)},
            {"last_control_error", es.last_control_error.empty() ? json(nullptr) : json(es.last_control_error)},
            {"model", s.model},
            {"compute_dtype", s.compute_dtype},
            {"num_requests_running", st.n_running},
            {"num_requests_waiting", st.n_waiting},
            {"kv_blocks", {{"used", st.n_kv_blocks_used}, {"free", st.n_kv_blocks_free}, {"total", st.n_kv_blocks_total}}},
            {"kv_cache", {{"dtype", st.kv_cache_dtype}, {"block_size", st.kv_block_size}, {"blocks", st.n_kv_blocks_total},
                          {"tokens", st.n_kv_blocks_total * st.kv_block_size}, {"bytes_per_token", st.kv_bytes_per_token},
                          {"bytes", st.n_kv_blocks_total * st.kv_block_size * st.kv_bytes_per_token},
                          {"budget_bytes", st.kv_budget_bytes}}},
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
            {"rss_bytes", s.rss_bytes},
            {"device_memory", device_memory_json(s.devices, s.taken)},
            {"progress", progress_json(s.progress)},
            {"speculative", speculative_json(st)}};
}

ControlReply render_v1(const ControlOutcome & o) {
    if (o.error) { return error_reply(*o.error); }
    if (o.legacy) {
        if (o.legacy->disabled) {  // FastDeploy's message, in its JSON error body (ErrorResponse)
            return json_reply(json{{"error", {{"message", o.legacy->msg}, {"type", "not_found"}, {"param", nullptr},
                                              {"code", "dynamic_load_weight_disabled"}}}}, o.legacy->http_status);
        }
        json j = {{"msg", o.legacy->msg}};
        if (!o.legacy->error.empty()) { j["error"] = o.legacy->error; }
        return json_reply(j, o.legacy->http_status);
    }
    if (o.status) { return json_reply(status_json(*o.status)); }
    if (o.state) {
        // Both FastDeploy forms at once: its docs' top-level {"is_paused"} and its CI client's
        // {"status": "success", "result": {"is_paused"}} (issue #13).
        const auto & st = *o.state;
        json j = {{"is_paused", st.paused}, {"pause_draining", st.pause_draining}, {"sleeping_tags", sleeping_tags(st)},
                  {"weights_valid", st.weights_valid}, {"weight_version", st.weight_version}};
        j["result"] = j;
        j["status"] = "success";
        return json_reply(j);
    }
    return json_reply(json{{"status", "success"}, {"result", result_json(o.op, o.result)}});
}

int http_status(const ControlOutcome & o) {
    if (o.error) { return errc_http_status(o.error->code()); }
    if (o.legacy) { return o.legacy->http_status; }
    return 200;
}

std::string error_message(const ControlOutcome & o) {
    if (o.error) { return o.error->what(); }
    if (o.legacy && o.legacy->http_status != 200) { return o.legacy->msg; }
    return "";
}

ControlReply render_error(const ControlOutcome & o, Peer peer) {
    const int status = http_status(o);
    const std::string msg = error_message(o);
    switch (peer) {
        case Peer::vllm: return json_reply(json{{"error", msg}}, status);
        case Peer::sglang: return json_reply(json{{"error", {{"message", msg}}}}, status);
        case Peer::fdrollout: break;
    }
    const std::string type = o.error ? std::string(errc_name(o.error->code())) : std::string("error");
    return json_reply(json{{"status", "error"}, {"error", {{"type", type}, {"message", msg}}}}, status);
}

}  // namespace fd::control
