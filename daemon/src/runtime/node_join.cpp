// Joining node 0 from another host: the shared token, the authenticated handshake, node 0's
// JoinListener and node k's join_master (fd/runtime/node_join.h).
#include "fd/runtime/node_join.h"
#include "fd/runtime/world.h"

#include "fd/file_io.h"
#include "fd/log.h"
#include "fd/status.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

namespace fd::runtime {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[8] = "FDJOIN1";

struct JoinHello {
    char     magic[8] = {};
    int32_t  nnodes = 0, node_rank = 0, tp = 0, rank = 0;
    uint64_t fingerprint = 0;
    char     model_dir[1024] = {};
    char     bind_addr[64]   = {};
    uint8_t  client_nonce[32] = {};
};
struct JoinChallenge {
    uint8_t server_nonce[32] = {};
    uint8_t server_mac[32]   = {};
};
struct JoinProof {
    uint8_t client_mac[32] = {};
};
struct JoinVerdict {
    int32_t status = 0;  ///< 0 accepted, else an Errc
    char    text[512] = {};
};

/// HMAC-SHA256(token, label | a | b).
void mac(const std::string & token, const char * label, const void * a, size_t na, const void * b, size_t nb, uint8_t out[32]) {
    std::string msg(label);
    msg.append(static_cast<const char *>(a), na);
    msg.append(static_cast<const char *>(b), nb);
    unsigned int len = 32;
    HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), reinterpret_cast<const unsigned char *>(msg.data()), msg.size(), out, &len);
}

void random_nonce(uint8_t out[32]) {
    if (RAND_bytes(out, 32) != 1) { fail(Errc::internal, "no random bytes for the join nonce"); }
}

std::string addr_string(const sockaddr_in & a) {
    char buf[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &a.sin_addr, buf, sizeof buf);
    return fmt::format("{}:{}", buf, ntohs(a.sin_port));
}

/// TCP_NODELAY (one record per step), keepalive (a vanished host is noticed) and a send timeout.
void tune_link_socket(int fd, double send_timeout_s) {
    int yes = 1, idle = 10, intvl = 5, cnt = 3;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof yes);
    ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &yes, sizeof yes);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    timeval tv{};
    tv.tv_sec  = static_cast<time_t>(send_timeout_s);
    tv.tv_usec = static_cast<suseconds_t>((send_timeout_s - static_cast<double>(tv.tv_sec)) * 1e6);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

sockaddr_in ipv4(const std::string & host, int port, const char * what) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port   = htons(static_cast<uint16_t>(port));
    if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) { fail(Errc::invalid_argument, "{} '{}' must be an IPv4 address", what, host); }
    return a;
}

template <typename T>
bool read_record(LinkSocket & s, T & rec, Clock::time_point deadline) {
    return s.recv_exact(&rec, sizeof rec, deadline) == LinkSocket::Recv::ok;
}

}  // namespace

std::string load_dist_token(const std::string & token_file) {
    std::string token;
    if (!token_file.empty()) {
        struct stat st{};
        if (::stat(token_file.c_str(), &st) != 0) {
            fail(Errc::invalid_argument, "--dist-token-file {}: {}", token_file, std::strerror(errno));
        }
        if (!S_ISREG(st.st_mode)) { fail(Errc::forbidden, "--dist-token-file {} is not a regular file", token_file); }
        if (st.st_uid != ::geteuid()) {
            fail(Errc::forbidden, "--dist-token-file {} is owned by uid {}, not by this user (uid {}): another user could know the token",
                 token_file, st.st_uid, ::geteuid());
        }
        if ((st.st_mode & 077) != 0) {
            fail(Errc::forbidden, "--dist-token-file {} has mode {:o}: group or others can read it; chmod 600 it", token_file, st.st_mode & 0777);
        }
        std::ifstream f(token_file, std::ios::binary);
        std::stringstream ss;
        ss << f.rdbuf();
        if (!f) { fail(Errc::invalid_argument, "--dist-token-file {}: cannot read it", token_file); }
        token = ss.str();
    } else if (const char * env = std::getenv("FD_DIST_TOKEN")) {
        token = env;
    } else {
        fail(Errc::invalid_argument, "--nnodes > 1 needs the nodes' shared secret: --dist-token-file FILE (owned by you, mode 0600, the "
             "same bytes on every node; e.g. `openssl rand -hex 32 > FILE`) or FD_DIST_TOKEN");
    }
    while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) { token.pop_back(); }
    while (!token.empty() && std::isspace(static_cast<unsigned char>(token.front()))) { token.erase(token.begin()); }
    if (token.size() < 16) { fail(Errc::invalid_argument, "the join token is {} bytes; use at least 16 (e.g. `openssl rand -hex 32`)", token.size()); }
    return token;
}

uint64_t model_fingerprint(const std::filesystem::path & model_dir) {
    std::ifstream f(model_dir / "config.json", std::ios::binary);
    if (!f) { fail(Errc::invalid_checkpoint, "{}: cannot read config.json", model_dir.string()); }
    uint64_t h = 1469598103934665603ull;
    char c;
    while (f.get(c)) {
        h ^= static_cast<uint8_t>(c);
        h *= 1099511628211ull;
    }
    return h;
}

// --- node 0 ---

JoinListener::JoinListener(const std::string & host, int port, JoinExpect expect) : expect_(std::move(expect)) {
    const sockaddr_in a = ipv4(host, port, "--master-addr");
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int yes = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<const sockaddr *>(&a), sizeof a) != 0 || ::listen(listen_fd_, 64) != 0) {
        const int e = errno;
        if (listen_fd_ >= 0) { ::close(listen_fd_); }
        fail(Errc::invalid_argument, "cannot listen for joining nodes on --master-addr {} --master-port {}: {}", host, port, std::strerror(e));
    }
    sockaddr_in got{};
    socklen_t len = sizeof got;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr *>(&got), &len);
    port_   = ntohs(got.sin_port);
    thread_ = std::thread([this] { serve(); });
}

JoinListener::~JoinListener() {
    stop_ = true;
    if (thread_.joinable()) { thread_.join(); }
    if (listen_fd_ >= 0) { ::close(listen_fd_); }
    for (const auto & [rank, fd] : serving_) { ::close(fd); }
}

void JoinListener::mark_serving(int32_t rank, int fd) {
    const int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    std::lock_guard lk(mu_);
    if (auto it = serving_.find(rank); it != serving_.end()) { ::close(it->second); }
    if (dup >= 0) { serving_[rank] = dup; }
}

void JoinListener::mark_gone(int32_t rank) {
    std::lock_guard lk(mu_);
    if (auto it = serving_.find(rank); it != serving_.end()) {
        ::close(it->second);
        serving_.erase(it);
    }
}

void JoinListener::serve() {
    while (!stop_) {
        pollfd p{listen_fd_, POLLIN, 0};
        if (::poll(&p, 1, 100) <= 0) { continue; }
        sockaddr_in peer{};
        socklen_t len = sizeof peer;
        const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr *>(&peer), &len, SOCK_CLOEXEC);
        if (fd < 0) { continue; }
        // One at a time, bounded: a join is a few small records.
        handshake(fd, addr_string(peer));
    }
}

void JoinListener::handshake(int fd, const std::string & peer) {
    auto lg = log::get("engine");
    tune_link_socket(fd, expect_.handshake_timeout_s);
    LinkSocket s(fd);
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(expect_.handshake_timeout_s));
    JoinHello hello;
    if (!read_record(s, hello, deadline) || std::memcmp(hello.magic, kMagic, sizeof kMagic) != 0) {
        lg->warn("join from {}: not an fdrollout node (no handshake); closed", peer);
        return;
    }
    hello.model_dir[sizeof hello.model_dir - 1] = '\0';
    hello.bind_addr[sizeof hello.bind_addr - 1] = '\0';
    JoinChallenge ch;
    random_nonce(ch.server_nonce);
    mac(expect_.token, "fd-join-server", hello.client_nonce, 32, ch.server_nonce, 32, ch.server_mac);
    JoinProof proof;
    if (!s.send_bytes(&ch, sizeof ch) || !read_record(s, proof, deadline)) {
        lg->warn("join from {}: the node left during the handshake", peer);
        return;
    }
    uint8_t want[32];
    mac(expect_.token, "fd-join-client", ch.server_nonce, 32, &hello, sizeof hello, want);
    JoinVerdict v;
    auto refuse = [&](Errc code, const std::string & why) {
        v.status = static_cast<int32_t>(code);
        set_field(v.text, why);
    };
    std::vector<std::string> bad_world;  // node 0's own settings were checked at start-up
    const World world = World::make(expect_.tp, expect_.nnodes, 1, bad_world);
    if (CRYPTO_memcmp(want, proof.client_mac, 32) != 0) {
        refuse(Errc::forbidden, "authentication failed: the node's join token differs from node 0's (--dist-token-file / FD_DIST_TOKEN)");
    } else if (hello.nnodes != expect_.nnodes || hello.tp != expect_.tp) {
        refuse(Errc::invalid_argument, fmt::format("node 0 runs --nnodes {} --tensor-parallel-size {}; this node has --nnodes {} "
                                                   "--tensor-parallel-size {}", expect_.nnodes, expect_.tp, hello.nnodes, hello.tp));
    } else if (hello.fingerprint != expect_.fingerprint) {
        refuse(Errc::invalid_argument, fmt::format("this node's model config.json ({}, fingerprint {:016x}) differs from node 0's "
                                                   "(fingerprint {:016x}): every node must serve the same model", hello.model_dir,
                                                   hello.fingerprint, expect_.fingerprint));
    } else if (hello.node_rank < 1 || hello.node_rank >= world.nnodes || hello.rank < world.first_rank(hello.node_rank) ||
               hello.rank >= world.first_rank(hello.node_rank + 1)) {
        refuse(Errc::invalid_argument, fmt::format("--node-rank {} rank {} is outside node ranks [1, {}) with {} rank(s) each",
                                                   hello.node_rank, hello.rank, expect_.nnodes, world.per_node()));
    }
    if (v.status == 0) {
        // A second copy of node k (started by mistake) must not take over, nor wait parked: the
        // rank is live while its link's peer is connected (a rejoining node closed its old links).
        std::lock_guard lk(mu_);
        auto connected = [](int fd) { return !peer_hung_up(fd); };
        std::string from;
        if (auto it = serving_.find(hello.rank); it != serving_.end()) {
            if (connected(it->second)) {
                from = "serving";
            } else {
                ::close(it->second);
                serving_.erase(it);
            }
        }
        if (from.empty()) {
            if (auto it = parked_.find(hello.rank); it != parked_.end() && connected(it->second.link.fd())) {
                from = fmt::format("joined from {}, waiting to be taken", it->second.peer);
            }
        }
        if (!from.empty()) {
            refuse(Errc::wrong_state, fmt::format("rank {} of node {} is already running ({}): is a second `fdrollout --node-rank {}` "
                                                  "running for the same node? Stop this one; node {} rejoins by itself when its ranks exit",
                                                  hello.rank, hello.node_rank, from, hello.node_rank, hello.node_rank));
        }
    }
    if (!s.send_bytes(&v, sizeof v)) { return; }
    if (v.status != 0) {
        lg->warn("refused a join from {} (node {} rank {}): {}", peer, hello.node_rank, hello.rank, v.text);
        return;
    }
    lg->info("node {} rank {} joined from {} (its ranks bind {})", hello.node_rank, hello.rank, peer, hello.bind_addr);
    tune_link_socket(fd, expect_.send_timeout_s);
    std::lock_guard lk(mu_);
    parked_[hello.rank] = JoinedLink{.link = std::move(s), .node_rank = hello.node_rank, .model_dir = hello.model_dir,
                                     .bind_addr = hello.bind_addr, .peer = peer};
    cv_.notify_all();
}

std::optional<JoinedLink> JoinListener::take(int32_t rank, Clock::time_point deadline) {
    std::unique_lock lk(mu_);
    for (;;) {
        auto it = parked_.find(rank);
        if (it != parked_.end()) {
            JoinedLink j = std::move(it->second);
            parked_.erase(it);
            if (!j.link.peer_closed()) { return j; }  // a rank sends nothing before its configuration
            continue;
        }
        if (cv_.wait_until(lk, deadline) == std::cv_status::timeout && !parked_.count(rank)) { return std::nullopt; }
    }
}

// --- node k ---

JoinedLink join_master(const JoinRequest & req, Clock::time_point deadline) {
    const sockaddr_in master = ipv4(req.master_addr, req.master_port, "--master-addr");
    std::string last_error = "no answer";
    for (;;) {
        if (Clock::now() >= deadline) {
            fail(Errc::rank_failed, "node {}: node 0 at {}:{} did not accept the join before the timeout ({})", req.node_rank,
                 req.master_addr, req.master_port, last_error);
        }
        const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) { fail(Errc::internal, "socket: {}", std::strerror(errno)); }
        LinkSocket s(fd);
        if (!req.bind_addr.empty()) {
            const sockaddr_in b = ipv4(req.bind_addr, 0, "--node-addr");
            if (::bind(fd, reinterpret_cast<const sockaddr *>(&b), sizeof b) != 0) {
                fail(Errc::invalid_argument, "--node-addr {}: cannot bind it: {}", req.bind_addr, std::strerror(errno));
            }
        }
        if (::connect(fd, reinterpret_cast<const sockaddr *>(&master), sizeof master) != 0) {
            last_error = std::strerror(errno);
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            continue;
        }
        tune_link_socket(fd, req.send_timeout_s);
        sockaddr_in mine{};
        socklen_t len = sizeof mine;
        ::getsockname(fd, reinterpret_cast<sockaddr *>(&mine), &len);
        char local[INET_ADDRSTRLEN] = {};
        ::inet_ntop(AF_INET, &mine.sin_addr, local, sizeof local);

        JoinHello hello;
        std::memcpy(hello.magic, kMagic, sizeof kMagic);
        hello.nnodes      = req.nnodes;
        hello.node_rank   = req.node_rank;
        hello.tp          = req.tp;
        hello.rank        = req.rank;
        hello.fingerprint = req.fingerprint;
        set_field(hello.model_dir, req.model_dir);
        set_field(hello.bind_addr, local);
        random_nonce(hello.client_nonce);
        JoinChallenge ch;
        const auto step = std::min(deadline, Clock::now() + std::chrono::seconds(30));
        if (!s.send_bytes(&hello, sizeof hello) || !read_record(s, ch, step)) {
            last_error = "the connection closed during the handshake";
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            continue;
        }
        // The proof goes out even when the master's does not check, so both sides log why.
        uint8_t want[32];
        mac(req.token, "fd-join-server", hello.client_nonce, 32, ch.server_nonce, 32, want);
        const bool master_ok = CRYPTO_memcmp(want, ch.server_mac, 32) == 0;
        JoinProof proof;
        mac(req.token, "fd-join-client", ch.server_nonce, 32, &hello, sizeof hello, proof.client_mac);
        JoinVerdict v;
        if (!s.send_bytes(&proof, sizeof proof) || !read_record(s, v, step)) {
            if (!master_ok) { v.status = static_cast<int32_t>(Errc::forbidden); }
            else {
                last_error = "the connection closed before node 0's verdict";
                std::this_thread::sleep_for(std::chrono::milliseconds(200));
                continue;
            }
        }
        if (!master_ok) {
            fail(Errc::forbidden, "node {}: authentication failed: {}:{} does not hold this node's join token (--dist-token-file / "
                 "FD_DIST_TOKEN differ); nothing run", req.node_rank, req.master_addr, req.master_port);
        }
        if (v.status != 0) {
            v.text[sizeof v.text - 1] = '\0';
            throw Error(static_cast<Errc>(v.status), fmt::format("node 0 refused node {}'s join: {}", req.node_rank, v.text));
        }
        return JoinedLink{.link = std::move(s), .node_rank = req.node_rank, .model_dir = req.model_dir, .bind_addr = local,
                          .peer = fmt::format("{}:{}", req.master_addr, req.master_port)};
    }
}

}  // namespace fd::runtime
