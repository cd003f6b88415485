// NcclComm: the CUDA build's collectives (device pointers, enqueued on the rank backend's stream).
// The NCCL unique id travels through the rank group's TcpStore, one per generation, as Gloo's
// addresses do. Without CUDA, make_nccl_comm refuses.
#include "fd/comm/comm.h"

#include "fd/status.h"

#if FD_WITH_CUDA
#include "fd/kernels/backend.h"
#include "fd/log.h"
#include "fd/comm/tcp_store.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#endif

namespace fd::comm {

#if FD_WITH_CUDA
namespace {

std::atomic<int64_t> g_live{0};   // communicators alive in this process
std::atomic<int64_t> g_inits{0};  // communicators created since start

class NcclComm final : public Comm {
public:
    NcclComm(const GlooCommConfig & cfg, int32_t device) : cfg_(cfg), device_(device) {}
    ~NcclComm() override {
        disconnect();
        if (one_) { cudaFree(one_); }
    }

    const char * name() const override { return "nccl"; }
    int32_t rank() const override { return cfg_.rank; }
    int32_t world_size() const override { return cfg_.world_size; }
    bool connected() const override { return comm_ != nullptr; }

    void use_backend(kernels::Backend * backend) override {
        stream_ = backend ? static_cast<cudaStream_t>(backend->native_stream()) : nullptr;
        bound_  = backend != nullptr && stream_ != nullptr;
    }

    void connect(int64_t generation) override {
        disconnect();
        if (cudaSetDevice(device_) != cudaSuccess) { fail(Errc::invalid_argument, "cannot use CUDA device {}", device_); }
        const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg_.timeout_s * 1000));
        TcpStoreClient store(cfg_.store_host, cfg_.store_port, timeout, cfg_.store_token);
        // A fresh id per generation: a rebuilt group never meets a stale id of the previous one.
        const std::string key = "gen" + std::to_string(generation) + "/nccl_id";
        ncclUniqueId id{};
        if (cfg_.rank == 0) {
            check(ncclGetUniqueId(&id), "ncclGetUniqueId");
            store.set(key, std::vector<char>(id.internal, id.internal + sizeof id.internal));
        } else {
            const auto v = store.get(key);
            FD_CHECK(v.size() == sizeof id.internal, "malformed NCCL id in the store");
            std::memcpy(id.internal, v.data(), v.size());
        }
        ncclComm_t c = nullptr;
        check(ncclCommInitRank(&c, cfg_.world_size, id, cfg_.rank), "ncclCommInitRank");
        comm_ = c;
        g_live.fetch_add(1);
        g_inits.fetch_add(1);
        log::get("comm")->info("rank {}/{}: nccl group connected (generation {}, device {})", cfg_.rank, cfg_.world_size, generation, device_);
    }

    void disconnect() override {
        if (!comm_) { return; }
        if (bound_) { cudaStreamSynchronize(stream_); }  // nothing of ours still queued on the group
        ncclCommDestroy(comm_);
        comm_ = nullptr;
        g_live.fetch_sub(1);
        log::get("comm")->info("rank {}/{}: nccl group destroyed", cfg_.rank, cfg_.world_size);
    }

    void all_reduce_sum(float * data, int64_t n) override {
        FD_CHECK(comm_, "all_reduce_sum on a disconnected group");
        check(ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat32, ncclSum, comm_, stream_), "ncclAllReduce");
        if (!bound_) { sync("all-reduce"); }
    }

    void gather(const float * send, int64_t n, float * recv) override {
        FD_CHECK(comm_, "gather on a disconnected group");
        // Point-to-point in one group: every rank sends to 0, rank 0 receives each in its row.
        if (cfg_.rank == 0 &&
            cudaMemcpyAsync(recv, send, sizeof(float) * static_cast<size_t>(n), cudaMemcpyDeviceToDevice, stream_) != cudaSuccess) {
            fail(Errc::rank_failed, "gather on rank 0: copying its own part failed");
        }
        check(ncclGroupStart(), "ncclGroupStart");
        if (cfg_.rank == 0) {
            for (int r = 1; r < cfg_.world_size; ++r) {
                check(ncclRecv(recv + r * n, static_cast<size_t>(n), ncclFloat32, r, comm_, stream_), "ncclRecv");
            }
        } else {
            check(ncclSend(send, static_cast<size_t>(n), ncclFloat32, 0, comm_, stream_), "ncclSend");
        }
        check(ncclGroupEnd(), "ncclGroupEnd");
        if (!bound_) { sync("gather"); }
    }

    void all_gather(const float * send, int64_t n, float * recv) override {
        FD_CHECK(comm_, "all_gather on a disconnected group");
        check(ncclAllGather(send, recv, static_cast<size_t>(n), ncclFloat32, comm_, stream_), "ncclAllGather");
        if (!bound_) { sync("all-gather"); }
    }

    void barrier() override {
        if (!one_ && cudaMalloc(&one_, sizeof(float)) != cudaSuccess) { fail(Errc::internal, "cudaMalloc for the barrier failed"); }
        FD_CHECK(comm_, "barrier on a disconnected group");
        check(ncclAllReduce(one_, one_, 1, ncclFloat32, ncclSum, comm_, stream_), "ncclAllReduce (barrier)");
        sync("barrier");
    }

private:
    void check(ncclResult_t r, const char * what) const {
        if (r != ncclSuccess) { fail(Errc::rank_failed, "{} on rank {}: {}", what, cfg_.rank, ncclGetErrorString(r)); }
    }
    void sync(const char * what) const {
        const cudaError_t e = cudaStreamSynchronize(stream_);
        if (e != cudaSuccess) { fail(Errc::rank_failed, "{} on rank {}: stream failed ({})", what, cfg_.rank, cudaGetErrorString(e)); }
    }

    GlooCommConfig cfg_;
    int32_t        device_ = 0;
    ncclComm_t     comm_   = nullptr;
    cudaStream_t   stream_ = nullptr;  ///< the backend's (use_backend); nullptr: the legacy default stream
    bool           bound_  = false;
    float *        one_    = nullptr;  ///< barrier's device float
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(const GlooCommConfig & cfg, int32_t device) { return std::make_unique<NcclComm>(cfg, device); }
NcclCommCounts nccl_comm_counts() { return {g_live.load(), g_inits.load()}; }
#else
std::unique_ptr<Comm> make_nccl_comm(const GlooCommConfig &, int32_t) {
    fail(Errc::invalid_argument, "NCCL needs a CUDA build of fdrollout (this one was built without a CUDA toolkit)");
}
NcclCommCounts nccl_comm_counts() { return {}; }
#endif

}  // namespace fd::comm
