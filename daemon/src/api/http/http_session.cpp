// One HTTP/1.1 connection, from accept to close, all on its strand:
//   wait for a request (keep-alive idle timeout) → read header (+ "100 Continue") and body
//   (read timeout, header/body limits) → dispatch to the route's lane → write the response, or
//   run its AsyncBody: pump on every engine wake-up, write what it yields (write timeout), and
//   watch the socket so a client that goes away releases its sequences at once → next request.
// Malformed input is answered 400 / 413 / 431 / 408 and the connection closed (after draining
// what the client still sends, so it reads the answer instead of a reset).
#include "http_server.h"

#include "fd/log.h"
#include "fd/status.h"

#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include <sys/socket.h>

#include <optional>
#include <string_view>

namespace fd::api {
namespace {

/// Bodies larger than this are read only once the route admitted their head (Route::admit).
constexpr uint64_t kAdmitBeforeBodyBytes = 64 << 10;

/// A Transfer-Encoding value naming no coding but "chunked" (any case, spaces around commas).
bool only_chunked(std::string_view te) {
    size_t start = 0;
    while (start <= te.size()) {
        const size_t end = std::min(te.find(',', start), te.size());
        std::string_view item = te.substr(start, end - start);
        while (!item.empty() && (item.front() == ' ' || item.front() == '\t')) { item.remove_prefix(1); }
        while (!item.empty() && (item.back() == ' ' || item.back() == '\t')) { item.remove_suffix(1); }
        if (!item.empty() && !boost::beast::iequals(boost::beast::string_view(item.data(), item.size()), "chunked")) { return false; }
        start = end + 1;
    }
    return true;
}

namespace beast = boost::beast;
namespace http  = beast::http;
namespace net   = boost::asio;
using tcp       = net::ip::tcp;
using error_code = boost::system::error_code;
using Clock     = std::chrono::steady_clock;

std::chrono::milliseconds ms(double seconds) { return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0)); }

class Session : public std::enable_shared_from_this<Session> {
public:
    Session(tcp::socket socket, HttpServer & server)
        : stream_(std::move(socket)), server_(server), timer_(stream_.get_executor()) {}

    ~Session() {
        if (async_ready()) { res_.async->release(false); }  // the server stopped mid-body
    }

    void start() {
        net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->await_request(); });
    }

private:
    const HttpLimits & limits() const { return server_.limits(); }

    // ---- reading ------------------------------------------------------------------------

    /// Idle (a new connection, or between keep-alive requests): wait for the first byte.
    void await_request() {
        if (buf_.size() > 0) { return read_header(); }  // pipelined: already here
        stream_.expires_after(ms(limits().keep_alive_timeout_s));
        stream_.async_read_some(buf_.prepare(4096), [self = shared_from_this()](error_code ec, size_t n) {
            if (ec) { return self->close_now(); }  // idle timeout, EOF, reset: nothing to answer
            self->buf_.commit(n);
            self->read_header();
        });
    }

    void read_header() {
        req_      = Request{};
        res_      = Response{};
        released_ = false;
        t0_       = Clock::now();
        parser_.emplace();
        parser_->header_limit(static_cast<uint32_t>(limits().max_header_bytes));
        parser_->body_limit(limits().max_body_bytes);
        read_deadline_ = Clock::now() + ms(limits().read_timeout_s);  // header and body together (a probe: each had its own)
        stream_.expires_at(read_deadline_);
        http::async_read_header(stream_, buf_, *parser_, [self = shared_from_this()](error_code ec, size_t) {
            if (ec) { return self->read_failed(ec); }
            self->on_header();
        });
    }

    void on_header() {
        const auto & h = parser_->get();
        if (h.find(http::field::transfer_encoding) != h.end() && parser_->chunked() && !only_chunked(std::string_view(h[http::field::transfer_encoding].data(), h[http::field::transfer_encoding].size()))) {
            // RFC 9112 6.1: a coding we do not implement (gzip, chunked) is a 501; its body was
            // used as if only chunked (a probe).
            keep_alive_ = false;
            version_    = 11;
            return answer_error(Error(Errc::invalid_argument, "Transfer-Encoding other than chunked alone is not implemented (send the "
                                                              "body uncompressed, chunked or with Content-Length)"), 501);
        }
        if (h.find(http::field::transfer_encoding) != h.end() && !parser_->chunked()) {
            // RFC 9112 6.1: a request whose last transfer coding is not chunked has no length we
            // can know: 400 and close. Read as an empty body, its bytes ran as a second request
            // (smuggling past a proxy that reads the coding otherwise; a probe).
            keep_alive_ = false;
            version_    = 11;
            return answer_error(Error(Errc::invalid_argument, "malformed HTTP request: Transfer-Encoding other than chunked "
                                                              "(send Content-Length, or chunked last)"), 400);
        }
        // A large (or chunked, or 100-continue) body is read only for a request its route admits
        // from the head (the API key); a small one is read with it and refused by the handler.
        const auto length = parser_->content_length();
        const bool large  = parser_->chunked() || (length && *length > kAdmitBeforeBodyBytes) ||
                           beast::iequals(h[http::field::expect], "100-continue");
        if (!parser_->is_done() && large && !admitted()) { return; }
        if (!parser_->is_done() && beast::iequals(h[http::field::expect], "100-continue")) {
            // curl waits a second for this before sending a large body.
            static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
            stream_.expires_after(ms(limits().write_timeout_s));
            net::async_write(stream_, net::buffer(kContinue), [self = shared_from_this()](error_code ec, size_t) {
                if (ec) { return self->close_now(); }
                self->read_body();
            });
            return;
        }
        read_body();
    }

    /// The route's head check (Route::admit) for a request whose body is still to come: true to
    /// read on; false after sending the route's refusal (the connection closes, lingering).
    bool admitted() {
        Request head;
        fill_request(head);
        bool known = false;
        const Route * r = server_.router().find(head.method, head.path, &known, nullptr);
        if (r == nullptr || !r->admit || r->admit(head, res_)) {
            res_ = Response{};
            return true;
        }
        req_        = std::move(head);
        keep_alive_ = false;  // the body stays unread
        write_whole();
        return false;
    }

    void read_body() {
        if (parser_->is_done()) { return on_request(); }
        stream_.expires_at(read_deadline_);  // what is left of the request's --http-read-timeout-s
        http::async_read(stream_, buf_, *parser_, [self = shared_from_this()](error_code ec, size_t) {
            if (ec) { return self->read_failed(ec); }
            self->on_request();
        });
    }

    void read_failed(error_code ec) {
        if (ec == http::error::end_of_stream || ec == http::error::partial_message || ec == net::error::connection_reset ||
            ec == net::error::broken_pipe || ec == net::error::operation_aborted || ec == net::error::eof) {
            return close_now();  // the client went away
        }
        keep_alive_ = false;
        version_    = 11;
        if (ec == beast::error::timeout) {
            // The socket is closed by the timeout already: nothing can be answered.
            log::get("api")->debug("request not read within {} s (--http-read-timeout-s); connection closed", limits().read_timeout_s);
            return close_now();
        }
        if (ec == http::error::body_limit) {
            return answer_error(Error(Errc::invalid_argument, fmt::format("request body larger than the limit of {} bytes", limits().max_body_bytes)), 413);
        }
        if (ec == http::error::header_limit) {
            return answer_error(Error(Errc::invalid_argument, fmt::format("request header larger than the limit of {} bytes", limits().max_header_bytes)), 431);
        }
        answer_error(Error(Errc::invalid_argument, fmt::format("malformed HTTP request: {}", ec.message())), 400);
    }

    /// The OpenAI error object with `status` as the response (the transport's own errors; the
    /// handlers write theirs through api/routes.cpp).
    void set_error(const Error & e, int status) {
        res_.status = status;
        res_.set_content(nlohmann::json{{"error", {{"message", e.what()}, {"type", errc_name(e.code())}, {"param", nullptr}, {"code", status}}}}
                             .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                         "application/json");
    }

    /// An error answered by the HTTP layer itself (the request could not be read or routed):
    /// the OpenAI error object with `status`.
    void answer_error(const Error & e, int status) {
        if (req_.method.empty() && parser_ && parser_->is_header_done()) {
            const bool keep = keep_alive_;
            fill_request();
            keep_alive_ = keep && keep_alive_;  // a request that could not be read closes the connection
        }
        if (req_.method.empty()) {  // its head never parsed (413 by its Content-Length, 431, malformed): still one access line
            req_.method = "-";
            req_.path   = "-";
        }
        set_error(e, status);
        write_whole();
    }

    void fill_request() { fill_request(req_); }

    /// `out` from the parsed head (method, target, path, query, headers); keep-alive and version too.
    void fill_request(Request & out) {
        auto & m     = parser_->get();
        out.method   = std::string(m.method_string());
        out.target   = std::string(m.target());
        const size_t q = out.target.find('?');
        out.path     = out.target.substr(0, q);
        if (q != std::string::npos) { out.params = parse_query(out.target.substr(q + 1)); }
        for (const auto & f : m) { out.headers.emplace(std::string(f.name_string()), std::string(f.value())); }
        keep_alive_ = m.keep_alive();
        version_    = m.version();
    }

    // ---- dispatch -----------------------------------------------------------------------

    void on_request() {
        fill_request();
        req_.body = std::move(parser_->get().body());
        parser_.reset();
        bool path_known = false;
        route_ = server_.router().find(req_.method, req_.path, &path_known, &req_.matches);
        if (!route_) {
            return path_known ? answer_error(Error(Errc::invalid_argument, "method " + req_.method + " not allowed on " + req_.path), 405)
                              : answer_error(Error(Errc::not_found, "no route " + req_.method + " " + req_.path), 404);
        }
        if (route_->lane == Lane::io) {
            route_->handler(req_, res_);
            return on_handled();
        }
        // req_/res_ belong to the handler until it posts back; nothing else runs on this
        // connection meanwhile (no read is pending).
        server_.pool(route_->lane).post([self = shared_from_this()] {
            self->route_->handler(self->req_, self->res_);
            net::post(self->stream_.get_executor(), [self] { self->on_handled(); });
        });
    }

    void on_handled() {
        if (!res_.async) { return write_whole(); }
        start_async();
    }

    // ---- whole responses ----------------------------------------------------------------

    void write_whole() {
        if (res_.get_header_value("Connection") == "close") { keep_alive_ = false; }
        auto out = std::make_shared<http::response<http::string_body>>(static_cast<http::status>(res_.status), version_);
        for (const auto & [k, v] : res_.headers) {
            if (!beast::iequals(k, "Connection")) { out->set(k, v); }
        }
        if (req_.method == "HEAD") {
            out->content_length(res_.body.size());
        } else {
            out->body() = std::move(res_.body);
            out->prepare_payload();
        }
        out->keep_alive(keep_alive_);
        stream_.expires_after(ms(limits().write_timeout_s));
        http::async_write(stream_, *out, [self = shared_from_this(), out](error_code ec, size_t) { self->response_sent(!ec); });
    }

    /// After the last byte of a response (or a failed write): log, then the next request.
    void response_sent(bool ok) {
        const double elapsed = std::chrono::duration<double, std::milli>(Clock::now() - t0_).count();
        if (!req_.method.empty()) { server_.sent(req_, res_, elapsed); }
        if (!ok) { return close_now(); }
        if (!keep_alive_) { return close_lingering(); }
        await_request();
    }

    // ---- async bodies (completions) -----------------------------------------------------

    void start_async() {
        AsyncBody & b = *res_.async;
        ++async_gen_;
        if (b.deadline != Clock::time_point::max()) {
            timer_.expires_at(b.deadline);
            timer_.async_wait([self = shared_from_this(), gen = async_gen_](error_code ec) {
                if (!ec && gen == self->async_gen_) { self->pump(); }
            });
        }
        std::weak_ptr<Session> weak = shared_from_this();
        b.subscribe([weak] {
            auto self = weak.lock();
            if (!self || self->wake_pending_.exchange(true)) { return; }  // a pump is already on its way
            net::post(self->stream_.get_executor(), [self] {
                self->wake_pending_.store(false);
                self->pump();
            });
        });
        watch_peer();
        if (!b.streamed) { return pump(); }
        // Streamed: the head now (chunked unless HTTP/1.0, which gets the body until close).
        chunked_ = version_ >= 11;
        if (!chunked_) { keep_alive_ = false; }
        http::response<http::empty_body> head(static_cast<http::status>(res_.status), version_);
        for (const auto & [k, v] : res_.headers) {
            if (!beast::iequals(k, "Connection")) { head.set(k, v); }
        }
        head.set(http::field::content_type, b.content_type);
        if (chunked_) { head.chunked(true); }
        head.keep_alive(keep_alive_);
        auto hdr = std::make_shared<std::string>();
        http::response_serializer<http::empty_body> sr(head);
        sr.split(true);
        error_code ec;
        while (!ec && !sr.is_header_done()) {
            sr.next(ec, [&](error_code &, const auto & buffers) {
                *hdr += beast::buffers_to_string(buffers);
                sr.consume(beast::buffer_bytes(buffers));
            });
        }
        write_bytes(hdr, false);
    }

    /// Ask the body for what is ready; write it. Runs after every wake, write and deadline.
    void pump() {
        if (!async_ready() || writing_) { return; }
        AsyncBody & b = *res_.async;
        std::string data;
        bool done = false;
        try {
            done = b.pump(res_, data);
        } catch (const std::exception & e) {  // a body's own bug: end it rather than hang the client
            log::get("api")->error("{} {}: {}", req_.method, req_.path, e.what());
            done = true;
            if (!b.streamed) { set_error(Error(Errc::internal, e.what()), errc_http_status(Errc::internal)); }
        }
        if (!b.streamed) {
            if (done) {
                release(true);
                write_whole();
            }
            return;
        }
        if (data.empty() && !done) { return; }
        auto bytes = std::make_shared<std::string>();
        if (chunked_ && !data.empty()) { *bytes = fmt::format("{:x}\r\n", data.size()) + data + "\r\n"; }
        if (!chunked_) { *bytes = std::move(data); }
        if (done && chunked_) { *bytes += "0\r\n\r\n"; }
        write_bytes(bytes, done);
    }

    /// One write of a streamed body; `last` ends it.
    void write_bytes(std::shared_ptr<std::string> bytes, bool last) {
        writing_ = true;
        stream_.expires_after(ms(limits().write_timeout_s));
        net::async_write(stream_, net::buffer(*bytes), [self = shared_from_this(), bytes, last](error_code ec, size_t) {
            self->writing_ = false;
            if (ec || (!last && !self->async_ready())) {
                self->release(false);  // the client is gone or stopped reading: free its sequences
                return self->response_sent(false);
            }
            if (!last) { return self->pump(); }
            self->release(true);
            self->response_sent(true);
        });
    }

    bool async_ready() const { return res_.async && !released_; }

    void release(bool delivered) {
        if (!async_ready()) { return; }
        released_ = true;
        ++async_gen_;  // stale timer and watch callbacks see a newer generation
        timer_.cancel();
        error_code ignored;
        stream_.socket().cancel(ignored);  // the peer watch; no read or write is pending here
        res_.async->release(delivered);
    }

    /// While the engine works, learn at once when the client closes: readable with nothing to
    /// read is EOF. Bytes (a pipelined request) are kept in buf_ for the next read (up to
    /// kPipelinedBytes; past that the watch ends) and the watch goes on, so a client that
    /// pipelines and then closes still cancels its request (a probe: it ran to its end).
    void watch_peer() {
        stream_.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this(), gen = async_gen_](error_code ec) {
            if (gen != self->async_gen_ || !self->async_ready() || ec == net::error::operation_aborted) { return; }
            char c = 0;
            const int fd = self->stream_.socket().native_handle();
            ssize_t n = ec ? -1 : ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
            if (n > 0) {
                constexpr size_t kPipelinedBytes = 64 << 10;
                if (self->buf_.size() >= kPipelinedBytes) { return; }
                const auto room = self->buf_.prepare(kPipelinedBytes - self->buf_.size());
                n = ::recv(fd, room.data(), room.size(), MSG_DONTWAIT);
                if (n > 0) {
                    self->buf_.commit(static_cast<size_t>(n));
                    return self->watch_peer();
                }
            }
            if (n < 0 && !ec && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) { return self->watch_peer(); }
            // Gone: free its sequences now. A pending write ends the response when it completes.
            const bool headers_sent = self->res_.async->streamed;
            self->release(false);
            if (!self->writing_) {
                if (!headers_sent) { self->res_.status = 499; }  // the access log's "client closed request" (as nginx)
                self->response_sent(false);
            }
        });
    }

    // ---- closing ------------------------------------------------------------------------

    void close_now() {
        if (async_ready()) { release(false); }
        timer_.cancel();
        error_code ignored;
        stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
        stream_.close();
    }

    /// After a `Connection: close` response: send FIN, then drain what the client still sends
    /// (at most a few seconds) so our answer is not lost to a reset.
    void close_lingering() {
        error_code ignored;
        stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
        buf_.clear();
        stream_.expires_after(std::chrono::seconds(5));
        drain();
    }

    void drain() {
        stream_.async_read_some(buf_.prepare(65536), [self = shared_from_this()](error_code ec, size_t n) {
            if (ec) { return self->close_now(); }
            self->buf_.consume(n);
            self->drain();
        });
    }

    beast::tcp_stream                                 stream_;
    HttpServer &                                      server_;
    net::steady_timer                                 timer_;  ///< the async body's deadline
    beast::flat_buffer                                buf_;
    Clock::time_point                                 read_deadline_{};  ///< the request's header + body deadline
    std::optional<http::request_parser<http::string_body>> parser_;
    Request                                           req_;
    Response                                          res_;
    const Route *                                     route_ = nullptr;
    Clock::time_point                                 t0_{};
    bool                                              keep_alive_ = true;
    unsigned                                          version_    = 11;
    bool                                              released_   = false;  ///< res_.async was released
    bool                                              writing_    = false;
    bool                                              chunked_    = true;
    uint64_t                                          async_gen_  = 0;
    std::atomic<bool>                                 wake_pending_{false};
};

}  // namespace

void serve_connection(tcp::socket socket, HttpServer & server) {
    std::make_shared<Session>(std::move(socket), server)->start();
}

}  // namespace fd::api
