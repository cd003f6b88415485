// ApiServer lifecycle and the small read-only endpoints: /health, /v1/models (/metrics, /version: metrics.cpp).
#include "access_log.h"
#include "handlers.h"
#include "http/http_server.h"

#include "fd/arena.h"
#include "fd/stream/weight_stream.h"
#include "fd/tokenizer/chat_template.h"
#include "fd/log.h"

#include <algorithm>
#include <ctime>
#include <string_view>

namespace fd::api {

Router make_routes(ApiContext & ctx);

using nlohmann::json;

std::string dump(const json & j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

namespace {
/// The deepest nesting of arrays and objects in `text` (strings skipped, escapes honoured),
/// stopping once past `limit`. One linear pass before the parse: the depth check used to be the
/// parse callback, and nlohmann's callback parser rescans a container's members as each closes,
/// O(n^2) in them (a probe: a body of 160,000 {} in one array held a data thread for 9 s).
int nesting_depth(std::string_view text, int limit) {
    int  depth = 0, deepest = 0;
    bool in_string = false, escaped = false;
    for (const char c : text) {
        if (in_string) {
            if (escaped) {
                escaped = false;
            } else if (c == '\\') {
                escaped = true;
            } else if (c == '"') {
                in_string = false;
            }
            continue;
        }
        if (c == '"') {
            in_string = true;
        } else if (c == '{' || c == '[') {
            deepest = std::max(deepest, ++depth);
            if (deepest > limit) { break; }
        } else if (c == '}' || c == ']') {
            --depth;
        }
    }
    return deepest;
}

template <typename J>
J parse_bounded(const std::string & text) {
    if (nesting_depth(text, kMaxJsonDepth) > kMaxJsonDepth) {  // refused before anything is built
        throw Error(Errc::invalid_argument, fmt::format("the request body nests deeper than {} arrays/objects", kMaxJsonDepth));
    }
    return J::parse(text);
}

/// The stream's status (/health's and the mailbox status's weight_stream): its serving fields
/// name the last stream only while the engine still serves its bytes.
std::string stream_status(const stream::StreamManager & sm, const engine::EngineState & st) {
    return sm.status_json(stream::ServingNow{st.weight_version, st.weights_epoch});
}

}  // namespace

json parse_json(const std::string & text) { return parse_bounded<json>(text); }
nlohmann::ordered_json parse_ordered_json(const std::string & text) { return parse_bounded<nlohmann::ordered_json>(text); }

std::string brief(const json & v) {
    std::string s = dump(v);
    if (s.size() > 100) {
        s.resize(100);
        s += "...";
    }
    return s;
}

void write_error(Response & res, const Error & e) {
    const int status = errc_http_status(e.code());
    json body = {{"error", {{"message", e.what()},
                            {"type", errc_name(e.code())},
                            {"param", e.param().empty() ? json(nullptr) : json(e.param())},
                            {"code", status}}}};
    res.status = status;
    res.set_content(dump(body), "application/json");
}

ApiServer::ApiServer(ServerConfig cfg, engine::Engine & engine, control::ControlService & control, const tokenizer::Tokenizer & tok)
    : ctx_(std::make_unique<ApiContext>(ApiContext{std::move(cfg), &engine, &control, &tok})) {
    if (!ctx_->cfg.model_dir.empty() || !ctx_->cfg.chat_template.empty()) {
        if (auto t = tokenizer::ChatTemplate::load(ctx_->cfg.model_dir, ctx_->cfg.chat_template)) {
            chat_template_      = std::make_unique<tokenizer::ChatTemplate>(std::move(*t));
            ctx_->chat_template = chat_template_.get();
            log::get("api")->info("chat template: {}", chat_template_->origin());
        }
    }
    const ServerConfig & c = ctx_->cfg;
    stream_ = std::make_unique<stream::StreamManager>(stream::StreamConfig{
        .model_dir = c.model_dir, .host = c.host, .port = c.port, .timeout_s = control.config().control_timeout_s,
        .model_cfg = engine.model_config(), .tp_size = engine.tensor_parallel_size(), .ep_size = engine.config().expert_parallel_size,
        .nnodes = engine.world().nnodes, .recycle_staging = c.stream_recycle_staging,
        .stage_ahead = stream::stage_ahead_choice(c.stream_stage_ahead, engine.tensor_parallel_size())});
    ctx_->stream = stream_.get();
    engine.set_weight_sleep_hook([s = stream_.get()] { return s->release_spare(); });  // a weight sleep hands the spare back
    const HttpLimits limits{.max_body_bytes = c.max_body_bytes, .max_header_bytes = c.max_header_bytes,
                            .read_timeout_s = c.http_read_timeout_s, .write_timeout_s = c.http_write_timeout_s,
                            .keep_alive_timeout_s = c.keep_alive_timeout_s, .n_io_threads = c.n_io_threads,
                            .n_data_threads = c.n_data_threads, .max_control_threads = c.max_control_threads};
    // Runs after a response is written: the access log.
    http_ = std::make_unique<HttpServer>(limits, make_routes(*ctx_), [](const Request & req, const Response & res, double ms) {
        access_end(req, res, ms);
    });
}

ApiServer::~ApiServer() {
    stop();
    ctx_->engine->set_weight_sleep_hook(nullptr);  // before stream_ goes
}

std::string ApiServer::weight_stream_status() const { return stream_status(*stream_, ctx_->engine->stats().state); }

void ApiServer::bind() {
    const uint64_t n_files = raise_fd_limit();
    if (n_files < 4096) {
        log::get("api")->warn("open-files limit is {}: at most that many connections (raise it: `ulimit -n`, LimitNOFILE=)", n_files);
    }
    http_->bind(ctx_->cfg.host, ctx_->cfg.port);
}

void ApiServer::serve() { http_->run(); }

void ApiServer::stop() {
    if (http_) { http_->stop(); }
}

namespace {
json model_json(ApiContext & ctx, const std::string & name) {
    const auto st = ctx.engine->stats();
    return {{"id", name},
              {"object", "model"},
              {"created", static_cast<int64_t>(std::time(nullptr))},
              {"owned_by", "fdrollout"},
              {"root", ctx.cfg.model_dir},
              {"max_model_len", ctx.engine->config().max_model_len},
              {"compute_dtype", ctx.engine->config().compute_dtype},
              {"weight_version", st.state.weight_version},
              {"kv_cache_dtype", st.kv_cache_dtype},
              {"kv_cache_tokens", st.n_kv_blocks_total * st.kv_block_size},
              {"kv_cache_bytes_per_token", st.kv_bytes_per_token}};
}
}  // namespace

void get_models(ApiContext & ctx, const Request &, Response & res) {
    json data = json::array();  // vLLM: one card per served name
    for (const auto & name : ctx.cfg.served_model_names.empty() ? std::vector<std::string>{ctx.cfg.served_model_name} : ctx.cfg.served_model_names) {
        data.push_back(model_json(ctx, name));
    }
    res.set_content(dump(json{{"object", "list"}, {"data", std::move(data)}}), "application/json");
}

void get_model(ApiContext & ctx, const Request & req, Response & res) {
    // Percent-decoded, as a path parameter ('+' stays '+'): 'org/my%20model' and 'org%2Fmy' named
    // nothing before (a probe).
    const std::string id = req.matches.size() > 1 ? url_decode(req.matches[1].str(), /*plus_is_space=*/false) : std::string();
    if (!ctx.cfg.serves(id)) {
        throw Error(Errc::not_found, fmt::format("The model '{}' does not exist; this server serves '{}'", id, ctx.cfg.served_model_name), "model");
    }
    res.set_content(dump(model_json(ctx, id)), "application/json");
}

void get_health(ApiContext & ctx, const Request &, Response & res) {
    const engine::EngineState st = ctx.engine->stats().state;
    res.status = ctx.engine->draining() || st.degraded ? 503 : 200;
    nlohmann::json body = ctx.control->status_json();
    if (ctx.stream) { body["weight_stream"] = nlohmann::json::parse(stream_status(*ctx.stream, st)); }
    res.set_content(dump(body), "application/json");
}

}  // namespace fd::api
