// The whole HTTP surface at a glance, plus the one wrapper that turns exceptions into errors.
#include "handlers.h"

#include "fd/log.h"

#include <map>

namespace fd::api {
namespace {

enum class Auth { open, api_key };
enum class Errors { openai, control };

/// Every handler runs inside this: fd::Error → its table status, anything else → 500, written
/// as an OpenAI error object (generation) or a {"status":"error"} object (control, SPEC §3).
Handler wrap(ApiContext & ctx, void (*fn)(ApiContext &, const httplib::Request &, httplib::Response &), Auth auth,
             Errors errors = Errors::openai) {
    const bool needs_key = auth == Auth::api_key;
    auto write = errors == Errors::openai ? write_error : write_control_error;
    return [&ctx, fn, needs_key, write](const httplib::Request & req, httplib::Response & res) {
        try {
            if (needs_key && !ctx.cfg.api_key.empty() &&
                req.get_header_value("Authorization") != "Bearer " + ctx.cfg.api_key) {
                throw Error(Errc::unauthorized, "missing or wrong API key: send 'Authorization: Bearer <key>'");
            }
            fn(ctx, req, res);
        } catch (const Error & e) {
            if (e.code() == Errc::internal) { log::get("api")->error("{} {}: {}", req.method, req.path, e.what()); }
            write(res, e);
        } catch (const std::exception & e) {
            log::get("api")->error("{} {}: {}", req.method, req.path, e.what());
            write(res, Error(Errc::internal, e.what()));
        }
    };
}

}  // namespace

void register_routes(httplib::Server & http, ApiContext & ctx) {
    constexpr auto C = Errors::control;
    // cpp-httplib answers a POST without Content-Length (`curl -X POST URL`) with a bare 400;
    // control scripts do exactly that, so such bodiless POSTs are dispatched here first.
    static std::map<std::string, Handler> bodiless_post;
    auto post = [&](const char * path, Handler h) {
        bodiless_post[path] = h;
        http.Post(path, std::move(h));
    };
    http.set_pre_routing_handler([](const httplib::Request & req, httplib::Response & res) {
        if (req.method != "POST" || req.has_header("Content-Length") || req.has_header("Transfer-Encoding")) {
            return httplib::Server::HandlerResponse::Unhandled;
        }
        auto it = bodiless_post.find(req.path);
        if (it == bodiless_post.end()) { return httplib::Server::HandlerResponse::Unhandled; }
        it->second(req, res);
        return httplib::Server::HandlerResponse::Handled;
    });
    http.Get ("/health",              wrap(ctx, get_health,              Auth::open));
    http.Get ("/metrics",             wrap(ctx, get_metrics,             Auth::open));
    http.Get ("/v1/models",           wrap(ctx, get_models,              Auth::api_key));
    post     ("/v1/completions",      wrap(ctx, post_completions,        Auth::api_key));
    // weight control (SPEC §3); sleep/wakeup/update_weights need --dynamic-load-weight
    post     ("/v1/pause",            wrap(ctx, control_route,           Auth::api_key, C));
    post     ("/v1/resume",           wrap(ctx, control_route,           Auth::api_key, C));
    http.Get ("/v1/is_paused",        wrap(ctx, control_route,           Auth::api_key, C));
    post     ("/v1/sleep",            wrap(ctx, control_route,           Auth::api_key, C));
    post     ("/v1/wakeup",           wrap(ctx, control_route,           Auth::api_key, C));
    post     ("/v1/update_weights",   wrap(ctx, control_route,           Auth::api_key, C));
    // legacy FastDeploy routes (SPEC §4)
    http.Get ("/clear_load_weight",   wrap(ctx, control_route,           Auth::api_key, C));
    http.Get ("/update_model_weight", wrap(ctx, control_route,           Auth::api_key, C));
}

}  // namespace fd::api
