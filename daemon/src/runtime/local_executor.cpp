// LocalExecutor: tensor-parallel size 1, the rank's Worker in this process.
#include "fd/arena.h"
#include "fd/runtime/executor.h"

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
        : worker_(std::move(worker)), source_(std::move(source)), rank_(rank), hold_fetched_(hold_fetched) {}

    int32_t world_size() const override { return 1; }
    const model::ModelConfig & model_config() const override { return worker_->config(); }

    bool forward(const model::StepBatch & batch, float * logits, const std::atomic<bool> * abandon) override {
        return worker_->forward(batch, logits, abandon);
    }

    const float * forward_in_place(const model::StepBatch & batch, const std::atomic<bool> * abandon) override {
        // At least one element, so a step without logits rows still returns non-null.
        logits_.resize(std::max<size_t>(1, batch.logits_rows.size() * static_cast<size_t>(worker_->config().vocab_size)));
        return worker_->forward(batch, logits_.data(), abandon) ? logits_.data() : nullptr;
    }

    std::vector<RankReport> stage_weights(const weights::FetchRequest & req) override {
        RankReport r{.rank = rank_};
        weights::FetchedCheckpoint ckpt = fetch(req, r);
        const auto t1 = Clock::now();
        r.bytes             = worker_->stage_weights(ckpt.index, ckpt.verify_copied);
        if (hold_fetched_) { fetch_hold_ = ckpt.hold; }
        r.stage_s           = seconds_since(t1);
        r.version           = ckpt.version;
        r.fingerprint       = ckpt.fingerprint;
        r.checksum_verified = ckpt.checksum_verified;
        r.rss_bytes         = process_rss_bytes();
        return {r};
    }

    std::vector<RankReport> commit_weights() override {
        const auto t0 = Clock::now();
        worker_->commit_staged();
        RankReport r{.rank = rank_};
        r.commit_s  = seconds_since(t0);
        r.rss_bytes = process_rss_bytes();
        return {r};
    }

    void drop_staged_weights() override {
        worker_->drop_staged();
        fetch_hold_.reset();
    }

    void release_fetched() override { fetch_hold_.reset(); }

    std::vector<RankReport> release(MemoryTag tag) override {
        RankReport r{.rank = rank_};
        const bool    cuda = worker_->backend().kind() == kernels::DeviceKind::cuda;
        const int64_t free0 = cuda ? worker_->backend().mem_info().free_bytes : 0;
        r.freed_bytes = worker_->release(tag);
        if (cuda) { r.device_freed_bytes = worker_->backend().mem_info().free_bytes - free0; }
        r.rss_bytes   = process_rss_bytes();
        refresh_rank_devices(0.0);
        return {r};
    }

    std::vector<RankReport> acquire_kv() override {
        worker_->acquire_kv();
        RankReport r{.rank = rank_};
        r.rss_bytes = process_rss_bytes();
        return {r};
    }

    void swap_kv(const kv::BlockCopy * out, int64_t n_out, const kv::BlockCopy * in, int64_t n_in, const kv::BlockCopy * bg,
                 int64_t n_bg) override {
        worker_->swap_out(out, n_out);  // waits for the background copies first
        worker_->swap_in(in, n_in);
        worker_->swap_out_background(bg, n_bg);
    }

    std::vector<RankReport> reload_weights(const weights::FetchRequest & req) override {
        RankReport r{.rank = rank_};
        weights::FetchedCheckpoint ckpt = fetch(req, r);
        const auto t1 = Clock::now();
        worker_->reload_weights(ckpt.index, ckpt.verify_copied);
        if (hold_fetched_) { fetch_hold_ = ckpt.hold; }
        r.stage_s   = seconds_since(t1);
        r.bytes     = ckpt.index.total_bytes;
        r.version     = ckpt.version;
        r.fingerprint = ckpt.fingerprint;
        r.rss_bytes   = process_rss_bytes();
        return {r};
    }

    int64_t weight_bytes() const override { return worker_->weight_bytes(); }
    int64_t kv_bytes() const override { return worker_->kv_bytes(); }

    std::vector<RankDevice> rank_devices() const override {
        std::lock_guard lk(dev_mu_);
        return dev_.measured == Clock::time_point{} ? std::vector<RankDevice>{} : std::vector<RankDevice>{dev_};
    }

    void refresh_rank_devices(double max_age_s) override {
        if (worker_->backend().kind() != kernels::DeviceKind::cuda) { return; }
        const auto now = Clock::now();
        {
            std::lock_guard lk(dev_mu_);
            if (dev_.measured != Clock::time_point{} && seconds_since(dev_.measured) < max_age_s) { return; }
        }
        RankDevice d{.rank = rank_, .device = worker_->device_id()};
        const auto m = worker_->backend().mem_info();
        d.free_bytes  = m.free_bytes;
        d.total_bytes = m.total_bytes;
        for (int t = 0; t < 4; ++t) { d.held_bytes[t] = worker_->allocator().held_bytes(static_cast<memory::Tag>(t)); }
        d.measured = now;
        std::lock_guard lk(dev_mu_);
        dev_ = d;
    }

private:
    /// This rank's checkpoint for `req`; the time it took goes to r.fetch_s.
    weights::FetchedCheckpoint fetch(const weights::FetchRequest & req, RankReport & r) {
        const auto t0 = Clock::now();
        weights::FetchRequest mine = req;
        mine.rank = rank_;
        mine.device_destination = worker_->backend().kind() == kernels::DeviceKind::cuda;  // ipc: device to device
        weights::FetchedCheckpoint ckpt = req.weight_dir.empty() ? source_->fetch(mine)
                                                                 : weights::fetch_checkpoint_dir(req.weight_dir, req.weight_dir_owned);
        r.fetch_s = seconds_since(t0);
        return ckpt;
    }

    std::unique_ptr<model::Worker>          worker_;
    std::unique_ptr<weights::WeightSource>  source_;
    int32_t                                 rank_ = 0;
    bool                                    hold_fetched_ = false;
    std::shared_ptr<void>                   fetch_hold_;   ///< the last fetch, until commit / drop (hold_fetched_)
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
