// vLLM's and SGLang's control routes as thin aliases over the one control service: each alias
// turns the peer's request into the same wire command a V1 route builds (so parse, validation
// and the engine operation are shared), and the service's reply into the peer's response shape.
// The table (route → V1 call → response shape) is documented in docs/peer_aliases.md and
// replayed by tests/e2e/test_peer_aliases.py.
//
// Tag names: vLLM and SGLang call the weight tag `weights`; ours is `weight`. Both are accepted
// here; `kv_cache` is the same everywhere. vLLM's sleep levels map onto tags: level 1 (offload
// weights, discard KV) and level 2 (discard both) both free weights and KV — fdrollout never
// keeps a host copy, wakeup reloads weights from the configured source.
#include "handlers.h"

#include "fd/shm/names.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>

namespace fd::api {
namespace {

using nlohmann::json;

/// The service's reply, decoded: ok + its `result` object, or the error's type/message.
struct Outcome {
    int         http_status = 200;
    bool        ok          = false;
    json        result;           ///< `result` of a success (or the whole body for status)
    std::string error_type;
    std::string error_message;
};

/// One command through the service, under the request's deadline headers (a fresh gate each).
Outcome run(ApiContext & ctx, const ControlInput & in, const shm::MailboxCommand & cmd) {
    const control::ControlReply r = ctx.control->handle(cmd, in.req ? request_gate(*in.req) : nullptr);
    Outcome o;
    o.http_status = r.http_status;
    const json j  = json::parse(r.body, nullptr, false);
    if (r.http_status == 200 && j.is_object()) {
        o.ok     = true;
        o.result = j.contains("result") ? j["result"] : j;
        return o;
    }
    if (j.is_object() && j.contains("error") && j["error"].is_object()) {
        o.error_type    = j["error"].value("type", "error");
        o.error_message = j["error"].value("message", r.body);
    } else {
        o.error_type    = "error";
        o.error_message = r.body;
    }
    return o;
}

void send_json(Response & res, int status, const json & body) {
    res.status = status;
    res.set_content(dump(body), "application/json");
}

/// vLLM's error body: {"error": message} with the service's status.
void vllm_error(Response & res, const Outcome & o) { send_json(res, o.http_status, json{{"error", o.error_message}}); }
/// SGLang's error body (_create_error_response): {"error": {"message": ...}}.
void sglang_error(Response & res, const Outcome & o) { send_json(res, o.http_status, json{{"error", {{"message", o.error_message}}}}); }

/// A peer tag (`weights` | `weight` | `kv_cache`, comma lists allowed) into our tags text.
std::string map_tags(const std::vector<std::string> & given, const char * param) {
    std::string out;
    for (const auto & item : given) {
        size_t start = 0;
        while (start <= item.size()) {
            const auto comma = item.find(',', start);
            std::string t    = item.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
            start            = comma == std::string::npos ? item.size() + 1 : comma + 1;
            if (t.empty()) { continue; }
            if (t == "weights") { t = "weight"; }
            if (t != "weight" && t != "kv_cache") {
                throw Error(Errc::invalid_argument, fmt::format("unknown tag '{}' (weights or kv_cache); nothing was done", t), param);
            }
            if (out.find(t) == std::string::npos) { out += (out.empty() ? "" : ",") + t; }
        }
    }
    return out;
}

/// SGLang's `tags` body field: null/absent = all, else a list of strings.
std::string sglang_tags(const json & body) {
    if (!body.is_object() || !body.contains("tags") || body["tags"].is_null()) { return ""; }
    if (!body["tags"].is_array()) { throw Error(Errc::invalid_argument, "'tags' must be a list of strings (weights, kv_cache)", "tags"); }
    std::vector<std::string> v;
    for (const auto & t : body["tags"]) {
        if (!t.is_string()) { throw Error(Errc::invalid_argument, "'tags' must be a list of strings (weights, kv_cache)", "tags"); }
        v.push_back(t.get<std::string>());
    }
    const std::string tags = map_tags(v, "tags");
    if (tags.empty()) { throw Error(Errc::invalid_argument, "'tags' is an empty list; omit it for all tags", "tags"); }
    return tags;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::round(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() * 100.0) / 100.0;
}

bool sleeping(ApiContext & ctx) { return !ctx.control->status_json()["sleeping_tags"].empty(); }

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
    const std::string tags = map_tags(in.all("tags"), "tags");
    const auto t0 = std::chrono::steady_clock::now();
    if (mode == "wait") {
        const Outcome p = run(ctx, in, {.op = "pause", .mode = "wait"});
        if (!p.ok) { return vllm_error(res, p); }
    }
    const Outcome o = run(ctx, in, {.op = "sleep", .tags = tags});
    if (!o.ok) { return vllm_error(res, o); }
    send_json(res, 200, json{{"status", "sleeping"}, {"level", level}, {"elapsed_ms", ms_since(t0)}});
}

void vllm_wake_up(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({"tags"}, "POST /wake_up");
    reject_unknown_fields(in.body, {}, "wake_up");
    const auto given = in.all("tags");
    const auto t0    = std::chrono::steady_clock::now();
    const Outcome o  = run(ctx, in, {.op = "wakeup", .tags = map_tags(given, "tags")});
    if (!o.ok) { return vllm_error(res, o); }
    send_json(res, 200, json{{"status", sleeping(ctx) ? "sleeping" : "awake"}, {"tags_woken", given.empty() ? json(nullptr) : json(given)},
                             {"elapsed_ms", ms_since(t0)}});
}

void vllm_is_sleeping(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "GET /is_sleeping");
    const Outcome o = run(ctx, in, {.op = "status"});
    if (!o.ok) { return vllm_error(res, o); }
    send_json(res, 200, json{{"is_sleeping", !o.result["sleeping_tags"].empty()}});
}

void vllm_pause(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({"mode", "wait_for_inflight_requests", "clear_cache"}, "POST /pause");
    std::string mode = check_pause_mode(in.get("mode"));
    if (const auto w = in.get("wait_for_inflight_requests"); w && *w != "false" && *w != "0") {  // vLLM's older spelling of mode=wait
        if (!mode.empty() && mode != "wait") {
            throw Error(Errc::invalid_argument, fmt::format("wait_for_inflight_requests=true contradicts mode={}; give one", mode), "mode");
        }
        mode = "wait";
    }
    if (const auto c = in.get("clear_cache"); c && *c != "true" && *c != "1") {
        throw Error(Errc::invalid_argument, "clear_cache=false is not supported: a pause always flushes the prefix cache", "clear_cache");
    }
    reject_unknown_fields(in.body, {}, "pause");
    const Outcome o = run(ctx, in, {.op = "pause", .mode = mode});
    if (!o.ok) { return vllm_error(res, o); }
    send_json(res, 200, json{{"status", "paused"}});
}

void vllm_resume(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /resume");
    reject_unknown_fields(in.body, {}, "resume");
    const Outcome o = run(ctx, in, {.op = "resume"});
    if (!o.ok) { return vllm_error(res, o); }
    send_json(res, 200, json{{"status", "resumed"}});
}

void vllm_is_paused(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "GET /is_paused");
    const Outcome o = run(ctx, in, {.op = "is_paused"});
    if (!o.ok) { return vllm_error(res, o); }
    send_json(res, 200, json{{"is_paused", o.result.value("is_paused", false)}});
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

void vllm_reset_prefix_cache(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({"keep_host_tier"}, "POST /reset_prefix_cache");
    reject_unknown_fields(in.body, {"keep_host_tier"}, "reset_prefix_cache");
    const Outcome o = run(ctx, in, {.op = "flush_cache", .mode = flush_mode(in)});
    if (!o.ok) { return vllm_error(res, o); }
    res.status = 200;  // vLLM answers an empty 200
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
                                                                "characters without spaces); nothing was aborted", id.dump()), "request_ids");
            }
            if (std::find(ids.begin(), ids.end(), id.get<std::string>()) == ids.end()) { ids.push_back(id.get<std::string>()); }
        }
    }
    if (ids.empty()) {
        const Outcome o = run(ctx, in, {.op = "abort", .abort_all = true});
        if (!o.ok) { return vllm_error(res, o); }
        return send_json(res, 200, json{{"status", "aborted"}, {"aborted", o.result.value("aborted", 0)}});
    }
    int aborted = 0;
    json not_found = json::array();
    for (const auto & id : ids) {
        const Outcome o = run(ctx, in, {.op = "abort", .request_id = id});
        if (o.ok) {
            aborted += o.result.value("aborted", 0);
        } else if (o.http_status == 404) {
            not_found.push_back(id);
        } else {
            return vllm_error(res, o);
        }
    }
    send_json(res, 200, json{{"status", "aborted"}, {"aborted", aborted}, {"not_found", not_found}});
}

// ---- SGLang ----

void sglang_release(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /release_memory_occupation");
    reject_unknown_fields(in.body, {"tags"}, "release_memory_occupation");
    const Outcome o = run(ctx, in, {.op = "sleep", .tags = sglang_tags(in.body)});
    if (!o.ok) { return sglang_error(res, o); }
    send_json(res, 200, nullptr);  // SGLang's handler returns None: a JSON null
}

void sglang_resume(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /resume_memory_occupation");
    reject_unknown_fields(in.body, {"tags"}, "resume_memory_occupation");
    const Outcome o = run(ctx, in, {.op = "wakeup", .tags = sglang_tags(in.body)});
    if (!o.ok) { return sglang_error(res, o); }
    send_json(res, 200, nullptr);
}

void sglang_flush_cache(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({"timeout", "keep_host_tier"}, "POST /flush_cache");
    reject_unknown_fields(in.body, {"keep_host_tier"}, "flush_cache");
    const Outcome o = run(ctx, in, {.op = "flush_cache", .mode = flush_mode(in)});
    res.status      = o.ok ? 200 : o.http_status;
    res.set_content(o.ok ? "Cache flushed.\n" : o.error_message + "\n", "text/plain");  // SGLang's text answer
}

void sglang_weight_version(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "GET /get_weight_version");
    const Outcome o = run(ctx, in, {.op = "status"});
    if (!o.ok) { return sglang_error(res, o); }
    send_json(res, 200, json{{"weight_version", o.result["weight_version"]}});
}

/// SGLang's update_weights_from_disk is one call on a serving engine: pause mode=wait (the
/// requests in flight finish first; with abort_all_requests they end with finish_reason abort,
/// counted in num_paused_requests), update_weights, then
/// resume unless the engine was paused before or keep_pause is set. `model_path` must name the
/// daemon's --model dir: weights come from the configured --load-strategy source only.
void sglang_update_from_disk(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /update_weights_from_disk");
    const json & b = in.body;
    reject_unknown_fields(b, {"model_path", "weight_version", "flush_cache", "load_format", "abort_all_requests", "keep_pause"},
                          "update_weights_from_disk");
    if (!b.is_object() || !b.contains("model_path") || !b["model_path"].is_string()) {
        throw Error(Errc::invalid_argument, "'model_path' (string) is required", "model_path");
    }
    std::error_code ec;
    const auto given = std::filesystem::weakly_canonical(b["model_path"].get<std::string>(), ec);
    const auto mine  = std::filesystem::weakly_canonical(ctx.cfg.model_dir, ec);
    if (given != mine) {
        throw Error(Errc::invalid_argument,
                    fmt::format("'model_path' must be this daemon's --model dir ({}): new weights come from its --load-strategy source, "
                                "selected by weight_version", ctx.cfg.model_dir), "model_path");
    }
    shm::MailboxCommand update{.op = "update_weights"};
    if (b.contains("weight_version") && !b["weight_version"].is_null()) {
        if (!b["weight_version"].is_string()) { throw Error(Errc::invalid_argument, "'weight_version' must be a string", "weight_version"); }
        update.version = b["weight_version"].get<std::string>();
    }
    for (const char * f : {"flush_cache", "abort_all_requests", "keep_pause"}) {
        if (b.contains(f) && !b[f].is_null() && !b[f].is_boolean()) { throw Error(Errc::invalid_argument, fmt::format("'{}' must be a boolean", f), f); }
    }
    if (b.contains("load_format") && !b["load_format"].is_null() && b["load_format"] != "auto") {
        throw Error(Errc::invalid_argument, "'load_format' must be null or \"auto\" (safetensors)", "load_format");
    }
    if (b.value("flush_cache", true) == false) {
        throw Error(Errc::invalid_argument, "flush_cache=false is not supported: KV computed with old weights is never reused", "flush_cache");
    }
    auto answer = [&](const Outcome & o, int aborted) {
        send_json(res, o.ok ? 200 : o.http_status,
                  json{{"success", o.ok}, {"message", o.ok ? fmt::format("Succeeded to update model weights (version {}).", o.result.value("version", "")) : o.error_message},
                       {"num_paused_requests", aborted}});
    };
    const bool was_paused = run(ctx, in, {.op = "is_paused"}).result.value("is_paused", false);
    int aborted = 0;
    if (!was_paused) {
        // SGLang lets the requests in flight finish unless abort_all_requests: pause mode=wait.
        const Outcome p = run(ctx, in, {.op = "pause", .mode = b.value("abort_all_requests", false) ? "abort" : "wait"});
        if (!p.ok) { return answer(p, 0); }
        aborted = p.result.value("aborted", 0);
    }
    const Outcome u = run(ctx, in, update);
    // Old or new weights: serving as before. Not under the client's deadline: a resume dropped
    // for lateness would leave the engine paused by a call that reported its outcome.
    if (!was_paused && !b.value("keep_pause", false)) { ctx.control->handle(shm::MailboxCommand{.op = "resume"}); }
    answer(u, aborted);
}

/// SGLang's AbortReq {rid, abort_all}: one request by id (the completion id or the client's
/// X-Request-Id), or every request; neither pauses. SGLang answers an empty 200; so do we, but an
/// unknown rid is 404 (SGLang ignores it) so a typo is visible.
void sglang_abort_request(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /abort_request");
    const json & b = in.body;
    reject_unknown_fields(b, {"rid", "abort_all"}, "abort_request");
    shm::MailboxCommand cmd{.op = "abort"};
    if (b.is_object() && b.contains("rid") && !b["rid"].is_null()) {
        if (!b["rid"].is_string()) { throw Error(Errc::invalid_argument, "'rid' must be a string", "rid"); }
        cmd.request_id = b["rid"].get<std::string>();
    }
    if (b.is_object() && b.contains("abort_all") && !b["abort_all"].is_null()) {
        if (!b["abort_all"].is_boolean()) { throw Error(Errc::invalid_argument, "'abort_all' must be a boolean", "abort_all"); }
        cmd.abort_all = b["abort_all"].get<bool>();
    }
    if (cmd.abort_all) { cmd.request_id.clear(); }  // SGLang: abort_all wins over rid
    const Outcome o = run(ctx, in, cmd);
    if (!o.ok) { return sglang_error(res, o); }
    res.status = 200;  // SGLang's Response(status_code=200): empty
}

using AliasFn = void (*)(ApiContext &, const ControlInput &, Response &);

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
    {"/release_memory_occupation", sglang_release},
    {"/resume_memory_occupation", sglang_resume},
    {"/flush_cache", sglang_flush_cache},
    {"/get_weight_version", sglang_weight_version},
    {"/update_weights_from_disk", sglang_update_from_disk},
    {"/abort_request", sglang_abort_request},
};

}  // namespace

void peer_alias_route(ApiContext & ctx, const Request & req, Response & res) {
    kAliases.at(req.path)(ctx, read_control_input(req), res);
}

}  // namespace fd::api
