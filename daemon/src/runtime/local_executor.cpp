// LocalExecutor: tensor-parallel size 1, the rank's Worker in this process; every rank
// operation runs the rank-call table's row on it (rank_ops.cpp).
#include "fd/arena.h"
#include "fd/runtime/executor.h"

#include "rank_ops.h"

#include <algorithm>
#include <chrono>
#include <mutex>

namespace fd::runtime {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

class LocalExecutor final : public Executor {
public:
    LocalExecutor(std::unique_ptr<model::Worker> worker, std::unique_ptr<weights::WeightSource> source, int32_t rank,
                  bool hold_fetched)
        : site_{.worker = std::move(worker), .source = std::move(source), .rank = rank, .hold_fetched = hold_fetched} {}

    int32_t world_size() const override { return 1; }
    const model::ModelConfig & model_config() const override { return site_.worker->config(); }

    bool forward(const model::StepBatch & batch, float * logits, const std::atomic<bool> * abandon) override {
        return site_.worker->forward(batch, logits, abandon);
    }

    const int32_t * step_routes() const override { return site_.worker->step_routes(); }

    const float * forward_in_place(const model::StepBatch & batch, const std::atomic<bool> * abandon) override {
        // At least one element, so a step without logits rows still returns non-null.
        logits_.resize(std::max<size_t>(1, batch.logits_rows.size() * static_cast<size_t>(site_.worker->config().vocab_size)));
        return site_.worker->forward(batch, logits_.data(), abandon) ? logits_.data() : nullptr;
    }

    void draft_mtp(const model::DraftBatch & db, std::vector<int32_t> & drafts) override { site_.worker->draft_mtp(db, drafts); }
    int64_t mtp_cache_bytes() const override { return site_.worker->mtp_cache_bytes(); }

    /// The one rank runs the table's row (rank_ops.cpp); a release measures the device again.
    std::vector<RankReport> rank_call(const RankRequest & req) override {
        RankReport r = run_rank_op(site_, req);
        if (req.op == RankOp::release || req.op == RankOp::release_graphs || req.op == RankOp::mem_info) { refresh_rank_devices(0.0); }
        return {std::move(r)};
    }

    std::vector<RankReport> stage_weights(const weights::FetchRequest & req) override {
        return rank_call({.op = RankOp::stage, .fetch = req});
    }
    std::vector<RankReport> commit_weights() override { return rank_call({.op = RankOp::commit}); }
    void drop_staged_weights() override { rank_call({.op = RankOp::drop}); }
    void release_fetched() override { rank_call({.op = RankOp::release_fetched}); }
    std::vector<RankReport> release(MemoryTag tag) override { return rank_call({.op = RankOp::release, .tag = tag}); }
    std::vector<RankReport> acquire_kv() override { return rank_call({.op = RankOp::acquire_kv}); }
    std::vector<RankReport> reload_weights(const weights::FetchRequest & req) override {
        return rank_call({.op = RankOp::reload, .fetch = req});
    }

    void swap_kv(const kv::BlockCopy * out, int64_t n_out, const kv::BlockCopy * in, int64_t n_in, const kv::BlockCopy * bg,
                 int64_t n_bg) override {
        site_.worker->swap_out(out, n_out);  // waits for the background copies first
        site_.worker->swap_in(in, n_in);
        site_.worker->swap_out_background(bg, n_bg);
    }

    int64_t weight_bytes() const override { return site_.worker->weight_bytes(); }
    int64_t kv_bytes() const override { return site_.worker->kv_bytes(); }

    std::vector<RankDevice> rank_devices() const override {
        std::lock_guard lk(dev_mu_);
        return dev_.measured == Clock::time_point{} ? std::vector<RankDevice>{} : std::vector<RankDevice>{dev_};
    }

    void refresh_rank_devices(double max_age_s) override {
        model::Worker & w = *site_.worker;
        if (w.backend().kind() != kernels::DeviceKind::cuda) { return; }
        const auto now = Clock::now();
        {
            std::lock_guard lk(dev_mu_);
            if (dev_.measured != Clock::time_point{} && seconds_since(dev_.measured) < max_age_s) { return; }
        }
        RankDevice d{.rank = site_.rank, .device = w.device_id()};
        const auto m = w.backend().mem_info();
        d.free_bytes  = m.free_bytes;
        d.total_bytes = m.total_bytes;
        for (int t = 0; t < 4; ++t) { d.held_bytes[t] = w.allocator().held_bytes(static_cast<memory::Tag>(t)); }
        d.measured = now;
        std::lock_guard lk(dev_mu_);
        dev_ = d;
    }

private:
    RankSite                                site_;         ///< the Worker, its source, the held fetch
    std::vector<float>                      logits_;       ///< forward_in_place's [rows, vocab]; only grows
    mutable std::mutex                      dev_mu_;
    RankDevice                              dev_;          ///< cuda: the last refresh_rank_devices (measured 0: never)
};

}  // namespace

std::unique_ptr<Executor> make_local_executor(std::unique_ptr<model::Worker> worker, std::unique_ptr<weights::WeightSource> source,
                                              int32_t rank, bool hold_fetched) {
    return std::make_unique<LocalExecutor>(std::move(worker), std::move(source), rank, hold_fetched);
}

}  // namespace fd::runtime
