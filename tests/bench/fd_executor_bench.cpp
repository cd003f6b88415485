// fd_executor_bench: what the multi-process executor costs against the in-process one (issue #9).
// Both executors are built over the same model with the same threads; decode steps of a fixed
// batch are timed in alternating rounds (uni, mp, uni, mp, ...) so machine noise hits both, and
// the result is printed as ratios mp / uni: the step link's overhead per step (goal <= 1.02), and
// the latency of the control calls behind sleep, wakeup and update_weights. One JSON object.
//   fd_executor_bench --model DIR --rank-binary build/fdrollout [--threads 1] [--batches 1,64]
#include "fd/model/model_config.h"
#include "fd/model/safetensors.h"
#include "fd/runtime/mp_executor.h"
#include "bench_batch.h"
#include "bench_util.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>

using json  = nlohmann::ordered_json;
using fd::bench::Clock;
using fd::bench::median;
using namespace fd;

namespace {

struct Options {
    std::string model, rank_binary;
    int32_t threads = 1, ctx = 128, rounds = 7;
    std::vector<int32_t> batches = {1, 64};
    double seconds_min = 0.5;
    int32_t control_trials = 3;
};

/// Seconds per step of `b` as the engine runs it (forward_in_place: the logits read where
/// rank 0 wrote them), repeated for at least `seconds_min`. `sink` keeps the read alive.
double step_seconds(runtime::Executor & ex, const model::StepBatch & b, std::vector<float> & sink, double seconds_min) {
    int64_t n = 0;
    const auto t0 = Clock::now();
    do {
        sink[0] += ex.forward_in_place(b, nullptr)[0];
        ++n;
    } while (fd::bench::seconds_since(t0) < seconds_min);
    return fd::bench::seconds_since(t0) / static_cast<double>(n);
}

/// The same with forward(): the logits copied out into `logits` (what the engine did before
/// forward_in_place), for the copy's cost in the same run.
double step_seconds_copy(runtime::Executor & ex, const model::StepBatch & b, std::vector<float> & logits, double seconds_min) {
    int64_t n = 0;
    const auto t0 = Clock::now();
    do {
        ex.forward(b, logits.data(), nullptr);
        ++n;
    } while (fd::bench::seconds_since(t0) < seconds_min);
    return fd::bench::seconds_since(t0) / static_cast<double>(n);
}

}  // namespace

int main(int argc, char ** argv) {
    CLI::App app{"fd_executor_bench: multi-process executor (mp) vs in-process (uni): step link overhead and control latency"};
    Options o;
    app.add_option("--model", o.model, "Checkpoint dir")->required();
    app.add_option("--rank-binary", o.rank_binary, "The fdrollout binary (rank processes)")->required();
    app.add_option("--threads", o.threads, "Threads per rank");
    app.add_option("--batches", o.batches, "Decode batch sizes")->delimiter(',');
    app.add_option("--ctx", o.ctx, "Context length of every sequence");
    app.add_option("--rounds", o.rounds, "Alternating uni/mp rounds per batch size (median taken)");
    app.add_option("--seconds-min", o.seconds_min, "Seconds per timing");
    app.add_option("--control-trials", o.control_trials, "sleep/wakeup/update cycles per executor");
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError & e) {
        return app.exit(e);
    }
    try {
        const auto cfg = model::load_model_config(o.model);
        const int32_t max_batch = *std::max_element(o.batches.begin(), o.batches.end());
        const int32_t blocks    = max_batch * ((o.ctx + 15) / 16) + 4;
        model::WorkerConfig w{.n_threads = o.threads, .block_size = 16, .n_blocks = blocks, .max_model_len = std::max(o.ctx, 64)};
        weights::SourceConfig src{.strategy = weights::LoadStrategy::normal, .model_dir = o.model};
        auto uni = runtime::make_local_executor(std::make_unique<model::Worker>(cfg, model::read_tensor_index(o.model), w),
                                                weights::make_weight_source(src));
        auto mp = runtime::make_mp_executor({.tensor_parallel_size = 1, .model_dir = o.model, .worker = w, .source = src,
                                             .timeout_s = 600, .rank_binary = o.rank_binary, .log_level = "warn"},
                                            cfg);
        json out;
        out["model"]   = o.model;
        out["threads"] = o.threads;
        out["ctx"]     = o.ctx;
        json steps = json::array();
        std::vector<float> logits;
        for (const int32_t b : o.batches) {
            bench::DecodeBatch db(b, o.ctx);
            logits.assign(1, 0.0f);
            std::vector<float> copied(static_cast<size_t>(b) * cfg.vocab_size);
            step_seconds(*uni, db.b, logits, 0.05);  // warm-up (KV pages touched, threads up)
            step_seconds(*mp, db.b, logits, 0.05);
            step_seconds_copy(*mp, db.b, copied, 0.05);
            std::vector<double> ratios, copy_ratios, t_uni, t_mp, t_copy;
            for (int32_t r = 0; r < o.rounds; ++r) {
                const double u = step_seconds(*uni, db.b, logits, o.seconds_min);
                const double m = step_seconds(*mp, db.b, logits, o.seconds_min);
                const double c = step_seconds_copy(*mp, db.b, copied, o.seconds_min);
                t_uni.push_back(u);
                t_mp.push_back(m);
                t_copy.push_back(c);
                ratios.push_back(m / u);
                copy_ratios.push_back(c / u);
            }
            steps.push_back({{"batch", b}, {"uni_step_ms", median(t_uni) * 1e3}, {"mp_step_ms", median(t_mp) * 1e3},
                             {"mp_over_uni", median(ratios)}, {"link_overhead_us", (median(t_mp) - median(t_uni)) * 1e6},
                             {"mp_copy_step_ms", median(t_copy) * 1e3}, {"mp_copy_over_uni", median(copy_ratios)},
                             {"copy_saved_us", (median(t_copy) - median(t_mp)) * 1e6}});
        }
        out["decode_step"] = steps;

        // Control calls: the executor part of sleep (release both tags), wakeup (KV, then a
        // reload), update_weights (stage + commit), median over trials.
        auto control = [&](runtime::Executor & ex) {
            std::vector<double> sl, wk, up;
            for (int32_t t = 0; t < o.control_trials; ++t) {
                auto t0 = Clock::now();
                ex.release(runtime::MemoryTag::kv_cache);
                ex.release(runtime::MemoryTag::weight);
                sl.push_back(fd::bench::seconds_since(t0));
                t0 = Clock::now();
                ex.acquire_kv();
                ex.reload_weights({.wakeup = true});
                wk.push_back(fd::bench::seconds_since(t0));
                t0 = Clock::now();
                ex.stage_weights({.version = "b"});
                ex.commit_weights();
                up.push_back(fd::bench::seconds_since(t0));
            }
            return json{{"sleep_s", median(sl)}, {"wakeup_s", median(wk)}, {"update_s", median(up)}};
        };
        const json cu = control(*uni), cm = control(*mp);
        out["control"] = {{"uni", cu}, {"mp", cm},
                          {"mp_over_uni", {{"sleep", cm["sleep_s"].get<double>() / cu["sleep_s"].get<double>()},
                                           {"wakeup", cm["wakeup_s"].get<double>() / cu["wakeup_s"].get<double>()},
                                           {"update", cm["update_s"].get<double>() / cu["update_s"].get<double>()}}}};
        std::cout << out.dump(2) << std::endl;
        return 0;
    } catch (const std::exception & e) {
        std::cerr << "fd_executor_bench: " << e.what() << "\n";
        return 1;
    }
}
