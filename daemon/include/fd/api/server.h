// fd/api/server.h — the HTTP front end (cpp-httplib): OpenAI-compatible generation, health,
// metrics. Owns JSON and nothing else: handlers parse into engine structs, submit, and stream
// ChoiceEvents back. The route table is in src/api/routes.cpp.
#pragma once

#include "fd/engine/engine.h"
#include "fd/tokenizer/tokenizer.h"

#include <cstdint>
#include <memory>
#include <string>

namespace httplib { class Server; }
namespace fd::tokenizer { class ChatTemplate; }
namespace fd::control { class ControlService; }

namespace fd::api {

struct ServerConfig {
    std::string host              = "127.0.0.1";
    int32_t     port              = 8000;
    std::string api_key;                     ///< empty = no auth; else `Authorization: Bearer KEY` on /v1/completions, /v1/models (and the control routes unless control_api_key is set)
    std::string control_api_key;             ///< non-empty: the only key the control routes (V1 and legacy) accept; api_key no longer opens them
    bool        allow_unauthenticated = false; ///< start on a non-loopback --host without --api-key (warned loudly)
    std::string served_model_name;           ///< `model` clients send; default = model dir name
    std::string model_dir;
    int32_t     n_http_threads    = 128;     ///< concurrent connections served
    double      request_timeout_s = 600.0;   ///< longest a completion may take before 504
    int32_t     max_logprobs      = 20;      ///< cap on `logprobs`
    int32_t     max_n             = 128;     ///< cap on `n`
};

/// Shared by every handler.
struct ApiContext {
    ServerConfig                cfg;
    engine::Engine *            engine = nullptr;
    control::ControlService *   control = nullptr;
    const tokenizer::Tokenizer *    tok    = nullptr;
    const tokenizer::ChatTemplate * chat_template = nullptr;  ///< null: the model has none (chat → 400)
};

class ApiServer {
public:
    /// Loads the model's chat template from cfg.model_dir (fd/tokenizer/chat_template.h).
    /// Errors  fd::Error{invalid_checkpoint} naming the file (and line/column) when the
    ///         template or tokenizer_config.json is malformed.
    ApiServer(ServerConfig cfg, engine::Engine & engine, control::ControlService & control, const tokenizer::Tokenizer & tok);
    ~ApiServer();

    /// Bind host:port. Errors  fd::Error{invalid_argument} when the address is unusable.
    void bind();
    /// Serve on the bound socket until stop() (blocks; run it on its own thread).
    void serve();
    void stop();

private:
    std::unique_ptr<ApiContext>      ctx_;
    std::unique_ptr<httplib::Server> http_;
    std::unique_ptr<tokenizer::ChatTemplate> chat_template_;
    int                              listen_fd_ = -1;
};

}  // namespace fd::api
