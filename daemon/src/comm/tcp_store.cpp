// TcpStoreServer / TcpStoreClient: the rank group's rendezvous store (see tcp_store.h).
#include "fd/comm/tcp_store.h"

#include "fd/status.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>

namespace fd::comm {
namespace {

constexpr uint32_t kMaxValue = 1u << 20;

/// Receive (or send) exactly n bytes; false on EOF or error.
bool transfer_full(int fd, void * p, size_t n, bool send) {
    auto * b = static_cast<char *>(p);
    while (n > 0) {
        const ssize_t r = send ? ::send(fd, b, n, MSG_NOSIGNAL) : ::recv(fd, b, n, 0);
        if (r <= 0) {
            if (r < 0 && errno == EINTR) { continue; }
            return false;
        }
        b += r;
        n -= static_cast<size_t>(r);
    }
    return true;
}

bool read_full(int fd, void * p, size_t n) { return transfer_full(fd, p, n, false); }
bool write_full(int fd, const void * p, size_t n) { return transfer_full(fd, const_cast<void *>(p), n, true); }

bool read_blob(int fd, std::string & s) {
    uint32_t len = 0;
    if (!read_full(fd, &len, sizeof len) || len > kMaxValue) { return false; }
    s.resize(len);
    return read_full(fd, s.data(), len);
}

bool write_blob(int fd, const char * p, uint32_t len) { return write_full(fd, &len, sizeof len) && write_full(fd, p, len); }

/// A TCP socket bound (listen) or connected to host:port; -1 with errno on failure.
int open_socket(const std::string & host, int port, bool listen) {
    addrinfo hints{};
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * res    = nullptr;
    if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) {
        errno = EADDRNOTAVAIL;
        return -1;
    }
    int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
        int yes = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof yes);
        const bool ok = listen ? (::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes) == 0 &&
                                  ::bind(fd, res->ai_addr, res->ai_addrlen) == 0 && ::listen(fd, 64) == 0)
                               : ::connect(fd, res->ai_addr, res->ai_addrlen) == 0;
        if (!ok) {
            const int e = errno;
            ::close(fd);
            fd    = -1;
            errno = e;
        }
    }
    ::freeaddrinfo(res);
    return fd;
}

}  // namespace

std::string new_store_token() {
    std::random_device rd;
    std::string t;
    for (int i = 0; i < 4; ++i) { t += fmt::format("{:08x}", static_cast<uint32_t>(rd())); }
    return t;
}

TcpStoreServer::TcpStoreServer(const std::string & host, int port, std::string token) : token_(std::move(token)) {
    listen_fd_ = open_socket(host, port, /*listen=*/true);
    if (listen_fd_ < 0) {
        fail(Errc::invalid_argument, "cannot listen on {}:{} for the rank group's store: {} (--master-port in use?)", host, port,
             std::strerror(errno));
    }
    sockaddr_storage addr{};
    socklen_t        len = sizeof addr;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr *>(&addr), &len);
    port_   = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6 *>(&addr)->sin6_port
                                               : reinterpret_cast<sockaddr_in *>(&addr)->sin_port);
    thread_ = std::thread([this] { serve(); });
}

TcpStoreServer::~TcpStoreServer() {
    stop_.store(true);
    if (thread_.joinable()) { thread_.join(); }
    ::close(listen_fd_);
}

namespace {

constexpr auto   kAuthWindow = std::chrono::seconds(2);  ///< a connection must authenticate within this
constexpr size_t kMaxConns   = 1024;

/// One client's connection: the bytes of its requests as they arrive.
struct StoreConn {
    int                                   fd = -1;
    std::string                           in;
    bool                                  authed = false;
    std::chrono::steady_clock::time_point since;
};

/// The first whole request in `in`: its op, key (or token) and value, and the bytes it took;
/// 0 bytes while incomplete, -1 for a malformed one (an unknown op, a length over kMaxValue).
int64_t parse_request(const std::string & in, char & op, std::string & key, std::string & value) {
    auto blob = [&](size_t at, std::string & out) -> int64_t {  // bytes after `at`, 0 incomplete, -1 bad
        uint32_t n = 0;
        if (in.size() < at + sizeof n) { return 0; }
        std::memcpy(&n, in.data() + at, sizeof n);
        if (n > kMaxValue) { return -1; }
        if (in.size() < at + sizeof n + n) { return 0; }
        out.assign(in, at + sizeof n, n);
        return static_cast<int64_t>(sizeof n + n);
    };
    if (in.empty()) { return 0; }
    op = in[0];
    if (op != 'S' && op != 'G' && op != 'A') { return -1; }
    const int64_t k = blob(1, key);
    if (k <= 0 || op != 'S') { return k <= 0 ? k : 1 + k; }
    const int64_t v = blob(1 + static_cast<size_t>(k), value);
    return v <= 0 ? v : 1 + k + v;
}

bool same_token(const std::string & got, const std::string & want) {
    if (got.size() != want.size()) { return false; }  // its length is no secret (32 hex digits)
    unsigned char diff = 0;
    for (size_t i = 0; i < want.size(); ++i) { diff |= static_cast<unsigned char>(got[i] ^ want[i]); }
    return diff == 0;
}

}  // namespace

void TcpStoreServer::serve() {
    std::vector<pollfd>    fds{{listen_fd_, POLLIN, 0}};
    std::vector<StoreConn> conns(1);  // conns[i] belongs to fds[i]; [0] is the listener's
    auto drop = [&](size_t i) {
        ::close(fds[i].fd);
        fds.erase(fds.begin() + static_cast<std::ptrdiff_t>(i));
        conns.erase(conns.begin() + static_cast<std::ptrdiff_t>(i));
    };
    // Answer every whole request connection i holds; false when it must be dropped.
    auto answer = [&](StoreConn & c) {
        for (;;) {
            char        op = 0;
            std::string key, value;
            const int64_t used = parse_request(c.in, op, key, value);
            if (used == 0) { return true; }
            if (used < 0) { return false; }
            c.in.erase(0, static_cast<size_t>(used));
            if (op == 'A') {
                if (!token_.empty() && !same_token(key, token_)) { return false; }
                c.authed = true;
                const char o = 'O';
                if (!write_full(c.fd, &o, 1)) { return false; }
                continue;
            }
            if (!c.authed) { return false; }
            if (op == 'S') {
                {
                    std::lock_guard lk(mu_);
                    data_[key].assign(value.begin(), value.end());
                }
                const char o = 'O';
                if (!write_full(c.fd, &o, 1)) { return false; }
            } else {
                std::vector<char> v;
                bool found = false;
                {
                    std::lock_guard lk(mu_);
                    auto it = data_.find(key);
                    if (it != data_.end()) { v = it->second; found = true; }
                }
                const char st = found ? 'F' : 'M';
                if (!write_full(c.fd, &st, 1) || (found && !write_blob(c.fd, v.data(), static_cast<uint32_t>(v.size())))) { return false; }
            }
        }
    };
    std::vector<char> buf(64 << 10);
    while (!stop_.load()) {
        const auto now = std::chrono::steady_clock::now();
        for (size_t i = fds.size(); i-- > 1;) {
            if (!conns[i].authed && now - conns[i].since > kAuthWindow) { drop(i); }
        }
        if (::poll(fds.data(), fds.size(), 100) <= 0) { continue; }
        for (size_t i = fds.size(); i-- > 0;) {
            if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) { continue; }
            if (i == 0) {
                const int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
                if (c < 0) { continue; }
                if (fds.size() > kMaxConns) {
                    ::close(c);
                    continue;
                }
                timeval tv{1, 0};  // an answer to a client that does not read holds the store up 1 s at most
                ::setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
                fds.push_back({c, POLLIN, 0});
                conns.push_back({.fd = c, .in = {}, .authed = token_.empty(), .since = std::chrono::steady_clock::now()});
                continue;
            }
            StoreConn & c = conns[i];
            const ssize_t r = ::recv(c.fd, buf.data(), buf.size(), MSG_DONTWAIT);
            if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) { continue; }
            // closed by the client, a malformed or unauthenticated request, a request larger
            // than any valid one: drop that connection only
            if (r <= 0) {
                drop(i);
                continue;
            }
            c.in.append(buf.data(), static_cast<size_t>(r));
            if (!answer(c) || c.in.size() > 2 * size_t{kMaxValue} + 16) { drop(i); }
        }
    }
    for (size_t i = 1; i < fds.size(); ++i) { ::close(fds[i].fd); }
}

TcpStoreClient::TcpStoreClient(const std::string & host, int port, std::chrono::milliseconds timeout, const std::string & token)
    : where_(host + ":" + std::to_string(port)), timeout_(timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while ((fd_ = open_socket(host, port, /*listen=*/false)) < 0) {
        if (std::chrono::steady_clock::now() >= deadline) {
            fail(Errc::rank_failed, "no rank group store answered at {} within {} ms (is the master node's fdrollout running, "
                                    "with the same --master-addr/--master-port?): {}", where_, timeout.count(), std::strerror(errno));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    timeval tv{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (!token.empty()) {
        const char op = 'A';
        char ack = 0;
        if (!write_full(fd_, &op, 1) || !write_blob(fd_, token.data(), static_cast<uint32_t>(token.size())) || !read_full(fd_, &ack, 1) ||
            ack != 'O') {
            ::close(fd_);
            fd_ = -1;
            fail(Errc::rank_failed, "the rank group store at {} refused this rank's token (another daemon's store on that port?)", where_);
        }
    }
}

TcpStoreClient::~TcpStoreClient() {
    if (fd_ >= 0) { ::close(fd_); }
}

void TcpStoreClient::set(const std::string & key, const std::vector<char> & data) {
    FD_CHECK(data.size() <= kMaxValue, "store value for '{}' too large", key);
    std::lock_guard lk(mu_);
    const char op = 'S';
    char ack = 0;
    if (!write_full(fd_, &op, 1) || !write_blob(fd_, key.data(), static_cast<uint32_t>(key.size())) ||
        !write_blob(fd_, data.data(), static_cast<uint32_t>(data.size())) || !read_full(fd_, &ack, 1) || ack != 'O') {
        fail(Errc::rank_failed, "the rank group store at {} stopped answering (set '{}')", where_, key);
    }
}

bool TcpStoreClient::try_get(const std::string & key, std::vector<char> * out) {
    std::lock_guard lk(mu_);
    const char op = 'G';
    char st = 0;
    if (!write_full(fd_, &op, 1) || !write_blob(fd_, key.data(), static_cast<uint32_t>(key.size())) || !read_full(fd_, &st, 1)) {
        fail(Errc::rank_failed, "the rank group store at {} stopped answering (get '{}')", where_, key);
    }
    if (st == 'M') { return false; }
    std::string v;
    if (st != 'F' || !read_blob(fd_, v)) { fail(Errc::rank_failed, "the rank group store at {} sent a malformed answer", where_); }
    if (out) { out->assign(v.begin(), v.end()); }
    return true;
}

std::vector<char> TcpStoreClient::get(const std::string & key) {
    wait({key}, timeout_);
    std::vector<char> v;
    try_get(key, &v);
    return v;
}

void TcpStoreClient::wait(const std::vector<std::string> & keys, const std::chrono::milliseconds & timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        std::vector<std::string> missing;
        for (const auto & k : keys) {
            if (!try_get(k, nullptr)) { missing.push_back(k); }
        }
        if (missing.empty()) { return; }
        if (std::chrono::steady_clock::now() >= deadline) {
            std::string names;
            for (const auto & k : missing) { names += (names.empty() ? "" : ", ") + k; }
            fail(Errc::rank_failed, "rank group rendezvous at {}: still waiting for {} after {} ms", where_, names, timeout.count());
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

}  // namespace fd::comm
