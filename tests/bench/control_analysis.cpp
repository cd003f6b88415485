// tests/bench/control_analysis.cpp — where the time of update, wakeup and sleep goes, stage by
// stage, with fd_core's own functions (part of fd_control_bench).
#include "fd/api/server.h"
#include "fd/arena.h"
#include "fd/config.h"
#include "fd/engine/engine.h"
#include "fd/kernels/ops.h"
#include "fd/log.h"
#include "fd/model/model_config.h"
#include "fd/model/safetensors.h"
#include "fd/model/tokenizer.h"
#include "fd/model/weights.h"
#include "fd/model/worker.h"
#include "fd/status.h"
#include "fd/weights/weight_source.h"
#include "bench_util.h"
#include <CLI/CLI.hpp>
#include <httplib.h>
#include <nlohmann/json.hpp>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include "bench_memory.h"
#include "control_analysis.h"

namespace fd::bench {
namespace M = fd::model;
using json = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------
// Analysis: the same paths, stage by stage, with fd_core's own functions
// ---------------------------------------------------------------------------------------------

double gbs(int64_t bytes, double s) { return s > 0 ? round_to(static_cast<double>(bytes) / s / 1e9, 3) : 0.0; }

json analyse(const std::string & dir, const M::ModelConfig & cfg, double memcpy_bps) {
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
    const int64_t total = idx.total_bytes, n_tensors = static_cast<int64_t>(idx.tensors.size());
    const int64_t staging_bytes = total + 64 * n_tensors;
    const int64_t warena_bytes  = M::weights_arena_bytes(cfg);
    j["checkpoint_bytes"] = total;
    j["tensors"] = n_tensors;
    j["weights_arena_bytes"] = warena_bytes;
    j["fetch_index_validate_ms"] = round_to(t_fetch * 1e3, 6);

    // update, sync half: staging arena (fresh, not pre-faulted) + one pread per tensor.
    json up;
    fd::Arena st_fresh("staging_fresh");
    auto t0 = Clock::now();
    st_fresh.reserve(staging_bytes);
    for (const auto & [name, t] : idx.tensors) { M::read_tensor_raw(t, st_fresh.alloc_floats((t.size_bytes + 3) / 4)); }
    const double t_stage_fresh = seconds_since(t0);
    // The same into pre-faulted memory: separates page faults from the page-cache copy.
    fd::Arena st("staging_prefaulted");
    t0 = Clock::now();
    st.reserve(staging_bytes, /*populate=*/true);
    const double t_populate = seconds_since(t0);
    std::map<std::string, const void *> staged;
    t0 = Clock::now();
    for (const auto & [name, t] : idx.tensors) {
        void * p = st.alloc_floats((t.size_bytes + 3) / 4);
        M::read_tensor_raw(t, p);
        staged[name] = p;
    }
    const double t_stage_pre = seconds_since(t0);
    t0 = Clock::now();
    st_fresh.release();
    const double t_unmap_staging = seconds_since(t0);
    up["stage_pread_fresh_s"] = round_to(t_stage_fresh, 6);
    up["stage_pread_fresh_gbs"] = gbs(total, t_stage_fresh);
    up["stage_populate_s"] = round_to(t_populate, 6);
    up["stage_populate_gbs"] = gbs(staging_bytes, t_populate);
    up["stage_pread_prefaulted_s"] = round_to(t_stage_pre, 6);
    up["stage_pread_prefaulted_gbs"] = gbs(total, t_stage_pre);
    up["staging_munmap_s"] = round_to(t_unmap_staging, 6);

    // update, apply half: fill_weights over live (resident) weights, as Worker::update_weights.
    fd::Arena wa("weights");
    t0 = Clock::now();
    wa.reserve(warena_bytes, /*populate=*/true);
    const double t_populate_w = seconds_since(t0);
    M::ModelWeights w;
    double t_conv = 0.0;
    auto conv_reader = [&](const std::string & name, float * dst) {
        const auto c0 = Clock::now();
        const M::TensorInfo & t = idx.tensors.at(name);
        M::convert_to_f32(t.dtype, staged.at(name), dst, t.numel());
        t_conv += seconds_since(c0);
    };
    M::fill_weights(cfg, conv_reader, &wa, w);  // lays out w (first pass; also grows fill_weights' tmp)
    t_conv = 0.0;
    t0 = Clock::now();
    M::fill_weights(cfg, conv_reader, nullptr, w);  // the in-place update
    const double t_apply = seconds_since(t0);
    up["apply_fill_weights_s"] = round_to(t_apply, 6);
    up["apply_convert_s"] = round_to(t_conv, 6);
    up["apply_convert_out_gbs"] = gbs(warena_bytes, t_conv);
    up["apply_pack_and_copy_s"] = round_to(t_apply - t_conv, 6);
    up["apply_pack_and_copy_out_gbs"] = gbs(warena_bytes, t_apply - t_conv);
    const double t_update_model = t_fetch + t_stage_fresh + t_apply + t_unmap_staging;
    up["modelled_total_s"] = round_to(t_update_model, 6);
    up["modelled_gbs"] = gbs(total, t_update_model);
    up["modelled_ratio_vs_memcpy"] = round_to(static_cast<double>(total) / t_update_model / memcpy_bps, 6);
    // Lower bound for this design on one thread: the bytes it must move, at memcpy speed
    // (pread copies the checkpoint once; convert+pack reads it and writes f32 twice: tmp, arena).
    up["memcpy_time_of_checkpoint_s"] = round_to(static_cast<double>(total) / memcpy_bps, 6);
    up["memcpy_time_of_f32_weights_s"] = round_to(static_cast<double>(warena_bytes) / memcpy_bps, 6);
    j["update_path"] = up;
    st.release();

    // sleep: munmap of the resident weights (4 KiB pages).
    json sl;
    t0 = Clock::now();
    wa.release();
    const double t_unmap_w = seconds_since(t0);
    sl["weights_munmap_s"] = round_to(t_unmap_w, 6);
    sl["weights_pages_4k"] = warena_bytes / 4096;
    sl["weights_munmap_ns_per_4k_page"] = round_to(t_unmap_w * 1e9 / static_cast<double>(warena_bytes / 4096), 1);
    sl["weights_populate_s"] = round_to(t_populate_w, 6);
    j["sleep_path"] = sl;

    // wakeup: Worker::reload_weights → load_weights: reserve (not pre-faulted), read_tensor_f32
    // per tensor (a zeroed std::vector, pread, convert), pack into fresh arena pages.
    json wk;
    double t_vec = 0.0, t_pread = 0.0, t_conv2 = 0.0, t_free = 0.0;
    auto f32_reader = [&](const std::string & name, float * dst) {  // read_tensor_f32, instrumented
        const M::TensorInfo & t = idx.tensors.at(name);
        if (t.dtype == M::DType::f32) {
            const auto c0 = Clock::now();
            M::read_tensor_raw(t, dst);
            t_pread += seconds_since(c0);
            return;
        }
        auto c0 = Clock::now();
        auto raw = std::make_unique<std::vector<uint16_t>>(static_cast<size_t>(t.numel()));
        t_vec += seconds_since(c0);
        c0 = Clock::now();
        M::read_tensor_raw(t, raw->data());
        t_pread += seconds_since(c0);
        c0 = Clock::now();
        M::convert_to_f32(t.dtype, raw->data(), dst, t.numel());
        t_conv2 += seconds_since(c0);
        c0 = Clock::now();
        raw.reset();
        t_free += seconds_since(c0);
    };
    fd::Arena fa("weights_wakeup");
    M::ModelWeights w2;
    t0 = Clock::now();
    M::validate_checkpoint(cfg, idx);
    fa.reserve(warena_bytes);
    M::fill_weights(cfg, f32_reader, &fa, w2);
    const double t_wake = seconds_since(t0);
    const double t_read_parts = t_vec + t_pread + t_conv2 + t_free;
    wk["load_weights_s"] = round_to(t_wake, 6);
    wk["load_weights_gbs"] = gbs(total, t_wake);
    wk["read_vector_alloc_zero_s"] = round_to(t_vec, 6);
    wk["read_pread_s"] = round_to(t_pread, 6);
    wk["read_convert_s"] = round_to(t_conv2, 6);
    wk["read_vector_free_s"] = round_to(t_free, 6);
    wk["pack_copy_and_arena_faults_s"] = round_to(t_wake - t_read_parts, 6);
    // The same fill again into the now-resident arena: the difference is the arena's page faults.
    t_vec = t_pread = t_conv2 = t_free = 0.0;
    t0 = Clock::now();
    M::fill_weights(cfg, f32_reader, nullptr, w2);
    const double t_wake_warm = seconds_since(t0);
    wk["refill_resident_arena_s"] = round_to(t_wake_warm, 6);
    wk["arena_first_touch_s_est"] = round_to(t_wake - t_wake_warm, 6);
    j["wakeup_path"] = wk;
    fa.release();

    // Kernels alone on the largest packed linear of a layer (gate|up, [2*ff, hidden]): what the
    // apply step does per tensor today (bf16_to_f32 into a temporary, then pack_linear), against a
    // plain memcpy of the f32 bytes and a fused bf16 -> packed-f32 pass, on 1 and 2 threads.
    {
        const int64_t n_out = 2 * int64_t(cfg.intermediate_size), n_in = cfg.hidden_size;
        const int64_t n = n_out * n_in;
        const int64_t packed_floats = fd::kernels::packed_linear_floats(n_out, n_in);
        Mapping src(static_cast<size_t>(n) * 4), dst(static_cast<size_t>(packed_floats) * 4 + 4096);
        Mapping b16(static_cast<size_t>(n) * 2);
        auto * s = reinterpret_cast<float *>(src.p);
        auto * h = reinterpret_cast<uint16_t *>(b16.p);
        auto * d = reinterpret_cast<float *>(dst.p);
        for (int64_t i = 0; i < n; ++i) { s[i] = static_cast<float>(i % 1000) * 1e-3f; h[i] = static_cast<uint16_t>(0x3c00 + (i % 512)); }
        std::memset(dst.p, 0, dst.bytes);
        auto best = [](const std::function<void()> & f) {
            double b = 1e300;
            for (int r = 0; r < 3; ++r) { const auto c0 = Clock::now(); f(); b = std::min(b, seconds_since(c0)); }
            return b;
        };
        // Rows [r0, r1) (multiples of 32) of the packed layout, from bf16, in one pass.
        auto fused = [&](int64_t r0, int64_t r1) {
            constexpr int kP = 32;
            for (int64_t p = r0 / kP; p < (r1 + kP - 1) / kP; ++p) {
                float * out = d + p * n_in * kP;
                for (int64_t k = 0; k < n_in; ++k) {
                    for (int c = 0; c < kP; ++c) {
                        const int64_t o = p * kP + c;
                        const uint32_t bits = o < n_out ? static_cast<uint32_t>(h[o * n_in + k]) << 16 : 0u;
                        std::memcpy(&out[k * kP + c], &bits, 4);
                    }
                }
            }
        };
        const int64_t half = (n_out / 2 + 31) / 32 * 32;
        auto two = [&](const std::function<void(int64_t, int64_t)> & f) {
            std::thread t([&] { f(half, n_out); });
            f(0, half);
            t.join();
        };
        const double tp  = best([&] { fd::kernels::pack_linear(d, s, n_out, n_in); });
        const double tm  = best([&] { std::memcpy(dst.p, src.p, static_cast<size_t>(n) * 4); });
        const double tc  = best([&] { fd::kernels::bf16_to_f32(d, h, n); });
        const double tf1 = best([&] { fused(0, n_out); });
        const double tf2 = best([&] { two(fused); });
        const double tp2 = best([&] { two([&](int64_t r0, int64_t r1) { fd::kernels::pack_linear(d + r0 * n_in, s + r0 * n_in, r1 - r0, n_in); }); });
        j["kernels"] = {{"shape", {n_out, n_in}},
                        {"f32_bytes", n * 4},
                        {"memcpy_f32_gbs", gbs(n * 4, tm)},
                        {"bf16_to_f32_out_gbs", gbs(n * 4, tc)},
                        {"pack_linear_out_gbs", gbs(n * 4, tp)},
                        {"today_convert_then_pack_out_gbs", gbs(n * 4, tc + tp)},
                        {"pack_linear_2_threads_out_gbs", gbs(n * 4, tp2)},
                        {"fused_bf16_pack_out_gbs", gbs(n * 4, tf1)},
                        {"fused_bf16_pack_2_threads_out_gbs", gbs(n * 4, tf2)}};
    }

    // Page size what-if: first touch and munmap of a mapping (the weights' size, at most 1 GiB),
    // 4 KiB pages (what Arena gets) vs 2 MiB transparent huge pages (madvise).
    {
        json th;
        const int64_t bytes = std::min<int64_t>(warena_bytes, 1LL << 30);
        th["bytes"] = bytes;
        for (bool huge : {false, true}) {
            Mapping m(static_cast<size_t>(bytes), huge);
            auto c0 = Clock::now();
            std::memset(m.p, 1, m.bytes);
            const double t_touch = seconds_since(c0);
            const int64_t anon_huge = smaps_rollup_bytes("AnonHugePages:");
            c0 = Clock::now();
            m.unmap();
            const double t_unmap = seconds_since(c0);
            const double scale = static_cast<double>(warena_bytes) / static_cast<double>(bytes);
            th[huge ? "thp_2m" : "pages_4k"] = {{"first_touch_s", round_to(t_touch, 6)}, {"first_touch_gbs", gbs(bytes, t_touch)},
                                                {"munmap_s", round_to(t_unmap, 6)},
                                                {"munmap_s_scaled_to_weights", round_to(t_unmap * scale, 6)},
                                                {"anon_huge_pages_bytes", anon_huge}};
        }
        j["page_size_whatif"] = th;
    }
    return j;
}

}  // namespace fd::bench
