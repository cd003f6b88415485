// fd_kv_copy_bench: the host KV tier's block copies against memcpy (issue #27). An in-process
// executor over the model, with a device KV pool and a host (kv_swap) pool of --blocks blocks
// each, runs Executor::swap_kv — the path every tier and preemption copy takes (Worker →
// backend download/upload, per layer K and V) — copying --blocks blocks device → host, then
// host → device; the reference is one memcpy of the same number of bytes between two
// pre-touched buffers. Rounds alternate the three and each figure is a median. One JSON object:
// bytes/s of each and the ratios copy / memcpy (goal >= 0.7).
//   fd_kv_copy_bench --model DIR [--blocks 256] [--rounds 9] [--device cpu|cuda]
#include "fd/kv/block_copy.h"
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/model/worker.h"
#include "fd/runtime/executor.h"
#include "fd/weights/weight_source.h"
#include "bench_util.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstring>
#include <iostream>
#include <vector>

using json = nlohmann::ordered_json;
using fd::bench::Clock;
using fd::bench::median;
using namespace fd;

int main(int argc, char ** argv) {
    CLI::App app{"fd_kv_copy_bench: host KV tier block copies (swap_kv) vs memcpy of the same bytes"};
    std::string model, device = "cpu";
    int64_t     blocks = 256;
    int32_t     rounds = 9, threads = 1;
    app.add_option("--model", model, "Checkpoint dir")->required();
    app.add_option("--blocks", blocks, "Blocks per copy call");
    app.add_option("--rounds", rounds, "Alternating rounds (median taken)");
    app.add_option("--threads", threads, "Kernel threads");
    app.add_option("--device", device, "cpu | cuda");
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError & e) {
        return app.exit(e);
    }
    try {
        const auto cfg = model::load_model_config(model);
        model::WorkerConfig w{.n_threads = threads, .block_size = 16, .n_blocks = blocks, .n_swap_blocks = blocks, .max_model_len = 64};
        w.device = device == "cuda" ? kernels::DeviceKind::cuda : kernels::DeviceKind::cpu;
        weights::SourceConfig src{.strategy = weights::LoadStrategy::normal, .model_dir = model};
        auto ex = runtime::make_local_executor(std::make_unique<model::Worker>(cfg, model::read_tensor_index(model), w),
                                               weights::make_weight_source(src));
        const int64_t block_bytes = model::Worker::kv_block_bytes(cfg, 16);
        const int64_t bytes       = blocks * block_bytes;
        std::vector<kv::BlockCopy> copies(static_cast<size_t>(blocks));
        for (int64_t i = 0; i < blocks; ++i) { copies[static_cast<size_t>(i)] = {static_cast<int32_t>(i), static_cast<int32_t>(blocks - 1 - i)}; }
        std::vector<std::byte> a(static_cast<size_t>(bytes)), b(static_cast<size_t>(bytes));
        std::memset(a.data(), 1, a.size());
        std::memset(b.data(), 2, b.size());
        auto time = [](auto && f) {
            const auto t0 = Clock::now();
            f();
            return fd::bench::seconds_since(t0);
        };
        auto out = [&] { ex->swap_kv(copies.data(), blocks, nullptr, 0); };
        auto in  = [&] { ex->swap_kv(nullptr, 0, copies.data(), blocks); };
        auto ref = [&] { std::memcpy(b.data(), a.data(), a.size()); };
        out(), in(), ref();  // warm-up: every page touched
        std::vector<double> t_out, t_in, t_ref;
        for (int32_t r = 0; r < rounds; ++r) {
            t_ref.push_back(time(ref));
            t_out.push_back(time(out));
            t_in.push_back(time(in));
        }
        const double m_out = median(t_out), m_in = median(t_in), m_ref = median(t_ref);
        json j;
        j["bench"]       = "kv_tier_block_copy";
        j["model"]       = model;
        j["device"]      = device;
        j["blocks"]      = blocks;
        j["block_bytes"] = block_bytes;
        j["bytes"]       = bytes;
        j["rounds"]      = rounds;
        j["gb_per_s"]    = {{"memcpy", bytes / m_ref / 1e9}, {"device_to_host", bytes / m_out / 1e9}, {"host_to_device", bytes / m_in / 1e9}};
        j["ratios"]      = {{"device_to_host_over_memcpy", m_ref / m_out}, {"host_to_device_over_memcpy", m_ref / m_in}};
        std::cout << j.dump(1) << std::endl;
    } catch (const std::exception & e) {
        std::cerr << "fd_kv_copy_bench: " << e.what() << std::endl;
        return 1;
    }
    return 0;
}
