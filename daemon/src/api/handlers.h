// Internal to fd::api: the handler functions the route table binds, and the error writer.
#pragma once

#include "fd/api/server.h"
#include "fd/control/service.h"
#include "fd/progress.h"
#include "fd/shm/control_client.h"
#include "fd/status.h"

#include "http/http_message.h"

#include <nlohmann/json.hpp>

#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fd::api {

/// Serialize for the wire (invalid UTF-8 replaced, never throws).
std::string dump(const nlohmann::json & j);

/// Deepest nesting of arrays and objects a request body may have. What reads a body recurses
/// over it (chat templates, error messages), so 20,000 nested '[' in 40 KB crashed the daemon
/// (a stack overflow) before; real bodies (tool schemas included) nest a few dozen levels.
constexpr int kMaxJsonDepth = 128;

/// nlohmann::json::parse(text) that also refuses nesting deeper than kMaxJsonDepth (checked while
/// parsing, before any value deeper is built). Errors  json::parse_error as parse();
/// fd::Error{invalid_argument} "the request body nests deeper than 128 arrays/objects".
nlohmann::json parse_json(const std::string & text);
/// The same, keeping key order (chat templates print tools with tojson).
nlohmann::ordered_json parse_ordered_json(const std::string & text);

/// A value quoted in an error message: its JSON, cut to 100 bytes ("..." after).
std::string brief(const nlohmann::json & v);

/// OpenAI error object: {"error": {"message", "type", "param", "code"}} with the table's status.
void write_error(Response & res, const Error & e);

/// Control-style error: {"status":"error","error":{"type","message"}} (SPEC §3).
void write_control_error(Response & res, const Error & e);

/// A control request's inputs as every control route reads them (control.cpp): the URL's query
/// only (never a form body), and the body parsed as a JSON object (null when empty).
struct ControlInput {
    std::vector<std::pair<std::string, std::string>> query;  ///< decoded, in order, repeats kept
    nlohmann::json                                   body;   ///< object, or null for no body
    const Request *                         req = nullptr;  ///< the request (deadline headers: request_gate)
    /// The value of `key`, if given. Errors  invalid_argument when it is given more than once.
    std::optional<std::string> get(const std::string & key) const;
    /// Every value of `key` (a peer's repeated-key list, e.g. vLLM's tags=a&tags=b).
    std::vector<std::string> all(const std::string & key) const;
    /// Errors  invalid_argument naming the first query key not in `keys` (`route` in the message).
    void allow_only(std::initializer_list<std::string_view> keys, const std::string & route) const;
};

/// The start gate of a control command from the request's deadline headers: `X-Request-Timeout:
/// <seconds>` (from now) and/or `X-Request-Deadline: <Unix time in seconds>`, the earlier wins;
/// null when neither is given (the service's default, --control-timeout-s). A command not
/// started by then is dropped, never run (504 `timeout`). One gate per command (single use).
/// Errors  invalid_argument naming the header when it is repeated or not a positive number.
std::shared_ptr<engine::StartGate> request_gate(const Request & req);

/// Read the query and body of a control request.
/// Errors  invalid_argument (param "body") when a non-blank body is not a JSON object, whatever
///         its Content-Type says; nothing is done then.
ControlInput read_control_input(const Request & req);

/// Errors  invalid_argument naming the first field of the object `body` not in `fields`.
void reject_unknown_fields(const nlohmann::json & body, std::initializer_list<std::string_view> fields, std::string_view what);
/// body[`key`] as a version: a string, or a non-negative integer as its decimal string (trainers
/// send step numbers); nullopt when absent or null. Syntax is checked later (ControlRequest).
/// Errors  fd::Error{invalid_argument} naming `key` for any other type.
std::optional<std::string> version_field(const nlohmann::json & body, const char * key);

/// A boolean query parameter as FastAPI parses one (true/false, 1/0, yes/no, on/off; any
/// case); `dflt` when absent. Errors  invalid_argument naming it for anything else.
bool query_bool(const ControlInput & in, const char * key, bool dflt);

/// `?mode=` of a pause (V1 and vLLM): absent → "", else "abort" | "wait" | "keep".
/// Errors  invalid_argument naming any other value (nothing is done).
std::string check_pause_mode(const std::optional<std::string> & mode);

/// Send a control service reply as is.
void send_reply(Response & res, const control::ControlReply & r);

/// Every control response carries a request id (FastDeploy logs by it): the client's
/// `X-Request-Id` when it sent a valid one (1..128 printable ASCII, no spaces), else a fresh
/// `ctrl-<16 hex>`; as the `X-Request-Id` header, and as `request_id` in a JSON object body.
void stamp_request_id(const Request & req, Response & res);

/// Every V1 and legacy control route: the request becomes the wire command the shm mailbox
/// carries too, the control service runs it (fd/control/service.h) and its V1 rendering is sent.
void control_route(ApiContext & ctx, const Request & req, Response & res);
/// The vLLM and SGLang control routes (peer_aliases.cpp): thin translations of a peer's
/// request into the same wire command, and of the service's typed outcome into the peer's shape.
void peer_alias_route(ApiContext & ctx, const Request & req, Response & res);
/// The weight-stream routes (stream_routes.cpp): vLLM's /init_weight_transfer_engine,
/// /start_weight_update, /finish_weight_update, our /abort_weight_update, SGLang's
/// /init_weights_update_group and /update_weights_from_distributed.
void stream_route(ApiContext & ctx, const Request & req, Response & res);
/// POST /update_weights: vLLM's bucket {"update_info"} (a weight stream), else prime-rl's {"weight_dir"}.
void update_weights_route(ApiContext & ctx, const Request & req, Response & res);

void post_completions(ApiContext & ctx, const Request & req, Response & res);
void post_tokenize(ApiContext & ctx, const Request & req, Response & res);
void post_detokenize(ApiContext & ctx, const Request & req, Response & res);
void post_chat_completions(ApiContext & ctx, const Request & req, Response & res);
/// SGLang's native routes (sglang_generate.cpp): POST /generate, GET /server_info (and
/// /get_server_info), GET /v1/loads, GET /health_generate.
void post_sglang_generate(ApiContext & ctx, const Request & req, Response & res);
void get_sglang_server_info(ApiContext & ctx, const Request & req, Response & res);
void get_sglang_loads(ApiContext & ctx, const Request & req, Response & res);
void get_sglang_health_generate(ApiContext & ctx, const Request & req, Response & res);
void get_models(ApiContext & ctx, const Request & req, Response & res);
/// GET /v1/models/{id}: the served model's object (OpenAI shape); 404 for any other id.
void get_model(ApiContext & ctx, const Request & req, Response & res);
void get_health(ApiContext & ctx, const Request & req, Response & res);
void get_metrics(ApiContext & ctx, const Request & req, Response & res);   ///< metrics.cpp
void get_version(ApiContext & ctx, const Request & req, Response & res);   ///< metrics.cpp

}  // namespace fd::api
