// ApiServer lifecycle and the small read-only endpoints: /health, /v1/models (/metrics, /version: metrics.cpp).
#include "access_log.h"
#include "handlers.h"

#include "fd/arena.h"
#include "fd/tokenizer/chat_template.h"
#include "fd/log.h"

#include <sys/socket.h>

#include <cstring>
#include <ctime>

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
    if (!ctx_->cfg.model_dir.empty()) {
        if (auto t = tokenizer::ChatTemplate::load(ctx_->cfg.model_dir)) {
            chat_template_      = std::make_unique<tokenizer::ChatTemplate>(std::move(*t));
            ctx_->chat_template = chat_template_.get();
            log::get("api")->info("chat template: {}", chat_template_->origin());
        }
    }
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
    http_->set_logger([this](const httplib::Request & req, const httplib::Response & res) {
        if (is_control_path(req.path)) { ctx_->engine->control_reply_sent(); }
        access_end(req, res);
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

namespace {
json model_json(ApiContext & ctx) {
    const auto st = ctx.engine->stats();
    return {{"id", ctx.cfg.served_model_name},
              {"object", "model"},
              {"created", static_cast<int64_t>(std::time(nullptr))},
              {"owned_by", "fdrollout"},
              {"root", ctx.cfg.model_dir},
              {"max_model_len", ctx.engine->config().max_model_len},
              {"weight_version", st.state.weight_version}};
}
}  // namespace

void get_models(ApiContext & ctx, const httplib::Request &, httplib::Response & res) {
    res.set_content(dump(json{{"object", "list"}, {"data", json::array({model_json(ctx)})}}), "application/json");
}

void get_model(ApiContext & ctx, const httplib::Request & req, httplib::Response & res) {
    const std::string id = req.matches.size() > 1 ? req.matches[1].str() : std::string();
    if (id != ctx.cfg.served_model_name) {
        throw Error(Errc::not_found, fmt::format("The model '{}' does not exist; this server serves '{}'", id, ctx.cfg.served_model_name), "model");
    }
    res.set_content(dump(model_json(ctx)), "application/json");
}

void get_health(ApiContext & ctx, const httplib::Request &, httplib::Response & res) {
    res.status = ctx.engine->draining() || ctx.engine->stats().state.degraded ? 503 : 200;
    res.set_content(dump(ctx.control->status_json()), "application/json");
}

}  // namespace fd::api
