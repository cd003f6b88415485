// MpExecutor's rank processes (class: mp_executor_impl.h): start-up (remote nodes joining,
// local ranks spawned, configured and waited for), failure (marking a rank out and naming it),
// restart (recover), shutdown, the comm group's rebuild, and what is measured of the ranks (RSS,
// each CUDA rank's device memory as its control replies report it).
#include "mp_executor_impl.h"

#include "fd/log.h"
#include "fd/status.h"

#include "mp_wire.h"

#include <fmt/ranges.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <thread>

namespace fd::runtime {

// ---- start-up

void MpExecutor::start_all() {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg_.timeout_s));
    std::map<int32_t, std::vector<int32_t>> missing;  // node → ranks
    for (int32_t r = 0; r < world_size(); ++r) {
        if (!ranks_[r].remote) { continue; }
        auto j = listener_->take(r, deadline);
        if (!j) {
            missing[ranks_[r].node].push_back(r);
            continue;
        }
        auto & k     = ranks_[r];
        k.link       = std::move(j->link);
        listener_->mark_serving(r, k.link.fd());  // a second copy of that node is refused from now on
        k.model_dir  = j->model_dir;
        k.bind_addr  = j->bind_addr;
        k.pid        = -1;
        k.failed     = false;
        k.why.clear();
    }
    if (!missing.empty()) {
        std::string names;
        for (const auto & [node, rs] : missing) {
            names += fmt::format("{}node {} (rank(s) {})", names.empty() ? "" : ", ", node, fmt::join(rs, ","));
            for (int32_t r : rs) {
                ranks_[r].failed = true;
                ranks_[r].why    = fmt::format("on node {} never joined", node);
            }
        }
        const int32_t node = missing.begin()->first;
        fail(Errc::rank_failed, "{} did not join within {:.0f} s: run `fdrollout --nnodes {} --node-rank {} --master-addr {} "
             "--master-port {} --dist-token-file FILE --model DIR` on it and check it can reach {}:{}", names, cfg_.timeout_s,
             cfg_.nnodes, node, cfg_.master_addr, listener_->port(), cfg_.master_addr, listener_->port());
    }
    // shm: this generation's segment travels with each local rank's config; the daemon's
    // descriptor closes once they all answered (their mappings keep it).
    comm::ShmCommSegment segment = comm_segment(generation_);
    std::vector<int32_t> all;
    for (int32_t r = 0; r < world_size(); ++r) {
        all.push_back(r);
        if (ranks_[r].remote) {
            send_config(r, -1);
        } else {
            spawn(r, segment.fd());
        }
    }
    wait_ready(all);
}

void MpExecutor::send_config(int32_t r, int segment_fd) {
    auto & k = ranks_[r];
    RankSpawn s{.cfg = cfg_, .rank = r, .generation = generation_, .store_port = store_->port(), .store_token = store_token_};
    s.cfg.dist_token.clear();  // never leaves node 0
    if (k.remote) {
        // Paths are the node's own; the checkpoint (and the update source) must be reachable there.
        if (s.cfg.source.model_dir == std::filesystem::path(cfg_.model_dir)) { s.cfg.source.model_dir = k.model_dir; }
        s.cfg.model_dir = k.model_dir;
        s.bind_addr     = k.bind_addr;
    }
    const std::string js = rank_spawn_to_json(s).dump();
    if (!k.link.send_blob(js.data(), js.size(), segment_fd)) { mark_failed(r, false); }
}

void MpExecutor::spawn(int32_t r, int segment_fd) {
    auto [mine, theirs] = make_link_pair();
    const pid_t pid = spawner_.spawn(binary_, theirs.fd(), region_.fd(), cfg_.timeout_s);
    auto & k  = ranks_[r];
    k.pid     = pid;
    pids_[r]  = pid;
    if (k.pidfd >= 0) { ::close(k.pidfd); }
    k.pidfd   = open_pidfd(pid);
    k.stopped_since = {};
    k.link    = std::move(mine);
    k.failed  = false;
    k.why.clear();
    send_config(r, segment_fd);
}

void MpExecutor::wait_ready(const std::vector<int32_t> & fresh) {
    std::vector<int32_t> waiting;
    for (int32_t r : fresh) {
        if (!ranks_[r].failed) { waiting.push_back(r); }
    }
    lost_mark_ = n_lost_;
    gather(waiting, Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg_.timeout_s)), nullptr, 0);
    std::string errors;
    // At the daemon's start, a rank that refused (its reply's error, e.g. invalid_checkpoint: a
    // NaN in its shard) stops it with that error's code, as one rank in-process would (the exit
    // code). A rank that died or never answered, or any failure of recover()'s restart (the
    // engine stays degraded on it), is rank_failed.
    std::optional<Errc> code;
    for (int32_t r = 0; r < world_size(); ++r) {
        if (ranks_[r].failed) {
            errors += fmt::format("{}rank {} {} during start-up", errors.empty() ? "" : "; ", r, ranks_[r].why);
            code = Errc::rank_failed;
        } else if (replies_[r].status != 0 && std::find(waiting.begin(), waiting.end(), r) != waiting.end()) {
            errors += fmt::format("{}rank {}: {}", errors.empty() ? "" : "; ", r, replies_[r].text);
            if (!code) { code = !started_ && replies_[r].status > 0 ? static_cast<Errc>(replies_[r].status) : Errc::rank_failed; }
            mark_failed(r, /*timed_out=*/false, "failed to start");
        }
    }
    if (!errors.empty()) { fail(*code, "{}", errors); }
    started_ = true;
    weight_bytes_ = replies_[0].weight_bytes;
    kv_bytes_     = replies_[0].kv_bytes;
    last_control_ = Clock::now();
    shared_devices_ = false;  // two ranks of one node on one device (each rank's `ready` names its device)
    for (int32_t a = 0; a < world_size(); ++a) {
        for (int32_t b = a + 1; b < world_size(); ++b) {
            shared_devices_ = shared_devices_ || (replies_[a].device_id >= 0 && ranks_[a].node == ranks_[b].node &&
                                                  replies_[a].device_id == replies_[b].device_id);
        }
    }
}

void MpExecutor::connect_group() {
    if (comm_connected_) { return; }
    LinkMsg m;
    m.op         = static_cast<uint32_t>(LinkOp::comm_connect);
    m.generation = ++generation_;
    comm::ShmCommSegment segment = comm_segment(generation_);
    call(m, "wakeup (rebuilding the communication group)", false, nullptr, nullptr, 0, -1, segment.fd());
    check_replies("wakeup (rebuilding the communication group)");
    comm_connected_ = true;
}

comm::ShmCommSegment MpExecutor::comm_segment(int64_t generation) const {
    if (cfg_.dist_backend != DistBackend::shm) { return {}; }
    return comm::ShmCommSegment(world_size(), generation);
}

// ---- failure, restart, shutdown

std::vector<int32_t> MpExecutor::failed_ranks() {
    std::vector<int32_t> out;
    const auto now = Clock::now();
    for (int32_t r = 0; r < world_size(); ++r) {
        auto & k = ranks_[r];
        // hung_up, not peer_closed: a survivor's reply that came after its call's grace (it waited
        // on the dead rank inside a collective) is still in its link, and does not make it dead.
        if (!k.failed && k.link.hung_up()) { mark_failed(r, false); }
        if (!k.failed) { check_process(r, now); }
        if (k.failed) { out.push_back(r); }
    }
    return out;
}

bool MpExecutor::check_process(int32_t r, Clock::time_point now) {
    auto & k = ranks_[r];
    if (k.failed || k.remote || k.pid <= 0) { return k.failed; }
    if (pidfd_exited(k.pidfd)) {
        mark_failed(r, /*timed_out=*/false);
        return true;
    }
    if (!process_stopped(k.pid)) {
        k.stopped_since = {};
        return false;
    }
    if (k.stopped_since == Clock::time_point{}) { k.stopped_since = now; }
    const double stopped_s = std::chrono::duration<double>(now - k.stopped_since).count();
    if (stopped_s < cfg_.heartbeat_s) { return false; }
    mark_failed(r, /*timed_out=*/true, fmt::format("is stopped (SIGSTOP or a debugger) for {:.1f} s (--rank-heartbeat-s {:g})", stopped_s,
                                                   cfg_.heartbeat_s));
    return true;
}

void MpExecutor::note_beat(int32_t r, const LinkMsg & m, Clock::time_point now) {
    auto & k     = ranks_[r];
    k.heard      = now;
    k.beat_seen  = true;
    if (m.since_progress_s < cfg_.stuck_s) { return; }
    mark_failed(r, /*timed_out=*/true, fmt::format("{}is stuck: its process runs and beats, but its main loop made no progress for {:.1f} s "
                                                   "(--rank-stuck-s {:g}; a deadlock, or a kernel that never returns)",
                                                   k.remote ? fmt::format("on node {} ", k.node) : std::string(), m.since_progress_s, cfg_.stuck_s));
}

bool MpExecutor::check_heard(int32_t r, Clock::time_point now, bool startup) {
    auto & k = ranks_[r];
    if (k.failed) { return true; }
    if (startup && !k.beat_seen) { return false; }  // exec and loading the binary send no beats
    const double silent_s = std::chrono::duration<double>(now - k.heard).count();
    if (silent_s < cfg_.heartbeat_s + beat_interval_s(cfg_.heartbeat_s)) { return false; }  // the beat due last, plus the bound
    std::string why;
    if (k.remote) {
        why = fmt::format("on node {} sent no heartbeat for {:.1f} s (--rank-heartbeat-s {:g}): stopped, frozen, or node {} is unreachable",
                          k.node, silent_s, cfg_.heartbeat_s, k.node);
    } else if (k.pid > 0 && process_stopped(k.pid)) {
        return false;  // stopped here: check_process's /proc look decides, timed from the stop itself (not from a late beat)
    } else {
        why = fmt::format("sent no heartbeat for {:.1f} s (--rank-heartbeat-s {:g}): frozen or not scheduled", silent_s, cfg_.heartbeat_s);
    }
    mark_failed(r, /*timed_out=*/true, why);
    return true;
}

void MpExecutor::mark_failed(int32_t r, bool timed_out, const std::string & what) {
    auto & k = ranks_[r];
    if (k.failed) { return; }
    if (k.remote) {
        listener_->mark_gone(r);
        remote_rss_[r].store(0, std::memory_order_relaxed);
    }
    bool reaped = false;
    if (!what.empty()) {
        k.why = what;
    } else if (k.remote) {
        k.why = timed_out ? fmt::format("on node {} did not answer within {:.1f} s", k.node, wait_s_)
                          : fmt::format("on node {} closed its link (the rank exited or node {} is unreachable)", k.node, k.node);
    } else if (timed_out) {
        k.why = fmt::format("{} within {:.1f} s", process_condition(k.pid, reaped), wait_s_);
    } else {
        // The link closes a moment before the process can be reaped: give it that moment.
        const auto until = Clock::now() + std::chrono::milliseconds(200);
        do {
            k.why = process_condition(k.pid, reaped);
            if (!reaped) { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }
        } while (!reaped && Clock::now() < until);
        if (!reaped) { k.why = "closed its link"; }
    }
    if (reaped) {
        k.pid    = -k.pid;  // reaped: never signal that pid again
        pids_[r] = 0;
    }
    k.failed        = true;
    comm_connected_ = false;  // the group lost a member: /health says so until a wakeup rebuilds it
    ++n_lost_;
    log::get("engine")->error("rank {} {}", r, k.why);
}

void MpExecutor::throw_failed(const char * what) const {
    std::string names;
    for (int32_t r = 0; r < world_size(); ++r) {
        if (!ranks_[r].failed) { continue; }
        if (ranks_[r].remote) {
            names += fmt::format("{}rank {} {}", names.empty() ? "" : "; ", r, ranks_[r].why);
        } else {
            names += fmt::format("{}rank {} (pid {}) {}", names.empty() ? "" : "; ", r, std::abs(ranks_[r].pid), ranks_[r].why);  // pid < 0: reaped
        }
    }
    fail(Errc::rank_failed, "{} failed: {}. In-flight requests ended; POST /v1/wakeup respawns the rank (a rank on another node: "
         "waits for its node to rejoin) and reloads the serving weights (or restart the daemon)", what, names);
}

void MpExecutor::recover() {
    // Every rank restarts, not only the failed ones: a survivor may still be inside the failed
    // step's collective (its late reply would answer the next request, a step out of phase with
    // the fresh ranks) and its group is broken anyway. The engine reloads the serving weights on
    // every rank next, so a fresh process costs only its start-up.
    auto lg = log::get("engine");
    std::vector<int32_t> all;
    for (int32_t r = 0; r < world_size(); ++r) {
        all.push_back(r);
        if (ranks_[r].failed) {
            lg->warn("respawning rank {} ({})", r, ranks_[r].why);
        } else {
            lg->warn("restarting rank {} with the group", r);
        }
        reap(r, /*kill=*/true);
    }
    ++generation_;
    start_all();
    comm_connected_ = true;
}

void MpExecutor::reap(int32_t r, bool kill) {
    auto & k = ranks_[r];
    if (k.remote && listener_) { listener_->mark_gone(r); }  // before the close: its duplicate would keep the link open
    k.link.close();
    if (k.pidfd >= 0) {
        ::close(k.pidfd);
        k.pidfd = -1;
    }
    k.stopped_since = {};
    if (k.pid <= 0) { return; }
    if (kill) { ::kill(k.pid, SIGKILL); }
    auto deadline = Clock::now() + std::chrono::seconds(5);
    int st = 0;
    while (::waitpid(k.pid, &st, WNOHANG) == 0) {
        if (Clock::now() > deadline) {
            if (!kill) {
                ::kill(k.pid, SIGKILL);
                kill     = true;
                deadline = Clock::now() + std::chrono::seconds(5);  // its own wait (it was "did not exit" at once)
                continue;
            }
            log::get("engine")->error("rank {} (pid {}) did not exit after SIGKILL", r, k.pid);
            break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    k.pid    = -k.pid;
    pids_[r] = 0;
}

void MpExecutor::shutdown() {
    // A group that lost a rank is broken: its survivors may be waiting for it inside a collective
    // (no shutdown answer would come), so every rank is killed rather than asked.
    const bool broken = std::any_of(ranks_.begin(), ranks_.end(), [](const Rank & k) { return k.failed; });
    LinkMsg m;
    m.op = static_cast<uint32_t>(LinkOp::shutdown);
    for (auto & k : ranks_) {
        if (!broken) { k.link.send(m); }
    }
    // One deadline for every rank's answer (it was 5 s each, one after another), and a stopped
    // rank (SIGSTOP, a debugger) is not asked: it cannot answer, and SIGKILL ends a stopped process
    // (a probe: SIGTERM with two stopped ranks exited after 20 s, past a 1 s grace).
    const auto until = Clock::now() + std::chrono::seconds(5);
    for (int32_t r = 0; r < world_size(); ++r) {
        auto & k = ranks_[r];
        const bool stopped = !k.remote && k.pid > 0 && process_stopped(k.pid);
        if (!broken && !stopped && k.link.open()) {
            LinkMsg ack;
            while (k.link.recv(ack, until) == LinkSocket::Recv::ok && ack.op == static_cast<uint32_t>(LinkOp::beat)) {}
        }
        reap(r, broken || stopped);
    }
}

// ---- measurements

int64_t MpExecutor::rank_processes_rss_bytes() const {
    int64_t sum = 0;
    for (const pid_t pid : pids_) {
        if (pid <= 0) { continue; }
        std::ifstream f(fmt::format("/proc/{}/statm", pid));
        int64_t size = 0, resident = 0;
        if (f >> size >> resident) { sum += resident * ::sysconf(_SC_PAGESIZE); }
    }
    for (const auto & rss : remote_rss_) { sum += rss.load(std::memory_order_relaxed); }
    return sum;
}

void MpExecutor::note_device(int32_t r, const LinkMsg & m) {
    RankDevice d = rank_device_from_msg(m);
    d.rank     = r;
    d.measured = Clock::now();
    std::lock_guard lk(dev_mu_);
    devs_[r] = d;
}

std::vector<RankDevice> MpExecutor::rank_devices() const {
    std::lock_guard lk(dev_mu_);
    std::vector<RankDevice> out;
    for (const auto & d : devs_) {
        if (d.measured != Clock::time_point{}) { out.push_back(d); }
    }
    return out;
}

void MpExecutor::refresh_rank_devices(double max_age_s) {
    if (!cuda_ || std::chrono::duration<double>(Clock::now() - last_control_).count() < max_age_s) { return; }
    for (const auto & k : ranks_) {
        if (k.failed) { return; }  // degraded: /health says so; wakeup recovers
    }
    call_op({.op = RankOp::mem_info});
}

}  // namespace fd::runtime
