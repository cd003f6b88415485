// vLLM's control routes as thin aliases over the one control service (SGLang's are in
// sglang_aliases.cpp): each alias turns the peer's request into the same wire command a V1
// route builds (so parse, validation and the engine operation are shared), and the service's
// reply into the peer's response shape. The table (route → V1 call → response shape) is
// documented in docs/peer_aliases.md and replayed by tests/e2e/test_peer_aliases.py; each RL
// framework's own call order by tests/e2e/test_client_sequences.py.
//
// Tag names: vLLM and SGLang call the weight tag `weights`; ours is `weight`. Both are accepted
// here; `kv_cache` is the same everywhere. vLLM's sleep levels map onto tags: level 1 (offload
// weights, discard KV) and level 2 (discard both) both free weights and KV — fdrollout never
// keeps a host copy, wakeup reloads weights from the configured source.
#include "peer_aliases.h"

#include "fd/log.h"
#include "fd/shm/names.h"

#include <algorithm>
#include <set>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <utility>
#include <map>

namespace fd::api {
namespace peer {

using nlohmann::json;

/// One command through the service, under the request's deadline headers (a fresh gate each).
ControlOutcome run(ApiContext & ctx, const ControlInput & in, const shm::MailboxCommand & cmd) {
    return ctx.control->run(cmd, in.req ? request_gate(*in.req) : nullptr);
}

void send_error(Response & res, const ControlOutcome & o, control::Peer peer) { send_reply(res, control::render_error(o, peer)); }

bool paused(const ControlOutcome & o) { return o.ok() && o.state && o.state->paused; }

void send_json(Response & res, int status, const json & body) {
    res.status = status;
    res.set_content(dump(body), "application/json");
}

engine::TagSet map_tags(const std::vector<std::string> & given, const char * param, bool cuda_graph_ok) {
    engine::TagSet out;
    for (const auto & item : given) {
        size_t start = 0;
        while (start <= item.size()) {
            const auto comma = item.find(',', start);
            std::string t    = item.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
            start            = comma == std::string::npos ? item.size() + 1 : comma + 1;
            if (t.empty()) { continue; }
            if (t == "weights" || t == "weight") {
                out.weight = true;
            } else if (t == "kv_cache") {
                out.kv_cache = true;
            } else if (cuda_graph_ok && t == "cuda_graph") {
                out.cuda_graph = true;
            } else {
                throw Error(Errc::invalid_argument, fmt::format("unknown tag '{}' (weights{} or kv_cache); nothing was done", t,
                                                                cuda_graph_ok ? ", cuda_graph" : ""), param);
            }
        }
    }
    if (!given.empty() && !out.weight && !out.kv_cache && !out.cuda_graph) {  // `?tags=`, [""], ",": never "release everything"
        throw Error(Errc::invalid_argument, fmt::format("'{}' names no tag (weights{} or kv_cache); omit it for all; nothing was done", param,
                                                        cuda_graph_ok ? ", cuda_graph" : ""), param);
    }
    return out;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::round(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() * 100.0) / 100.0;
}

bool sleeping(ApiContext & ctx) {
    const auto st = ctx.control->status_report().stats.state;
    return st.weight_asleep || st.kv_asleep;
}

/// Both cache-flush aliases clear the device prefix cache and the host KV tier; `keep_host_tier`
/// (query `true|false|1|0`, or a JSON body boolean) keeps the host tier. Errors  invalid_argument.
std::string flush_mode(const ControlInput & in) {
    bool keep = false;
    if (const auto q = in.get("keep_host_tier")) {
        if (*q != "true" && *q != "false" && *q != "1" && *q != "0") {
            throw Error(Errc::invalid_argument, fmt::format("keep_host_tier must be true or false, got '{}'", *q), "keep_host_tier");
        }
        keep = *q == "true" || *q == "1";
    }
    if (in.body.is_object() && in.body.contains("keep_host_tier")) {
        if (!in.body["keep_host_tier"].is_boolean()) {
            throw Error(Errc::invalid_argument, "keep_host_tier must be a boolean", "keep_host_tier");
        }
        keep = in.body["keep_host_tier"].get<bool>();
    }
    return keep ? "device" : "";
}

}  // namespace peer

namespace {

using nlohmann::json;
using namespace peer;

/// vLLM's error body: {"error": message} with the service's status.
void vllm_error(Response & res, const ControlOutcome & o) { send_error(res, o, control::Peer::vllm); }

// ---- vLLM ----

void vllm_sleep(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({"level", "tags", "mode"}, "POST /sleep");
    int level = 1;
    if (const auto l = in.get("level")) {
        if (*l != "1" && *l != "2") {
            throw Error(Errc::invalid_argument, fmt::format("sleep level '{}' is not supported: level=1 or level=2 (both free weights and KV)", *l), "level");
        }
        level = std::stoi(*l);
    }
    // vLLM pauses before sleeping: mode=abort (ours: sleep aborts) or mode=wait (the requests in
    // flight finish first). keep cannot survive a sleep (the KV is freed): 400.
    const std::string mode = check_pause_mode(in.get("mode"));
    if (mode == "keep") {
        throw Error(Errc::invalid_argument, "sleep with mode=keep is not supported: sleeping frees the KV cache the kept requests need "
                                            "(mode=abort or mode=wait); nothing was done", "mode");
    }
    reject_unknown_fields(in.body, {}, "sleep");
    const std::string tags = map_tags(in.all("tags"), "tags").text();
    const auto t0 = std::chrono::steady_clock::now();
    // Already paused (keep included: the sleep ends the kept requests, as before): nothing to drain.
    if (mode == "wait" && !paused(run(ctx, in, {.op = "is_paused"}))) {
        const ControlOutcome p = run(ctx, in, {.op = "pause", .mode = "wait"});
        if (!p.ok()) { return vllm_error(res, p); }
    }
    const ControlOutcome o = run(ctx, in, {.op = "sleep", .tags = tags});
    if (!o.ok()) { return vllm_error(res, o); }
    send_json(res, 200, json{{"status", "sleeping"}, {"level", level}, {"elapsed_ms", ms_since(t0)}});
}

void vllm_wake_up(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({"tags"}, "POST /wake_up");
    reject_unknown_fields(in.body, {}, "wake_up");
    const auto given = in.all("tags");
    const auto t0    = std::chrono::steady_clock::now();
    const ControlOutcome o  = run(ctx, in, {.op = "wakeup", .tags = map_tags(given, "tags").text()});
    if (!o.ok()) { return vllm_error(res, o); }
    // The tags this call woke, in vLLM's names (not the query echoed: "kv_cache,weights" as one
    // tag, a repeated tag, or a tag that was already awake were reported as woken; a probe).
    json woken = json::array();
    for (const auto & t : o.result.tags_done) {
        if (t != "cuda_graph") { woken.push_back(t == "weight" ? "weights" : t); }
    }
    send_json(res, 200, json{{"status", sleeping(ctx) ? "sleeping" : "awake"}, {"tags_woken", woken}, {"elapsed_ms", ms_since(t0)}});
}

void vllm_is_sleeping(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "GET /is_sleeping");
    const ControlOutcome o = run(ctx, in, {.op = "status"});
    if (!o.ok()) { return vllm_error(res, o); }
    const auto & st = o.status->stats.state;
    send_json(res, 200, json{{"is_sleeping", st.weight_asleep || st.kv_asleep}});
}

void vllm_pause(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({"mode", "wait_for_inflight_requests", "clear_cache"}, "POST /pause");
    std::string mode = check_pause_mode(in.get("mode"));
    if (query_bool(in, "wait_for_inflight_requests", false)) {  // vLLM's older spelling of mode=wait (a bool: anything else is 400)
        if (!mode.empty() && mode != "wait") {
            throw Error(Errc::invalid_argument, fmt::format("wait_for_inflight_requests=true contradicts mode={}; give one", mode), "mode");
        }
        mode = "wait";
    }
    // clear_cache=false (prime-rl's keep pause): the prefix cache stays, so requests after the
    // resume hit it; its blocks were computed with the serving weights, and any weight change
    // (update_weights, commit_weights, a weight wakeup) still flushes it.
    const bool keep_cache = !query_bool(in, "clear_cache", true);
    reject_unknown_fields(in.body, {}, "pause");
    const ControlOutcome o = run(ctx, in, {.op = "pause", .mode = mode, .keep_prefix_cache = keep_cache});
    if (!o.ok()) { return vllm_error(res, o); }
    send_json(res, 200, json{{"status", "paused"}});
}

void vllm_resume(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /resume");
    reject_unknown_fields(in.body, {}, "resume");
    const ControlOutcome o = run(ctx, in, {.op = "resume"});
    if (!o.ok()) { return vllm_error(res, o); }
    send_json(res, 200, json{{"status", "resumed"}});
}

void vllm_is_paused(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "GET /is_paused");
    const ControlOutcome o = run(ctx, in, {.op = "is_paused"});
    if (!o.ok()) { return vllm_error(res, o); }
    send_json(res, 200, json{{"is_paused", paused(o)}});
}

void vllm_reset_prefix_cache(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({"keep_host_tier", "reset_running_requests", "reset_external"}, "POST /reset_prefix_cache");
    reject_unknown_fields(in.body, {"keep_host_tier"}, "reset_prefix_cache");
    // vLLM's two bools: false (their default) is what this route does; true asks for what it cannot.
    for (const char * key : {"reset_running_requests", "reset_external"}) {
        if (query_bool(in, key, false)) {
            throw Error(Errc::invalid_argument, fmt::format("{}=true is not supported: the prefix cache is reset, running requests "
                                                            "keep their blocks, and there is no external KV connector; nothing was "
                                                            "done", key), key);
        }
    }
    const ControlOutcome o = run(ctx, in, {.op = "flush_cache", .mode = flush_mode(in)});
    if (!o.ok()) { return vllm_error(res, o); }
    res.status = 200;  // vLLM answers an empty 200
}

/// vLLM's KV-only release (vllm/entrypoints/serve/dev/sleep/api_router.py, LLM.release_kv_cache_memory):
/// needs a completed pause (409 otherwise, nothing freed), then frees the KV cache as
/// `/v1/sleep?tags=kv_cache`; `POST /wake_up?tags=kv_cache` restores it. vLLM recomputes
/// requests kept by a keep pause after the wake-up; ours end with finish_reason "abort" (a sleep
/// frees the KV they hold). vLLM answers an empty 200; so do we.
void vllm_release_kv_cache_memory(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /release_kv_cache_memory");
    reject_unknown_fields(in.body, {}, "release_kv_cache_memory");
    if (!paused(run(ctx, in, {.op = "is_paused"}))) {
        return vllm_error(res, ControlOutcome{.error = Error(Errc::wrong_state, "release_kv_cache_memory needs a paused engine: POST /pause "
                                                                                "first (nothing was freed)")});
    }
    const ControlOutcome o = run(ctx, in, {.op = "sleep", .tags = "kv_cache"});
    if (!o.ok()) { return vllm_error(res, o); }
    res.status = 200;
}

/// vLLM's dev-mode RL route (vllm/entrypoints/serve/dev/rlhf/api_router.py): {"request_ids":
/// [...]} ends those requests, an empty or missing list ends every request; neither pauses.
/// vLLM answers {"status": "aborted", "aborted": N}. Ids are checked before any is aborted; an
/// id that runs nowhere is skipped as vLLM does (a request that just finished is the normal race)
/// and listed in `not_found` (our addition); `aborted` counts the choices actually ended.
void vllm_abort_requests(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /abort_requests");
    const json & b = in.body;
    if (!b.is_null() && !b.is_object()) { throw Error(Errc::invalid_argument, "the body must be a JSON object {\"request_ids\": [...]}", "request_ids"); }
    reject_unknown_fields(b, {"request_ids"}, "abort_requests");
    std::vector<std::string> ids;
    if (b.is_object() && b.contains("request_ids") && !b["request_ids"].is_null()) {
        if (!b["request_ids"].is_array()) { throw Error(Errc::invalid_argument, "'request_ids' must be a list of strings", "request_ids"); }
        for (const auto & id : b["request_ids"]) {
            if (!id.is_string() || !shm::is_valid_request_id(id.get<std::string>())) {
                throw Error(Errc::invalid_argument, fmt::format("'request_ids' entry {} is not a request id (1..128 printable ASCII "
                                                                "characters without spaces); nothing was aborted", brief(id)), "request_ids");
            }
            if (std::find(ids.begin(), ids.end(), id.get<std::string>()) == ids.end()) { ids.push_back(id.get<std::string>()); }
        }
    }
    if (ids.empty()) {
        const ControlOutcome o = run(ctx, in, {.op = "abort", .abort_all = true});
        if (!o.ok()) { return vllm_error(res, o); }
        return send_json(res, 200, json{{"status", "aborted"}, {"aborted", o.result.n_aborted}});
    }
    int aborted = 0;
    json not_found = json::array();
    for (const auto & id : ids) {
        const ControlOutcome o = run(ctx, in, {.op = "abort", .request_id = id});
        if (o.ok()) {
            aborted += o.result.n_aborted;
        } else if (control::http_status(o) == 404) {
            not_found.push_back(id);
        } else {
            return vllm_error(res, o);
        }
    }
    send_json(res, 200, json{{"status", "aborted"}, {"aborted", aborted}, {"not_found", not_found}});
}

// ---- prime-rl (its vLLM server's own routes: src/prime_rl/inference/vllm/server.py) ----

/// Our error object (prime-rl only checks the status; the type and message say what to do).
void fd_error(Response & res, const ControlOutcome & o) { send_error(res, o, control::Peer::fdrollout); }

/// One weight change the way prime-rl's orchestrator drives it (src/prime_rl/orchestrator/clients.py:
/// /pause?mode=keep, then this, then /resume): on a paused engine the update alone, which leaves
/// it paused; on a serving one pause mode=wait, the update, resume (prime-rl's vLLM runs
/// collective_rpc on a live engine). Answers prime-rl's {"status": "ok"} plus the version now served.
void prime_update(ApiContext & ctx, const ControlInput & in, Response & res, shm::MailboxCommand update) {
    const bool was_paused = paused(run(ctx, in, {.op = "is_paused"}));
    if (!was_paused) {
        const ControlOutcome p = run(ctx, in, {.op = "pause", .mode = "wait"});
        if (!p.ok()) { return fd_error(res, p); }
    }
    const ControlOutcome u = run(ctx, in, update);
    // Old or new weights: serving as before (not under the client's deadline, as for SGLang's).
    if (!was_paused) { ctx.control->run(shm::MailboxCommand{.op = "resume"}); }
    if (!u.ok()) { return fd_error(res, u); }
    json body{{"status", "ok"}, {"weight_version", u.result.version}};
    if (!update.weight_dir.empty()) { body["weight_dir"] = update.weight_dir; }
    send_json(res, 200, body);
}

/// POST /update_weights {"weight_dir": DIR, "version"?: str|int, "version_uid"?: str|null}: load
/// the complete HF checkpoint in DIR (owned by the daemon's user; all-or-nothing). A relative DIR
/// is resolved against the daemon's working directory, as prime-rl's vLLM server resolves it
/// against its own (its default config sends "outputs/<run>/broadcasts/step_N", both processes
/// started from the same dir); the trust checks apply to the resolved path, which the answer
/// echoes. Label: `version`, else `version_uid`, else DIR/version.yaml `step`, else the
/// fingerprint label.
void prime_update_weights(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /update_weights");
    const json & b = in.body;
    reject_unknown_fields(b, {"weight_dir", "version", "version_uid"}, "update_weights");
    if (!b.is_object() || !b.contains("weight_dir") || !b["weight_dir"].is_string() || b["weight_dir"].get<std::string>().empty()) {
        throw Error(Errc::invalid_argument, "'weight_dir' (a Hugging Face checkpoint dir: absolute, or relative to the daemon's working "
                                            "directory) is required; POST /v1/update_weights updates from the --load-strategy source",
                    "weight_dir");
    }
    shm::MailboxCommand update{.op = "update_weights"};
    update.weight_dir = b["weight_dir"].get<std::string>();
    if (update.weight_dir.front() != '/') {
        std::error_code ec;
        const std::filesystem::path cwd = std::filesystem::current_path(ec);
        if (ec) {
            throw Error(Errc::invalid_argument, fmt::format("weight_dir '{}' is relative and the daemon's working directory cannot be read "
                                                            "({}); pass an absolute path", update.weight_dir, ec.message()), "weight_dir");
        }
        const std::string given = std::exchange(update.weight_dir, (cwd / update.weight_dir).lexically_normal().string());
        log::get("api")->info("update_weights: relative weight_dir '{}' resolved against the working directory {}: {}", given,
                              cwd.string(), update.weight_dir);
    }
    update.version    = version_field(b, "version");
    if (!update.version) { update.version = version_field(b, "version_uid"); }
    prime_update(ctx, in, res, update);
}

/// POST /reload_weights {}: back to the base --model checkpoint (prime-rl resets between runs),
/// labelled as at start-up (its version.yaml `step`, else --weight-version).
void prime_reload_weights(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /reload_weights");
    reject_unknown_fields(in.body, {}, "reload_weights");
    shm::MailboxCommand update{.op = "update_weights"};
    update.reload_base = true;
    prime_update(ctx, in, res, update);
}

/// POST /init_broadcaster {host, port, rank_offset, inference_world_size, timeout, ...}: prime-rl's
/// NCCL weight broadcast. fdrollout has no NCCL receiver for a trainer's group (the weight-stream
/// transport is issue #25's), so it is refused before anything connects, naming what works
/// instead: prime-rl's filesystem weight broadcast (its default) calls /update_weights
/// {"weight_dir"} above. prime-rl's client (init_nccl_broadcast) logs a 404 as "route does not
/// exist, skipping" and drops any other status without a word, so the refusal is also logged
/// here, where the operator looks when the trainer's broadcast finds no receiver.
void prime_init_broadcaster(ApiContext &, const ControlInput & in, Response &) {
    in.allow_only({}, "POST /init_broadcaster");
    const std::string msg =
        "/init_broadcaster (prime-rl's NCCL weight broadcast) is not supported: fdrollout takes new weights from a checkpoint dir "
        "(POST /update_weights {\"weight_dir\": ABS_DIR}: prime-rl's filesystem weight broadcast, its default) or from its "
        "--load-strategy source (POST /v1/update_weights: normal, ipc, ipc_snapshot, rsync; docs/weight_sources.md). Run prime-rl "
        "with the filesystem weight broadcast. Nothing was done";
    log::get("api")->warn("{}", msg);
    throw Error(Errc::invalid_argument, msg);
}

/// Path → alias (the route table in routes.cpp binds each path to peer_alias_route).
const std::map<std::string, AliasFn> kAliases = {
    {"/sleep", vllm_sleep},
    {"/wake_up", vllm_wake_up},
    {"/is_sleeping", vllm_is_sleeping},
    {"/pause", vllm_pause},
    {"/resume", vllm_resume},
    {"/is_paused", vllm_is_paused},
    {"/reset_prefix_cache", vllm_reset_prefix_cache},
    {"/abort_requests", vllm_abort_requests},
    {"/release_kv_cache_memory", vllm_release_kv_cache_memory},
    {"/release_memory_occupation", sglang_release},
    {"/resume_memory_occupation", sglang_resume},
    {"/flush_cache", sglang_flush_cache},
    {"/get_weight_version", sglang_weight_version},
    {"/update_weights_from_disk", sglang_update_from_disk},
    {"/abort_request", sglang_abort_request},
    {"/update_weights", prime_update_weights},
    {"/reload_weights", prime_reload_weights},
    {"/init_broadcaster", prime_init_broadcaster},
    {"/pause_generation", sglang_pause_generation},
    {"/continue_generation", sglang_continue_generation},
    {"/post_process_weights", sglang_post_process_weights},
    {"/weights_checker", sglang_weights_checker},
    {"/update_weights_from_tensor", sglang_update_from_tensor},
};

}  // namespace

void peer_alias_route(ApiContext & ctx, const Request & req, Response & res) {
    // The aliases that load, change or release weights are not there without
    // --dynamic-load-weight: 404 before their body is read (a malformed one got a 400 or 409 first),
    // in the failure shape of the route's peer (docs/peer_aliases.md; a probe: vLLM's /sleep
    // answered our V1 error object). prime-rl's routes answer ours, as their other failures do.
    static const std::map<std::string, control::Peer> kNeedsDynamicLoad = {
        {"/sleep", control::Peer::vllm},
        {"/wake_up", control::Peer::vllm},
        {"/release_kv_cache_memory", control::Peer::vllm},
        {"/release_memory_occupation", control::Peer::sglang},
        {"/resume_memory_occupation", control::Peer::sglang},
        {"/update_weights_from_disk", control::Peer::sglang},
        {"/update_weights", control::Peer::fdrollout},
        {"/reload_weights", control::Peer::fdrollout},
    };
    const auto needs = kNeedsDynamicLoad.find(req.path);
    if (needs != kNeedsDynamicLoad.end() && !ctx.control->config().dynamic_load_weight) {
        const ControlOutcome o{.error = Error(Errc::not_found, fmt::format("{} needs dynamic weight loading; start fdrollout with "
                                                                           "--dynamic-load-weight", req.path))};
        if (req.path == "/update_weights_from_disk") {  // SGLang's UpdateWeightFromDiskReqOutput, as its other failures
            return send_json(res, control::http_status(o), json{{"success", false}, {"message", control::error_message(o)},
                                                                {"num_paused_requests", 0}});
        }
        return send_error(res, o, needs->second);
    }
    kAliases.at(req.path)(ctx, read_control_input(req), res);
}

}  // namespace fd::api
