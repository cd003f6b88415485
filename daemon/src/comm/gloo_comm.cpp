// NullComm and GlooComm (CPU collectives over Gloo's TCP transport).
#include "fd/comm/comm.h"

#include "fd/log.h"
#include "fd/comm/tcp_store.h"
#include "fd/status.h"

#include <gloo/allgather.h>
#include <gloo/barrier.h>
#include <gloo/gather.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <vector>

namespace fd::comm {
namespace {

class NullComm final : public Comm {
public:
    const char * name() const override { return "null"; }
    int32_t rank() const override { return 0; }
    int32_t world_size() const override { return 1; }
    bool connected() const override { return true; }
    void connect(int64_t) override {}
    void disconnect() override {}
    void all_reduce_sum(float *, int64_t) override {}
    void gather(const float * send, int64_t n, float * recv) override { std::copy_n(send, n, recv); }
    void all_gather(const float * send, int64_t n, float * recv) override { std::copy_n(send, n, recv); }
    void barrier() override {}
};

class GlooComm final : public Comm {
public:
    explicit GlooComm(const GlooCommConfig & cfg) : cfg_(cfg) {
        FD_CHECK(cfg.world_size >= 1 && cfg.rank >= 0 && cfg.rank < cfg.world_size, "rank {} of {}", cfg.rank, cfg.world_size);
    }
    ~GlooComm() override { disconnect(); }

    const char * name() const override { return "gloo"; }
    int32_t rank() const override { return cfg_.rank; }
    int32_t world_size() const override { return cfg_.world_size; }
    bool connected() const override { return ctx_ != nullptr; }

    void connect(int64_t generation) override {
        disconnect();
        const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg_.timeout_s * 1000));
        auto store = std::make_shared<TcpStoreClient>(cfg_.store_host, cfg_.store_port, timeout, cfg_.store_token);
        const std::string gen = "gen" + std::to_string(generation);
        // Our own join round first, so a rank that never comes is named (Gloo would only say
        // which store key it waited for).
        store->set(gen + "/joined/" + std::to_string(cfg_.rank), {'1'});
        std::vector<std::string> keys;
        for (int r = 0; r < cfg_.world_size; ++r) { keys.push_back(gen + "/joined/" + std::to_string(r)); }
        try {
            store->wait(keys, timeout);
        } catch (const Error &) {
            std::string missing;
            for (int r = 0; r < cfg_.world_size; ++r) {
                try {
                    store->wait({keys[r]}, std::chrono::milliseconds(0));
                } catch (const Error &) {
                    missing += (missing.empty() ? "" : ", ") + std::to_string(r);
                }
            }
            fail(Errc::rank_failed, "rank(s) {} never joined the tensor-parallel group (generation {}) within {} s", missing, generation,
                 cfg_.timeout_s);
        }
        try {
            gloo::transport::tcp::attr attr;
            attr.hostname = cfg_.bind_host;
            auto device   = gloo::transport::tcp::CreateDevice(attr);
            auto ctx      = std::make_shared<gloo::rendezvous::Context>(cfg_.rank, cfg_.world_size);
            ctx->setTimeout(timeout);
            gloo::rendezvous::PrefixStore prefixed(gen + "/gloo", *store);
            ctx->connectFullMesh(prefixed, device);
            ctx_ = std::move(ctx);
        } catch (const gloo::Exception & e) {
            fail(Errc::rank_failed, "rank {} could not connect the tensor-parallel group (generation {}): {}", cfg_.rank, generation,
                 e.what());
        }
        store_ = std::move(store);
        log::get("comm")->info("rank {}/{}: gloo group connected (generation {}, {})", cfg_.rank, cfg_.world_size, generation, cfg_.bind_host);
    }

    void disconnect() override {
        if (!ctx_) { return; }
        ctx_.reset();  // the pairs' sockets close with the context
        store_.reset();
        log::get("comm")->info("rank {}/{}: gloo group disconnected", cfg_.rank, cfg_.world_size);
    }

    void all_reduce_sum(float * data, int64_t n) override {
        FD_CHECK(ctx_, "all_reduce_sum on a disconnected group");
        if (cfg_.world_size == 1 || n == 0) { return; }
        // All-gather, then sum each element in rank order: the same bits on every rank, whatever n.
        const int64_t W = cfg_.world_size;
        all_.resize(static_cast<size_t>(W * n));
        try {
            gloo::AllgatherOptions opts(ctx_);
            opts.setInput(data, static_cast<size_t>(n));
            opts.setOutput(all_.data(), static_cast<size_t>(W * n));
            opts.setTag(tag_++);
            opts.setTimeout(timeout());
            gloo::allgather(opts);
        } catch (const gloo::Exception & e) {
            fail(Errc::rank_failed, "all-reduce on rank {} failed (a peer rank died or hung): {}", cfg_.rank, e.what());
        }
        const float * a = all_.data();
        for (int64_t i = 0; i < n; ++i) { data[i] = a[i]; }
        for (int64_t r = 1; r < W; ++r) {
            const float * x = a + r * n;
            for (int64_t i = 0; i < n; ++i) { data[i] += x[i]; }
        }
    }

    void gather(const float * send, int64_t n, float * recv) override {
        FD_CHECK(ctx_, "gather on a disconnected group");
        if (cfg_.world_size == 1) {
            std::copy_n(send, n, recv);
            return;
        }
        try {
            gloo::GatherOptions opts(ctx_);
            opts.setInput(const_cast<float *>(send), static_cast<size_t>(n));  // gloo only reads the input
            if (cfg_.rank == 0) { opts.setOutput(recv, static_cast<size_t>(n * cfg_.world_size)); }
            opts.setRoot(0);
            opts.setTag(tag_++);
            opts.setTimeout(timeout());
            gloo::gather(opts);
        } catch (const gloo::Exception & e) {
            fail(Errc::rank_failed, "gather on rank {} failed (a peer rank died or hung): {}", cfg_.rank, e.what());
        }
    }

    void all_gather(const float * send, int64_t n, float * recv) override {
        FD_CHECK(ctx_, "all_gather on a disconnected group");
        if (cfg_.world_size == 1 || n == 0) {
            std::copy_n(send, n, recv);
            return;
        }
        try {
            gloo::AllgatherOptions opts(ctx_);
            opts.setInput(const_cast<float *>(send), static_cast<size_t>(n));  // gloo only reads the input
            opts.setOutput(recv, static_cast<size_t>(n * cfg_.world_size));
            opts.setTag(tag_++);
            opts.setTimeout(timeout());
            gloo::allgather(opts);
        } catch (const gloo::Exception & e) {
            fail(Errc::rank_failed, "all-gather on rank {} failed (a peer rank died or hung): {}", cfg_.rank, e.what());
        }
    }

    void barrier() override {
        FD_CHECK(ctx_, "barrier on a disconnected group");
        try {
            gloo::BarrierOptions opts(ctx_);
            opts.setTag(tag_++);
            opts.setTimeout(timeout());
            gloo::barrier(opts);
        } catch (const gloo::Exception & e) {
            fail(Errc::rank_failed, "barrier on rank {} failed (a peer rank died or hung): {}", cfg_.rank, e.what());
        }
    }

private:
    std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(static_cast<int64_t>(cfg_.timeout_s * 1000)); }

    GlooCommConfig                    cfg_;
    std::shared_ptr<TcpStoreClient>   store_;
    std::shared_ptr<gloo::Context>    ctx_;
    uint32_t                          tag_ = 0;
    std::vector<float>                all_;   ///< all_reduce_sum's gathered buffers [world, n]
};

}  // namespace

void Comm::all_gather(const float *, int64_t, float *) {
    fail(Errc::internal, "comm '{}' has no all_gather (expert parallelism needs it)", name());
}

std::unique_ptr<Comm> make_null_comm() { return std::make_unique<NullComm>(); }

std::unique_ptr<Comm> make_gloo_comm(const GlooCommConfig & cfg) { return std::make_unique<GlooComm>(cfg); }

}  // namespace fd::comm
