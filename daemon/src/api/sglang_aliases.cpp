// SGLang's control routes as slime and AReaL call them (python/sglang/srt/entrypoints/
// http_server.py): thin aliases over the one control service, like the vLLM ones in
// peer_aliases.cpp. Tag names: SGLang's `weights` is our `weight`; `cuda_graph` frees the captured
// graphs and their buffers on CUDA (engine::TagSet; nothing on CPU); no tags = all three, as
// SGLang's GPU_MEMORY_ALL_TYPES.
#include "peer_aliases.h"

#include "fd/log.h"
#include "fd/shm/names.h"

#include <filesystem>
#include <optional>

namespace fd::api::peer {
namespace {

using nlohmann::json;

/// SGLang's error body (_create_error_response): {"error": {"message": ...}}.
void sglang_error(Response & res, const ControlOutcome & o) { send_error(res, o, control::Peer::sglang); }

/// SGLang's `tags` body field: null/absent = all three, else a non-empty list of strings
/// (weights, kv_cache, cuda_graph). Returns the wire's tags text.
std::string sglang_tags(const json & body) {
    if (!body.is_object() || !body.contains("tags") || body["tags"].is_null()) { return engine::TagSet::all().text(); }
    const char * shape = "'tags' must be a list of strings (weights, kv_cache, cuda_graph)";
    if (!body["tags"].is_array()) { throw Error(Errc::invalid_argument, shape, "tags"); }
    std::vector<std::string> v;
    for (const auto & t : body["tags"]) {
        if (!t.is_string()) { throw Error(Errc::invalid_argument, shape, "tags"); }
        v.push_back(t.get<std::string>());
    }
    if (v.empty()) { throw Error(Errc::invalid_argument, "'tags' is an empty list; omit it for all tags", "tags"); }
    return map_tags(v, "tags", /*cuda_graph_ok=*/true).text();
}

/// SGLang's answer to pause_generation / continue_generation.
void generation_ok(Response & res, const char * what) {
    send_json(res, 200, json{{"message", fmt::format("Generation {} successfully.", what)}, {"status", "ok"}});
}

/// An optional boolean body field. Errors  invalid_argument naming it when not a boolean.
bool body_bool(const json & b, const char * key, bool dflt) {
    if (!b.is_object() || !b.contains(key) || b[key].is_null()) { return dflt; }
    if (!b[key].is_boolean()) { throw Error(Errc::invalid_argument, fmt::format("'{}' must be a boolean", key), key); }
    return b[key].get<bool>();
}

}  // namespace

void sglang_release(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /release_memory_occupation");
    reject_unknown_fields(in.body, {"tags"}, "release_memory_occupation");
    const ControlOutcome o = run(ctx, in, {.op = "sleep", .tags = sglang_tags(in.body)});
    if (!o.ok()) { return sglang_error(res, o); }
    send_json(res, 200, nullptr);  // SGLang's handler returns None: a JSON null
}

void sglang_resume(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /resume_memory_occupation");
    reject_unknown_fields(in.body, {"tags"}, "resume_memory_occupation");
    const ControlOutcome o = run(ctx, in, {.op = "wakeup", .tags = sglang_tags(in.body)});
    if (!o.ok()) { return sglang_error(res, o); }
    send_json(res, 200, nullptr);
}

/// GET or POST (SGLang serves both; slime polls GET until it answers 200). SGLang refuses while
/// requests run; ours flushes only unreferenced blocks, so it always succeeds.
void sglang_flush_cache(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({"timeout", "keep_host_tier"}, in.req ? in.req->method + " /flush_cache" : "/flush_cache");
    reject_unknown_fields(in.body, {"keep_host_tier"}, "flush_cache");
    const ControlOutcome o = run(ctx, in, {.op = "flush_cache", .mode = flush_mode(in)});
    res.status      = control::http_status(o);
    res.set_content(o.ok() ? "Cache flushed.\n" : control::error_message(o) + "\n", "text/plain");  // SGLang's text answer
}

void sglang_weight_version(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "GET /get_weight_version");
    const ControlOutcome o = run(ctx, in, {.op = "status"});
    if (!o.ok()) { return sglang_error(res, o); }
    send_json(res, 200, json{{"weight_version", o.status->stats.state.weight_version}});
}

/// SGLang's update_weights_from_disk is one call on a serving engine: pause mode=wait (the
/// requests in flight finish first; with abort_all_requests they end with finish_reason abort,
/// counted in num_paused_requests), update_weights, then
/// resume unless the engine was paused before or keep_pause is set. `model_path` naming the
/// daemon's --model dir updates from the configured --load-strategy source; any other absolute
/// dir is loaded as a complete HF checkpoint (AReaL saves each version to its own
/// .../weight_update_v{N} and deletes it after the load), under the trust rules of prime-rl's
/// weight_dir (owned by the daemon's user). Label: `weight_version`, else the dir's version.yaml
/// `step`, else the serving label when the bytes are the ones it names, else the fingerprint label
/// `fp-<hex>` (AReaL sends no version; docs/weight_sources.md).
void sglang_update_from_disk(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /update_weights_from_disk");
    const json & b = in.body;
    reject_unknown_fields(b, {"model_path", "weight_version", "flush_cache", "load_format", "abort_all_requests", "keep_pause"},
                          "update_weights_from_disk");
    if (!b.is_object() || !b.contains("model_path") || !b["model_path"].is_string()) {
        throw Error(Errc::invalid_argument, "'model_path' (string) is required", "model_path");
    }
    const std::string path = b["model_path"].get<std::string>();
    std::error_code ec;
    const auto given = std::filesystem::weakly_canonical(path, ec);
    const auto mine  = std::filesystem::weakly_canonical(ctx.cfg.model_dir, ec);
    shm::MailboxCommand update{.op = "update_weights"};
    if (given != mine) {
        if (!std::filesystem::path(path).is_absolute()) {
            throw Error(Errc::invalid_argument,
                        fmt::format("'model_path' must be an absolute path to a Hugging Face checkpoint dir (or this daemon's --model dir "
                                    "{}, to update from its --load-strategy source), got '{}'", ctx.cfg.model_dir, path), "model_path");
        }
        update.weight_dir = path;  // a checkpoint of its own, as prime-rl's weight_dir
    }
    update.version = version_field(b, "weight_version");  // slime sends str(int); an integer is its decimal string
    for (const char * f : {"flush_cache", "abort_all_requests", "keep_pause"}) {
        if (b.contains(f) && !b[f].is_null() && !b[f].is_boolean()) { throw Error(Errc::invalid_argument, fmt::format("'{}' must be a boolean", f), f); }
    }
    if (b.contains("load_format") && !b["load_format"].is_null() && b["load_format"] != "auto") {
        throw Error(Errc::invalid_argument, "'load_format' must be null or \"auto\" (safetensors)", "load_format");
    }
    if (b.value("flush_cache", true) == false) {
        throw Error(Errc::invalid_argument, "flush_cache=false is not supported: KV computed with old weights is never reused", "flush_cache");
    }
    auto answer = [&](const ControlOutcome & o, int aborted) {
        send_json(res, control::http_status(o),
                  json{{"success", o.ok()}, {"message", o.ok() ? fmt::format("Succeeded to update model weights (version {}).", o.result.version) : control::error_message(o)},
                       {"num_paused_requests", aborted}});
    };
    const bool was_paused = paused(run(ctx, in, {.op = "is_paused"}));
    int aborted = 0;
    if (!was_paused) {
        // SGLang lets the requests in flight finish unless abort_all_requests: pause mode=wait.
        const ControlOutcome p = run(ctx, in, {.op = "pause", .mode = b.value("abort_all_requests", false) ? "abort" : "wait"});
        if (!p.ok()) { return answer(p, 0); }
        aborted = p.result.n_aborted;
    }
    const ControlOutcome u = run(ctx, in, update);
    // Old or new weights: serving as before. Not under the client's deadline: a resume dropped
    // for lateness would leave the engine paused by a call that reported its outcome.
    if (!was_paused && !b.value("keep_pause", false)) { ctx.control->run(shm::MailboxCommand{.op = "resume"}); }
    answer(u, aborted);
}

/// SGLang's AbortReq {rid, abort_all}: one request by id (the completion id or the client's
/// X-Request-Id), or every request; neither pauses. SGLang answers an empty 200, also for an
/// unknown or finished rid (http_server.py abort_request; TokenizerManager.abort_request ignores
/// an id it does not hold): so do we, logging the unknown id (POST /v1/abort is the 404 that
/// makes a typo visible).
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
    if (!cmd.abort_all && cmd.request_id.empty()) {  // SGLang's AbortReq() defaults (rid "", abort_all false): nothing to abort, 200
        log::get("api")->info("abort_request: neither a rid nor abort_all; nothing aborted, answered 200 as SGLang does");
        res.status = 200;
        return;
    }
    const ControlOutcome o = run(ctx, in, cmd);
    if (!o.ok() && control::http_status(o) == 404 && !cmd.abort_all) {  // a finished (or never known) request: SGLang's 200
        log::get("api")->info("abort_request: no queued, running or kept request has rid '{}' (finished or unknown); answered 200 as "
                              "SGLang does", cmd.request_id);
    } else if (!o.ok()) {
        return sglang_error(res, o);
    }
    res.status = 200;  // SGLang's Response(status_code=200): empty
}

/// SGLang's PauseGenerationReqInput {"mode": "abort" | "retract" | "in_place"} (default abort):
/// abort ends every request with finish_reason "abort" (`/v1/pause?mode=abort`); in_place
/// freezes them with their KV and retract re-queues them to be recomputed, both of which our
/// `mode=keep` does (a kept request resumes bitwise as if never paused, or is recomputed with the
/// new weights after an update). Answers SGLang's {"message", "status": "ok"}.
void sglang_pause_generation(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /pause_generation");
    reject_unknown_fields(in.body, {"mode"}, "pause_generation");
    std::string mode = "abort";
    if (in.body.is_object() && in.body.contains("mode") && !in.body["mode"].is_null()) {
        const json & m = in.body["mode"];
        if (!m.is_string() || (m != "abort" && m != "retract" && m != "in_place")) {
            throw Error(Errc::invalid_argument, fmt::format("'mode' must be \"abort\", \"retract\" or \"in_place\", got {}; nothing was done", brief(m)),
                        "mode");
        }
        mode = m == "abort" ? "abort" : "keep";
    }
    const ControlOutcome o = run(ctx, in, {.op = "pause", .mode = mode});
    if (!o.ok()) { return sglang_error(res, o); }
    generation_ok(res, "paused");
}

/// SGLang's continue_generation: resume. slime calls it after a weights-only resume, before the
/// kv_cache resume (train.py: onload_weights, update_weights, onload_kv); while a tag is asleep
/// the engine cannot serve, and the wakeup that brings the last tag back resumes it (SPEC §3), so
/// the call answers 200 and leaves the resume to that wakeup.
void sglang_continue_generation(ApiContext & ctx, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /continue_generation");
    reject_unknown_fields(in.body, {}, "continue_generation");
    if (sleeping(ctx)) { return generation_ok(res, "continued"); }
    const ControlOutcome o = run(ctx, in, {.op = "resume"});
    if (!o.ok()) { return sglang_error(res, o); }
    generation_ok(res, "continued");
}

/// SGLang's post_process_weights {"restore_weights_before_load", "post_process_quantization"}
/// (slime calls it around a tensor/distributed update): hooks for quantized weights. fdrollout
/// serves only unquantized checkpoints (model_config.cpp refuses quantization_config), so both
/// are no-ops; the answer is SGLang's {"success", "message"}.
void sglang_post_process_weights(ApiContext &, const ControlInput & in, Response & res) {
    in.allow_only({}, "POST /post_process_weights");
    reject_unknown_fields(in.body, {"restore_weights_before_load", "post_process_quantization"}, "post_process_weights");
    body_bool(in.body, "restore_weights_before_load", false);
    body_bool(in.body, "post_process_quantization", false);
    send_json(res, 200, json{{"success", true}, {"message", "nothing to post-process: the weights are not quantized"}});
}

/// SGLang's weights_checker {"action": "snapshot" | "reset_tensors" | "compare"} (slime's
/// --check-weight-update-equal: snapshot, reset_tensors, push the same weights, compare). It does
/// not map: reset_tensors would serve invalid weights, which fdrollout never does (SPEC §8.1),
/// and every update is already checked before it applies (names, shapes, dtypes, sizes;
/// checksums with verify_checksum). 400 saying so, nothing done.
void sglang_weights_checker(ApiContext &, const ControlInput & in, Response &) {
    in.allow_only({}, "POST /weights_checker");
    reject_unknown_fields(in.body, {"action"}, "weights_checker");
    throw Error(Errc::invalid_argument,
                "weights_checker is not supported: fdrollout never serves reset (invalid) tensors, and it validates every update before "
                "applying it (names, shapes, dtypes, sizes; checksums with {\"verify_checksum\": true} on /v1/update_weights); run "
                "slime without --check-weight-update-equal. Nothing was done", "action");
}

/// SGLang's update_weights_from_tensor {serialized_named_tensors, load_format, flush_cache, ...}:
/// torch tensors pickled with CUDA IPC handles (MultiprocessingSerializer), which only a
/// process in the trainer's torch runtime can open. Not mapped: 400 naming what works instead
/// (a bare "no route" 404 said nothing); nothing done.
void sglang_update_from_tensor(ApiContext &, const ControlInput &, Response &) {
    const std::string msg =
        "/update_weights_from_tensor (SGLang's pickled torch tensors over CUDA IPC) is not supported: fdrollout takes new weights from "
        "a checkpoint dir (POST /update_weights_from_disk {\"model_path\": DIR}), from its --load-strategy source (POST "
        "/v1/update_weights; --load-strategy ipc: the trainer publishes its tensors with `fdctl publish --strategy ipc` or "
        "fdrollout.publish; docs/weight_sources.md), or from a weight stream (/init_weights_update_group + "
        "/update_weights_from_distributed, docs/weight_streams.md). Nothing was done";
    log::get("api")->warn("{}", msg);
    throw Error(Errc::invalid_argument, msg);
}

}  // namespace fd::api::peer
