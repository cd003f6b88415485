#include "access_log.h"

#include "fd/log.h"

#include <chrono>

namespace fd::api {
namespace {

struct AccessRecord {
    std::chrono::steady_clock::time_point t0{};
    int64_t                               n_prompt    = -1;  ///< -1: not a completion
    int64_t                               n_generated = -1;
};

thread_local AccessRecord t_rec;

}  // namespace

void access_begin() { t_rec = AccessRecord{.t0 = std::chrono::steady_clock::now()}; }

void access_note_tokens(int64_t n_prompt, int64_t n_generated) {
    t_rec.n_prompt    = n_prompt;
    t_rec.n_generated = n_generated;
}

void access_end(const httplib::Request & req, const httplib::Response & res) {
    static const auto lg = log::get("access");
    const bool probe = req.method == "GET" && (req.path == "/health" || req.path == "/metrics");
    const auto level = probe ? spdlog::level::debug : spdlog::level::info;
    if (!lg->should_log(level)) { return; }
    const double ms = t_rec.t0 == std::chrono::steady_clock::time_point{}
                          ? 0.0
                          : std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_rec.t0).count();
    if (t_rec.n_prompt < 0) {
        lg->log(level, "{} {} {} tokens=-/- {:.1f} ms", req.method, req.path, res.status, ms);
    } else {
        lg->log(level, "{} {} {} tokens={}/{} {:.1f} ms", req.method, req.path, res.status, t_rec.n_prompt, t_rec.n_generated, ms);
    }
    t_rec = AccessRecord{};
}

}  // namespace fd::api
