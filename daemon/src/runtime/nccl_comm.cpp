// NcclComm: the CUDA build's collectives (device pointers). The NCCL unique id travels through
// the rank group's TcpStore, as Gloo's addresses do. Without CUDA, make_nccl_comm refuses.
#include "fd/runtime/comm.h"

#include "fd/status.h"

#if FD_WITH_CUDA
#include "fd/log.h"
#include "fd/runtime/tcp_store.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#endif

namespace fd::runtime {

#if FD_WITH_CUDA
namespace {

class NcclComm final : public Comm {
public:
    NcclComm(const GlooCommConfig & cfg, int32_t device) : cfg_(cfg), device_(device) {}
    ~NcclComm() override { disconnect(); }

    const char * name() const override { return "nccl"; }
    int32_t rank() const override { return cfg_.rank; }
    int32_t world_size() const override { return cfg_.world_size; }
    bool connected() const override { return comm_ != nullptr; }

    void connect(int64_t generation) override {
        disconnect();
        const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg_.timeout_s * 1000));
        TcpStoreClient store(cfg_.store_host, cfg_.store_port, timeout);
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
        if (cudaSetDevice(device_) != cudaSuccess) { fail(Errc::invalid_argument, "cannot use CUDA device {}", device_); }
        ncclComm_t c = nullptr;
        check(ncclCommInitRank(&c, cfg_.world_size, id, cfg_.rank), "ncclCommInitRank");
        comm_ = c;
        log::get("comm")->info("rank {}/{}: nccl group connected (generation {}, device {})", cfg_.rank, cfg_.world_size, generation, device_);
    }

    void disconnect() override {
        if (!comm_) { return; }
        ncclCommDestroy(comm_);
        comm_ = nullptr;
    }

    void all_reduce_sum(float * data, int64_t n) override {
        FD_CHECK(comm_, "all_reduce_sum on a disconnected group");
        check(ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat32, ncclSum, comm_, nullptr), "ncclAllReduce");
        if (cudaStreamSynchronize(nullptr) != cudaSuccess) { fail(Errc::rank_failed, "all-reduce on rank {}: stream failed", cfg_.rank); }
    }

    void gather(const float * send, int64_t n, float * recv) override {
        FD_CHECK(comm_, "gather on a disconnected group");
        // Point-to-point in one group: every rank sends to 0, rank 0 receives each in its row.
        check(ncclGroupStart(), "ncclGroupStart");
        if (cfg_.rank == 0) {
            cudaMemcpyAsync(recv, send, sizeof(float) * static_cast<size_t>(n), cudaMemcpyDeviceToDevice, nullptr);
            for (int r = 1; r < cfg_.world_size; ++r) {
                check(ncclRecv(recv + r * n, static_cast<size_t>(n), ncclFloat32, r, comm_, nullptr), "ncclRecv");
            }
        } else {
            check(ncclSend(send, static_cast<size_t>(n), ncclFloat32, 0, comm_, nullptr), "ncclSend");
        }
        check(ncclGroupEnd(), "ncclGroupEnd");
        if (cudaStreamSynchronize(nullptr) != cudaSuccess) { fail(Errc::rank_failed, "gather on rank {}: stream failed", cfg_.rank); }
    }

    void barrier() override {
        float one = 0.0f;
        float * d = nullptr;
        if (cudaMalloc(&d, sizeof one) != cudaSuccess) { fail(Errc::internal, "cudaMalloc for the barrier failed"); }
        cudaMemcpy(d, &one, sizeof one, cudaMemcpyHostToDevice);
        all_reduce_sum(d, 1);
        cudaFree(d);
    }

private:
    void check(ncclResult_t r, const char * what) const {
        if (r != ncclSuccess) { fail(Errc::rank_failed, "{} on rank {}: {}", what, cfg_.rank, ncclGetErrorString(r)); }
    }

    GlooCommConfig cfg_;
    int32_t        device_ = 0;
    ncclComm_t     comm_   = nullptr;
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(const GlooCommConfig & cfg, int32_t device) { return std::make_unique<NcclComm>(cfg, device); }
#else
std::unique_ptr<Comm> make_nccl_comm(const GlooCommConfig &, int32_t) {
    fail(Errc::invalid_argument, "NCCL needs a CUDA build of fdrollout (this one was built without a CUDA toolkit)");
}
#endif

}  // namespace fd::runtime
