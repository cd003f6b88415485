// fd_tp_bench — the tensor-parallel forward pass at tp = 1 vs tp = N (issue #9), one JSON object.
//
// For each tp of --tp (default 1,2): tp rank processes are fork()ed, each a Worker of its rank
// with --threads threads (default 1 per rank), joined by Gloo over loopback (tp 1: one process,
// no Comm: today's path). Every rank runs the same steps in lockstep (the collectives pair them
// up); rank 0 times them and reports through a shared mapping:
//   prefill   one sequence of --prefill-len tokens per forward, tok/s
//   decode    B sequences (each of --batches) with --prompt-len contexts prefilled (untimed),
//             then --decode-steps forwards of B tokens (logits for all), tok/s
// Each measurement is the best of --repeats runs. `ratios_vs_tp1` divides each tp's tok/s by
// tp 1's measured in the same run (a ratio > 1: tp is faster). --comm gloo,shm measures each tp > 1
// with each all-reduce (GlooComm over loopback TCP; ShmComm, a shared-memory segment): keys
// "tp2" (the first --comm) and "tp2_shm" etc. for the others. --ep (MoE models, issue 23) also
// measures each tp > 1 with expert parallelism (ep = tp: experts whole per rank, the combine's
// all-gather, fd/model/moe_ep.h): keys "tp2_ep" etc., and for every run the share of rank 0's
// decode time spent inside all-gather / all-reduce calls (waiting for the peers included).
// Usage: fd_tp_bench --model DIR [--tp 1,2] [--threads 1] [--batches 1,64] [--prompt-len 128]
//                    [--decode-steps 16] [--prefill-len 512] [--repeats 3] [--comm gloo[,shm]] [--ep]
#include "fd/kv/kv_cache.h"
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/model/worker.h"
#include "fd/comm/comm.h"
#include "fd/comm/tcp_store.h"

#include "bench_batch.h"
#include "bench_util.h"

#include "../fork_ranks.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace {

using fd::bench::Clock;
using fd::bench::round_to;
using fd::bench::seconds_since;
using json = nlohmann::ordered_json;
namespace M = fd::model;

struct Options {
    std::string      model;
    std::vector<int> tps     = {1, 2};
    int              threads = 1;
    std::vector<int> batches = {1, 64};
    int              prompt_len = 128;
    int              decode_steps = 16;
    int              prefill_len = 512;
    int              repeats = 3;
    std::vector<std::string> comms = {"gloo"};
    bool             ep = false;
};

/// The rank's comm with the seconds spent inside its collectives counted (fd_tp_bench --ep).
class TimingComm final : public fd::comm::Comm {
public:
    explicit TimingComm(std::unique_ptr<fd::comm::Comm> inner) : inner_(std::move(inner)) {}
    const char * name() const override { return inner_->name(); }
    int32_t rank() const override { return inner_->rank(); }
    int32_t world_size() const override { return inner_->world_size(); }
    bool connected() const override { return inner_->connected(); }
    void connect(int64_t g) override { inner_->connect(g); }
    void disconnect() override { inner_->disconnect(); }
    void all_reduce_sum(float * d, int64_t n) override {
        const auto t0 = Clock::now();
        inner_->all_reduce_sum(d, n);
        reduce_s += seconds_since(t0);
    }
    void gather(const float * s, int64_t n, float * r) override { inner_->gather(s, n, r); }
    void all_gather(const float * s, int64_t n, float * r) override {
        const auto t0 = Clock::now();
        inner_->all_gather(s, n, r);
        gather_s += seconds_since(t0);
    }
    void barrier() override { inner_->barrier(); }
    double reduce_s = 0, gather_s = 0;

private:
    std::unique_ptr<fd::comm::Comm> inner_;
};

/// What rank 0 measured, written into the shared mapping.
struct Result {
    double prefill_s = 0;       ///< best forward of prefill_len tokens
    double decode_s[16] = {};   ///< best run of decode_steps forwards, per batch size
    double gather_s[16] = {};   ///< of that run: seconds inside all_gather (expert parallel's combine)
    double reduce_s[16] = {};   ///< of that run: seconds inside all_reduce_sum
    int    ok = 0;
};

using fd::bench::add_tokens;

/// One rank's run (every rank executes the same forwards; only rank 0's timings are kept).
void run_rank(const Options & o, int rank, int tp, int ep, TimingComm * comm, Result * out) {
    const M::ModelConfig cfg = M::load_model_config(o.model);
    const int32_t vocab = cfg.vocab_size, bs = 16, total = o.prompt_len + o.decode_steps;
    const int32_t bmax = *std::max_element(o.batches.begin(), o.batches.end());
    const int64_t n_blocks = int64_t(bmax) * ((total + bs - 1) / bs) + (o.prefill_len + bs - 1) / bs;
    M::Worker w(cfg, M::read_tensor_index(o.model),
                {.rank = rank, .tp_size = tp, .ep_size = ep, .n_threads = o.threads, .block_size = bs, .n_blocks = n_blocks,
                 .max_model_len = std::max(total, o.prefill_len)}, comm);
    fd::kv::KvCache kv({.n_blocks = n_blocks, .block_size_tokens = bs, .enable_prefix_caching = false});
    for (int64_t s = 0; s <= bmax; ++s) {
        if (!kv.allocate(s, s == bmax ? o.prefill_len : total)) { throw std::runtime_error("KV allocation failed"); }
    }
    std::vector<float> logits;
    auto sync = [&] { if (comm) { comm->barrier(); } };
    {  // prefill
        M::StepBatch b;
        add_tokens(b, kv, bmax, 0, o.prefill_len, vocab);
        logits.resize(static_cast<size_t>(vocab));
        w.forward(b, logits.data());  // warm-up
        double best = 1e30;
        for (int r = 0; r < o.repeats; ++r) {
            sync();
            const auto t0 = Clock::now();
            w.forward(b, logits.data());
            best = std::min(best, seconds_since(t0));
        }
        out->prefill_s = best;
    }
    for (int64_t s0 = 0; s0 < bmax; s0 += 16) {  // decode contexts, untimed
        M::StepBatch b;
        for (int64_t s = s0; s < std::min<int64_t>(bmax, s0 + 16); ++s) { add_tokens(b, kv, s, 0, o.prompt_len, vocab); }
        logits.resize(b.logits_rows.size() * static_cast<size_t>(vocab));
        w.forward(b, logits.data());
    }
    for (size_t i = 0; i < o.batches.size(); ++i) {
        std::vector<M::StepBatch> steps(static_cast<size_t>(o.decode_steps));
        for (int st = 0; st < o.decode_steps; ++st) {
            for (int s = 0; s < o.batches[i]; ++s) { add_tokens(steps[st], kv, s, o.prompt_len + st, 1, vocab); }
        }
        logits.resize(static_cast<size_t>(o.batches[i]) * vocab);
        w.forward(steps[0], logits.data());  // warm-up
        double best = 1e30;
        for (int r = 0; r < o.repeats; ++r) {
            sync();
            const double g0 = comm ? comm->gather_s : 0, r0 = comm ? comm->reduce_s : 0;
            const auto t0 = Clock::now();
            for (const auto & b : steps) { w.forward(b, logits.data()); }
            const double s = seconds_since(t0);
            if (s < best) {
                best = s;
                out->gather_s[i] = comm ? comm->gather_s - g0 : 0;
                out->reduce_s[i] = comm ? comm->reduce_s - r0 : 0;
            }
        }
        out->decode_s[i] = best;
    }
    out->ok = 1;
}

/// Run `tp` rank processes; rank 0's Result.
Result run_tp(const Options & o, int tp, int ep, const std::string & comm_kind) {
    auto * shared = static_cast<Result *>(mmap(nullptr, sizeof(Result), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    if (shared == MAP_FAILED) { throw std::runtime_error("mmap failed"); }
    *shared = Result{};
    std::unique_ptr<fd::comm::TcpStoreServer> store;
    if (tp > 1) { store = std::make_unique<fd::comm::TcpStoreServer>("127.0.0.1", 0); }
    fd::comm::ShmCommSegment segment;  // each fork()ed rank inherits its descriptor
    if (tp > 1 && comm_kind == "shm") { segment = fd::comm::ShmCommSegment(tp, 1); }
    const bool failed = fd::testing::run_forked_ranks(tp, [&](int r) {
        std::unique_ptr<TimingComm> comm;
        if (tp > 1) {
            if (comm_kind == "shm") {
                comm = std::make_unique<TimingComm>(fd::comm::make_shm_comm(
                    {.rank = r, .world_size = tp, .segment_fd = [&](int64_t) { return ::dup(segment.fd()); }, .timeout_s = 300}));
            } else {
                comm = std::make_unique<TimingComm>(
                    fd::comm::make_gloo_comm({.rank = r, .world_size = tp, .store_port = store->port(), .timeout_s = 300}));
            }
            comm->connect(1);
        }
        Result mine;
        run_rank(o, r, tp, ep, comm.get(), &mine);
        if (r == 0) { *shared = mine; }
        if (comm) { comm->barrier(); }
        return 0;
    }, 24 * 3600.0) != 0;  // (a bench may run long: only a day-long hang is cut)
    const Result res = *shared;
    munmap(shared, sizeof(Result));
    if (failed || !res.ok) { throw std::runtime_error("a rank process failed at tp " + std::to_string(tp)); }
    return res;
}

}  // namespace

int main(int argc, char ** argv) {
    Options o;
    CLI::App app{"fd_tp_bench: tensor-parallel forward, tp 1 vs tp N (JSON on stdout)"};
    app.add_option("--model", o.model, "checkpoint directory")->required();
    app.add_option("--tp", o.tps, "tensor-parallel sizes, comma-separated (1 is always measured first)")->delimiter(',');
    app.add_option("--threads", o.threads, "kernel threads per rank")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--batches", o.batches, "decode batch sizes, comma-separated (at most 16)")->delimiter(',');
    app.add_option("--prompt-len", o.prompt_len, "decode context")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--decode-steps", o.decode_steps, "timed decode steps per run")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--prefill-len", o.prefill_len, "prefill tokens per forward")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--repeats", o.repeats, "runs per measurement (best kept)")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--comm", o.comms, "all-reduce(s) for tp > 1, comma-separated: gloo, shm")->delimiter(',')
        ->check(CLI::IsMember({"gloo", "shm"}));
    app.add_flag("--ep", o.ep, "MoE: also measure each tp > 1 with expert parallelism (ep = tp)");
    CLI11_PARSE(app, argc, argv);
    if (o.batches.empty() || o.batches.size() > 16) {
        std::fprintf(stderr, "fd_tp_bench: 1 to 16 batch sizes\n");
        return 2;
    }
    o.tps.erase(std::remove(o.tps.begin(), o.tps.end(), 1), o.tps.end());
    o.tps.insert(o.tps.begin(), 1);
    const M::ModelConfig cfg = M::load_model_config(o.model);
    json j;
    j["model"] = o.model;
    j["shape"] = {{"layers", cfg.n_layers}, {"hidden", cfg.hidden_size}, {"intermediate", cfg.intermediate_size},
                  {"heads", cfg.n_heads}, {"kv_heads", cfg.n_kv_heads}, {"vocab", cfg.vocab_size}};
    j["threads_per_rank"] = o.threads;
    j["cpu"] = fd::bench::cpu_model();
    j["online_cpus"] = sysconf(_SC_NPROCESSORS_ONLN);
    j["date"] = fd::bench::utc_now();
    json runs = json::array(), ratios = json::object();
    Result base;
    struct Planned {
        int tp, ep;
        std::string comm;
    };
    std::vector<Planned> plan;
    for (int tp : o.tps) {
        if (tp == 1) {
            plan.push_back({1, 1, "none"});
        } else {
            for (const auto & c : o.comms) { plan.push_back({tp, 1, c}); }
            if (o.ep) {
                for (const auto & c : o.comms) { plan.push_back({tp, tp, c}); }
            }
        }
    }
    for (const auto & [tp, ep, comm_kind] : plan) {
        std::fprintf(stderr, "fd_tp_bench: tp %d ep %d (%s)...\n", tp, ep, comm_kind.c_str());
        const Result r = run_tp(o, tp, ep, comm_kind);
        if (tp == 1) { base = r; }
        json run = {{"tp", tp}, {"ep", ep}, {"comm", comm_kind}, {"prefill_tok_s", round_to(o.prefill_len / r.prefill_s, 1)}};
        json dec = json::array();
        json ratio = {{"prefill", round_to(base.prefill_s / r.prefill_s, 3)}};
        for (size_t i = 0; i < o.batches.size(); ++i) {
            const double tok_s = o.batches[i] * o.decode_steps / r.decode_s[i];
            dec.push_back({{"batch", o.batches[i]}, {"tok_s", round_to(tok_s, 1)},
                           {"ms_per_step", round_to(r.decode_s[i] / o.decode_steps * 1e3, 3)},
                           {"all_gather_share", round_to(r.gather_s[i] / r.decode_s[i], 4)},
                           {"all_reduce_share", round_to(r.reduce_s[i] / r.decode_s[i], 4)}});
            ratio["decode_b" + std::to_string(o.batches[i])] = round_to(base.decode_s[i] / r.decode_s[i], 3);
        }
        run["decode"] = dec;
        runs.push_back(run);
        if (tp != 1) {
            ratios["tp" + std::to_string(tp) + (ep > 1 ? "_ep" : "") + (comm_kind == o.comms[0] ? "" : "_" + comm_kind)] = ratio;
        }
    }
    j["runs"] = runs;
    j["ratios_vs_tp1"] = ratios;
    std::cout << j.dump(2) << std::endl;
    return 0;
}
