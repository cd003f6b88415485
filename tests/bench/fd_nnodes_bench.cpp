// fd_nnodes_bench: tensor-parallel ranks on two "hosts" against the same ranks on one (issue #9).
// Both executors run tp=2 over Gloo: "one node" spawns both ranks and feeds them the step through
// the shared memfd region; "two nodes" starts a node agent (`fdrollout --nnodes 2 --node-rank 1`,
// its rank binding 127.0.0.2) so rank 1's step link is TCP with the step arrays sent inline.
// Decode steps of a fixed batch are timed in alternating pairs (one step on one node, one on two,
// repeated), so a loaded machine's swings hit both alike; the medians and the median of the per-pair
// ratios two / one are printed. One JSON object.
//   fd_nnodes_bench --model DIR --rank-binary build/fdrollout [--threads 1] [--batches 1,64]
#include "fd/checkpoint/model_config.h"
#include "fd/runtime/mp_executor.h"
#include "bench_batch.h"
#include "bench_util.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>

extern char ** environ;

using json  = nlohmann::ordered_json;
using fd::bench::Clock;
using fd::bench::median;
using namespace fd;

namespace {

struct Options {
    std::string model, rank_binary;
    int32_t threads = 1, ctx = 128, pairs = 30, port = 0;
    std::vector<int32_t> batches = {1, 64};
};

double step_seconds(runtime::Executor & ex, const model::StepBatch & b, std::vector<float> & logits) {
    const auto t0 = Clock::now();
    ex.forward(b, logits.data(), nullptr);
    return fd::bench::seconds_since(t0);
}

/// A free TCP port on 127.0.0.1 (bound and released).
int free_port() {
    std::mt19937 rng(static_cast<uint32_t>(::getpid()) ^ static_cast<uint32_t>(Clock::now().time_since_epoch().count()));
    return 20000 + static_cast<int>(rng() % 20000);
}

}  // namespace

int main(int argc, char ** argv) {
    CLI::App app{"fd_nnodes_bench: tp=2 with rank 1 on a second node (TCP step link) vs tp=2 on one node"};
    Options o;
    app.add_option("--model", o.model, "Checkpoint dir")->required();
    app.add_option("--rank-binary", o.rank_binary, "The fdrollout binary (rank processes and the node agent)")->required();
    app.add_option("--threads", o.threads, "Threads per rank");
    app.add_option("--batches", o.batches, "Decode batch sizes")->delimiter(',');
    app.add_option("--ctx", o.ctx, "Context length of every sequence");
    app.add_option("--pairs", o.pairs, "Alternating one-node/two-node decode steps per batch size (medians taken)");
    app.add_option("--master-port", o.port, "Port node 0 listens on for node 1 (0: a random one in [20000, 40000))");
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError & e) {
        return app.exit(e);
    }
    char tmpl[] = "/tmp/fd-nnodes-bench-XXXXXX";
    if (!::mkdtemp(tmpl)) {
        std::cerr << "fd_nnodes_bench: mkdtemp failed\n";
        return 1;
    }
    const std::filesystem::path dir(tmpl);
    pid_t agent = -1;
    int rc = 0;
    try {
        const auto cfg = model::load_model_config(o.model);
        const int32_t max_batch = *std::max_element(o.batches.begin(), o.batches.end());
        const int32_t blocks    = max_batch * ((o.ctx + 15) / 16) + 4;
        model::WorkerConfig w{.n_threads = o.threads, .block_size = 16, .n_blocks = blocks, .max_model_len = std::max(o.ctx, 64)};
        weights::SourceConfig src{.strategy = weights::LoadStrategy::normal, .model_dir = o.model};
        const std::string token = "fd-nnodes-bench-" + std::to_string(::getpid()) + "-" + std::to_string(Clock::now().time_since_epoch().count());
        const auto token_file = dir / "token";
        { std::ofstream(token_file) << token; }
        ::chmod(token_file.c_str(), 0600);
        const int port = o.port ? o.port : free_port();

        // Gloo on one node too: the comparison is of the links (shm would change the collectives).
        auto one = runtime::make_mp_executor({.tensor_parallel_size = 2, .model_dir = o.model, .worker = w, .source = src,
                                              .dist_backend = fd::runtime::DistBackend::gloo, .timeout_s = 600, .rank_binary = o.rank_binary, .log_level = "warn"},
                                             cfg);
        // Node 1 first (it retries until node 0 listens), then node 0's executor waits for its join.
        const std::string ports = std::to_string(port);
        std::vector<std::string> args = {o.rank_binary, "--model", o.model, "--tensor-parallel-size", "2", "--nnodes", "2",
                                         "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", ports,
                                         "--node-addr", "127.0.0.2", "--dist-token-file", token_file.string(),
                                         "--control-timeout-s", "600", "--log-level", "warn"};
        std::vector<char *> av;
        for (auto & a : args) { av.push_back(a.data()); }
        av.push_back(nullptr);
        if (const int e = ::posix_spawn(&agent, o.rank_binary.c_str(), nullptr, nullptr, av.data(), environ); e != 0) {
            throw std::runtime_error("cannot start the node agent: " + std::string(std::strerror(e)));
        }
        auto two = runtime::make_mp_executor({.tensor_parallel_size = 2, .model_dir = o.model, .worker = w, .source = src,
                                              .master_addr = "127.0.0.1", .master_port = port, .nnodes = 2, .dist_token = token,
                                              .timeout_s = 600, .rank_binary = o.rank_binary, .log_level = "warn"},
                                             cfg);
        json out;
        out["model"]   = o.model;
        out["threads_per_rank"] = o.threads;
        out["ctx"]     = o.ctx;
        json steps = json::array();
        std::vector<float> logits, check;
        for (const int32_t b : o.batches) {
            bench::DecodeBatch db(b, o.ctx);
            logits.resize(static_cast<size_t>(b) * cfg.vocab_size);
            check.resize(logits.size());
            for (int i = 0; i < 2; ++i) {  // warm-up
                step_seconds(*one, db.b, logits);
                step_seconds(*two, db.b, check);
            }
            // The same step on both: the two-node logits must equal the one-node ones bitwise.
            one->forward(db.b, logits.data(), nullptr);
            two->forward(db.b, check.data(), nullptr);
            const bool equal = std::equal(logits.begin(), logits.end(), check.begin());
            std::vector<double> ratios, t1, t2;
            for (int32_t r = 0; r < o.pairs; ++r) {
                const double a = step_seconds(*one, db.b, logits);
                const double c = step_seconds(*two, db.b, logits);
                t1.push_back(a);
                t2.push_back(c);
                ratios.push_back(c / a);
            }
            steps.push_back({{"batch", b}, {"one_node_step_ms", median(t1) * 1e3}, {"two_nodes_step_ms", median(t2) * 1e3},
                             {"two_over_one", median(ratios)}, {"tcp_link_overhead_us", (median(t2) - median(t1)) * 1e6},
                             {"logits_bitwise_equal", equal}});
        }
        out["decode_step"] = steps;
        two.reset();  // tells node 1's rank to shut down; the agent then exits 0
        one.reset();
        int st = 0;
        ::waitpid(agent, &st, 0);
        agent = -1;
        out["node_agent_exit"] = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        std::cout << out.dump(2) << std::endl;
    } catch (const std::exception & e) {
        std::cerr << "fd_nnodes_bench: " << e.what() << "\n";
        rc = 1;
    }
    if (agent > 0) {
        ::kill(agent, SIGTERM);
        ::waitpid(agent, nullptr, 0);
    }
    std::filesystem::remove_all(dir);
    return rc;
}
