// ShmComm: collectives between ranks on one host through a memfd segment the daemon hands over (fd/comm/comm.h).
#include "fd/comm/comm.h"

#include "fd/log.h"
#include "fd/status.h"
#include "fd/trust.h"

#include <fcntl.h>
#include <poll.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace fd::comm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x6664746d2d73686dULL;  // "fdtm-shm"

struct alignas(64) Header {
    uint64_t magic;
    int32_t  world_size;
    int32_t  pad_;
    int64_t  slot_floats;
    int64_t  generation;
};

/// The seals a segment carries: its size is fixed for good (no peer can shrink it under a
/// mapping, which would fault every rank) and no further seal can be added or removed.
constexpr int kSegmentSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

/// One rank's arrival line: `arrived` is the number of the last call this rank reached (futex word),
/// `sleepers` counts peers in a futex wait on it, `pid` is the rank's process (set at connect: a
/// peer waiting on it watches that process through a pidfd and fails at once when it exits).
struct alignas(64) Line {
    std::atomic<uint32_t> arrived;
    std::atomic<uint32_t> sleepers;
    std::atomic<int32_t>  pid;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free);

int64_t lines_offset() { return static_cast<int64_t>(sizeof(Header)); }
int64_t slots_offset(int32_t world) { return lines_offset() + static_cast<int64_t>(sizeof(Line)) * world; }

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

/// Shared (not process-private) futex wait on `word` while it holds `expected`, at most `ms`.
void futex_wait(std::atomic<uint32_t> * word, uint32_t expected, int64_t ms) {
    timespec ts{static_cast<time_t>(ms / 1000), static_cast<long>((ms % 1000) * 1000000)};
    ::syscall(SYS_futex, reinterpret_cast<uint32_t *>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t> * word) {
    ::syscall(SYS_futex, reinterpret_cast<uint32_t *>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

class ShmComm final : public Comm {
public:
    explicit ShmComm(const ShmCommConfig & cfg) : cfg_(cfg) {
        FD_CHECK(cfg.world_size >= 1 && cfg.rank >= 0 && cfg.rank < cfg.world_size, "rank {} of {}", cfg.rank, cfg.world_size);
    }
    ~ShmComm() override { disconnect(); }

    const char * name() const override { return "shm"; }
    int32_t rank() const override { return cfg_.rank; }
    int32_t world_size() const override { return cfg_.world_size; }
    bool connected() const override { return base_ != nullptr; }

    void connect(int64_t generation) override {
        disconnect();
        const int64_t bytes = shm_comm_segment_bytes(cfg_.world_size);
        const int fd = cfg_.segment_fd ? cfg_.segment_fd(generation) : -1;
        if (fd < 0) {
            fail(Errc::rank_failed, "rank {}: no tensor-parallel segment was handed over for generation {}", cfg_.rank, generation);
        }
        struct stat st{};
        const bool stat_ok = ::fstat(fd, &st) == 0;
        const int  seals   = ::fcntl(fd, F_GET_SEALS);  // EINVAL unless a memfd (or another sealable shmem file)
        if (!stat_ok || !is_trusted(st, Trust::secret) || st.st_size != bytes || seals < 0 || (seals & kSegmentSeals) != kSegmentSeals) {
            ::close(fd);
            fail(Errc::rank_failed, "rank {}: the tensor-parallel segment handed over for generation {} is not this user's sealed 0600 "
                 "memfd of {} bytes (owner {}, mode {:o}, {} bytes, seals {:#x}); refusing it", cfg_.rank, generation, bytes, st.st_uid,
                 st.st_mode & 0777, st.st_size, seals);
        }
        void * p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        const int err = errno;
        ::close(fd);
        if (p == MAP_FAILED) { fail(Errc::rank_failed, "rank {}: mapping the tensor-parallel segment: {}", cfg_.rank, std::strerror(err)); }
        const auto * h = static_cast<const Header *>(p);
        if (h->magic != kMagic || h->world_size != cfg_.world_size || h->slot_floats != kShmCommSlotFloats || h->generation != generation) {
            const int64_t got_gen = h->generation;
            ::munmap(p, static_cast<size_t>(bytes));
            fail(Errc::rank_failed, "rank {}: the segment handed over is not a {}-rank tensor-parallel segment of generation {} (its "
                 "generation: {})", cfg_.rank, cfg_.world_size, generation, got_gen);
        }
        base_  = static_cast<char *>(p);
        bytes_ = bytes;
        // Counters start at 0 in a fresh segment: every rank's first call is 1.
        call_ = lines()[cfg_.rank].arrived.load(std::memory_order_acquire);
        lines()[cfg_.rank].pid.store(static_cast<int32_t>(::getpid()), std::memory_order_release);
        peer_fds_.assign(static_cast<size_t>(cfg_.world_size), -1);
        log::get("comm")->info("rank {}/{}: shm group connected (generation {})", cfg_.rank, cfg_.world_size, generation);
    }

    void disconnect() override {
        for (int & fd : peer_fds_) {
            if (fd >= 0) { ::close(fd); }
            fd = -1;
        }
        if (!base_) { return; }
        ::munmap(base_, static_cast<size_t>(bytes_));
        base_  = nullptr;
        bytes_ = 0;
        log::get("comm")->info("rank {}/{}: shm group disconnected", cfg_.rank, cfg_.world_size);
    }

    void all_reduce_sum(float * data, int64_t n) override {
        FD_CHECK(base_, "all_reduce_sum on a disconnected group");
        if (cfg_.world_size == 1 || n == 0) { return; }
        const int32_t W = cfg_.world_size;
        for (int64_t off = 0; off < n; off += kShmCommSlotFloats) {
            const int64_t m = std::min(kShmCommSlotFloats, n - off);
            float * x = data + off;
            const uint32_t k = arrive(x, m, "all-reduce");
            // Rank order 0..W-1 from rank 0's value: GlooComm's order, the same bits on every rank.
            const float * s0 = slot(k, 0);
            for (int64_t i = 0; i < m; ++i) { x[i] = s0[i]; }
            for (int32_t r = 1; r < W; ++r) {
                const float * s = slot(k, r);
                for (int64_t i = 0; i < m; ++i) { x[i] += s[i]; }
            }
        }
    }

    void gather(const float * send, int64_t n, float * recv) override { collect(send, n, recv, /*every_rank=*/false, "gather"); }

    void all_gather(const float * send, int64_t n, float * recv) override { collect(send, n, recv, /*every_rank=*/true, "all-gather"); }

    void barrier() override {
        FD_CHECK(base_, "barrier on a disconnected group");
        if (cfg_.world_size == 1) { return; }
        arrive(nullptr, 0, "barrier");
    }

private:
    Line * lines() const { return reinterpret_cast<Line *>(base_ + lines_offset()); }
    float * slot(uint32_t call, int32_t r) const {
        const int64_t set = call % 2;
        return reinterpret_cast<float *>(base_ + slots_offset(cfg_.world_size)) + (set * cfg_.world_size + r) * kShmCommSlotFloats;
    }

    /// Call k: put `m` floats of `x` in this rank's slot, publish k, wait until every rank has.
    /// Errors  rank_failed naming the ranks that did not arrive within timeout_s.
    /// gather / all_gather: every rank's `send` [n] lands at recv [world, n] in rank order, slot by
    /// slot, on rank 0 only or (every_rank) on all ranks.
    void collect(const float * send, int64_t n, float * recv, bool every_rank, const char * what) {
        FD_CHECK(base_, "{} on a disconnected group", what);
        if (cfg_.world_size == 1) {
            std::copy_n(send, n, recv);
            return;
        }
        for (int64_t off = 0; off < n; off += kShmCommSlotFloats) {
            const int64_t  m = std::min(kShmCommSlotFloats, n - off);
            const uint32_t k = arrive(send + off, m, what);
            if (!every_rank && cfg_.rank != 0) { continue; }
            for (int32_t r = 0; r < cfg_.world_size; ++r) { std::copy_n(slot(k, r), m, recv + r * n + off); }
        }
    }

    uint32_t arrive(const float * x, int64_t m, const char * what) {
        const uint32_t k = ++call_;
        if (m > 0) { std::memcpy(slot(k, cfg_.rank), x, static_cast<size_t>(m) * sizeof(float)); }
        Line * L = lines();
        L[cfg_.rank].arrived.store(k, std::memory_order_seq_cst);
        if (L[cfg_.rank].sleepers.load(std::memory_order_seq_cst) != 0) { futex_wake_all(&L[cfg_.rank].arrived); }
        const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg_.timeout_s));
        for (int32_t r = 0; r < cfg_.world_size; ++r) {
            if (r == cfg_.rank) { continue; }
            auto reached = [&] { return static_cast<int32_t>(L[r].arrived.load(std::memory_order_acquire) - k) >= 0; };
            // A short spin (~30 us) covers a peer a few microseconds behind; then sleep on its counter.
            if (!reached()) {
                const auto spin_until = Clock::now() + std::chrono::microseconds(30);
                for (int i = 1; !reached(); ++i) {
                    cpu_relax();
                    if (i % 64 == 0 && Clock::now() >= spin_until) { break; }
                }
            }
            while (!reached()) {
                const auto now = Clock::now();
                if (now >= deadline) {
                    fail(Errc::rank_failed, "{} on rank {}: rank {} did not arrive within {:.1f} s (a peer rank died or hung)", what,
                         cfg_.rank, r, cfg_.timeout_s);
                }
                if (cfg_.before_exit_check) { cfg_.before_exit_check(r); }
                // A peer may arrive and exit between reached() and this check: its arrival (stored
                // before its exit) counts, only a peer that exited without arriving failed.
                if (peer_exited(r) && !reached()) {
                    fail(Errc::rank_failed, "{} on rank {}: rank {} (pid {}) exited before arriving", what, cfg_.rank, r,
                         L[r].pid.load(std::memory_order_acquire));
                }
                L[r].sleepers.fetch_add(1, std::memory_order_seq_cst);
                const uint32_t seen = L[r].arrived.load(std::memory_order_seq_cst);
                if (static_cast<int32_t>(seen - k) < 0) {
                    // 10 ms slices: a peer that exits meanwhile is seen within one.
                    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
                    futex_wait(&L[r].arrived, seen, std::clamp<int64_t>(left, 1, 10));
                }
                L[r].sleepers.fetch_sub(1, std::memory_order_seq_cst);
            }
        }
        return k;
    }

    /// True once peer `r`'s process (the pid its line names) has exited: its pidfd, opened on
    /// first need, is readable (or the pid is already gone). False while it has not connected.
    bool peer_exited(int32_t r) {
        const int32_t pid = lines()[r].pid.load(std::memory_order_acquire);
        if (pid <= 0) { return false; }
        int & fd = peer_fds_[static_cast<size_t>(r)];
        if (fd < 0) {
            fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
            if (fd < 0) { return errno == ESRCH; }
        }
        pollfd p{fd, POLLIN, 0};
        return ::poll(&p, 1, 0) > 0;
    }

    ShmCommConfig cfg_;
    std::vector<int> peer_fds_;  ///< [world] pidfds of the peers (-1: not opened yet)
    char *        base_  = nullptr;
    int64_t       bytes_ = 0;
    uint32_t      call_  = 0;   ///< the number of this rank's last collective call (same on every rank)
};

}  // namespace

int64_t shm_comm_segment_bytes(int32_t world_size) {
    return slots_offset(world_size) + int64_t{2} * world_size * kShmCommSlotFloats * static_cast<int64_t>(sizeof(float));
}

std::unique_ptr<Comm> make_shm_comm(const ShmCommConfig & cfg) { return std::make_unique<ShmComm>(cfg); }

ShmCommSegment::ShmCommSegment(int32_t world_size, int64_t generation) {
    FD_CHECK(world_size >= 1, "world size {}", world_size);
    fd_ = ::memfd_create("fdrollout-tp", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd_ < 0) { fail(Errc::internal, "creating the tensor-parallel segment (memfd_create): {}", std::strerror(errno)); }
    const int64_t bytes = shm_comm_segment_bytes(world_size);
    void * p = MAP_FAILED;
    if (::fchmod(fd_, 0600) == 0 && ::ftruncate(fd_, bytes) == 0) {
        p = ::mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    }
    int err = errno;
    if (p != MAP_FAILED) {
        auto * h = static_cast<Header *>(p);
        h->world_size  = world_size;
        h->slot_floats = kShmCommSlotFloats;
        h->generation  = generation;
        h->magic       = kMagic;
        ::munmap(p, sizeof(Header));
        if (::fcntl(fd_, F_ADD_SEALS, kSegmentSeals) == 0) { return; }
        err = errno;
    }
    close();
    fail(Errc::internal, "preparing the tensor-parallel segment ({} bytes): {}", bytes, std::strerror(err));
}

ShmCommSegment::~ShmCommSegment() { close(); }
ShmCommSegment::ShmCommSegment(ShmCommSegment && o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
ShmCommSegment & ShmCommSegment::operator=(ShmCommSegment && o) noexcept {
    if (this != &o) {
        close();
        fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
}

void ShmCommSegment::close() {
    if (fd_ >= 0) { ::close(fd_); }
    fd_ = -1;
}

}  // namespace fd::comm
