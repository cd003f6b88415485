// The whole HTTP surface at a glance, plus the one wrapper that turns exceptions into errors.
#include "access_log.h"
#include "handlers.h"

#include "fd/log.h"

#include <map>
#include <set>

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
Handler wrap(ApiContext & ctx, void (*fn)(ApiContext &, const httplib::Request &, httplib::Response &), Auth auth,
             Errors errors = Errors::openai) {
    auto write = errors == Errors::openai ? write_error : write_control_error;
    return [&ctx, fn, auth, write](const httplib::Request & req, httplib::Response & res) {
        try {
            const std::string & key = auth == Auth::open             ? std::string()
                                    : auth == Auth::api_key          ? ctx.cfg.api_key
                                    : ctx.cfg.control_api_key.empty() ? ctx.cfg.api_key : ctx.cfg.control_api_key;
            if (!key.empty() && !same_key(req.get_header_value("Authorization"), "Bearer " + key)) {
                throw Error(Errc::unauthorized, auth == Auth::control_key && !ctx.cfg.control_api_key.empty()
                                                    ? "missing or wrong control API key: send 'Authorization: Bearer <--control-api-key>'"
                                                    : "missing or wrong API key: send 'Authorization: Bearer <key>'");
            }
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
    };
}

std::set<std::string> g_control_paths;  ///< filled once by register_routes, read-only after

}  // namespace

bool is_control_path(const std::string & path) { return g_control_paths.count(path) != 0; }

void register_routes(httplib::Server & http, ApiContext & ctx) {
    constexpr auto C = Errors::control;
    // cpp-httplib answers a POST without Content-Length (`curl -X POST URL`) with a bare 400;
    // control scripts do exactly that, so such bodiless POSTs are dispatched here first.
    static std::map<std::string, Handler> bodiless_post;
    auto post = [&](const char * path, Handler h) {
        bodiless_post[path] = h;
        http.Post(path, std::move(h));
    };
    // A bodiless POST to an unknown route is answered 404 here, at once: left to cpp-httplib it
    // would wait for a body until the read timeout (60 s). The connection is closed after it,
    // since bytes the client may still send cannot be framed.
    http.set_pre_routing_handler([](const httplib::Request & req, httplib::Response & res) {
        access_begin();  // the access log's clock starts here (access_log.h)
        if (req.method != "POST" || req.has_header("Content-Length") || req.has_header("Transfer-Encoding")) {
            return httplib::Server::HandlerResponse::Unhandled;
        }
        auto it = bodiless_post.find(req.path);
        if (it == bodiless_post.end()) {
            write_error(res, Error(Errc::not_found, "no route POST " + req.path));
            res.set_header("Connection", "close");
            return httplib::Server::HandlerResponse::Handled;
        }
        it->second(req, res);
        return httplib::Server::HandlerResponse::Handled;
    });
    auto control = [&](const char * method, const char * path) {
        g_control_paths.insert(path);
        auto h = wrap(ctx, control_route, Auth::control_key, C);
        if (std::string_view(method) == "POST") {
            post(path, std::move(h));
        } else {
            http.Get(path, std::move(h));
        }
    };
    http.Get ("/health",              wrap(ctx, get_health,              Auth::open));
    http.Get ("/metrics",             wrap(ctx, get_metrics,             Auth::open));
    http.Get ("/version",             wrap(ctx, get_version,             Auth::open));
    http.Get ("/v1/models",           wrap(ctx, get_models,              Auth::api_key));
    http.Get (R"(/v1/models/(.+))",   wrap(ctx, get_model,               Auth::api_key));
    post     ("/v1/completions",      wrap(ctx, post_completions,        Auth::api_key));
    post     ("/tokenize",            wrap(ctx, post_tokenize,           Auth::api_key));
    post     ("/detokenize",          wrap(ctx, post_detokenize,         Auth::api_key));
    post     ("/v1/chat/completions", wrap(ctx, post_chat_completions,   Auth::api_key));
    // weight control (SPEC §3); sleep/wakeup/update_weights need --dynamic-load-weight
    control("POST", "/v1/pause");
    control("POST", "/v1/resume");
    control("GET",  "/v1/is_paused");
    control("POST", "/v1/sleep");
    control("POST", "/v1/wakeup");
    control("POST", "/v1/update_weights");
    // legacy FastDeploy routes (SPEC §4)
    control("GET",  "/clear_load_weight");
    control("GET",  "/update_model_weight");
}

}  // namespace fd::api
