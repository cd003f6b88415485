#include "access_log.h"

#include "fd/log.h"

namespace fd::api {

void access_end(const Request & req, const Response & res, double ms) {
    static const auto lg = log::get("access");
    const bool probe = req.method == "GET" && (req.path == "/health" || req.path == "/metrics");
    const auto level = probe ? spdlog::level::debug : spdlog::level::info;
    if (!lg->should_log(level)) { return; }
    if (res.n_prompt_tokens < 0) {
        lg->log(level, "{} {} {} tokens=-/- {:.1f} ms", req.method, req.path, res.status, ms);
    } else {
        lg->log(level, "{} {} {} tokens={}/{} {:.1f} ms", req.method, req.path, res.status, res.n_prompt_tokens, res.n_generated_tokens, ms);
    }
}

}  // namespace fd::api
