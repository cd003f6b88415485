// The daemon ↔ rank link: step batch encoding in the shared region, the seqpacket socket.
#include "fd/runtime/rank_link.h"

#include "fd/file_io.h"

#include "fd/status.h"

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>

extern char ** environ;

namespace fd::runtime {
namespace {

int64_t align64(int64_t x) { return (x + 63) / 64 * 64; }

template <typename T>
T * at(void * region, int64_t off) { return reinterpret_cast<T *>(static_cast<char *>(region) + off); }
template <typename T>
const T * at(const void * region, int64_t off) { return reinterpret_cast<const T *>(static_cast<const char *>(region) + off); }

}  // namespace

StepLayout step_layout(int64_t n_tokens, int64_t n_logits, int64_t n_tables, int64_t vocab, int64_t route_cols) {
    StepLayout l;
    int64_t off = align64(sizeof(RegionHeader));
    auto take = [&](int64_t & field, int64_t bytes) {
        field = off;
        off   = align64(off + bytes);
    };
    take(l.tokens, n_tokens * 4);
    take(l.positions, n_tokens * 4);
    take(l.slots, n_tokens * 8);
    take(l.q_table, n_tokens * 4);
    take(l.q_ctx, n_tokens * 4);
    take(l.logits_rows, n_logits * 4);
    take(l.tables, n_tables * 4);
    take(l.logits, n_logits * vocab * 4);
    take(l.routes, n_tokens * route_cols * 4);
    l.total_bytes = off;
    return l;
}

int64_t step_tables(const model::StepBatch & b, int32_t block_size) {
    int64_t n = 0;
    const int32_t * run = nullptr;
    int32_t run_ctx = 0;
    for (const auto & q : b.queries) {
        if (q.block_table != run) {
            n += (run_ctx + block_size - 1) / block_size;
            run     = q.block_table;
            run_ctx = 0;
        }
        run_ctx = std::max(run_ctx, q.n_ctx);
    }
    return n + (run_ctx + block_size - 1) / block_size;
}

int64_t step_encode(void * region, int64_t region_bytes, const model::StepBatch & b, int32_t block_size, int32_t vocab,
                    int32_t route_cols) {
    const int64_t n = b.n_tokens(), nl = static_cast<int64_t>(b.logits_rows.size());
    const int64_t nt = step_tables(b, block_size);
    const int32_t rc = b.want_routes ? route_cols : 0;
    const StepLayout l = step_layout(n, nl, nt, vocab, rc);
    if (l.total_bytes > region_bytes) { return l.total_bytes; }
    auto * h = static_cast<RegionHeader *>(region);
    h->n_tokens = static_cast<int32_t>(n);
    h->n_logits = static_cast<int32_t>(nl);
    h->n_tables = static_cast<int32_t>(nt);
    h->vocab    = vocab;
    h->route_cols = rc;
    std::memcpy(at<int32_t>(region, l.tokens), b.tokens.data(), n * 4);
    std::memcpy(at<int32_t>(region, l.positions), b.positions.data(), n * 4);
    std::memcpy(at<int64_t>(region, l.slots), b.slots.data(), n * 8);
    std::memcpy(at<int32_t>(region, l.logits_rows), b.logits_rows.data(), nl * 4);
    int32_t * q_table = at<int32_t>(region, l.q_table);
    int32_t * q_ctx   = at<int32_t>(region, l.q_ctx);
    int32_t * tables  = at<int32_t>(region, l.tables);
    // One run of block ids per sequence: the tokens of a sequence are adjacent and share a table.
    int64_t used = 0, run_start = 0;
    const int32_t * run = nullptr;
    int32_t run_ctx = 0;
    auto close_run = [&] {
        const int64_t len = (run_ctx + block_size - 1) / block_size;
        if (len > 0) { std::memcpy(tables + run_start, run, len * 4); }
        used = run_start + len;
    };
    for (int64_t t = 0; t < n; ++t) {
        const auto & q = b.queries[t];
        if (q.block_table != run) {
            if (run) { close_run(); }
            run       = q.block_table;
            run_start = used;
            run_ctx   = 0;
        }
        run_ctx    = std::max(run_ctx, q.n_ctx);
        q_table[t] = static_cast<int32_t>(run_start);
        q_ctx[t]   = q.n_ctx;
    }
    if (run) { close_run(); }
    FD_CHECK(used == nt, "block-table runs {} != counted {}", used, nt);
    return l.total_bytes;
}

void step_decode(const void * region, model::StepBatch & b) {
    const auto * h = static_cast<const RegionHeader *>(region);
    const int64_t n = h->n_tokens, nl = h->n_logits;
    const StepLayout l = step_layout(n, nl, h->n_tables, h->vocab);
    const int32_t * tokens = at<int32_t>(region, l.tokens);
    const int32_t * pos    = at<int32_t>(region, l.positions);
    const int64_t * slots  = at<int64_t>(region, l.slots);
    const int32_t * rows   = at<int32_t>(region, l.logits_rows);
    const int32_t * qt     = at<int32_t>(region, l.q_table);
    const int32_t * qc     = at<int32_t>(region, l.q_ctx);
    const int32_t * tables = at<int32_t>(region, l.tables);
    b.tokens.assign(tokens, tokens + n);
    b.positions.assign(pos, pos + n);
    b.slots.assign(slots, slots + n);
    b.logits_rows.assign(rows, rows + nl);
    b.want_routes = h->route_cols > 0;
    b.queries.resize(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) {
        FD_CHECK(qt[t] >= 0 && qt[t] <= h->n_tables, "block table offset {} outside {}", qt[t], h->n_tables);
        b.queries[t] = {tables + qt[t], qc[t]};
    }
}

float * step_logits(void * region) {
    const auto * h = static_cast<const RegionHeader *>(region);
    return at<float>(region, step_layout(h->n_tokens, h->n_logits, h->n_tables, h->vocab).logits);
}

int32_t * step_routes(void * region) {
    const auto * h = static_cast<const RegionHeader *>(region);
    if (h->route_cols <= 0) { return nullptr; }
    return at<int32_t>(region, step_layout(h->n_tokens, h->n_logits, h->n_tables, h->vocab, h->route_cols).routes);
}

int64_t swap_encode(void * region, int64_t region_bytes, const kv::BlockCopy * out, int64_t n_out, const kv::BlockCopy * in,
                    int64_t n_in) {
    const int64_t off_out = align64(sizeof(RegionHeader));
    const int64_t off_in  = align64(off_out + n_out * static_cast<int64_t>(sizeof(kv::BlockCopy)));
    const int64_t total   = off_in + n_in * static_cast<int64_t>(sizeof(kv::BlockCopy));
    if (total > region_bytes) { return total; }
    if (n_out > 0) { std::memcpy(at<kv::BlockCopy>(region, off_out), out, n_out * sizeof(kv::BlockCopy)); }
    if (n_in > 0) { std::memcpy(at<kv::BlockCopy>(region, off_in), in, n_in * sizeof(kv::BlockCopy)); }
    return total;
}

std::pair<const kv::BlockCopy *, const kv::BlockCopy *> swap_lists(const void * region, int64_t n_out) {
    const int64_t off_out = align64(sizeof(RegionHeader));
    const int64_t off_in  = align64(off_out + n_out * static_cast<int64_t>(sizeof(kv::BlockCopy)));
    return {at<kv::BlockCopy>(region, off_out), at<kv::BlockCopy>(region, off_in)};
}

void check_inline_step(const void * data, int64_t n) {
    if (n < static_cast<int64_t>(sizeof(RegionHeader)) || data == nullptr) {
        fail(Errc::invalid_argument, "inline step of {} bytes: shorter than its {}-byte header", n, sizeof(RegionHeader));
    }
    RegionHeader h;  // copied out: the bytes came from the network
    std::memcpy(static_cast<void *>(&h), data, sizeof h);
    const auto bad = [&](const char * what) {
        fail(Errc::invalid_argument, "inline step of {} bytes {}: n_tokens {}, n_logits {}, n_tables {}", n, what, h.n_tokens,
             h.n_logits, h.n_tables);
    };
    if (h.n_tokens < 0 || h.n_logits < 0 || h.n_tables < 0 || h.vocab < 0) { bad("has a negative count"); }
    if (step_layout(h.n_tokens, h.n_logits, h.n_tables, 0).logits > n) { bad("is shorter than the arrays its header counts"); }
}

void check_inline_swap(int64_t n, int64_t n_out, int64_t n_in) {
    const int64_t max_copies = kInlineMaxBytes / static_cast<int64_t>(sizeof(kv::BlockCopy));
    if (n_out < 0 || n_in < 0 || n_out > max_copies || n_in > max_copies) {
        fail(Errc::invalid_argument, "inline swap_kv of {} bytes: {} out / {} in block copies", n, n_out, n_in);
    }
    const int64_t need = align64(align64(sizeof(RegionHeader)) + n_out * static_cast<int64_t>(sizeof(kv::BlockCopy))) +
                         n_in * static_cast<int64_t>(sizeof(kv::BlockCopy));
    if (need > n) { fail(Errc::invalid_argument, "inline swap_kv of {} bytes: {} out / {} in block copies need {}", n, n_out, n_in, need); }
}

LinkSocket::Recv recv_inline(LinkSocket & link, const LinkMsg & m, std::vector<int64_t> & buf,
                             std::chrono::steady_clock::time_point deadline) {
    if (m.bytes < 0 || m.bytes > kInlineMaxBytes) {
        fail(Errc::invalid_argument, "request {} (link op {}) announces {} inline bytes; at most {} may follow a request", m.seq, m.op,
             m.bytes, kInlineMaxBytes);
    }
    const size_t n = static_cast<size_t>(m.bytes);
    if (buf.size() * sizeof(int64_t) < n) { buf.resize((n + 7) / 8); }
    return link.recv_exact(buf.data(), n, deadline);
}

// --- socket ---

LinkSocket::LinkSocket(int fd) : fd_(fd) {
    int type = 0;
    socklen_t len = sizeof type;
    stream_ = fd >= 0 && ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM;
}
LinkSocket::~LinkSocket() { close(); }
LinkSocket::LinkSocket(LinkSocket && o) noexcept
    : fd_(std::exchange(o.fd_, -1)), stream_(o.stream_), received_fd_(std::exchange(o.received_fd_, -1)) {}
LinkSocket & LinkSocket::operator=(LinkSocket && o) noexcept {
    if (this != &o) {
        close();
        fd_          = std::exchange(o.fd_, -1);
        stream_      = o.stream_;
        received_fd_ = std::exchange(o.received_fd_, -1);
    }
    return *this;
}

void LinkSocket::close() {
    if (fd_ >= 0) { ::close(fd_); }
    fd_ = -1;
    if (received_fd_ >= 0) { ::close(received_fd_); }
    received_fd_ = -1;
}

int LinkSocket::take_fd() { return std::exchange(received_fd_, -1); }

bool LinkSocket::send(const LinkMsg & m, int pass_fd) { return send_bytes(&m, sizeof m, pass_fd); }

namespace {

/// One seqpacket record carrying a copy of `pass_fd` (SCM_RIGHTS).
ssize_t send_with_fd(int sock, const void * data, size_t n, int pass_fd) {
    iovec iov{const_cast<void *>(data), n};
    alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
    msghdr mh{};
    mh.msg_iov        = &iov;
    mh.msg_iovlen     = 1;
    mh.msg_control    = ctl;
    mh.msg_controllen = sizeof ctl;
    cmsghdr * c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type  = SCM_RIGHTS;
    c->cmsg_len   = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    return ::sendmsg(sock, &mh, MSG_NOSIGNAL);
}

}  // namespace

bool LinkSocket::send_bytes(const void * data, size_t n, int pass_fd) {
    if (fd_ < 0) { return false; }
    if (pass_fd >= 0) {
        if (stream_) { return false; }  // descriptors only cross a local (seqpacket) link
        for (;;) {
            const ssize_t w = send_with_fd(fd_, data, n, pass_fd);
            if (w < 0 && errno == EINTR) { continue; }
            return w == static_cast<ssize_t>(n);
        }
    }
    const char * p = static_cast<const char *>(data);
    for (;;) {
        const ssize_t w = ::send(fd_, p, n, MSG_NOSIGNAL);
        if (w == static_cast<ssize_t>(n)) { return true; }
        if (w < 0 && errno == EINTR) { continue; }
        if (stream_ && w > 0) {  // a partial write (a stream's send timeout, SO_SNDTIMEO, ends a stuck peer's)
            p += w;
            n -= static_cast<size_t>(w);
            continue;
        }
        return false;
    }
}

bool LinkSocket::send_beat(const LinkMsg & m) {
    if (fd_ < 0) { return false; }
    if (stream_) { return send_bytes(&m, sizeof m); }
    for (;;) {
        const ssize_t w = ::send(fd_, &m, sizeof m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && errno == EINTR) { continue; }
        return w == static_cast<ssize_t>(sizeof m);
    }
}

bool LinkSocket::send_blob(const void * data, size_t n, int pass_fd) {
    if (stream_) {
        if (pass_fd >= 0) { return false; }
        const uint32_t len = static_cast<uint32_t>(n);
        if (!send_bytes(&len, sizeof len)) { return false; }
    }
    return send_bytes(data, n, pass_fd);
}

ssize_t LinkSocket::recv_record(void * data, size_t cap, int flags) {
    iovec iov{data, cap};
    alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))];
    msghdr mh{};
    mh.msg_iov        = &iov;
    mh.msg_iovlen     = 1;
    mh.msg_control    = ctl;
    mh.msg_controllen = sizeof ctl;
    const ssize_t r = ::recvmsg(fd_, &mh, flags | MSG_CMSG_CLOEXEC);
    if (r < 0) { return r; }
    for (cmsghdr * c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len < CMSG_LEN(sizeof(int))) { continue; }
        // One descriptor per record is all a sender passes (more would not fit: the kernel closes those).
        int got = -1;
        std::memcpy(&got, CMSG_DATA(c), sizeof(int));
        if (received_fd_ >= 0) { ::close(received_fd_); }
        received_fd_ = got;
    }
    return r;
}

LinkSocket::Recv LinkSocket::recv_exact(void * data, size_t n, std::chrono::steady_clock::time_point deadline) {
    char * p = static_cast<char *>(data);
    size_t got = 0;
    while (got < n) {
        if (fd_ < 0) { return Recv::closed; }
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline) { return Recv::timeout; }
        pollfd pf{fd_, POLLIN, 0};
        const int rc = ::poll(&pf, 1, static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count()));
        if (rc < 0 && errno != EINTR) { return Recv::closed; }
        if (rc <= 0) { continue; }
        const ssize_t r = ::recv(fd_, p + got, n - got, 0);
        if (r > 0) {
            got += static_cast<size_t>(r);
        } else if (r == 0 || (errno != EINTR && errno != EAGAIN)) {
            return Recv::closed;
        }
    }
    return Recv::ok;
}

bool LinkSocket::send_payload(const void * data, size_t n) {
    if (stream_) { return n == 0 || send_bytes(data, n); }
    const char * p = static_cast<const char *>(data);
    for (size_t off = 0; off < n; off += kPayloadChunk) {
        if (!send_bytes(p + off, std::min(kPayloadChunk, n - off))) { return false; }
    }
    return true;
}

LinkSocket::Recv LinkSocket::recv_payload(void * data, size_t n, std::chrono::steady_clock::time_point deadline) {
    if (stream_) { return recv_exact(data, n, deadline); }
    char * p = static_cast<char *>(data);
    for (size_t off = 0; off < n;) {
        if (fd_ < 0) { return Recv::closed; }
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline) { return Recv::timeout; }
        pollfd pf{fd_, POLLIN, 0};
        const int rc = ::poll(&pf, 1, static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count()));
        if (rc < 0 && errno != EINTR) { return Recv::closed; }
        if (rc <= 0) { continue; }
        const size_t want = std::min(kPayloadChunk, n - off);
        const ssize_t r = recv_record(p + off, want, MSG_DONTWAIT);
        if (r < 0 && (errno == EINTR || errno == EAGAIN)) { continue; }
        if (r != static_cast<ssize_t>(want)) { return Recv::closed; }
        off += want;
    }
    return Recv::ok;
}

LinkSocket::Recv LinkSocket::recv(LinkMsg & m, std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds poll_slice,
                                  const std::function<void()> & on_slice) {
    if (fd_ < 0) { return Recv::closed; }
    for (;;) {
        const auto now  = std::chrono::steady_clock::now();
        if (now >= deadline) { return Recv::timeout; }
        auto wait = std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
        if (poll_slice.count() > 0) { wait = std::min(wait, poll_slice); }
        pollfd p{fd_, POLLIN, 0};
        const int rc = ::poll(&p, 1, static_cast<int>(wait.count()));
        if (rc < 0 && errno != EINTR) { return Recv::closed; }
        if (rc <= 0) {
            if (on_slice) { on_slice(); }
            continue;
        }
        // A stream delivers the record in pieces: once it starts, read the rest (bounded).
        if (stream_) { return recv_exact(&m, sizeof m, std::max(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(5))); }
        const ssize_t r = recv_record(&m, sizeof m, 0);
        if (r == static_cast<ssize_t>(sizeof m)) { return Recv::ok; }
        if (r < 0 && (errno == EINTR || errno == EAGAIN)) { continue; }
        return Recv::closed;  // EOF, reset, or a malformed record: the link is unusable
    }
}

LinkSocket::Recv LinkSocket::try_recv(LinkMsg & m) {
    if (fd_ < 0) { return Recv::closed; }
    for (;;) {
        const ssize_t r = recv_record(&m, sizeof m, MSG_DONTWAIT);
        if (r == static_cast<ssize_t>(sizeof m)) { return Recv::ok; }
        if (r < 0 && errno == EINTR) { continue; }
        if (r < 0 && errno == EAGAIN) { return Recv::timeout; }
        return Recv::closed;  // EOF, reset, or a malformed record
    }
}

int64_t LinkSocket::recv_bytes(void * data, size_t cap) {
    if (stream_) {
        const auto forever = std::chrono::steady_clock::time_point::max();
        uint32_t len = 0;
        if (recv_exact(&len, sizeof len, forever) != Recv::ok || len > cap) { return 0; }
        return recv_exact(data, len, forever) == Recv::ok ? static_cast<int64_t>(len) : 0;
    }
    for (;;) {
        const ssize_t r = recv_record(data, cap, 0);
        if (r < 0 && errno == EINTR) { continue; }
        return r < 0 ? 0 : r;
    }
}

bool LinkSocket::peer_closed() const {
    if (fd_ < 0) { return true; }
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) { return false; }
    return (p.revents & (POLLHUP | POLLERR | POLLIN)) != 0;  // nothing is ever sent unasked
}

bool LinkSocket::hung_up() const { return peer_hung_up(fd_); }

pid_t spawn_rank_process(const std::string & binary, int link_fd, int region_fd) {
    // Above any fd the child's dup2 targets (3, 4) could clobber.
    const int lfd = ::fcntl(link_fd, F_DUPFD_CLOEXEC, 100);
    const int rfd = region_fd >= 0 ? ::fcntl(region_fd, F_DUPFD_CLOEXEC, 100) : -1;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, lfd, 3);
    if (rfd >= 0) { posix_spawn_file_actions_adddup2(&fa, rfd, 4); }
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    sigaddset(&defaults, SIGTERM);
    sigaddset(&defaults, SIGINT);
    sigaddset(&defaults, SIGPIPE);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    posix_spawnattr_setsigmask(&attr, &none);  // the daemon blocks SIGTERM/SIGINT for sigwait
    posix_spawnattr_setsigdefault(&attr, &defaults);
    const std::string ppid = std::to_string(::getpid());
    const char * flag = "--fd-rank-process";
    std::vector<char *> argv = {const_cast<char *>(binary.c_str()), const_cast<char *>(flag), const_cast<char *>("3"),
                                const_cast<char *>(rfd >= 0 ? "4" : "-1"), const_cast<char *>(ppid.c_str()), nullptr};
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, binary.c_str(), &fa, &attr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    ::close(lfd);
    if (rfd >= 0) { ::close(rfd); }
    if (rc != 0) { fail(Errc::rank_failed, "cannot start a rank process ({}): {}", binary, std::strerror(rc)); }
    return pid;
}

std::pair<LinkSocket, LinkSocket> make_link_pair() {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
        fail(Errc::internal, "socketpair for a rank link: {}", std::strerror(errno));
    }
    return {LinkSocket(sv[0]), LinkSocket(sv[1])};
}

// --- shared region ---

SharedRegion::~SharedRegion() {
    if (data_) { ::munmap(data_, static_cast<size_t>(bytes_)); }
    if (fd_ >= 0) { ::close(fd_); }
}

void SharedRegion::create(int64_t bytes) {
    fd_ = ::memfd_create("fdrollout-step", MFD_CLOEXEC);
    if (fd_ < 0) { fail(Errc::internal, "memfd_create for the step region: {}", std::strerror(errno)); }
    resize(bytes);
}

void SharedRegion::attach(int fd) {
    fd_ = fd;
    remap();
}

void SharedRegion::resize(int64_t bytes) {
    if (bytes <= bytes_) { return; }
    const int64_t page = sysconf(_SC_PAGESIZE);
    bytes = (bytes + page - 1) / page * page;
    if (::ftruncate(fd_, bytes) != 0) { fail(Errc::internal, "growing the step region to {} bytes: {}", bytes, std::strerror(errno)); }
    map(bytes);
}

void SharedRegion::remap() {
    const off_t size = ::lseek(fd_, 0, SEEK_END);
    if (size <= 0) { fail(Errc::internal, "step region fd {} has no size", fd_); }
    if (size != bytes_) { map(size); }
}

void SharedRegion::map(int64_t bytes) {
    if (data_) { ::munmap(data_, static_cast<size_t>(bytes_)); }
    data_  = nullptr;
    void * p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) { fail(Errc::internal, "mapping the step region ({} bytes): {}", bytes, std::strerror(errno)); }
    data_  = p;
    bytes_ = bytes;
}

}  // namespace fd::runtime
