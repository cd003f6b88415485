// Internal to fd::api: the request and response the route handlers see, independent of the
// HTTP library underneath (Boost.Beast, http_session.cpp). Member names follow what the handlers
// used before (method, path, params, body; status, set_content, set_header) so a handler is a
// plain function of (Request, Response).
//
// A response is either complete when its handler returns (status, headers, body), or carries an
// AsyncBody that the engine fills later without a thread waiting on it: the connection's strand
// pumps it each time the engine wakes it, so thousands of streams cost no threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <utility>
#include <vector>

namespace fd::api {

/// Case-insensitive ASCII ordering for header names.
struct CaseInsensitiveLess {
    bool operator()(const std::string & a, const std::string & b) const;
};

/// One HTTP request, fully read (header and body).
struct Request {
    std::string method;   ///< "GET", "POST", ...
    std::string target;   ///< as sent: path and query ("/v1/sleep?tags=weight")
    std::string path;     ///< target up to '?', not decoded
    std::multimap<std::string, std::string>                      params;   ///< query parameters, %XX and '+' decoded; repeats kept
    std::multimap<std::string, std::string, CaseInsensitiveLess> headers;
    std::string body;     ///< raw body bytes (empty when the request had none)
    std::smatch matches;  ///< a pattern route's match of `path` ([1] = its first group); empty for exact routes

    bool        has_header(const std::string & name) const { return headers.count(name) != 0; }
    size_t      get_header_value_count(const std::string & name) const { return headers.count(name); }
    /// First value of header `name`, "" when absent.
    std::string get_header_value(const std::string & name) const;
    bool        has_param(const std::string & key) const { return params.count(key) != 0; }
    /// First value of query parameter `key`, "" when absent.
    std::string get_param_value(const std::string & key) const;
    size_t      get_param_value_count(const std::string & key) const { return params.count(key); }
};

struct Response;

/// A body the engine produces over time (a completion). The server calls every member on the
/// connection's strand, never two at once: `subscribe` once, then `pump` right away, after each
/// wake, after each chunk it wrote, and once `deadline` has passed; `release` exactly once last.
struct AsyncBody {
    /// true: status 200 and headers go out at once, then the chunks `pump` yields (chunked
    /// transfer encoding; SSE). false: the whole response goes out when `pump` says done.
    bool streamed = false;
    std::string content_type;  ///< streamed only ("text/event-stream")
    /// pump is called (at least) once after this instant so the body can time itself out.
    std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
    /// Hands the body its wake-up: `wake` may be called from any thread (the engine's), any
    /// number of times; calls while a pump is pending coalesce.
    std::function<void(std::function<void()> wake)> subscribe;
    /// Never blocks. Streamed: append the bytes ready now to `chunk`. Whole: fill `res`
    /// (status, body; set_content) when complete. Returns true when the body is complete.
    std::function<bool(Response & res, std::string & chunk)> pump;
    /// The end: `delivered` is false when the client went away (or a write failed or timed
    /// out, or the server stopped) before the body was complete.
    std::function<void(bool delivered)> release;
};

/// The response a handler fills.
struct Response {
    int status = 200;
    std::string body;
    std::vector<std::pair<std::string, std::string>> headers;  ///< besides Content-Type/Length (set_header)
    std::shared_ptr<AsyncBody> async;   ///< non-null: the body comes later (set_async)
    int64_t n_prompt_tokens    = -1;    ///< for the access log: -1 = not a completion
    int64_t n_generated_tokens = -1;

    /// Body and its Content-Type.
    void set_content(std::string content, const std::string & content_type);
    /// Set (replace) header `name`.
    void set_header(const std::string & name, const std::string & value);
    /// Value of header `name` set so far ("" when none).
    std::string get_header_value(const std::string & name) const;
    /// The body is `b`, produced later (see AsyncBody).
    void set_async(AsyncBody b) { async = std::make_shared<AsyncBody>(std::move(b)); }
};

/// Decode %XX escapes (and '+' as a space when `plus_is_space`); a malformed escape is kept as is.
std::string url_decode(const std::string & s, bool plus_is_space);
/// "a=1&b=x%20y&a=2" → {a:1, b:"x y", a:2} (a key without '=' has the value "").
std::multimap<std::string, std::string> parse_query(const std::string & query);

}  // namespace fd::api
