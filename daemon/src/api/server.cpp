// ApiServer lifecycle and the small read-only endpoints: /health, /v1/models, /metrics.
#include "handlers.h"

#include "fd/arena.h"
#include "fd/log.h"
#include "fd/shm/weights_status.h"

#include <ctime>
#include <sstream>

namespace fd::api {

void register_routes(httplib::Server & http, ApiContext & ctx);

using nlohmann::json;

std::string dump(const json & j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void write_error(httplib::Response & res, const Error & e) {
    const int status = errc_http_status(e.code());
    json body = {{"error", {{"message", e.what()},
                            {"type", errc_name(e.code())},
                            {"param", e.param().empty() ? json(nullptr) : json(e.param())},
                            {"code", status}}}};
    res.status = status;
    res.set_content(dump(body), "application/json");
}

ApiServer::ApiServer(ServerConfig cfg, engine::Engine & engine, const model::Tokenizer & tok)
    : ctx_(std::make_unique<ApiContext>(ApiContext{std::move(cfg), &engine, &tok})),
      http_(std::make_unique<httplib::Server>()) {
    const int n_threads = ctx_->cfg.n_http_threads;
    http_->new_task_queue = [n_threads] { return new httplib::ThreadPool(static_cast<size_t>(n_threads)); };
    http_->set_payload_max_length(64 << 20);
    http_->set_read_timeout(60, 0);
    http_->set_write_timeout(60, 0);
    http_->set_error_handler([](const httplib::Request & req, httplib::Response & res) {
        if (!res.body.empty()) { return; }  // a handler already wrote its error object
        if (res.status == 404) {
            write_error(res, Error(Errc::not_found, "no route " + req.method + " " + req.path));
        } else if (res.status == 405) {
            write_error(res, Error(Errc::invalid_argument, "method " + req.method + " not allowed on " + req.path));
        }
    });
    register_routes(*http_, *ctx_);
}

ApiServer::~ApiServer() { stop(); }

void ApiServer::bind() {
    if (!http_->bind_to_port(ctx_->cfg.host, ctx_->cfg.port)) {
        fail(Errc::invalid_argument, "cannot listen on {}:{} (address in use or not local?)", ctx_->cfg.host, ctx_->cfg.port);
    }
    log::get("api")->info("listening on http://{}:{}", ctx_->cfg.host, ctx_->cfg.port);
}

void ApiServer::serve() { http_->listen_after_bind(); }

void ApiServer::stop() {
    if (http_) { http_->stop(); }
}

void get_models(ApiContext & ctx, const httplib::Request &, httplib::Response & res) {
    const auto st = ctx.engine->stats();
    json m = {{"id", ctx.cfg.served_model_name},
              {"object", "model"},
              {"created", static_cast<int64_t>(std::time(nullptr))},
              {"owned_by", "fdrollout"},
              {"root", ctx.cfg.model_dir},
              {"max_model_len", ctx.engine->config().max_model_len},
              {"weight_version", st.weight_version}};
    res.set_content(dump(json{{"object", "list"}, {"data", json::array({m})}}), "application/json");
}

void get_health(ApiContext & ctx, const httplib::Request &, httplib::Response & res) {
    const auto st = ctx.engine->stats();
    const bool draining = ctx.engine->draining();
    json h = {{"status", draining ? "draining" : "ok"},
              {"state", draining ? "draining" : "serving"},
              {"is_paused", false},
              {"sleeping_tags", json::array()},
              {"weights_valid", true},
              {"weight_version", st.weight_version},
              {"model_weights_status", static_cast<int>(shm::WeightsStatus::normal)},
              {"model", ctx.cfg.served_model_name},
              {"num_requests_running", st.n_running},
              {"num_requests_waiting", st.n_waiting},
              {"kv_blocks", {{"used", st.n_kv_blocks_used}, {"free", st.n_kv_blocks_free}, {"total", st.n_kv_blocks_total}}},
              {"rss_bytes", process_rss_bytes()}};
    res.status = draining ? 503 : 200;
    res.set_content(dump(h), "application/json");
}

void get_metrics(ApiContext & ctx, const httplib::Request &, httplib::Response & res) {
    const auto st = ctx.engine->stats();
    std::ostringstream o;
    auto gauge = [&](const char * name, const char * help, const char * type, auto value) {
        o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n' << name << ' ' << value << '\n';
    };
    gauge("fdrollout_num_requests_running", "Sequences in the running batch.", "gauge", st.n_running);
    gauge("fdrollout_num_requests_waiting", "Sequences waiting for admission.", "gauge", st.n_waiting);
    gauge("fdrollout_requests_total", "Completion requests accepted.", "counter", st.n_requests_total);
    gauge("fdrollout_generation_tokens_total", "Tokens generated.", "counter", st.n_tokens_generated_total);
    gauge("fdrollout_prompt_tokens_total", "Prompt tokens admitted.", "counter", st.n_tokens_prompt_total);
    gauge("fdrollout_prompt_tokens_cached_total", "Prompt tokens served from the prefix cache.", "counter", st.n_tokens_cached_total);
    gauge("fdrollout_preemptions_total", "Sequences preempted (recompute).", "counter", st.n_preemptions_total);
    gauge("fdrollout_kv_blocks_used", "KV blocks in use.", "gauge", st.n_kv_blocks_used);
    gauge("fdrollout_kv_blocks_free", "KV blocks free (including evictable cached blocks).", "gauge", st.n_kv_blocks_free);
    gauge("fdrollout_kv_blocks_total", "KV blocks in the pool.", "gauge", st.n_kv_blocks_total);
    o << "# HELP fdrollout_weight_version_info Weight version being served.\n# TYPE fdrollout_weight_version_info gauge\n"
      << "fdrollout_weight_version_info{weight_version=\"" << st.weight_version << "\"} 1\n";
    o << "# HELP fdrollout_step_latency_seconds Engine step latency.\n# TYPE fdrollout_step_latency_seconds histogram\n";
    int64_t cum = 0;
    for (size_t i = 0; i < engine::kStepLatencyBuckets.size(); ++i) {
        cum += st.step_latency_counts[i];
        o << "fdrollout_step_latency_seconds_bucket{le=\"" << engine::kStepLatencyBuckets[i] << "\"} " << cum << '\n';
    }
    cum += st.step_latency_counts.back();
    o << "fdrollout_step_latency_seconds_bucket{le=\"+Inf\"} " << cum << '\n'
      << "fdrollout_step_latency_seconds_sum " << st.step_latency_sum_s << '\n'
      << "fdrollout_step_latency_seconds_count " << cum << '\n';
    res.set_content(o.str(), "text/plain; version=0.0.4");
}

}  // namespace fd::api
