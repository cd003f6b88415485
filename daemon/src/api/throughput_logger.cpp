#include "fd/api/throughput_logger.h"

#include "fd/log.h"

#include <fmt/format.h>

#include <chrono>

namespace fd::api {

std::string ThroughputLogger::format_line(const engine::EngineStats & a, const engine::EngineStats & b, double dt_s) {
    const int64_t d_prompt = b.n_tokens_prompt_total - a.n_tokens_prompt_total;
    const int64_t d_gen    = b.n_tokens_generated_total - a.n_tokens_generated_total;
    if (d_prompt == 0 && d_gen == 0 && b.n_running == 0 && b.n_waiting == 0) { return ""; }
    const double kv_pct = b.n_kv_blocks_total > 0 ? 100.0 * static_cast<double>(b.n_kv_blocks_used) / static_cast<double>(b.n_kv_blocks_total) : 0.0;
    const double dt     = dt_s > 0 ? dt_s : 1.0;
    return fmt::format("throughput: prompt {:.1f} tok/s, generation {:.1f} tok/s | running {}, waiting {} | KV {:.1f}% used | new requests {} | "
                       "weight_version {}",
                       static_cast<double>(d_prompt) / dt, static_cast<double>(d_gen) / dt, b.n_running, b.n_waiting, kv_pct,
                       b.n_requests_total - a.n_requests_total, b.state.weight_version);
}

void ThroughputLogger::start() {
    if (!(interval_s_ > 0) || thread_.joinable()) { return; }
    thread_ = std::thread([this] {
        auto lg   = log::get("stats");
        auto prev = engine_.stats();
        auto t0   = std::chrono::steady_clock::now();
        std::unique_lock lk(mu_);
        while (!cv_.wait_for(lk, std::chrono::duration<double>(interval_s_), [&] { return stop_; })) {
            auto       now = engine_.stats();
            const auto t1  = std::chrono::steady_clock::now();
            const auto line = format_line(prev, now, std::chrono::duration<double>(t1 - t0).count());
            if (!line.empty()) { lg->info("{}", line); }
            prev = std::move(now);
            t0   = t1;
        }
    });
}

void ThroughputLogger::stop() {
    {
        std::lock_guard lk(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) { thread_.join(); }
}

}  // namespace fd::api
