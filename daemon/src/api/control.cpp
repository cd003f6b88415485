// The weight-control routes (SPEC §3, §4): HTTP ↔ the control service, nothing else. The
// request (path, query, body) becomes the wire command the shm mailbox carries too, and the
// service's reply is sent as is, so both transports answer identically.
#include "handlers.h"

#include <map>

namespace fd::api {
namespace {

using nlohmann::json;

/// HTTP path → control command name.
const std::map<std::string, std::string> kRouteOps = {
    {"/v1/pause", "pause"},   {"/v1/resume", "resume"}, {"/v1/is_paused", "is_paused"},
    {"/v1/sleep", "sleep"},   {"/v1/wakeup", "wakeup"}, {"/v1/update_weights", "update_weights"},
    {"/clear_load_weight", "clear_load_weight"},        {"/update_model_weight", "update_model_weight"},
};

/// The update_weights body {"version": str|null, "verify_checksum": bool|null} into `cmd`.
void parse_update_body(const std::string & body, shm::MailboxCommand & cmd) {
    json j;
    try {
        j = json::parse(body);
    } catch (const json::exception & e) {
        throw Error(Errc::invalid_argument, fmt::format("request body is not valid JSON: {}", e.what()));
    }
    if (!j.is_object()) { throw Error(Errc::invalid_argument, "request body must be a JSON object"); }
    if (j.contains("version") && !j["version"].is_null()) {
        if (!j["version"].is_string()) { throw Error(Errc::invalid_argument, "'version' must be a string", "version"); }
        cmd.version = j["version"].get<std::string>();
    }
    if (j.contains("verify_checksum") && !j["verify_checksum"].is_null()) {
        if (!j["verify_checksum"].is_boolean()) { throw Error(Errc::invalid_argument, "'verify_checksum' must be a boolean", "verify_checksum"); }
        cmd.verify_checksum = j["verify_checksum"].get<bool>();
    }
}

}  // namespace

void write_control_error(Response & res, const Error & e) {
    const control::ControlReply r = control::error_reply(e);
    res.status = r.http_status;
    res.set_content(r.body, r.content_type);
}

void control_route(ApiContext & ctx, const Request & req, Response & res) {
    shm::MailboxCommand cmd;
    cmd.op = kRouteOps.at(req.path);
    // Only `tags` is a control parameter (which ops take it is ControlRequest::parse's call);
    // anything else, e.g. vLLM's ?level=1, is refused here rather than guessed at.
    for (const auto & [key, value] : req.params) {
        if (key != "tags") {
            throw Error(Errc::invalid_argument, fmt::format("unknown query parameter '{}' for {} (sleep and wakeup take tags=weight,kv_cache)",
                                                            key, req.path), key);
        }
    }
    if (req.has_param("tags")) { cmd.tags = req.get_param_value("tags"); }
    if (cmd.op == "update_weights" && !req.body.empty()) { parse_update_body(req.body, cmd); }
    const control::ControlReply r = ctx.control->handle(cmd);
    res.status = r.http_status;
    res.set_content(r.body, r.content_type);
}

}  // namespace fd::api
