// The CPU weight-stream transport: one TCP connection from the trainer, frames read with a
// deadline (poll + non-blocking recv, never a blocking read). docs/weight_streams.md, "Wire".
#include "stream_io.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace fd::stream {

namespace {

int ms_left(Clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return static_cast<int>(std::clamp<int64_t>(left, 0, 1000));  // wake at least every second
}

/// The one frame the daemon writes: {"accepted": true} after a valid hello. The trainer need not
/// read it; unread, it makes the trainer's kernel answer the trainer's death with a reset (Linux
/// resets a connection closed with unread data), which the watchdog sees at once even when the
/// dead trainer's unsent bytes wait behind our full receive window (a plain FIN would queue behind
/// them and never arrive while no bucket reads). Best effort: a failed write changes nothing.
void send_accepted(int fd) {
    static const std::string body = R"({"accepted": true})";
    std::string f(kFrameMagic, 4);
    const auto n = static_cast<uint32_t>(body.size());
    for (int i = 0; i < 4; ++i) { f += static_cast<char>((n >> (8 * i)) & 0xff); }
    f += body;
    (void)::send(fd, f.data(), f.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

bool same_token(const std::string & a, const std::string & b) {
    if (a.size() != b.size()) { return false; }
    unsigned diff = 0;
    for (size_t i = 0; i < a.size(); ++i) { diff |= static_cast<unsigned>(static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i])); }
    return diff == 0;
}

}  // namespace

std::string random_token() {
    unsigned char raw[16];
    const UniqueFd f = open_read("/dev/urandom", Errc::internal);
    size_t got = 0;
    while (got < sizeof raw) {
        const ssize_t n = ::read(f.get(), raw + got, sizeof raw - got);
        if (n <= 0 && errno != EINTR) { fail(Errc::internal, "cannot read /dev/urandom: {}", std::strerror(errno)); }
        if (n > 0) { got += static_cast<size_t>(n); }
    }
    static const char * hex = "0123456789abcdef";
    std::string out;
    for (unsigned char c : raw) {
        out += hex[c >> 4];
        out += hex[c & 15];
    }
    return out;
}

UniqueFd tcp_listen(const std::string & host, int32_t * port_out) {
    addrinfo hints{};
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags    = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo * res    = nullptr;
    if (const int rc = ::getaddrinfo(host.c_str(), "0", &hints, &res); rc != 0) {
        fail(Errc::invalid_argument, "weight stream: cannot resolve host '{}': {}", host, ::gai_strerror(rc));
    }
    std::string why = "no address";
    for (addrinfo * a = res; a; a = a->ai_next) {
        UniqueFd s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
        if (!s.valid()) { why = std::strerror(errno); continue; }
        if (::bind(s.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(s.get(), 4) != 0) { why = std::strerror(errno); continue; }
        sockaddr_storage ss{};
        socklen_t len = sizeof ss;
        ::getsockname(s.get(), reinterpret_cast<sockaddr *>(&ss), &len);
        *port_out = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6 *>(&ss)->sin6_port)
                                             : ntohs(reinterpret_cast<sockaddr_in *>(&ss)->sin_port);
        ::freeaddrinfo(res);
        return s;
    }
    ::freeaddrinfo(res);
    fail(Errc::invalid_argument, "weight stream: cannot listen on '{}': {}", host, why);
}

void read_exact(int fd, void * dst, size_t n, Clock::time_point deadline, const std::string & what, bool * ended) {
    auto * p = static_cast<char *>(dst);
    const size_t total = n;
    if (ended) { *ended = false; }
    while (n > 0) {
        const ssize_t got = ::recv(fd, p, n, MSG_DONTWAIT);
        if (got > 0) {
            p += got;
            n -= static_cast<size_t>(got);
            continue;
        }
        if (got == 0 && ended && n == total) {
            *ended = true;
            return;
        }
        if (got == 0) { fail(Errc::source_unavailable, "the trainer closed the weight-stream connection while {} was due", what); }
        if (errno == EINTR) { continue; }
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            fail(Errc::source_unavailable, "the weight-stream connection failed while {} was due: {}", what, std::strerror(errno));
        }
        if (Clock::now() >= deadline) { fail(Errc::timeout, "{} did not arrive on the weight-stream connection before the deadline", what); }
        pollfd pfd{fd, POLLIN, 0};
        ::poll(&pfd, 1, ms_left(deadline));
    }
}

nlohmann::json read_frame_header(int fd, Clock::time_point deadline, const std::string & what) {
    unsigned char pre[8];
    read_exact(fd, pre, sizeof pre, deadline, what);
    if (std::memcmp(pre, kFrameMagic, 4) != 0) {
        fail(Errc::invalid_argument, "weight stream: {}: the frame does not start with \"FDW1\" (the bytes are out of step with the "
                                     "announced tensors)", what);
    }
    const uint32_t len = uint32_t(pre[4]) | uint32_t(pre[5]) << 8 | uint32_t(pre[6]) << 16 | uint32_t(pre[7]) << 24;
    if (len == 0 || len > kMaxFrameHeaderBytes) {
        fail(Errc::invalid_argument, "weight stream: {}: frame header of {} bytes (1..{} allowed)", what, len, kMaxFrameHeaderBytes);
    }
    std::string text(len, '\0');
    read_exact(fd, text.data(), len, deadline, what);
    auto j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_object()) { fail(Errc::invalid_argument, "weight stream: {}: the frame header is not a JSON object", what); }
    return j;
}

UniqueFd tcp_accept_trainer(int listener, const std::string & token, Clock::time_point deadline) {
    for (;;) {
        if (Clock::now() >= deadline) {
            fail(Errc::timeout, "no trainer connected to the weight-stream port with the right token before the deadline; "
                                "POST /init_weight_transfer_engine again and connect to the port it answers");
        }
        pollfd pfd{listener, POLLIN, 0};
        if (::poll(&pfd, 1, ms_left(deadline)) <= 0) { continue; }
        UniqueFd c(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
        if (!c.valid()) {
            if (errno == EINVAL || errno == EBADF) { fail(Errc::source_unavailable, "the weight-stream transport was closed"); }
            continue;
        }
        try {
            // A connection gets a few seconds (within the deadline) to say who it is.
            const auto hello_by = std::min(deadline, Clock::now() + std::chrono::seconds(5));
            const auto j        = read_frame_header(c.get(), hello_by, "the hello frame");
            if (j.contains("token") && j["token"].is_string() && same_token(j["token"].get<std::string>(), token)) {
                send_accepted(c.get());
                return c;
            }
        } catch (const Error &) {
        }
        // Wrong token or garbage: not the trainer; keep waiting for it.
    }
}

namespace {

class TcpReceiver final : public Receiver {
public:
    explicit TcpReceiver(UniqueFd conn) : conn_(std::move(conn)) {}
    ~TcpReceiver() override { interrupt(); }
    const char * name() const override { return "tcp"; }
    bool peer_closed() override { return peer_hung_up(conn_.get()); }  // fd/file_io.h
    void interrupt() override { ::shutdown(conn_.get(), SHUT_RDWR); }

    void receive(const std::vector<TensorSpec> & specs, bool packed, const Sink & sink, Clock::time_point deadline) override {
        const int fd = conn_.get();
        if (packed) {
            int64_t total = 0;
            for (const auto & s : specs) { total += s.nbytes; }
            const auto h = read_frame_header(fd, deadline, "the packed bucket's frame");
            if (!h.value("packed", false) || h.value("nbytes", int64_t(-1)) != total) {
                fail(Errc::invalid_argument, "the packed bucket's frame says {}; expected {{\"packed\": true, \"nbytes\": {}}}", h.dump(), total);
            }
        }
        for (size_t i = 0; i < specs.size(); ++i) {
            const TensorSpec & s = specs[i];
            const std::string what = fmt::format("tensor '{}'", s.name);
            if (!packed) {
                const auto h = read_frame_header(fd, deadline, what);
                const bool same = h.value("name", "") == s.name && h.contains("dtype") && h["dtype"].is_string() &&
                                  parse_dtype_name(h["dtype"].get<std::string>(), what) == s.dtype && h.contains("shape") &&
                                  h["shape"] == nlohmann::json(s.shape) && h.value("nbytes", int64_t(-1)) == s.nbytes &&
                                  h.value("n_indices", int64_t(-1)) == s.n_indices;
                if (!same) {
                    fail(Errc::invalid_argument, "the frame {} arrived where {} {} {} ({} bytes) was announced; frames must follow the "
                                                 "announced names, dtypes and shapes in order", h.dump(), what,
                         model::dtype_name(s.dtype), nlohmann::json(s.shape).dump(), s.nbytes);
                }
            }
            for (int64_t off = 0; off < s.nbytes;) {
                const size_t n = static_cast<size_t>(std::min<int64_t>(s.nbytes - off, static_cast<int64_t>(kPieceBytes)));
                read_exact(fd, piece_.get(), n, deadline, what);
                sink(i, off, piece_.get(), n);
                off += static_cast<int64_t>(n);
            }
        }
    }

private:
    UniqueFd                     conn_;
    std::unique_ptr<std::byte[]> piece_ = std::make_unique<std::byte[]>(kPieceBytes);  ///< kept: its pages stay in L2
};

}  // namespace

std::unique_ptr<Receiver> make_tcp_receiver(UniqueFd conn) { return std::make_unique<TcpReceiver>(std::move(conn)); }

}  // namespace fd::stream
