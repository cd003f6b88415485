// The weight-control routes (SPEC §3, §4): HTTP ↔ the control service, nothing else. The
// request (path, query, body) becomes the wire command the shm mailbox carries too, and the
// service's reply is sent as is, so both transports answer identically.
//
// Input rules, the same for every control route (V1, legacy and the peers' aliases):
// - parameters come from the URL's query only, never from a form body (cpp-httplib would merge a
//   form-encoded body into its params: `curl -d tags=kv_cache` must not act on a tag);
// - each query parameter at most once (`tags=kv_cache&tags=foo` is 400, nothing done), except
//   where a peer's route documents a repeated key (vLLM's `wake_up?tags=a&tags=b`);
// - a body, whatever its Content-Type, is parsed as a JSON object or refused with 400;
// - unknown body fields are 400 naming the field (a typo never turns into a silent default).
// A client deadline (X-Request-Timeout / X-Request-Deadline, below) becomes the command's start
// gate: a command still queued at its deadline is withdrawn, never run, and answered 504 `timeout`.
#include "handlers.h"
#include "peer_aliases.h"

#include "fd/shm/names.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <random>

namespace fd::api {

std::optional<std::string> version_field(const nlohmann::json & body, const char * key) {
    if (!body.is_object() || !body.contains(key) || body[key].is_null()) { return std::nullopt; }
    const nlohmann::json & v = body[key];
    if (v.is_string()) { return v.get<std::string>(); }
    if (v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0)) { return std::to_string(v.get<uint64_t>()); }
    throw Error(Errc::invalid_argument, fmt::format("'{}' must be a string or a non-negative integer (a step)", key), key);
}

namespace {

using nlohmann::json;

/// HTTP path → control command name.
const std::map<std::string, std::string> kRouteOps = {
    {"/v1/pause", "pause"},   {"/v1/resume", "resume"}, {"/v1/is_paused", "is_paused"},
    {"/v1/sleep", "sleep"},   {"/v1/wakeup", "wakeup"}, {"/v1/update_weights", "update_weights"},
    {"/v1/commit_weights", "commit_weights"},           {"/v1/drop_staged_weights", "drop_staged_weights"},
    {"/v1/abort", "abort"},                             {"/v1/flush_cache", "flush_cache"},
    {"/clear_load_weight", "clear_load_weight"},        {"/update_model_weight", "update_model_weight"},
};

std::string new_request_id() {
    thread_local std::mt19937_64 rng{std::random_device{}()};
    return fmt::format("ctrl-{:016x}", rng());
}

/// `text` parsed as JSON, else the string itself (--rsync-config is JSON; a client may send the
/// field as an object or as the JSON text).
json json_or_string(const std::string & text) {
    json j = json::parse(text, nullptr, false);
    return j.is_discarded() ? json(text) : j;
}

/// FastDeploy's `rsync_config` body field: accepted (and ignored) only when it equals the
/// daemon's --rsync-config, compared as JSON values; anything else is 400.
void check_rsync_config(const json & given, const std::string & configured) {
    if (given.is_null()) { return; }
    if (configured.empty()) {
        throw Error(Errc::invalid_argument,
                    "'rsync_config' was given but this daemon has no --rsync-config (its weights do not come from an rsync store); "
                    "drop the field", "rsync_config");
    }
    const json mine   = json_or_string(configured);
    const json theirs = given.is_string() ? json_or_string(given.get<std::string>()) : given;
    if (theirs != mine) {
        throw Error(Errc::invalid_argument,
                    "'rsync_config' differs from the daemon's --rsync-config (compared as JSON); the source is fixed at "
                    "start-up: drop the field or send exactly the configured one", "rsync_config");
    }
}

/// The update_weights body {"version", "verify_checksum", "commit", "rsync_config"} into `cmd`.
void parse_update_body(const json & j, const std::string & rsync_config, shm::MailboxCommand & cmd) {
    reject_unknown_fields(j, {"version", "verify_checksum", "commit", "rsync_config"}, "update_weights");
    cmd.version = version_field(j, "version");
    if (j.contains("verify_checksum") && !j["verify_checksum"].is_null()) {
        if (!j["verify_checksum"].is_boolean()) { throw Error(Errc::invalid_argument, "'verify_checksum' must be a boolean", "verify_checksum"); }
        cmd.verify_checksum = j["verify_checksum"].get<bool>();
    }
    if (j.contains("commit") && !j["commit"].is_null()) {
        if (!j["commit"].is_boolean()) { throw Error(Errc::invalid_argument, "'commit' must be a boolean", "commit"); }
        cmd.commit = j["commit"].get<bool>();
    }
    if (j.contains("rsync_config")) { check_rsync_config(j["rsync_config"], rsync_config); }
}

/// FastDeploy's CE script sends the sleep/wakeup tags in a JSON body instead of the query:
/// `{"tags": "weight,kv_cache"}` (the query's comma text) or `{"tags": ["weight", "kv_cache"]}`.
/// Returns the comma text, or nullopt when the body has no `tags` (or null). A list must hold
/// strings and not be empty (omit `tags` for both); the tag names are checked by the service.
std::optional<std::string> body_tags(const json & body) {
    if (!body.is_object() || !body.contains("tags") || body["tags"].is_null()) { return std::nullopt; }
    const json & t = body["tags"];
    const char * shape = "'tags' must be a string (\"weight,kv_cache\") or a list of strings ([\"weight\", \"kv_cache\"]); nothing was done";
    if (t.is_string()) { return t.get<std::string>(); }
    if (!t.is_array()) { throw Error(Errc::invalid_argument, shape, "tags"); }
    if (t.empty()) { throw Error(Errc::invalid_argument, "'tags' is an empty list; omit it for both tags (weight, kv_cache); nothing was done", "tags"); }
    std::string text;
    for (const auto & e : t) {
        if (!e.is_string()) { throw Error(Errc::invalid_argument, shape, "tags"); }
        if (e.get<std::string>().find_first_not_of(" \t") == std::string::npos) {  // [""]: malformed, never "release everything"
            throw Error(Errc::invalid_argument, "'tags' holds an empty name; list weight, kv_cache, cuda_graph, or omit it for weight,kv_cache; "
                                                "nothing was done", "tags");
        }
        text += (text.empty() ? "" : ",") + e.get<std::string>();
    }
    return text;
}

/// The tags of a sleep/wakeup from the query and/or the body; given in both, they must name the
/// same set (order and repeats aside), else 400 and nothing is done.
std::string sleep_tags(const ControlInput & in) {
    const auto q = in.get("tags");
    const auto b = body_tags(in.body);
    if (q && b && shm::parse_tag_list(*q) != shm::parse_tag_list(*b)) {
        throw Error(Errc::invalid_argument,
                    fmt::format("tags '{}' in the query and '{}' in the body differ; give them once (query or body); nothing was done", *q, *b),
                    "tags");
    }
    return q ? *q : b ? *b : std::string();
}

/// The number in header `name` (one occurrence, a finite decimal), or nullopt when absent.
std::optional<double> header_number(const Request & req, const char * name, const char * what) {
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

}  // namespace

// The client's deadline (issue #12): `X-Request-Timeout: <seconds>` counted from when the daemon
// reads the request, and/or `X-Request-Deadline: <Unix time in seconds>` (CLOCK_REALTIME; what
// fdctl sends, so time spent queued in the socket while the daemon was stopped counts too).
// Both: the earlier wins. Neither: null (the service's default, --control-timeout-s).
std::shared_ptr<engine::StartGate> request_gate(const Request & req) {
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

std::optional<std::string> ControlInput::get(const std::string & key) const {
    std::optional<std::string> v;
    for (const auto & [k, val] : query) {
        if (k != key) { continue; }
        if (v) {
            throw Error(Errc::invalid_argument, fmt::format("query parameter '{}' is given more than once; give it once (nothing was done)", key), key);
        }
        v = val;
    }
    return v;
}

std::vector<std::string> ControlInput::all(const std::string & key) const {
    std::vector<std::string> out;
    for (const auto & [k, val] : query) {
        if (k == key) { out.push_back(val); }
    }
    return out;
}

namespace {

bool is_one_of(std::string_view k, std::initializer_list<std::string_view> names) {
    for (const auto n : names) {
        if (n == k) { return true; }
    }
    return false;
}

/// "'a', 'b'" (or "none") for an error message.
std::string quoted_list(std::initializer_list<std::string_view> names) {
    std::string out;
    for (const auto n : names) { out += fmt::format("{}'{}'", out.empty() ? "" : ", ", n); }
    return out.empty() ? "none" : out;
}

}  // namespace

void ControlInput::allow_only(std::initializer_list<std::string_view> keys, const std::string & route) const {
    for (const auto & [k, val] : query) {
        if (!is_one_of(k, keys)) {
            throw Error(Errc::invalid_argument, fmt::format("unknown query parameter '{}' for {} (it takes {})", k, route, quoted_list(keys)), k);
        }
    }
}

void reject_unknown_fields(const json & body, std::initializer_list<std::string_view> fields, std::string_view what) {
    if (!body.is_object()) { return; }
    for (const auto & [k, v] : body.items()) {
        if (!is_one_of(k, fields)) {
            throw Error(Errc::invalid_argument,
                        fmt::format("unknown field '{}' in the {} body (known: {}); nothing was done", k, what, quoted_list(fields)), k);
        }
    }
}

ControlInput read_control_input(const Request & req) {
    ControlInput in;
    in.req = &req;
    // the URL's query only (http_message.cpp decodes it; a form body never becomes parameters)
    for (const auto & [k, v] : req.params) { in.query.emplace_back(k, v); }
    const bool blank = req.body.find_first_not_of(" \t\r\n") == std::string::npos;
    if (!blank) {
        try {
            in.body = parse_json(req.body);
        } catch (const json::exception &) {
            const std::string ct = req.get_header_value("Content-Type");
            throw Error(Errc::invalid_argument,
                        fmt::format("control routes take a JSON object body (Content-Type: application/json){}; parameters go in the "
                                    "query string, never in a form body; nothing was done",
                                    ct.empty() || ct.rfind("application/json", 0) == 0 ? std::string() : fmt::format(", not '{}'", ct)),
                        "body");
        }
        if (!in.body.is_object() && !in.body.is_null()) {
            throw Error(Errc::invalid_argument, "the request body must be a JSON object; nothing was done", "body");
        }
    }
    return in;
}

void write_control_error(Response & res, const Error & e) {
    const control::ControlReply r = control::error_reply(e);
    res.status = r.http_status;
    res.set_content(r.body, r.content_type);
}

void send_reply(Response & res, const control::ControlReply & r) {
    res.status = r.http_status;
    res.set_content(r.body, r.content_type);
}

void stamp_request_id(const Request & req, Response & res) {
    std::string id = req.get_header_value("X-Request-Id");
    if (!shm::is_valid_request_id(id)) { id = new_request_id(); }
    res.set_header("X-Request-Id", id);
    if (res.get_header_value("Content-Type").rfind("application/json", 0) != 0) { return; }
    json j = json::parse(res.body, nullptr, false);
    if (!j.is_object() || j.contains("request_id")) { return; }
    j["request_id"] = id;
    res.set_content(dump(j), "application/json");
}

void control_route(ApiContext & ctx, const Request & req, Response & res) {
    shm::MailboxCommand cmd;
    cmd.op = kRouteOps.at(req.path);
    const ControlInput in = read_control_input(req);
    // Only `tags` (sleep, wakeup), `mode` and `clear_cache` (pause) are control parameters; which ops take tags
    // is ControlRequest::parse's call. Anything else, e.g. vLLM's ?level=1 on /v1/sleep, is
    // refused here rather than guessed at (vLLM's own route is POST /sleep).
    in.allow_only(cmd.op == "pause"         ? std::initializer_list<std::string_view>{"tags", "mode", "clear_cache"}
                  : cmd.op == "flush_cache" ? std::initializer_list<std::string_view>{"keep_host_tier"}
                                            : std::initializer_list<std::string_view>{"tags"},
                  req.path);
    if (cmd.op == "sleep" || cmd.op == "wakeup") {
        reject_unknown_fields(in.body, {"tags"}, cmd.op);
        cmd.tags = sleep_tags(in);
    } else if (const auto tags = in.get("tags")) {
        cmd.tags = *tags;
    }
    if (cmd.op == "pause") {
        // mode in the query (vLLM's spelling) or the body {"mode": ...}; both must agree
        reject_unknown_fields(in.body, {"mode"}, "pause");
        std::optional<std::string> mode = in.get("mode");
        if (in.body.is_object() && in.body.contains("mode") && !in.body["mode"].is_null()) {
            if (!in.body["mode"].is_string()) { throw Error(Errc::invalid_argument, "'mode' must be a string (abort, wait or keep)", "mode"); }
            const std::string b = in.body["mode"].get<std::string>();
            if (mode && *mode != b) {
                throw Error(Errc::invalid_argument, fmt::format("mode '{}' in the query and '{}' in the body differ; give it once", *mode, b), "mode");
            }
            mode = b;
        }
        cmd.mode = check_pause_mode(mode);
        // clear_cache=false (vLLM's and prime-rl's flag; fdrollout.Client.pause): the prefix
        // cache stays, as on POST /pause; a weight change still flushes it
        cmd.keep_prefix_cache = !query_bool(in, "clear_cache", true);
    } else if (cmd.op == "abort") {
        reject_unknown_fields(in.body, {"request_id", "abort_all"}, "abort");
        if (in.body.is_object() && in.body.contains("request_id") && !in.body["request_id"].is_null()) {
            if (!in.body["request_id"].is_string()) { throw Error(Errc::invalid_argument, "'request_id' must be a string", "request_id"); }
            cmd.request_id = in.body["request_id"].get<std::string>();
        }
        if (in.body.is_object() && in.body.contains("abort_all") && !in.body["abort_all"].is_null()) {
            if (!in.body["abort_all"].is_boolean()) { throw Error(Errc::invalid_argument, "'abort_all' must be a boolean", "abort_all"); }
            cmd.abort_all = in.body["abort_all"].get<bool>();
        }
    } else if (cmd.op == "update_weights") {
        if (!in.body.is_null()) { parse_update_body(in.body, ctx.control->config().rsync_config, cmd); }
    } else if (cmd.op == "flush_cache") {
        // ?keep_host_tier=true (or the body's boolean) keeps the host KV tier: mode "device"
        reject_unknown_fields(in.body, {"keep_host_tier"}, "flush_cache");
        cmd.mode = peer::flush_mode(in);
    } else if (cmd.op == "commit_weights") {
        reject_unknown_fields(in.body, {"version"}, "commit_weights");
        cmd.version = version_field(in.body, "version");
    } else if (cmd.op != "sleep" && cmd.op != "wakeup") {
        reject_unknown_fields(in.body, {}, cmd.op);  // these ops take no body ({} is fine)
    }
    send_reply(res, ctx.control->handle(cmd, request_gate(req)));
}

bool query_bool(const ControlInput & in, const char * key, bool dflt) {
    const auto v = in.get(key);
    if (!v) { return dflt; }
    std::string l = *v;
    std::transform(l.begin(), l.end(), l.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (l == "true" || l == "1" || l == "yes" || l == "on") { return true; }
    if (l == "false" || l == "0" || l == "no" || l == "off") { return false; }
    throw Error(Errc::invalid_argument, fmt::format("'{}' must be true or false, got '{}'; nothing was done", key, *v), key);
}

std::string check_pause_mode(const std::optional<std::string> & mode) {
    if (!mode) { return ""; }
    return std::string(engine::to_string(engine::parse_pause_mode(*mode)));
}

}  // namespace fd::api
