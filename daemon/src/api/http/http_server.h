// Internal to fd::api: the event-driven HTTP/1.1 server (Boost.Beast over Asio) under the route
// table. A couple of I/O threads hold every connection (idle keep-alive ones, streams) and do
// all socket work; handlers run on lanes:
//   io       on the I/O thread itself: non-blocking probes (/health, /metrics, /version, models)
//   control  a pool that grows on demand (up to max_control_threads): weight-control calls,
//            which block on the engine; never queued behind generation handlers
//   query    a small pool of its own: abort and the read-only control queries (is_paused,
//            is_sleeping, get_weight_version), which never wait for an engine operation, so they
//            answer (and an abort ends a pause's drain) even while every control thread waits
//   data     a small fixed pool: generation and tokenizer handlers (JSON parse, tokenize,
//            submit); their waiting on the engine is an AsyncBody, not a thread
#pragma once

#include "handler_pool.h"
#include "http_message.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <string>
#include <thread>
#include <vector>

namespace fd::api {

using Handler = std::function<void(const Request &, Response &)>;

/// Where a route's handler runs (see the file comment).
enum class Lane { io, control, query, data };

/// A route's check of a request's head alone (method, target, headers; the body not read): false
/// when it wrote the refusal into the Response (a missing API key's 401), which is then sent
/// without reading the body. Run for a body still to come (a large, chunked or 100-continue one),
/// so a client without the key cannot make the daemon hold a 64 MiB body first (a probe); the
/// handler checks again (small bodies arrive with their head).
using Admit = std::function<bool(const Request &, Response &)>;

struct Route {
    std::string method;
    std::string path;
    Handler     handler;
    Lane        lane = Lane::data;
    Admit       admit;  ///< empty: every head admitted
};

/// A handler with its head check (api/routes.cpp's wrap).
struct Wrapped {
    Handler handler;
    Admit   admit;
};

/// The route table's container: exact paths, and patterns (a path holding a regex group, e.g.
/// `/v1/models/(.+)`, matched whole, tried in the order added). HEAD is served by the GET route.
class Router {
public:
    void Get(const std::string & path, Handler h, Lane lane = Lane::data) { add("GET", path, std::move(h), lane, {}); }
    void Post(const std::string & path, Handler h, Lane lane = Lane::data) { add("POST", path, std::move(h), lane, {}); }
    void Get(const std::string & path, Wrapped w, Lane lane = Lane::data) { add("GET", path, std::move(w.handler), lane, std::move(w.admit)); }
    void Post(const std::string & path, Wrapped w, Lane lane = Lane::data) { add("POST", path, std::move(w.handler), lane, std::move(w.admit)); }

    /// The route for `method` `path`, or null; `*path_known` tells whether any method is routed
    /// at `path` (405 rather than 404); a pattern route's groups go to `*matches` (which refers
    /// into `path`: keep it alive and unchanged).
    const Route * find(const std::string & method, const std::string & path, bool * path_known, std::smatch * matches = nullptr) const;

private:
    struct Pattern {
        std::string                  source;
        std::regex                   re;
        std::map<std::string, Route> by_method;
    };
    void add(const std::string & method, const std::string & path, Handler h, Lane lane, Admit admit);
    std::map<std::string, std::map<std::string, Route>> by_path_;  ///< exact path → method → route
    std::vector<Pattern>                                 patterns_;
};

/// Limits and timeouts of the HTTP layer (one config struct: ServerConfig fills it).
struct HttpLimits {
    size_t  max_body_bytes       = size_t(64) << 20;  ///< larger bodies: 413, before reading them
    size_t  max_header_bytes     = size_t(16) << 10;  ///< request line + header fields; larger: 431
    double  read_timeout_s       = 60.0;   ///< a request begun must be read (header and body) within this; else 408 and close
    double  write_timeout_s      = 60.0;   ///< each write (a response, one SSE chunk) must drain within this; else close (and cancel)
    double  keep_alive_timeout_s = 5.0;    ///< an idle connection (new or between requests) is closed after this
    int32_t n_io_threads         = 2;
    int32_t n_data_threads       = 2;
    int32_t max_control_threads  = 32;
    int32_t max_query_threads    = 4;
};

/// Called once per request after its response went out (or failed to): the access log and the
/// engine's control-reply acknowledgement. `ms` runs from the request's first byte.
using SentHook = std::function<void(const Request & req, const Response & res, double ms)>;

class HttpServer {
public:
    HttpServer(HttpLimits limits, Router router, SentHook on_sent);
    ~HttpServer();

    /// Listen on host:port (SO_REUSEADDR, never SO_REUSEPORT: a taken port fails), backlog
    /// SOMAXCONN. Errors: fd::Error{invalid_argument} naming the address and the OS error.
    void bind(const std::string & host, int32_t port);
    /// Accept and serve until stop(): runs the I/O threads (the caller's is one of them).
    void run();
    /// Stop accepting, close every connection (in-flight async bodies are released as not
    /// delivered), join the I/O threads and the handler pools. Idempotent; any thread.
    void stop();

    // Used by the connections (http_session.cpp).
    const HttpLimits & limits() const { return limits_; }
    const Router &     router() const { return router_; }
    HandlerPool &      pool(Lane lane) { return lane == Lane::control ? control_pool_ : lane == Lane::query ? query_pool_ : data_pool_; }
    void               sent(const Request & req, const Response & res, double ms) { if (on_sent_) { on_sent_(req, res, ms); } }

private:
    void accept();

    boost::asio::io_context        ioc_;  ///< first: destroyed last (connections hold its sockets)
    boost::asio::ip::tcp::acceptor acceptor_;
    boost::asio::steady_timer      accept_backoff_;
    HttpLimits                     limits_;
    Router                         router_;
    SentHook                       on_sent_;
    HandlerPool                    control_pool_;
    HandlerPool                    query_pool_;
    HandlerPool                    data_pool_;
    std::mutex                     threads_mu_;
    std::vector<std::thread>       io_threads_;  ///< the I/O threads besides run()'s caller
    std::atomic<bool>              stopped_{false};
};

/// Serve one accepted connection until it closes (http_session.cpp). The socket's executor
/// must be a strand of the server's io_context.
void serve_connection(boost::asio::ip::tcp::socket socket, HttpServer & server);

/// Raise this process's soft RLIMIT_NOFILE to its hard limit (each connection is a descriptor);
/// returns the new soft limit.
uint64_t raise_fd_limit();

}  // namespace fd::api
