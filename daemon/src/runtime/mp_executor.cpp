// MpExecutor: one OS process per rank, reached through rank links (fd/runtime/mp_executor.h).
#include "fd/runtime/mp_executor.h"

#include "fd/kernels/backend.h"
#include "fd/log.h"
#include "fd/runtime/comm.h"
#include "fd/runtime/node_join.h"
#include "fd/runtime/tcp_store.h"
#include "fd/status.h"

#include "mp_wire.h"
#include "rank_spawn.h"

#include <fmt/ranges.h>

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

namespace fd::runtime {
namespace {

using Clock = std::chrono::steady_clock;

class MpExecutor final : public Executor {
public:
    MpExecutor(const MpExecutorConfig & cfg, const model::ModelConfig & model_cfg)
        : cfg_(cfg), model_cfg_(model_cfg), wait_s_(std::max(0.2, 0.9 * cfg.timeout_s)) {
        FD_CHECK(cfg.tensor_parallel_size >= 1, "tensor_parallel_size {}", cfg.tensor_parallel_size);
        FD_CHECK(cfg.nnodes >= 1 && cfg.tensor_parallel_size % cfg.nnodes == 0, "--nnodes {} must divide --tensor-parallel-size {}",
                 cfg.nnodes, cfg.tensor_parallel_size);
        per_node_ = cfg.tensor_parallel_size / cfg.nnodes;
        cuda_     = cfg.worker.device == kernels::DeviceKind::cuda;
        const int32_t n_dev = cuda_ ? kernels::device_count(kernels::DeviceKind::cuda) : 1;
        if (cfg_.dist_backend == "auto") {
            // As resolve() does (fd/config.h Resolved::dist_backend): nccl where every rank has its own device.
            cfg_.dist_backend = cuda_ && cfg.tensor_parallel_size > 1 && cfg.nnodes == 1 && per_node_ <= n_dev ? "nccl"
                                : cfg.nnodes == 1                                                              ? "shm"
                                                                                                               : "gloo";
        }
        FD_CHECK(cfg_.dist_backend == "gloo" || ((cfg_.dist_backend == "shm" || cfg_.dist_backend == "nccl") && cfg.nnodes == 1),
                 "--dist-backend {} with --nnodes {}: shm and nccl need every rank on one host", cfg_.dist_backend, cfg.nnodes);
        if (cuda_ && per_node_ > n_dev) {
            log::get("engine")->warn("{} ranks share {} CUDA device(s): rank r runs on device r mod {}. Fine for tests; each rank holds its "
                                     "own context and the group runs {} staged through host memory (NCCL refuses two ranks on one device)",
                                     per_node_, n_dev, std::max(1, n_dev), cfg_.dist_backend);
        }
        if (cfg.nnodes > 1) {
            listener_ = std::make_unique<JoinListener>(
                cfg.master_addr, cfg.master_port,
                JoinExpect{.nnodes = cfg.nnodes, .tp = cfg.tensor_parallel_size, .fingerprint = model_fingerprint(cfg.model_dir),
                           .token = cfg.dist_token, .send_timeout_s = wait_s_});
            store_ = std::make_unique<TcpStoreServer>(cfg.master_addr, 0);
        } else {
            store_ = std::make_unique<TcpStoreServer>(cfg.master_addr, cfg.master_port);
        }
        binary_ = cfg.rank_binary.empty() ? std::filesystem::read_symlink("/proc/self/exe").string() : cfg.rank_binary;
        region_.create(step_layout(256, 64, 1024, model_cfg.vocab_size).total_bytes);
        ranks_.resize(static_cast<size_t>(cfg.tensor_parallel_size));
        for (int32_t r = 0; r < world_size(); ++r) {
            ranks_[r].node   = r / per_node_;
            ranks_[r].remote = ranks_[r].node != 0;
        }
        pids_ = std::vector<std::atomic<pid_t>>(ranks_.size());
        remote_rss_ = std::vector<std::atomic<int64_t>>(ranks_.size());
        replies_.resize(ranks_.size());
        devs_.resize(ranks_.size());
        generation_ = 1;
        try {
            start_all();
        } catch (...) {
            shutdown();
            throw;
        }
        comm_connected_ = true;
        log::get("engine")->info("mp executor: {} rank process(es) ready (store {}:{})", world_size(), cfg.master_addr, store_->port());
    }

    ~MpExecutor() override { shutdown(); }

    int32_t world_size() const override { return cfg_.tensor_parallel_size; }
    const model::ModelConfig & model_config() const override { return model_cfg_; }
    const char * backend() const override { return "mp"; }
    const char * comm_state() const override { return comm_connected_ ? "connected" : "disconnected"; }
    const char * comm_backend() const override { return cfg_.dist_backend.c_str(); }
    int64_t rank_processes_rss_bytes() const override {
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
    int64_t weight_bytes() const override { return weight_bytes_; }
    int64_t kv_bytes() const override { return kv_bytes_; }

    bool forward(const model::StepBatch & batch, float * logits, const std::atomic<bool> * abandon) override {
        const float * in_place = forward_in_place(batch, abandon);
        if (!in_place) { return false; }
        std::memcpy(logits, in_place, batch.logits_rows.size() * static_cast<size_t>(model_cfg_.vocab_size) * sizeof(float));
        return true;
    }

    /// Rank 0 wrote the logits into the region: the engine reads them there (valid until the
    /// next call, which rewrites the region).
    const float * forward_in_place(const model::StepBatch & batch, const std::atomic<bool> * abandon) override {
        const int32_t bs = cfg_.worker.block_size, vocab = model_cfg_.vocab_size;
        int64_t need = step_encode(region_.data(), region_.bytes(), batch, bs, vocab);
        if (need > region_.bytes()) {
            region_.resize(need + need / 2);
            need = step_encode(region_.data(), region_.bytes(), batch, bs, vocab);
        }
        auto * h = static_cast<RegionHeader *>(region_.data());
        h->abandon.store(false, std::memory_order_relaxed);  // the link's send orders it before the rank reads
        LinkMsg req;
        req.op           = static_cast<uint32_t>(LinkOp::forward);
        req.region_bytes = static_cast<uint64_t>(region_.bytes());
        // Ranks on other nodes get the step's arrays inline (everything before the logits).
        const size_t inline_n = per_node_ < world_size() ? static_cast<size_t>(step_layout(h->n_tokens, h->n_logits, h->n_tables, vocab).logits) : 0;
        call(req, "forward", false, abandon, inline_n ? region_.data() : nullptr, inline_n);
        if (replies_[0].status == kLinkAbandoned) { return nullptr; }
        check_replies("forward");
        return step_logits(region_.data());
    }

    /// probe_step_link(): forward()'s encode and round trip, without the model.
    void probe(const model::StepBatch * batch) {
        LinkMsg req;
        req.op = static_cast<uint32_t>(LinkOp::probe);
        size_t inline_n = 0;
        if (batch) {
            const int32_t bs = cfg_.worker.block_size, vocab = model_cfg_.vocab_size;
            int64_t need = step_encode(region_.data(), region_.bytes(), *batch, bs, vocab);
            if (need > region_.bytes()) {
                region_.resize(need + need / 2);
                need = step_encode(region_.data(), region_.bytes(), *batch, bs, vocab);
            }
            const auto * h   = static_cast<const RegionHeader *>(region_.data());
            req.region_bytes = static_cast<uint64_t>(region_.bytes());
            inline_n = per_node_ < world_size() ? static_cast<size_t>(step_layout(h->n_tokens, h->n_logits, h->n_tables, vocab).logits) : 0;
        }
        call(req, "link probe", false, nullptr, inline_n ? region_.data() : nullptr, inline_n);
        check_replies("link probe");
    }

    std::vector<RankReport> stage_weights(const weights::FetchRequest & req) override {
        LinkMsg m;
        m.op = static_cast<uint32_t>(LinkOp::stage);
        fetch_request_to_msg(req, m);
        try {
            call(m, "update_weights (staging)");
            check_replies("update_weights (staging)");
            for (const auto & r : replies_) {
                if (r.has_reply_version != replies_[0].has_reply_version || std::strcmp(r.version, replies_[0].version) != 0) {
                    // Only a "latest" fetch can differ (a named version is checked by every rank): the source
                    // moved between the ranks' reads, a transient state like a record rewritten mid-copy.
                    fail(Errc::source_unavailable, "ranks fetched different versions (rank 0 '{}', rank {} '{}'): the source changed while they read it; nothing applied, retry",
                         replies_[0].version, r.rank, r.version);
                }
            }
        } catch (...) {
            drop_on_survivors();
            throw;
        }
        auto reps = reports();
        release_fetched_everywhere();
        return reps;
    }

    std::vector<RankReport> commit_weights() override {
        call_op(LinkOp::commit, "update_weights (commit)");
        return reports();
    }

    void drop_staged_weights() override { call_op(LinkOp::drop, "drop_staged_weights"); }

    std::vector<RankReport> release(MemoryTag tag) override {
        const LinkOp op = tag == MemoryTag::weight     ? LinkOp::release_weight
                          : tag == MemoryTag::kv_cache ? LinkOp::release_kv
                                                       : LinkOp::release_swap;
        if (shared_devices_) {
            // Ranks sharing a device release one at a time: each one's cudaMemGetInfo delta
            // (device_freed_bytes) is then its own, not its neighbour's too.
            for (auto & m : replies_) { m.status = 0; }  // check_replies reads every rank's: none stale
            for (int32_t r = 0; r < world_size(); ++r) {
                LinkMsg m;
                m.op = static_cast<uint32_t>(op);
                call(m, "sleep", false, nullptr, nullptr, 0, r);
                check_replies("sleep");
            }
        } else {
            call_op(op, "sleep");
        }
        auto reps = reports();
        if (tag == MemoryTag::weight && cfg_.shutdown_comm_group_if_worker_idle && comm_connected_) {
            call_op(LinkOp::comm_disconnect, "sleep (closing the communication group)");
            comm_connected_ = false;
        }
        return reps;
    }

    void swap_kv(const kv::BlockCopy * out, int64_t n_out, const kv::BlockCopy * in, int64_t n_in) override {
        int64_t need = swap_encode(region_.data(), region_.bytes(), out, n_out, in, n_in);
        if (need > region_.bytes()) {
            region_.resize(need + need / 2);
            need = swap_encode(region_.data(), region_.bytes(), out, n_out, in, n_in);
        }
        LinkMsg m;
        m.op           = static_cast<uint32_t>(LinkOp::swap_kv);
        m.region_bytes = static_cast<uint64_t>(region_.bytes());
        m.n_swap_out   = n_out;
        m.n_swap_in    = n_in;
        // Ranks on other nodes get the block lists inline, like a step's arrays.
        const bool remote = per_node_ < world_size();
        call(m, "KV swap", false, nullptr, remote ? region_.data() : nullptr, remote ? static_cast<size_t>(need) : 0);
        check_replies("KV swap");
    }

    std::vector<RankReport> acquire_kv() override {
        call_op(LinkOp::acquire_kv, "wakeup (kv_cache)");
        return reports();
    }

    std::vector<RankReport> reload_weights(const weights::FetchRequest & req) override {
        connect_group();
        LinkMsg m;
        m.op = static_cast<uint32_t>(LinkOp::reload);
        fetch_request_to_msg(req, m);
        call(m, "wakeup (weights)");
        try {
            check_replies("wakeup (weights)");
        } catch (...) {
            // All or none: ranks that did load hand their copy back again.
            LinkMsg rel;
            rel.op = static_cast<uint32_t>(LinkOp::release_weight);
            try { call(rel, "wakeup (undo)", true); } catch (const Error &) {}
            throw;
        }
        auto reps = reports();
        release_fetched_everywhere();
        return reps;
    }

    std::vector<int32_t> failed_ranks() override {
        std::vector<int32_t> out;
        for (int32_t r = 0; r < world_size(); ++r) {
            auto & k = ranks_[r];
            if (!k.failed && k.link.peer_closed()) { mark_failed(r, false); }
            if (k.failed) { out.push_back(r); }
        }
        return out;
    }

    std::vector<RankDevice> rank_devices() const override {
        std::lock_guard lk(dev_mu_);
        std::vector<RankDevice> out;
        for (const auto & d : devs_) {
            if (d.measured != Clock::time_point{}) { out.push_back(d); }
        }
        return out;
    }

    void refresh_rank_devices(double max_age_s) override {
        if (!cuda_ || std::chrono::duration<double>(Clock::now() - last_control_).count() < max_age_s) { return; }
        for (const auto & k : ranks_) {
            if (k.failed) { return; }  // degraded: /health says so; wakeup recovers
        }
        call_op(LinkOp::mem_info, "measuring device memory");
    }

    void recover() override {
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

private:
    struct Rank {
        pid_t       pid = -1;
        LinkSocket  link;
        bool        failed = false;
        std::string why;
        int32_t     node = 0;
        bool        remote = false;          ///< on node > 0: a TCP link from its node agent, no pid here
        std::string model_dir, bind_addr;    ///< remote: the node's --model and its ranks' Gloo address
    };

    /// Wait (timeout_s) for every other node's ranks to join, spawn this node's, configure all, wait ready.
    void start_all() {
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
        ShmCommSegment segment = comm_segment(generation_);
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

    /// `segment_fd` >= 0: the shm group's segment, passed with the config (local ranks only).
    void send_config(int32_t r, int segment_fd) {
        auto & k = ranks_[r];
        RankSpawn s{.cfg = cfg_, .rank = r, .generation = generation_, .store_port = store_->port()};
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

    void spawn(int32_t r, int segment_fd) {
        auto [mine, theirs] = make_link_pair();
        const pid_t pid = spawner_.spawn(binary_, theirs.fd(), region_.fd(), cfg_.timeout_s);
        auto & k  = ranks_[r];
        k.pid     = pid;
        pids_[r]  = pid;
        k.link    = std::move(mine);
        k.failed  = false;
        k.why.clear();
        send_config(r, segment_fd);
    }

    /// Wait for `ready` from the freshly spawned ranks in `fresh`.
    void wait_ready(const std::vector<int32_t> & fresh) {
        std::vector<int32_t> waiting;
        for (int32_t r : fresh) {
            if (!ranks_[r].failed) { waiting.push_back(r); }
        }
        gather(waiting, Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg_.timeout_s)), nullptr, 0);
        std::string errors;
        for (int32_t r = 0; r < world_size(); ++r) {
            if (ranks_[r].failed) {
                errors += fmt::format("{}rank {} {} during start-up", errors.empty() ? "" : "; ", r, ranks_[r].why);
            } else if (replies_[r].status != 0 && std::find(waiting.begin(), waiting.end(), r) != waiting.end()) {
                errors += fmt::format("{}rank {}: {}", errors.empty() ? "" : "; ", r, replies_[r].text);
                mark_failed(r, /*timed_out=*/false, "failed to start");
            }
        }
        if (!errors.empty()) { fail(Errc::rank_failed, "{}", errors); }
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

    void note_device(int32_t r, const LinkMsg & m) {
        RankDevice d = rank_device_from_msg(m);
        d.rank     = r;
        d.measured = Clock::now();
        std::lock_guard lk(dev_mu_);
        devs_[r] = d;
    }

    /// Collect one reply from each rank in `ranks` until `deadline` into replies_[r] (a `ready`
    /// or the answer to `seq`). A rank whose link closes or that misses the deadline is marked
    /// failed. Allocation-free once warm (the step path).
    void gather(const std::vector<int32_t> & ranks, Clock::time_point deadline, const std::atomic<bool> * abandon, uint64_t seq) {
        pending_.assign(ranks.begin(), ranks.end());
        pollfd fds[64];
        FD_CHECK(pending_.size() <= 64, "{} ranks on one node", pending_.size());
        bool abandoned = false;
        while (!pending_.empty()) {
            const auto now = Clock::now();
            if (now >= deadline) {
                for (int32_t r : pending_) { mark_failed(r, /*timed_out=*/true); }
                return;
            }
            auto wait = std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
            if (abandon) { wait = std::min(wait, std::chrono::milliseconds(2)); }
            for (size_t i = 0; i < pending_.size(); ++i) { fds[i] = {ranks_[pending_[i]].link.fd(), POLLIN, 0}; }
            const int rc = ::poll(fds, pending_.size(), static_cast<int>(wait.count()));
            if (abandon && !abandoned && abandon->load(std::memory_order_relaxed)) {
                static_cast<RegionHeader *>(region_.data())->abandon.store(true);
                abandoned = true;
            }
            if (rc <= 0) { continue; }
            still_.clear();
            for (size_t i = 0; i < pending_.size(); ++i) {
                const int32_t r = pending_[i];
                if (fds[i].revents == 0) {
                    still_.push_back(r);
                    continue;
                }
                LinkMsg & m = replies_[r];
                // poll said readable: a seqpacket record is whole, read it without a second poll.
                const auto got = ranks_[r].link.stream() ? ranks_[r].link.recv(m, Clock::now() + std::chrono::seconds(1))
                                                         : ranks_[r].link.try_recv(m);
                if (got == LinkSocket::Recv::timeout && !ranks_[r].link.stream()) {
                    still_.push_back(r);  // readable but nothing whole yet: poll again
                } else if (got != LinkSocket::Recv::ok) {
                    mark_failed(r, /*timed_out=*/false);
                } else if (m.op != static_cast<uint32_t>(LinkOp::ready) && m.seq != seq) {
                    still_.push_back(r);  // a late answer to an older request
                } else {
                    if (ranks_[r].remote && m.rss_bytes > 0) {
                        remote_rss_[r].store(m.rss_bytes, std::memory_order_relaxed);  // control replies carry it; steps do not
                    }
                    if (m.device_id >= 0) { note_device(r, m); }  // a CUDA rank's control reply
                }
            }
            pending_.swap(still_);
        }
    }

    /// Send `req` to every rank (or only the live ones) and gather the replies.
    /// Errors  rank_failed naming every failed rank when one was failed before or failed now.
    /// `payload` (n bytes) follows the request on stream links (remote ranks: the step inline).
    /// `only` >= 0: send to that rank alone (the others' replies_ stay as they were).
    /// `pass_fd` >= 0 travels with the request to every (local) rank.
    void call(LinkMsg req, const char * what, bool survivors_only = false, const std::atomic<bool> * abandon = nullptr,
              const void * payload = nullptr, size_t payload_n = 0, int32_t only = -1, int pass_fd = -1) {
        std::vector<int32_t> & targets = targets_;
        targets.clear();
        for (int32_t r = 0; r < world_size(); ++r) {
            if (!ranks_[r].failed) {
                if (only < 0 || r == only) { targets.push_back(r); }
            } else if (!survivors_only) {
                throw_failed(what);
            }
        }
        if (req.op != static_cast<uint32_t>(LinkOp::forward)) { last_control_ = Clock::now(); }  // its replies carry device memory
        req.seq = ++seq_;
        if (payload) { req.bytes = static_cast<int64_t>(payload_n); }
        live_.clear();
        for (int32_t r : targets) {
            replies_[r].status = 0;
            auto & link = ranks_[r].link;
            if (link.send(req, pass_fd) && (!payload || !link.stream() || link.send_bytes(payload, payload_n))) {
                live_.push_back(r);
            } else {
                mark_failed(r, false);
            }
        }
        gather(live_, Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wait_s_)), abandon, req.seq);
        for (int32_t r : targets) {
            if (ranks_[r].failed) { throw_failed(what); }
        }
        if (!targets.empty() && !ranks_[0].failed) {
            weight_bytes_ = replies_[0].weight_bytes;
            kv_bytes_     = replies_[0].kv_bytes;
        }
    }

    /// Every rank has staged or reloaded: each lets go of its fetch (the last holder of the rsync
    /// source's shared dir removes it), before commit, so a rank killed later leaves nothing.
    void release_fetched_everywhere() {
        try {
            call_op(LinkOp::release_fetched, "releasing the fetched weights");
        } catch (...) {
            drop_on_survivors();
            throw;
        }
    }

    void call_op(LinkOp op, const char * what) {
        LinkMsg m;
        m.op = static_cast<uint32_t>(op);
        call(m, what);
        check_replies(what);
    }

    /// The first rank's error (every rank answered).
    void check_replies(const char * what) const {
        for (const auto & m : replies_) {
            if (m.status > 0) {
                const auto code = static_cast<Errc>(m.status);
                throw Error(code, world_size() == 1 ? std::string(m.text) : fmt::format("rank {} ({}): {}", m.rank, what, m.text));
            }
        }
    }

    [[noreturn]] void throw_failed(const char * what) const {
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

    /// Rank `r` is out until recover(): its link closed (`timed_out` false) or it missed a deadline.
    void mark_failed(int32_t r, bool timed_out, const std::string & what = {}) {
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
        k.failed = true;
        log::get("engine")->error("rank {} {}", r, k.why);
    }

    std::vector<RankReport> reports() const {
        std::vector<RankReport> out;
        for (int32_t r = 0; r < world_size(); ++r) { out.push_back(rank_report_from_msg(replies_[r])); }
        return out;
    }

    void drop_on_survivors() {
        LinkMsg m;
        m.op = static_cast<uint32_t>(LinkOp::drop);
        try { call(m, "drop_staged_weights", true); } catch (const Error &) {}
    }

    void connect_group() {
        if (comm_connected_) { return; }
        LinkMsg m;
        m.op         = static_cast<uint32_t>(LinkOp::comm_connect);
        m.generation = ++generation_;
        ShmCommSegment segment = comm_segment(generation_);
        call(m, "wakeup (rebuilding the communication group)", false, nullptr, nullptr, 0, -1, segment.fd());
        check_replies("wakeup (rebuilding the communication group)");
        comm_connected_ = true;
    }

    /// shm: a fresh memfd segment for `generation` (the daemon's descriptor closes when the
    /// returned holder goes); gloo: none.
    ShmCommSegment comm_segment(int64_t generation) const {
        if (cfg_.dist_backend != "shm") { return {}; }
        return ShmCommSegment(world_size(), generation);
    }

    /// Wait for rank `r`'s process to end (SIGKILL first when `kill`); bounded.
    void reap(int32_t r, bool kill) {
        auto & k = ranks_[r];
        if (k.remote && listener_) { listener_->mark_gone(r); }  // before the close: its duplicate would keep the link open
        k.link.close();
        if (k.pid <= 0) { return; }
        if (kill) { ::kill(k.pid, SIGKILL); }
        const auto deadline = Clock::now() + std::chrono::seconds(5);
        int st = 0;
        while (::waitpid(k.pid, &st, WNOHANG) == 0) {
            if (Clock::now() > deadline) {
                if (!kill) {
                    ::kill(k.pid, SIGKILL);
                    kill = true;
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

    void shutdown() {
        LinkMsg m;
        m.op = static_cast<uint32_t>(LinkOp::shutdown);
        for (auto & k : ranks_) {
            if (!k.failed) { k.link.send(m); }
        }
        for (int32_t r = 0; r < world_size(); ++r) {
            auto & k = ranks_[r];
            if (!k.failed && k.link.open()) {
                LinkMsg ack;
                k.link.recv(ack, Clock::now() + std::chrono::seconds(5));
            }
            reap(r, ranks_[r].failed);
        }
    }

    MpExecutorConfig                 cfg_;
    model::ModelConfig               model_cfg_;
    double                           wait_s_;
    std::string                      binary_;
    SpawnThread                      spawner_;   ///< every local rank is started (and so parented) there
    std::unique_ptr<JoinListener>    listener_;  ///< nnodes > 1: where other nodes' ranks join
    std::unique_ptr<TcpStoreServer>  store_;
    int32_t                          per_node_ = 1;
    SharedRegion                     region_;
    std::vector<Rank>                ranks_;
    std::vector<std::atomic<pid_t>>  pids_;      ///< [world] live rank pids (0: none), read by other threads
    std::vector<std::atomic<int64_t>> remote_rss_;  ///< [world] RSS a rank on another node last reported (0: local / none)
    std::vector<LinkMsg>             replies_;   ///< [world] the latest call's answers
    std::vector<int32_t>             targets_, live_, pending_, still_;
    uint64_t                         seq_ = 0;
    int64_t                          generation_ = 1;
    bool                             comm_connected_ = false;
    int64_t                          weight_bytes_ = 0, kv_bytes_ = 0;
    bool                             cuda_ = false;            ///< --device cuda: replies carry device memory
    bool                             shared_devices_ = false;  ///< two ranks of one node on one CUDA device
    Clock::time_point                last_control_{};          ///< the last call whose replies carried device memory
    mutable std::mutex               dev_mu_;
    std::vector<RankDevice>          devs_;                    ///< [world] each CUDA rank's last report (measured 0: none yet)
};

}  // namespace

void probe_step_link(Executor & ex, const model::StepBatch * batch) {
    auto * mp = dynamic_cast<MpExecutor *>(&ex);
    if (!mp) { fail(Errc::invalid_argument, "probe_step_link: the {} executor has no step link", ex.backend()); }
    mp->probe(batch);
}

std::unique_ptr<Executor> make_mp_executor(const MpExecutorConfig & cfg, const model::ModelConfig & model_cfg) {
    return std::make_unique<MpExecutor>(cfg, model_cfg);
}

}  // namespace fd::runtime
