// fd/api/server.h — the HTTP front end (cpp-httplib): OpenAI-compatible generation, health,
// metrics. Owns JSON and nothing else: handlers parse into engine structs, submit, and stream
// ChoiceEvents back. The route table is in src/api/routes.cpp.
#pragma once

#include "fd/engine/engine.h"
#include "fd/model/tokenizer.h"

#include <cstdint>
#include <memory>
#include <string>

namespace httplib { class Server; }
namespace fd::shm { struct MailboxCommand; }

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
    bool        dynamic_load_weight = false; ///< enables sleep/wakeup/update_weights and the legacy routes
    bool        v1_update_weights = false;   ///< FD_ENABLE_V1_UPDATE_WEIGHTS: legacy routes = V1 sleep/wakeup
    double      control_timeout_s = 900.0;   ///< longest a V1 control call waits for the engine before 504
    double      legacy_timeout_s  = 300.0;   ///< legacy clear/update wait for the status word (SPEC §4)
};

/// A finished control answer: exactly what the V1 HTTP route sends.
struct ControlReply {
    int         http_status = 200;
    std::string content_type = "application/json";
    std::string body;
};

/// Shared by every handler.
struct ApiContext {
    ServerConfig                cfg;
    engine::Engine *            engine = nullptr;
    const model::Tokenizer *    tok    = nullptr;
};

class ApiServer {
public:
    ApiServer(ServerConfig cfg, engine::Engine & engine, const model::Tokenizer & tok);
    ~ApiServer();

    /// Bind host:port. Errors  fd::Error{invalid_argument} when the address is unusable.
    void bind();
    /// Serve on the bound socket until stop() (blocks; run it on its own thread).
    void serve();
    void stop();

    /// Run one control command (as sent over the shm mailbox) through the same code as its V1
    /// HTTP route and return that route's answer. Never throws.
    ControlReply dispatch(const shm::MailboxCommand & cmd);

private:
    std::unique_ptr<ApiContext>      ctx_;
    std::unique_ptr<httplib::Server> http_;
    int                              listen_fd_ = -1;
};

}  // namespace fd::api
