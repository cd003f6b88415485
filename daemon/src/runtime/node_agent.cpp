// The node agent: `fdrollout --nnodes N --node-rank k ...` on node k > 0 (fd/runtime/node_join.h).
// Joins node 0 once per local rank, runs each rank process on its joined link, and rejoins with
// fresh rank processes whenever one exits abnormally (node 0's wakeup after a rank failure waits
// for that, bounded), until node 0 shuts the ranks down (exit 0), a signal arrives (exit 0), node 0
// refuses the join (its error's exit code) or stays unreachable past the timeout (rank_failed).
#include "fd/log.h"
#include "fd/runtime/node_join.h"
#include "fd/runtime/world.h"
#include "fd/status.h"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <ctime>
#include <filesystem>
#include <map>
#include <thread>
#include <vector>

namespace fd::runtime {
namespace {

using Clock = std::chrono::steady_clock;

/// SIGKILL and reap every rank still in `pids` (bounded: 5 s).
void stop_ranks(std::map<pid_t, int32_t> & pids) {
    for (const auto & [pid, rank] : pids) { ::kill(pid, SIGKILL); }
    const auto until = Clock::now() + std::chrono::seconds(5);
    while (!pids.empty() && Clock::now() < until) {
        for (auto it = pids.begin(); it != pids.end();) {
            int st = 0;
            it = ::waitpid(it->first, &st, WNOHANG) == it->first ? pids.erase(it) : std::next(it);
        }
        if (!pids.empty()) { std::this_thread::sleep_for(std::chrono::milliseconds(5)); }
    }
}

std::string exit_words(int st) {
    if (WIFSIGNALED(st)) { return fmt::format("was killed by signal {} ({})", WTERMSIG(st), strsignal(WTERMSIG(st))); }
    return fmt::format("exited with code {}", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}

enum class Watch { shutdown, rejoin, signal };

/// Until a rank exits or a signal arrives.
Watch watch_ranks(std::map<pid_t, int32_t> & pids, const sigset_t & signals, int32_t node_rank) {
    auto lg = log::get("node");
    for (;;) {
        timespec ts{0, 100 * 1000 * 1000};
        const int sig = ::sigtimedwait(&signals, nullptr, &ts);
        if (sig > 0) {
            lg->info("node {}: signal {}: stopping its ranks", node_rank, sig);
            stop_ranks(pids);
            return Watch::signal;
        }
        for (auto it = pids.begin(); it != pids.end(); ++it) {
            int st = 0;
            if (::waitpid(it->first, &st, WNOHANG) != it->first) { continue; }
            const int32_t rank = it->second;
            pids.erase(it);
            if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
                // Node 0 said shutdown: its other ranks here are told the same; give them a moment.
                const auto until = Clock::now() + std::chrono::seconds(10);
                bool clean = true;
                while (!pids.empty() && Clock::now() < until) {
                    for (auto jt = pids.begin(); jt != pids.end();) {
                        int s2 = 0;
                        if (::waitpid(jt->first, &s2, WNOHANG) == jt->first) {
                            clean = clean && WIFEXITED(s2) && WEXITSTATUS(s2) == 0;
                            jt    = pids.erase(jt);
                        } else {
                            ++jt;
                        }
                    }
                    std::this_thread::sleep_for(std::chrono::milliseconds(20));
                }
                if (clean && pids.empty()) { return Watch::shutdown; }
                stop_ranks(pids);
                return Watch::rejoin;
            }
            lg->warn("node {}: rank {} {}; restarting this node's ranks and rejoining node 0", node_rank, rank, exit_words(st));
            stop_ranks(pids);
            return Watch::rejoin;
        }
    }
}

}  // namespace

int node_agent_main(const NodeAgentConfig & cfg, const sigset_t & signals) {
    auto lg = log::get("node");
    const World   world = World::make(cfg.tp, cfg.nnodes, 1);  // devices: each rank asks its own host (rank_device_id)
    const int32_t per = world.per_node(), first = world.first_rank(cfg.node_rank);
    const std::string binary = cfg.rank_binary.empty() ? std::filesystem::read_symlink("/proc/self/exe").string() : cfg.rank_binary;
    JoinRequest req{.nnodes = cfg.nnodes, .node_rank = cfg.node_rank, .tp = cfg.tp, .rank = first, .master_addr = cfg.master_addr,
                    .bind_addr = cfg.node_addr, .model_dir = std::filesystem::absolute(cfg.model_dir).string(), .token = cfg.token,
                    .master_port = cfg.master_port, .fingerprint = model_fingerprint(cfg.model_dir),
                    .send_timeout_s = std::max(1.0, 0.9 * cfg.timeout_s)};
    lg->info("node {} of {}: joining node 0 at {}:{} with rank(s) {}..{}", cfg.node_rank, cfg.nnodes, cfg.master_addr, cfg.master_port,
             first, first + per - 1);
    for (;;) {
        const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.timeout_s));
        std::map<pid_t, int32_t> pids;
        try {
            for (int32_t i = 0; i < per; ++i) {
                req.rank = first + i;
                JoinedLink j = join_master(req, deadline);
                pids[spawn_rank_process(binary, j.link.fd(), -1)] = req.rank;  // the rank holds the link; our copy closes here
            }
        } catch (const Error & e) {
            stop_ranks(pids);
            lg->error("{}", e.what());
            return errc_info(e.code()).exit_code;
        }
        lg->info("node {}: rank(s) {}..{} joined node 0", cfg.node_rank, first, first + per - 1);
        switch (watch_ranks(pids, signals, cfg.node_rank)) {
            case Watch::shutdown: lg->info("node {}: node 0 shut the ranks down; exiting", cfg.node_rank); return 0;
            case Watch::signal: return 0;
            case Watch::rejoin: break;
        }
    }
}

}  // namespace fd::runtime
