// tests/bench/control_analysis.cpp — where the time of update, wakeup and sleep goes, stage by
// stage, with fd_core's own functions (part of fd_control_bench).
#include "control_analysis.h"

#include "bench_memory.h"
#include "bench_util.h"
#include "fd/arena.h"
#include "fd/kernels/cpu_ops.h"
#include "fd/kernels/thread_pool.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/model/weights.h"

#include <algorithm>
#include <memory>
#include <vector>

namespace fd::bench {
namespace M = fd::model;
using json = nlohmann::ordered_json;

namespace {

double gbs(int64_t bytes, double s) { return s > 0 ? round_to(static_cast<double>(bytes) / s / 1e9, 3) : 0.0; }

}  // namespace

json analyse(const std::string & dir, const M::ModelConfig & cfg, double memcpy_bps, int n_threads) {
    json j;
    // fetch: what NormalSource::fetch + validate do on every update.
    double t_fetch = 1e300;
    M::TensorIndex idx;
    for (int r = 0; r < 3; ++r) {
        const auto t0 = Clock::now();
        idx = M::read_tensor_index(dir);
        (void)M::read_version_step(dir);
        M::validate_checkpoint(cfg, idx);
        t_fetch = std::min(t_fetch, seconds_since(t0));
    }
    const M::WeightLayout layout = M::plan_layout(cfg, idx);
    const int64_t total = idx.total_bytes;
    j["checkpoint_bytes"] = total;
    j["tensors"] = static_cast<int64_t>(idx.tensors.size());
    j["weights_arena_bytes"] = layout.arena_bytes;
    j["fetch_index_validate_ms"] = round_to(t_fetch * 1e3, 6);

    // update: fill_weights into a resident (pre-faulted) staging arena, 1 thread and the pool.
    kernels::ThreadPool pool(n_threads);
    json up;
    fd::Arena st("staging");
    auto t0 = Clock::now();
    st.reserve(layout.arena_bytes, /*populate=*/true);
    const double t_populate = seconds_since(t0);
    M::fill_weights(layout, idx, st.data(), &pool);  // warm: page cache
    // The NaN/Inf check is fused into the copy (each 256 KiB piece scanned right after its
    // read); on and off are timed alternately, best of 3 each, so both see the same machine.
    for (kernels::ThreadPool * p : {static_cast<kernels::ThreadPool *>(nullptr), &pool}) {
        double best_on = 1e300, best_off = 1e300;
        for (int r = 0; r < 3; ++r) {
            for (bool check : {true, false}) {
                t0 = Clock::now();
                M::fill_weights(layout, idx, st.data(), p, {.check_finite = check});
                (check ? best_on : best_off) = std::min(check ? best_on : best_off, seconds_since(t0));
            }
        }
        const std::string key = p ? "fill_resident_" + std::to_string(n_threads) + "_threads" : "fill_resident_1_thread";
        up[key + "_s"] = round_to(best_on, 6);
        up[key + "_gbs"] = gbs(total, best_on);
        up[key + "_vs_memcpy"] = round_to(static_cast<double>(total) / best_on / memcpy_bps, 3);
        up[key + "_no_finite_check_vs_memcpy"] = round_to(static_cast<double>(total) / best_off / memcpy_bps, 3);
        up[key + "_finite_check_cost"] = round_to(best_on / best_off, 3);  // time with ÷ time without
    }
    // The check itself: find_nonfinite over one 256 KiB piece already in cache (as the fill
    // runs it, right after the piece's pread), best of 5 x 200 scans. Its cost per byte
    // relative to a DRAM-speed copy bounds what the check can add: time × (1 + memcpy ÷ scan).
    {
        const int64_t piece = 256 << 10;
        std::vector<float> f(static_cast<size_t>(piece / 4), 0.5f);
        std::vector<uint16_t> b(static_cast<size_t>(piece / 2), 0x3f00);
        for (int kind = 0; kind < 2; ++kind) {
            double best = 1e300;
            int64_t sink = 0;
            for (int r = 0; r < 5; ++r) {
                t0 = Clock::now();
                for (int i = 0; i < 200; ++i) {
                    sink += kind == 0 ? kernels::find_nonfinite_f32(f.data(), piece / 4) : kernels::find_nonfinite_bf16(b.data(), piece / 2);
                }
                best = std::min(best, seconds_since(t0));
            }
            const double scan_bps = 200.0 * static_cast<double>(piece) / best + static_cast<double>(sink == 1);
            up[kind == 0 ? "finite_scan_f32_l2_gbs" : "finite_scan_bf16_l2_gbs"] = round_to(scan_bps / 1e9, 2);
            up[kind == 0 ? "finite_scan_f32_bound_cost" : "finite_scan_bf16_bound_cost"] = round_to(1.0 + memcpy_bps / scan_bps, 3);
        }
    }
    up["populate_fresh_s"] = round_to(t_populate, 6);
    up["populate_fresh_gbs"] = gbs(layout.arena_bytes, t_populate);
    j["update_path"] = up;

    // wakeup: a fresh (not pre-faulted) arena filled over the pool, as Worker::reload_weights.
    json wk;
    fd::Arena fresh("fresh");
    t0 = Clock::now();
    fresh.reserve(layout.arena_bytes);
    M::fill_weights(layout, idx, fresh.data(), &pool);
    const double t_wake = seconds_since(t0);
    wk["fill_fresh_s"] = round_to(t_wake, 6);
    wk["fill_fresh_gbs"] = gbs(total, t_wake);
    wk["fill_fresh_vs_memcpy"] = round_to(static_cast<double>(total) / t_wake / memcpy_bps, 3);
    j["wakeup_path"] = wk;

    // sleep: munmap of the resident weights (2 MiB pages when the arena is big enough).
    json sl;
    t0 = Clock::now();
    fresh.release();
    sl["weights_munmap_s"] = round_to(seconds_since(t0), 6);
    sl["anon_huge_pages_bytes_before"] = smaps_rollup_bytes("AnonHugePages:");
    j["sleep_path"] = sl;
    return j;
}

}  // namespace fd::bench
