// fd/api/server.h — the HTTP front end: OpenAI-compatible generation, health, metrics, weight
// control. An event-driven HTTP/1.1 server (Boost.Beast over Asio, src/api/http_server.h): a
// couple of I/O threads hold every connection, idle or streaming; handlers parse into engine
// structs and submit, and the engine's events are written as they come, no thread per request.
// The route table is in src/api/routes.cpp.
#pragma once

#include "fd/checkpoint/model_config.h"
#include "fd/engine/engine.h"
#include "fd/tokenizer/tokenizer.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fd::tokenizer { class ChatTemplate; }
namespace fd::control { class ControlService; }
namespace fd::stream { class StreamManager; }

namespace fd::api {

class HttpServer;

struct ServerConfig {
    std::string host              = "127.0.0.1";
    int32_t     port              = 8000;
    std::string api_key;                     ///< empty = no auth; else `Authorization: Bearer KEY` on /v1/completions, /v1/models (and the control routes unless control_api_key is set)
    std::string control_api_key;             ///< non-empty: the only key the control routes (V1 and legacy) accept; api_key no longer opens them
    bool        allow_unauthenticated = false; ///< start on a non-loopback --host without --api-key (warned loudly)
    std::string served_model_name;           ///< the name responses report: served_model_names[0]
    /// --served-model-name (vLLM's flag, one or more): every name a request's `model` may give
    /// (and the model dir) and /v1/models lists; default = {model dir name}
    std::vector<std::string> served_model_names;
    /// True when `name` is one of served_model_names (or served_model_name).
    bool serves(const std::string & name) const {
        return name == served_model_name || std::find(served_model_names.begin(), served_model_names.end(), name) != served_model_names.end();
    }
    std::string model_dir;
    std::string chat_template;               ///< --chat-template: a file, or the template itself; replaces the model's
    bool        trust_request_chat_template = false;  ///< --trust-request-chat-template: a request's `chat_template` is used (else 400)
    bool        stream_recycle_staging = true;  ///< FD_STREAM_RECYCLE_STAGING (StreamConfig::recycle_staging)
    int32_t     stream_stage_ahead = -1;        ///< FD_STREAM_STAGE_AHEAD: 1 / 0 / -1 auto (StreamConfig::stage_ahead)
    int32_t     n_io_threads      = 2;       ///< HTTP I/O threads: every connection's reads and writes (thousands per thread)
    int32_t     n_data_threads    = 2;       ///< threads running generation/tokenizer handlers (parse, tokenize, submit; never the wait)
    int32_t     max_control_threads = 32;    ///< control-route threads, started on demand (a control call blocks on the engine)
    double      http_read_timeout_s  = 60.0; ///< a request's header and body must arrive within this (slow or stalled clients are cut off)
    double      http_write_timeout_s = 60.0; ///< each response write or SSE chunk must drain within this (a client that stops reading is cut off, its request cancelled)
    double      keep_alive_timeout_s = 5.0;  ///< idle connections (new or between requests) are closed after this
    size_t      max_body_bytes    = size_t(64) << 20;  ///< larger request bodies: 413
    size_t      max_header_bytes  = size_t(16) << 10;  ///< larger request headers: 431
    double      request_timeout_s = 600.0;   ///< longest a completion may take before 504
    int32_t     max_logprobs      = 20;      ///< cap on `logprobs`
    int32_t     max_n             = 128;     ///< cap on `n`
    bool        enable_return_routed_experts = false;  ///< --enable-return-routed-experts: requests may ask for return_routed_experts (R3)
    /// --generation-config (vLLM's flag): auto = the model's generation_config.json sampling
    /// defaults, vllm = none, else a folder holding a generation_config.json.
    std::string generation_config = "auto";
    /// --override-generation-config (vLLM's flag): a JSON object whose sampling fields replace
    /// the ones --generation-config gave (model::override_generation_defaults); "" = none.
    std::string override_generation_config;
    /// What --generation-config resolved to (config.cpp): the default of each sampling field a
    /// request leaves out; max_new_tokens caps every request's max tokens (vLLM's get_max_tokens).
    model::GenerationDefaults sampling_defaults;
};

/// Shared by every handler.
struct ApiContext {
    ServerConfig                cfg;
    engine::Engine *            engine = nullptr;
    control::ControlService *   control = nullptr;
    const tokenizer::Tokenizer *    tok    = nullptr;
    const tokenizer::ChatTemplate * chat_template = nullptr;  ///< null: the model has none (chat → 400)
    stream::StreamManager *     stream = nullptr;  ///< trainer weight streams (fd/stream/weight_stream.h)
};

class ApiServer {
public:
    /// Loads the model's chat template from cfg.model_dir (fd/tokenizer/chat_template.h).
    /// Errors  fd::Error{invalid_checkpoint} naming the file (and line/column) when the
    ///         template or tokenizer_config.json is malformed.
    ApiServer(ServerConfig cfg, engine::Engine & engine, control::ControlService & control, const tokenizer::Tokenizer & tok);
    ~ApiServer();

    /// Raise the open-files limit to its hard limit (one descriptor per connection) and bind
    /// host:port. Errors  fd::Error{invalid_argument} when the address is unusable or taken.
    void bind();
    /// Serve on the bound socket until stop() (blocks; run it on its own thread).
    void serve();
    /// Close every connection (unfinished completions are cancelled) and join the threads.
    void stop();
    /// The weight stream's state as /health's "weight_stream" shows it (JSON text; any thread).
    std::string weight_stream_status() const;

private:
    std::unique_ptr<ApiContext>              ctx_;
    std::unique_ptr<tokenizer::ChatTemplate> chat_template_;
    std::unique_ptr<stream::StreamManager>   stream_;  ///< outlives http_ (declared before it)
    std::unique_ptr<HttpServer>              http_;
};

}  // namespace fd::api
