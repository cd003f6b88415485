// The weight-control routes (SPEC §3, §4): HTTP ↔ the control service, nothing else. The
// request (path, query, body) becomes the wire command the shm mailbox carries too, and the
// service's reply is sent as is, so both transports answer identically. A client deadline
// (X-Request-Timeout / X-Request-Deadline, below) becomes the command's start gate: a command
// still queued at its deadline is withdrawn, never run, and answered 504 `timeout`.
#include "handlers.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>

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

/// The number in header `name` (one occurrence, a finite decimal), or nullopt when absent.
std::optional<double> header_number(const httplib::Request & req, const char * name, const char * what) {
    const size_t n = req.get_header_value_count(name);
    if (n == 0) { return std::nullopt; }
    const std::string v = req.get_header_value(name);
    char * end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (n > 1 || v.empty() || end != v.c_str() + v.size() || !std::isfinite(x) || x <= 0) {
        throw Error(Errc::invalid_argument, fmt::format("header {} must appear once and be {} (a positive decimal number), got '{}'", name, what, v),
                    name);
    }
    return x;
}

/// The client's deadline (issue #12): `X-Request-Timeout: <seconds>` counted from when the daemon
/// reads the request, and/or `X-Request-Deadline: <Unix time in seconds>` (CLOCK_REALTIME; what
/// fdctl sends, so time spent queued in the socket while the daemon was stopped counts too).
/// Both: the earlier wins. Neither: null (the service's default, --control-timeout-s).
std::shared_ptr<engine::StartGate> request_gate(const httplib::Request & req) {
    using namespace std::chrono;
    const auto timeout  = header_number(req, "X-Request-Timeout", "seconds");
    const auto deadline = header_number(req, "X-Request-Deadline", "a Unix time in seconds");
    if (!timeout && !deadline) { return nullptr; }
    const auto now = steady_clock::now();
    auto at = steady_clock::time_point::max();
    auto after = [&](double s) { return now + duration_cast<steady_clock::duration>(duration<double>(std::min(s, 1e9))); };
    if (timeout) { at = after(*timeout); }
    if (deadline) {
        const double left = *deadline - duration<double>(system_clock::now().time_since_epoch()).count();
        at = std::min(at, left > 0 ? after(left) : now);
    }
    return std::make_shared<engine::LocalStartGate>(at);
}

}  // namespace

void write_control_error(httplib::Response & res, const Error & e) {
    const control::ControlReply r = control::error_reply(e);
    res.status = r.http_status;
    res.set_content(r.body, r.content_type);
}

void control_route(ApiContext & ctx, const httplib::Request & req, httplib::Response & res) {
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
    const control::ControlReply r = ctx.control->handle(cmd, request_gate(req));
    res.status = r.http_status;
    res.set_content(r.body, r.content_type);
}

}  // namespace fd::api
