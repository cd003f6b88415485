// ApiServer lifecycle and the small read-only endpoints: /health, /v1/models, /metrics.
#include "handlers.h"

#include "fd/arena.h"
#include "fd/log.h"

#include <sys/socket.h>

#include <cstring>
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

ApiServer::ApiServer(ServerConfig cfg, engine::Engine & engine, control::ControlService & control, const tokenizer::Tokenizer & tok)
    : ctx_(std::make_unique<ApiContext>(ApiContext{std::move(cfg), &engine, &control, &tok})),
      http_(std::make_unique<httplib::Server>()) {
    const int n_threads = ctx_->cfg.n_http_threads;
    http_->new_task_queue = [n_threads] { return new httplib::ThreadPool(static_cast<size_t>(n_threads)); };
    http_->set_payload_max_length(64 << 20);
    http_->set_tcp_nodelay(true);  // no Nagle + delayed-ACK stalls (~40 ms) on keep-alive control calls
    http_->set_read_timeout(60, 0);
    http_->set_write_timeout(60, 0);
    // No SO_REUSEPORT (httplib's default): a second daemon on a taken port must fail, not
    // silently share the port and answer half the requests with other weights.
    http_->set_socket_options([this](socket_t sock) {
        int yes = 1;
        setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
        listen_fd_ = sock;
    });
    http_->set_error_handler([](const httplib::Request & req, httplib::Response & res) {
        if (!res.body.empty()) { return; }  // a handler already wrote its error object
        if (res.status == 400) {
            write_error(res, Error(Errc::invalid_argument, "malformed HTTP request (a body needs Content-Length or chunked encoding)"));
        } else if (res.status == 404) {
            write_error(res, Error(Errc::not_found, "no route " + req.method + " " + req.path));
        } else if (res.status == 405) {
            write_error(res, Error(Errc::invalid_argument, "method " + req.method + " not allowed on " + req.path));
        }
    });
    // Runs after a response is written: tell the engine a control reply is out, so requests the
    // control call aborted are answered after it, not in competition with it.
    http_->set_logger([this](const httplib::Request & req, const httplib::Response &) {
        if (is_control_path(req.path)) { ctx_->engine->control_reply_sent(); }
    });
    register_routes(*http_, *ctx_);
}

ApiServer::~ApiServer() { stop(); }

void ApiServer::bind() {
    if (!http_->bind_to_port(ctx_->cfg.host, ctx_->cfg.port)) {
        fail(Errc::invalid_argument, "cannot listen on {}:{}: {} (another fdrollout on that port? choose one with --port)",
             ctx_->cfg.host, ctx_->cfg.port, std::strerror(errno));
    }
    // cpp-httplib 0.11 listens with a backlog of 5; a burst of RL clients overflows that and
    // gets connection resets. Listening again on the same socket raises the backlog.
    if (listen_fd_ >= 0) { ::listen(listen_fd_, SOMAXCONN); }
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
              {"weight_version", st.state.weight_version}};
    res.set_content(dump(json{{"object", "list"}, {"data", json::array({m})}}), "application/json");
}

void get_health(ApiContext & ctx, const httplib::Request &, httplib::Response & res) {
    res.status = ctx.engine->draining() ? 503 : 200;
    res.set_content(dump(ctx.control->status_json()), "application/json");
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
      << "fdrollout_weight_version_info{weight_version=\"" << st.state.weight_version << "\"} 1\n";
    const auto & es = st.state;
    gauge("fdrollout_paused", "1 while generation is paused.", "gauge", es.paused ? 1 : 0);
    gauge("fdrollout_weights_valid", "1 when the loaded weights are valid.", "gauge", es.weights_valid ? 1 : 0);
    gauge("fdrollout_model_weights_status", "Legacy status word: 0 normal, 1 updating, -1 clearing, -2 cleared.", "gauge",
          static_cast<int>(es.model_weights_status));
    o << "# HELP fdrollout_sleeping Memory tags asleep.\n# TYPE fdrollout_sleeping gauge\n"
      << "fdrollout_sleeping{tag=\"weight\"} " << (es.weight_asleep ? 1 : 0) << '\n'
      << "fdrollout_sleeping{tag=\"kv_cache\"} " << (es.kv_asleep ? 1 : 0) << '\n';
    o << "# HELP fdrollout_control_in_flight Control operation running now.\n# TYPE fdrollout_control_in_flight gauge\n";
    for (const char * op : {"pause", "resume", "sleep", "wakeup", "update_weights"}) {
        o << "fdrollout_control_in_flight{op=\"" << op << "\"} " << (es.control_in_flight == op ? 1 : 0) << '\n';
    }
    o << "# HELP fdrollout_control_ops_total Control operations run.\n# TYPE fdrollout_control_ops_total counter\n";
    for (const auto & [op, c] : st.control_ops) { o << "fdrollout_control_ops_total{op=\"" << op << "\"} " << c.n_total << '\n'; }
    o << "# HELP fdrollout_control_errors_total Control operations that failed.\n# TYPE fdrollout_control_errors_total counter\n";
    for (const auto & [op, c] : st.control_ops) { o << "fdrollout_control_errors_total{op=\"" << op << "\"} " << c.n_errors << '\n'; }
    o << "# HELP fdrollout_control_seconds_sum Total seconds spent in control operations.\n# TYPE fdrollout_control_seconds_sum counter\n";
    for (const auto & [op, c] : st.control_ops) { o << "fdrollout_control_seconds_sum{op=\"" << op << "\"} " << c.seconds_sum << '\n'; }
    o << "# HELP fdrollout_control_seconds_last Duration of the latest control operation.\n# TYPE fdrollout_control_seconds_last gauge\n";
    for (const auto & [op, c] : st.control_ops) { o << "fdrollout_control_seconds_last{op=\"" << op << "\"} " << c.seconds_last << '\n'; }
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
