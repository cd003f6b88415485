// The GPU weight-stream transport (stream_io.h make_nccl_receiver): this process joins the
// trainer's NCCL group from the ncclUniqueId carried in the init body and receives each tensor
// as a broadcast from rank 0. Every wait is bounded: the communicator is created non-blocking
// and every collective is polled (cudaStreamQuery + ncclCommGetAsyncError) until its deadline,
// then the communicator is aborted (ncclCommAbort), so a dead trainer never hangs a handler.
// Compiled with CUDA only (FD_WITH_CUDA); without it the factory refuses.
#include "stream_io.h"

#include "fd/log.h"

#if FD_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#endif

namespace fd::stream {

#if FD_WITH_CUDA
namespace {

/// One device buffer receives each broadcast (grown to the largest transfer), then is copied to
/// the host destination; the trainer's broadcasts must match the announced sizes exactly.
class NcclReceiver final : public Receiver {
public:
    NcclReceiver(const NcclGroup & g, Clock::time_point deadline) : device_(g.device) {
        if (g.unique_id_hex.size() != 2 * sizeof(ncclUniqueId::internal)) {
            fail(Errc::invalid_argument, "nccl_unique_id must be {} hex digits (the trainer's ncclUniqueId), got {} characters",
                 2 * sizeof(ncclUniqueId::internal), g.unique_id_hex.size());
        }
        if (g.world_size < 2 || g.rank < 1 || g.rank >= g.world_size) {
            fail(Errc::invalid_argument, "nccl group: rank_offset {} of world_size {} (the trainer is rank 0; 1 <= rank_offset < world_size)",
                 g.rank, g.world_size);
        }
        ncclUniqueId id{};
        for (size_t i = 0; i < sizeof id.internal; ++i) {
            const int hi = hex(g.unique_id_hex[2 * i]), lo = hex(g.unique_id_hex[2 * i + 1]);
            if (hi < 0 || lo < 0) { fail(Errc::invalid_argument, "nccl_unique_id holds a character that is not a hex digit"); }
            id.internal[i] = static_cast<char>(hi << 4 | lo);
        }
        if (const cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
            fail(Errc::not_found, "the nccl weight-stream backend needs CUDA device {}: {}; use backend \"tcp\"", device_, cudaGetErrorString(e));
        }
        cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        cfg.blocking     = 0;  // returns at once; the group forms in the background, polled below
        const ncclResult_t r = ncclCommInitRankConfig(&comm_, g.world_size, id, g.rank, &cfg);
        if (r != ncclSuccess && r != ncclInProgress) { fail(Errc::source_unavailable, "ncclCommInitRank: {}", ncclGetErrorString(r)); }
        wait_comm(deadline, "the trainer joining the NCCL group");
        log::get("stream")->info("weight stream: joined the trainer's NCCL group as rank {} of {} (device {})", g.rank, g.world_size, device_);
    }

    ~NcclReceiver() override {
        if (comm_) { ncclCommAbort(comm_); }  // never a graceful destroy: the trainer may be gone
        if (buf_) { cudaFree(buf_); }
        if (piece_) { cudaFreeHost(piece_); }
        if (stream_) { cudaStreamDestroy(stream_); }
    }

    const char * name() const override { return "nccl"; }
    bool peer_closed() override {
        if (aborted_) { return true; }
        ncclResult_t st = ncclSuccess;
        return ncclCommGetAsyncError(comm_, &st) != ncclSuccess || (st != ncclSuccess && st != ncclInProgress);
    }
    void interrupt() override { interrupted_.store(true); }

    void receive(const std::vector<TensorSpec> & specs, bool packed, const Sink & sink, Clock::time_point deadline) override {
        cuda(cudaSetDevice(device_), "cudaSetDevice");
        if (packed) {
            size_t total = 0;
            for (const auto & s : specs) { total += static_cast<size_t>(s.nbytes); }
            broadcast(total, deadline, "the packed bucket");
            size_t off = 0;
            for (size_t i = 0; i < specs.size(); ++i) {
                copy_out(sink, i, off, static_cast<size_t>(specs[i].nbytes));
                off += static_cast<size_t>(specs[i].nbytes);
            }
            return;
        }
        for (size_t i = 0; i < specs.size(); ++i) {
            broadcast(static_cast<size_t>(specs[i].nbytes), deadline, fmt::format("tensor '{}'", specs[i].name));
            copy_out(sink, i, 0, static_cast<size_t>(specs[i].nbytes));
        }
    }

private:
    static int hex(char c) {
        if (c >= '0' && c <= '9') { return c - '0'; }
        if (c >= 'a' && c <= 'f') { return c - 'a' + 10; }
        if (c >= 'A' && c <= 'F') { return c - 'A' + 10; }
        return -1;
    }

    static void cuda(cudaError_t e, const char * what) {
        if (e != cudaSuccess) { fail(Errc::internal, "weight stream: {}: {}", what, cudaGetErrorString(e)); }
    }

    [[noreturn]] void abort_group(Errc code, const std::string & why) {
        aborted_ = true;
        ncclCommAbort(comm_);  // frees the group's kernels and sockets; nothing waits on it any more
        comm_ = nullptr;
        fail(code, "{}; the NCCL group was aborted (POST /init_weight_transfer_engine again)", why);
    }

    /// Poll the communicator until it is idle (init done, or the last call's work issued).
    void wait_comm(Clock::time_point deadline, const std::string & what) {
        for (;;) {
            ncclResult_t st = ncclSuccess;
            if (ncclCommGetAsyncError(comm_, &st) != ncclSuccess || (st != ncclSuccess && st != ncclInProgress)) {
                abort_group(Errc::source_unavailable, fmt::format("NCCL failed while waiting for {}: {}", what, ncclGetErrorString(st)));
            }
            if (st == ncclSuccess) { return; }
            if (interrupted_.load()) { abort_group(Errc::source_unavailable, "the stream was dropped"); }
            if (Clock::now() >= deadline) { abort_group(Errc::timeout, fmt::format("{} did not happen before the deadline", what)); }
            std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
    }

    /// Receive `n` bytes broadcast by rank 0 into buf_.
    void broadcast(size_t n, Clock::time_point deadline, const std::string & what) {
        if (!comm_) { fail(Errc::source_unavailable, "the NCCL group was aborted; POST /init_weight_transfer_engine again"); }
        if (n > cap_) {
            if (buf_) { cudaFree(buf_); }
            buf_ = nullptr;
            cuda(cudaMalloc(&buf_, n), "cudaMalloc (stream receive buffer)");
            cap_ = n;
        }
        const ncclResult_t r = ncclBroadcast(buf_, buf_, n, ncclUint8, 0, comm_, stream_);
        if (r != ncclSuccess && r != ncclInProgress) { abort_group(Errc::source_unavailable, fmt::format("ncclBroadcast: {}", ncclGetErrorString(r))); }
        wait_comm(deadline, what);
        for (;;) {  // the broadcast's kernel: done, failed, or still waiting for the trainer
            const cudaError_t q = cudaStreamQuery(stream_);
            if (q == cudaSuccess) { return; }
            if (q != cudaErrorNotReady) { abort_group(Errc::internal, fmt::format("CUDA failed receiving {}: {}", what, cudaGetErrorString(q))); }
            ncclResult_t st = ncclSuccess;
            ncclCommGetAsyncError(comm_, &st);
            if (st != ncclSuccess && st != ncclInProgress) {
                abort_group(Errc::source_unavailable, fmt::format("NCCL failed receiving {}: {}", what, ncclGetErrorString(st)));
            }
            if (interrupted_.load()) { abort_group(Errc::source_unavailable, "the stream was dropped"); }
            if (Clock::now() >= deadline) { abort_group(Errc::timeout, fmt::format("{} did not arrive before the deadline", what)); }
            std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
    }

    /// Tensor i's `n` bytes at `off` of buf_ to the sink, one host piece at a time.
    void copy_out(const Sink & sink, size_t i, size_t off, size_t n) {
        if (!piece_) { cuda(cudaMallocHost(&piece_, kPieceBytes), "cudaMallocHost (stream receive piece)"); }
        for (size_t done = 0; done < n;) {
            const size_t k = std::min(n - done, kPieceBytes);
            cuda(cudaMemcpy(piece_, static_cast<const char *>(buf_) + off + done, k, cudaMemcpyDeviceToHost), "cudaMemcpy (stream receive)");
            sink(i, static_cast<int64_t>(done), static_cast<const std::byte *>(piece_), k);
            done += k;
        }
    }

    int32_t           device_ = 0;
    ncclComm_t        comm_   = nullptr;
    cudaStream_t      stream_ = nullptr;
    void *            buf_    = nullptr;
    size_t            cap_    = 0;
    void *            piece_  = nullptr;  ///< pinned host piece (kPieceBytes), the sink's view
    bool              aborted_ = false;
    std::atomic<bool> interrupted_{false};
};

}  // namespace

std::unique_ptr<Receiver> make_nccl_receiver(const NcclGroup & g, Clock::time_point deadline) {
    return std::make_unique<NcclReceiver>(g, deadline);
}
#else
std::unique_ptr<Receiver> make_nccl_receiver(const NcclGroup &, Clock::time_point) {
    fail(Errc::not_found, "the nccl weight-stream backend needs a CUDA build of fdrollout (this one has none); use backend \"tcp\"");
}
#endif

}  // namespace fd::stream
