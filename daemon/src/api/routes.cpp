// The whole HTTP surface at a glance, plus the one wrapper that turns exceptions into errors.
#include "handlers.h"
#include "http/http_server.h"

#include "fd/log.h"


namespace fd::api {
namespace {

/// Which key a route needs: none (/health, /metrics), --api-key (generation, models), or the
/// control key (--control-api-key when set, else --api-key) for the weight-control routes.
enum class Auth { open, api_key, control_key };
enum class Errors { openai, control };

/// Constant-time comparison of equal-length strings (the time taken does not tell how much of
/// a guessed key matched; only the length can leak).
bool same_key(const std::string & a, const std::string & b) {
    if (a.size() != b.size()) { return false; }
    unsigned diff = 0;
    for (size_t i = 0; i < a.size(); ++i) { diff |= static_cast<unsigned>(static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i])); }
    return diff == 0;
}

/// Every handler runs inside this: fd::Error → its table status, anything else → 500, written
/// as an OpenAI error object (generation) or a {"status":"error"} object (control, SPEC §3).
/// The 401 a request without the route's key gets, or nullopt.
std::optional<Error> unauthorized(const ApiContext & ctx, Auth auth, const Request & req) {
    const std::string & key = auth == Auth::open             ? std::string()
                            : auth == Auth::api_key          ? ctx.cfg.api_key
                            : ctx.cfg.control_api_key.empty() ? ctx.cfg.api_key : ctx.cfg.control_api_key;
    if (key.empty() || same_key(req.get_header_value("Authorization"), "Bearer " + key)) { return std::nullopt; }
    return Error(Errc::unauthorized, auth == Auth::control_key && !ctx.cfg.control_api_key.empty()
                                         ? "missing or wrong control API key: send 'Authorization: Bearer <--control-api-key>'"
                                         : "missing or wrong API key: send 'Authorization: Bearer <key>'");
}

Wrapped wrap(ApiContext & ctx, void (*fn)(ApiContext &, const Request &, Response &), Auth auth,
             Errors errors = Errors::openai) {
    auto write = errors == Errors::openai ? write_error : write_control_error;
    const bool control = errors == Errors::control;
    // The key is checked from the head too, before a large body is read (Route::admit).
    Admit admit = [&ctx, auth, write, control](const Request & req, Response & res) {
        const auto e = unauthorized(ctx, auth, req);
        if (!e) { return true; }
        write(res, *e);
        if (control) { stamp_request_id(req, res); }
        return false;
    };
    Handler handler = [&ctx, fn, auth, write, control](const Request & req, Response & res) {
        try {
            if (auto e = unauthorized(ctx, auth, req)) { throw *e; }
            fn(ctx, req, res);
        } catch (const Error & e) {
            if (e.code() == Errc::internal) { log::get("api")->error("{} {}: {}", req.method, req.path, e.what()); }
            write(res, e);
        } catch (const nlohmann::json::exception &) {  // a body type error no parser foresaw: still the client's
            write(res, Error(Errc::invalid_argument, "a field of the request body has the wrong JSON type (see the API reference for each field's type)"));
        } catch (const std::exception & e) {
            log::get("api")->error("{} {}: {}", req.method, req.path, e.what());
            write(res, Error(Errc::internal, e.what()));
        }
        if (control) { stamp_request_id(req, res); }  // every control answer, errors included, carries request_id
    };
    return {std::move(handler), std::move(admit)};
}

}  // namespace

/// The route table. Lanes (http_server.h): probes answer on the I/O thread, control calls on
/// their own pool, generation and tokenizer handlers on the data pool. A POST without a body
/// (`curl -X POST URL`, no Content-Length) is a POST with an empty body; to an unknown route it
/// is a 404 at once.
Router make_routes(ApiContext & ctx) {
    constexpr auto C = Errors::control;
    constexpr auto io = Lane::io;
    Router http;
    auto post = [&](const char * path, Wrapped h) { http.Post(path, std::move(h)); };
    // Abort and the read-only queries take the query lane: they never wait for an engine
    // operation, so a pool of control calls blocked on a pause's drain cannot hold them up.
    auto control = [&](const char * method, const char * path, auto handler, Lane lane = Lane::control) {
        auto h = wrap(ctx, handler, Auth::control_key, C);
        if (std::string_view(method) == "POST") {
            http.Post(path, std::move(h), lane);
        } else {
            http.Get(path, std::move(h), lane);
        }
    };
    constexpr auto query = Lane::query;
    http.Get ("/health",              wrap(ctx, get_health,              Auth::open), io);
    http.Get ("/metrics",             wrap(ctx, get_metrics,             Auth::open), io);
    http.Get ("/version",             wrap(ctx, get_version,             Auth::open), io);
    http.Get ("/v1/models",           wrap(ctx, get_models,              Auth::api_key), io);
    http.Get (R"(/v1/models/(.+))",   wrap(ctx, get_model,               Auth::api_key), io);
    post     ("/v1/completions",      wrap(ctx, post_completions,        Auth::api_key));
    post     ("/tokenize",            wrap(ctx, post_tokenize,           Auth::api_key));
    post     ("/detokenize",          wrap(ctx, post_detokenize,         Auth::api_key));
    post     ("/v1/chat/completions", wrap(ctx, post_chat_completions,   Auth::api_key));
    // SGLang's native generation routes (sglang_generate.cpp; docs/peer_aliases.md)
    post     ("/generate",            wrap(ctx, post_sglang_generate,    Auth::api_key));
    http.Get ("/server_info",         wrap(ctx, get_sglang_server_info,  Auth::api_key), io);
    http.Get ("/get_server_info",     wrap(ctx, get_sglang_server_info,  Auth::api_key), io);
    http.Get ("/v1/loads",            wrap(ctx, get_sglang_loads,        Auth::api_key), io);  // slime polls it after abort_request
    http.Get ("/health_generate",     wrap(ctx, get_sglang_health_generate, Auth::open));  // a one-token generation, as SGLang
    // weight control (SPEC §3); sleep/wakeup/update_weights need --dynamic-load-weight
    control("POST", "/v1/pause",                control_route);
    control("POST", "/v1/resume",               control_route);
    control("GET",  "/v1/is_paused",            control_route, query);
    control("POST", "/v1/sleep",                control_route);
    control("POST", "/v1/wakeup",               control_route);
    control("POST", "/v1/update_weights",       control_route);
    control("POST", "/v1/commit_weights",       control_route);  // two-phase update (SPEC §3)
    control("POST", "/v1/drop_staged_weights",  control_route);
    control("POST", "/v1/abort",                control_route, query);  // end one request (or all) without pausing
    control("POST", "/v1/flush_cache",          control_route);  // prefix cache, both tiers (?keep_host_tier=true: device only)
    // legacy FastDeploy routes (SPEC §4)
    control("GET",  "/clear_load_weight",       control_route);
    control("GET",  "/update_model_weight",     control_route);
    // vLLM's and SGLang's control routes: thin aliases over the same service (docs/peer_aliases.md)
    control("POST", "/sleep",                   peer_alias_route);  // vLLM
    control("POST", "/wake_up",                 peer_alias_route);
    control("GET",  "/is_sleeping",             peer_alias_route, query);
    control("POST", "/pause",                   peer_alias_route);
    control("POST", "/resume",                  peer_alias_route);
    control("GET",  "/is_paused",               peer_alias_route, query);
    control("POST", "/reset_prefix_cache",      peer_alias_route);
    control("POST", "/abort_requests",          peer_alias_route, query);  // vLLM dev-mode RL route
    control("POST", "/release_kv_cache_memory", peer_alias_route);  // vLLM dev-mode KV-only release
    control("POST", "/release_memory_occupation", peer_alias_route);  // SGLang
    control("POST", "/resume_memory_occupation",  peer_alias_route);
    control("POST", "/flush_cache",             peer_alias_route);
    control("GET",  "/flush_cache",             peer_alias_route);  // slime polls it with GET
    control("POST", "/pause_generation",        peer_alias_route);
    control("POST", "/continue_generation",     peer_alias_route);
    control("POST", "/post_process_weights",    peer_alias_route);
    control("POST", "/weights_checker",         peer_alias_route);
    control("POST", "/update_weights_from_tensor", peer_alias_route);  // refused, naming the alternatives
    control("GET",  "/get_weight_version",      peer_alias_route, query);
    control("POST", "/update_weights_from_disk", peer_alias_route);
    control("POST", "/abort_request",           peer_alias_route, query);
    control("POST", "/update_weights",          update_weights_route);  // vLLM: {"update_info"} (a stream bucket); prime-rl: {"weight_dir"}
    control("POST", "/reload_weights",          peer_alias_route);  // prime-rl: back to --model
    // trainer weight streams (SPEC §12, docs/weight_streams.md; stream_routes.cpp)
    control("POST", "/init_weight_transfer_engine",     stream_route);  // vLLM
    control("POST", "/start_weight_update",             stream_route);
    control("POST", "/finish_weight_update",            stream_route);
    control("POST", "/abort_weight_update",             stream_route);  // ours: drop the open update
    control("POST", "/init_weights_update_group",       stream_route);  // SGLang
    control("POST", "/update_weights_from_distributed", stream_route);
    control("POST", "/init_broadcaster",        peer_alias_route);  // prime-rl's NCCL broadcast: refused, naming the alternatives
    return http;
}

}  // namespace fd::api
