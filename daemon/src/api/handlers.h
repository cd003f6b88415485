// Internal to fd::api: the handler functions the route table binds, and the error writer.
#pragma once

#include "fd/api/server.h"
#include "fd/control/service.h"
#include "fd/progress.h"
#include "fd/shm/control_client.h"
#include "fd/status.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

namespace fd::api {

using Handler = std::function<void(const httplib::Request &, httplib::Response &)>;

/// Serialize for the wire (invalid UTF-8 replaced, never throws).
std::string dump(const nlohmann::json & j);

/// OpenAI error object: {"error": {"message", "type", "param", "code"}} with the table's status.
void write_error(httplib::Response & res, const Error & e);

/// Control-style error: {"status":"error","error":{"type","message"}} (SPEC §3).
void write_control_error(httplib::Response & res, const Error & e);

/// Every control route: the request becomes the wire command the shm mailbox carries too and
/// goes through the control service (fd/control/service.h).
void control_route(ApiContext & ctx, const httplib::Request & req, httplib::Response & res);
/// True for the weight-control routes of the route table (V1 and legacy).
bool is_control_path(const std::string & path);

void post_completions(ApiContext & ctx, const httplib::Request & req, httplib::Response & res);
void post_tokenize(ApiContext & ctx, const httplib::Request & req, httplib::Response & res);
void post_detokenize(ApiContext & ctx, const httplib::Request & req, httplib::Response & res);
void post_chat_completions(ApiContext & ctx, const httplib::Request & req, httplib::Response & res);
void get_models(ApiContext & ctx, const httplib::Request & req, httplib::Response & res);
/// GET /v1/models/{id}: the served model's object (OpenAI shape); 404 for any other id.
void get_model(ApiContext & ctx, const httplib::Request & req, httplib::Response & res);
void get_health(ApiContext & ctx, const httplib::Request & req, httplib::Response & res);
void get_metrics(ApiContext & ctx, const httplib::Request & req, httplib::Response & res);   ///< metrics.cpp
void get_version(ApiContext & ctx, const httplib::Request & req, httplib::Response & res);   ///< metrics.cpp

}  // namespace fd::api
