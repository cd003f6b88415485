// The listening side of the HTTP layer: route lookup, bind/accept, the I/O threads, shutdown.
// One connection's life (read, dispatch, write, stream) is http_session.cpp.
#include "http_server.h"

#include "fd/log.h"
#include "fd/status.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/strand.hpp>

#include <sys/resource.h>

namespace fd::api {

namespace net = boost::asio;
using tcp     = net::ip::tcp;

void Router::add(const std::string & method, const std::string & path, Handler h, Lane lane, Admit admit) {
    Route r{method, path, std::move(h), lane, std::move(admit)};
    if (path.find('(') == std::string::npos) {
        by_path_[path][method] = std::move(r);
        return;
    }
    for (auto & p : patterns_) {
        if (p.source == path) {
            p.by_method[method] = std::move(r);
            return;
        }
    }
    patterns_.push_back(Pattern{path, std::regex(path), {}});
    patterns_.back().by_method[method] = std::move(r);
}

const Route * Router::find(const std::string & method, const std::string & path, bool * path_known, std::smatch * matches) const {
    const std::string & m = method == "HEAD" ? std::string("GET") : method;
    const std::map<std::string, Route> * by_method = nullptr;
    if (auto p = by_path_.find(path); p != by_path_.end()) {
        by_method = &p->second;
    } else {
        std::smatch sm;
        for (const auto & p : patterns_) {
            if (std::regex_match(path, sm, p.re)) {
                by_method = &p.by_method;
                if (matches) { *matches = sm; }
                break;
            }
        }
    }
    if (path_known) { *path_known = by_method != nullptr; }
    if (!by_method) { return nullptr; }
    auto r = by_method->find(m);
    return r == by_method->end() ? nullptr : &r->second;
}

HttpServer::HttpServer(HttpLimits limits, Router router, SentHook on_sent)
    : acceptor_(ioc_), accept_backoff_(ioc_), limits_(limits), router_(std::move(router)), on_sent_(std::move(on_sent)),
      control_pool_("fd-http-ctl", 1, limits.max_control_threads),
      query_pool_("fd-http-query", 1, limits.max_query_threads),
      data_pool_("fd-http-data", limits.n_data_threads, limits.n_data_threads) {}

HttpServer::~HttpServer() { stop(); }

void HttpServer::bind(const std::string & host, int32_t port) {
    boost::system::error_code ec;
    tcp::resolver resolver(ioc_);
    const auto results = resolver.resolve(host, std::to_string(port), tcp::resolver::passive | tcp::resolver::numeric_service, ec);
    if (ec || results.empty()) {
        fail(Errc::invalid_argument, "cannot listen on {}:{}: {} (--host must be an address or a resolvable name)", host, port,
             ec ? ec.message() : std::string("no address"));
    }
    const tcp::endpoint ep = results.begin()->endpoint();
    auto check = [&](const char * what) {
        if (ec) {
            fail(Errc::invalid_argument, "cannot listen on {}:{}: {} failed: {} (another fdrollout on that port? choose one with --port)",
                 host, port, what, ec.message());
        }
    };
    acceptor_.open(ep.protocol(), ec);
    check("socket");
    // SO_REUSEADDR only (restart while old connections sit in TIME_WAIT). No SO_REUSEPORT: a
    // second daemon on a taken port must fail, not share it and answer with other weights.
    acceptor_.set_option(net::socket_base::reuse_address(true), ec);
    check("setsockopt");
    acceptor_.bind(ep, ec);
    check("bind");
    acceptor_.listen(net::socket_base::max_listen_connections, ec);
    check("listen");
    // An IPv6 address is bracketed in a URL (http://[::1]:8000), as a client needs it.
    log::get("api")->info("listening on http://{}:{}", host.find(':') != std::string::npos ? "[" + host + "]" : host, port);
}

void HttpServer::accept() {
    acceptor_.async_accept(net::make_strand(ioc_), [this](boost::system::error_code ec, tcp::socket socket) {
        if (ec == net::error::operation_aborted || stopped_.load()) { return; }
        if (ec) {
            // Out of descriptors (EMFILE/ENFILE) or memory: wait a little rather than spin; the
            // pending connection stays in the backlog until then.
            static std::atomic<int64_t> n_logged{0};
            if (n_logged.fetch_add(1) % 1000 == 0) {
                log::get("api")->warn("accept failed: {} (raise the open-files limit, `ulimit -n`, for more connections)", ec.message());
            }
            accept_backoff_.expires_after(std::chrono::milliseconds(50));
            accept_backoff_.async_wait([this](boost::system::error_code) { if (!stopped_.load()) { accept(); } });
            return;
        }
        boost::system::error_code ignored;
        socket.set_option(tcp::no_delay(true), ignored);  // no Nagle + delayed-ACK stalls (~40 ms) on keep-alive calls
        serve_connection(std::move(socket), *this);
        accept();
    });
}

void HttpServer::run() {
    {
        std::lock_guard lk(threads_mu_);
        if (stopped_.load()) { return; }
        accept();
        const int32_t n = std::max(1, limits_.n_io_threads);
        for (int32_t i = 1; i < n; ++i) {
            io_threads_.emplace_back([this] { ioc_.run(); });
            pthread_setname_np(io_threads_.back().native_handle(), "fd-http-io");
        }
    }
    ioc_.run();
}

void HttpServer::stop() {
    if (stopped_.exchange(true)) { return; }
    net::post(ioc_, [this] {
        boost::system::error_code ignored;
        acceptor_.close(ignored);
        accept_backoff_.cancel();
    });
    ioc_.stop();
    std::vector<std::thread> threads;
    {
        std::lock_guard lk(threads_mu_);
        threads.swap(io_threads_);
    }
    for (auto & t : threads) { t.join(); }
    control_pool_.stop();
    query_pool_.stop();
    data_pool_.stop();
}

uint64_t raise_fd_limit() {
    rlimit rl{};
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) { return 0; }
    if (rl.rlim_cur < rl.rlim_max) {
        rlimit want = rl;
        want.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &want) == 0) { rl = want; }
    }
    return static_cast<uint64_t>(rl.rlim_cur);
}

}  // namespace fd::api
