// The whole HTTP surface at a glance, plus the one wrapper that turns exceptions into errors.
#include "handlers.h"

#include "fd/log.h"

namespace fd::api {
namespace {

/// Every handler runs inside this: fd::Error → its table status, anything else → 500.
Handler wrap(ApiContext & ctx, void (*fn)(ApiContext &, const httplib::Request &, httplib::Response &), bool needs_key) {
    return [&ctx, fn, needs_key](const httplib::Request & req, httplib::Response & res) {
        try {
            if (needs_key && !ctx.cfg.api_key.empty() &&
                req.get_header_value("Authorization") != "Bearer " + ctx.cfg.api_key) {
                throw Error(Errc::unauthorized, "missing or wrong API key: send 'Authorization: Bearer <key>'");
            }
            fn(ctx, req, res);
        } catch (const Error & e) {
            if (e.code() == Errc::internal) { log::get("api")->error("{} {}: {}", req.method, req.path, e.what()); }
            write_error(res, e);
        } catch (const std::exception & e) {
            log::get("api")->error("{} {}: {}", req.method, req.path, e.what());
            write_error(res, Error(Errc::internal, e.what()));
        }
    };
}

}  // namespace

void register_routes(httplib::Server & http, ApiContext & ctx) {
    http.Get ("/health",          wrap(ctx, get_health,       false));
    http.Get ("/metrics",         wrap(ctx, get_metrics,      false));
    http.Get ("/v1/models",       wrap(ctx, get_models,       true));
    http.Post("/v1/completions",  wrap(ctx, post_completions, true));
}

}  // namespace fd::api
