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

#include <cerrno>
#include <cstring>

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

TcpStoreServer::TcpStoreServer(const std::string & host, int port) {
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

void TcpStoreServer::serve() {
    std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
    while (!stop_.load()) {
        if (::poll(fds.data(), fds.size(), 100) <= 0) { continue; }
        for (size_t i = fds.size(); i-- > 0;) {
            if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) { continue; }
            if (i == 0) {
                const int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
                if (c >= 0) { fds.push_back({c, POLLIN, 0}); }
                continue;
            }
            const int c = fds[i].fd;
            char op = 0;
            std::string key, value;
            bool ok = read_full(c, &op, 1) && read_blob(c, key);
            if (ok && op == 'S') {
                ok = read_blob(c, value);
                if (ok) {
                    std::lock_guard lk(mu_);
                    data_[key].assign(value.begin(), value.end());
                    const char o = 'O';
                    ok = write_full(c, &o, 1);
                }
            } else if (ok && op == 'G') {
                std::vector<char> v;
                bool found = false;
                {
                    std::lock_guard lk(mu_);
                    auto it = data_.find(key);
                    if (it != data_.end()) { v = it->second; found = true; }
                }
                const char st = found ? 'F' : 'M';
                ok = write_full(c, &st, 1) && (!found || write_blob(c, v.data(), static_cast<uint32_t>(v.size())));
            } else {
                ok = false;
            }
            if (!ok) {  // closed by the client, or a malformed request: drop that connection only
                ::close(c);
                fds.erase(fds.begin() + static_cast<std::ptrdiff_t>(i));
            }
        }
    }
    for (size_t i = 1; i < fds.size(); ++i) { ::close(fds[i].fd); }
}

TcpStoreClient::TcpStoreClient(const std::string & host, int port, std::chrono::milliseconds timeout)
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
