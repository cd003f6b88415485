// A rank process of the multi-process executor: builds its Worker and its weight source (a
// LocalExecutor for its own rank), joins the communication group, then serves the link. The
// fields it exchanges with the daemon (spawn JSON, LinkMsg control fields): mp_wire.cpp.
#include "fd/arena.h"
#include "fd/log.h"
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/comm/comm.h"
#include "fd/liveness.h"
#include "fd/status.h"

#include "draft_wire.h"
#include "mp_wire.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fd::runtime {

using json = nlohmann::json;
using namespace comm;  // the collectives (fd/comm/comm.h) this rank builds

namespace {

/// The file of a TEST-ONLY hook spec `<phase>:<rank>:<file>` in environment variable `env` when
/// it names `phase` and `rank`, and this process created the file just now (O_EXCL, the pid
/// written in it: once per file, so a respawned rank does not trip again); else empty.
std::string test_hook_trips(const char * env, const char * phase, int rank) {
    const char * spec = std::getenv(env);
    if (spec == nullptr || *spec == '\0') { return {}; }
    const std::string s = spec;
    const auto c1 = s.find(':');
    const auto c2 = c1 == std::string::npos ? std::string::npos : s.find(':', c1 + 1);
    if (c2 == std::string::npos || s.compare(0, c1, phase) != 0 || c1 != std::strlen(phase) ||
        s.substr(c1 + 1, c2 - c1 - 1) != std::to_string(rank)) {
        return {};
    }
    const std::string file = s.substr(c2 + 1);
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) { return {}; }
    const std::string pid = std::to_string(::getpid()) + "\n";
    [[maybe_unused]] const auto n = ::write(fd, pid.data(), pid.size());
    ::close(fd);
    return file;
}

/// TEST-ONLY hooks (docs/operations.md, "Test hooks"), compiled in always and inert unless the
/// environment sets them. Phases: `stage` (asked to stage, nothing fetched yet), `commit`
/// (staged, asked to commit), `committed` (committed, before it answers), `comm_connect` (a
/// wakeup's group rebuild, before it joins), `forward` (a step, before its model run) and
/// `ep_dispatch` (expert parallel: a MoE layer, before its dispatch; its peers wait in the combine).
/// FD_TEST_PAUSE_AT=<phase>:<rank>:<file>: rank <rank> writes its pid to <file> and sleeps up to
/// 60 s as a bounded wait (its heartbeat says it progresses), for a test to SIGKILL or SIGSTOP it
/// at exactly that phase. FD_TEST_HANG_AT=<phase>:<rank>:<file>: the same, but its main loop hangs
/// (up to 600 s, no progress, the beat thread still beating): a deadlocked rank, for the stuck
/// check (--rank-stuck-s). A test arms a hook for later by creating <file> first and deleting it
/// when the hook should trip. Never set them in production.
void test_pause_at(const char * phase, int rank) {
    if (!test_hook_trips("FD_TEST_PAUSE_AT", phase, rank).empty()) {
        log::get("rank")->warn("rank {}: FD_TEST_PAUSE_AT: pausing at {} (test-only hook)", rank, phase);
        liveness::WaitScope waiting;
        std::this_thread::sleep_for(std::chrono::seconds(60));
    }
    if (!test_hook_trips("FD_TEST_HANG_AT", phase, rank).empty()) {
        log::get("rank")->warn("rank {}: FD_TEST_HANG_AT: hanging at {} (test-only hook)", rank, phase);
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(600);
        while (std::chrono::steady_clock::now() < until) { std::this_thread::sleep_for(std::chrono::milliseconds(10)); }
    }
}

/// A rank's Comm as its heartbeat sees it: every collective and (re)connect is a wait on the
/// peers, bounded by the comm's own timeout (and each peer watched by the daemon), so a rank
/// waiting there is not stuck; a finished one is progress (fd/liveness.h).
class WatchedComm final : public Comm {
public:
    explicit WatchedComm(std::unique_ptr<Comm> inner) : inner_(std::move(inner)) {}
    const char * name() const override { return inner_->name(); }
    int32_t rank() const override { return inner_->rank(); }
    int32_t world_size() const override { return inner_->world_size(); }
    bool connected() const override { return inner_->connected(); }
    void connect(int64_t generation) override {
        liveness::WaitScope w;
        inner_->connect(generation);
    }
    void disconnect() override { inner_->disconnect(); }
    void all_reduce_sum(float * data, int64_t n) override {
        liveness::WaitScope w;
        inner_->all_reduce_sum(data, n);
    }
    void gather(const float * send, int64_t n, float * recv) override {
        liveness::WaitScope w;
        inner_->gather(send, n, recv);
    }
    void all_gather(const float * send, int64_t n, float * recv) override {
        liveness::WaitScope w;
        inner_->all_gather(send, n, recv);
    }
    void barrier() override {
        liveness::WaitScope w;
        inner_->barrier();
    }
    void use_backend(kernels::Backend * backend) override { inner_->use_backend(backend); }

private:
    std::unique_ptr<Comm> inner_;
};

/// The rank's group: nccl on its CUDA device, or shm / gloo (staged through host memory when the
/// rank's tensors are device memory, or always under the FD_TEST_STAGED_FILL test hook).
/// `segment_fd`: the shm group's segment for a generation (the fd that came over the rank link).
std::unique_ptr<Comm> make_rank_comm(const RankSpawn & s, std::function<int(int64_t)> segment_fd) {
    const auto & c = s.cfg;
    // Half the daemon's timeout: a rank whose peer died answers with that error before the daemon
    // gives up on it, so the daemon names the dead rank, not the waiting one.
    const GlooCommConfig g{.rank = s.rank, .world_size = c.tensor_parallel_size, .bind_host = s.bind_addr.empty() ? c.master_addr : s.bind_addr,
                           .store_host = c.master_addr, .store_port = s.store_port, .store_token = s.store_token,
                           .timeout_s = 0.5 * c.timeout_s};
    if (c.dist_backend == DistBackend::nccl) { return std::make_unique<WatchedComm>(make_nccl_comm(g, c.worker.device_id)); }
    std::unique_ptr<Comm> host = c.dist_backend == DistBackend::shm
                                     ? make_shm_comm({.rank = s.rank, .world_size = c.tensor_parallel_size, .segment_fd = std::move(segment_fd),
                                                      .timeout_s = 0.5 * c.timeout_s})
                                     : make_gloo_comm(g);
    const bool device = c.worker.device != kernels::DeviceKind::cpu;
    if (!device && !c.worker.test_device_paths) { return std::make_unique<WatchedComm>(std::move(host)); }
    log::get("rank")->info("rank {}: {} collectives staged through host memory ({})", s.rank, dist_backend_name(c.dist_backend),
                           device ? "device tensors" : "TEST: FD_TEST_STAGED_FILL");
    return std::make_unique<WatchedComm>(make_staged_comm(std::move(host), c.worker.test_device_paths));
}

/// The rank's side: one request at a time, answered in order.
class RankServer {
public:
    /// `region_fd` -1: a rank on another node (a TCP link; the step arrives inline).
    RankServer(LinkSocket link, int region_fd) : link_(std::move(link)) {
        if (region_fd >= 0) { region_.attach(region_fd); }
    }
    ~RankServer() {
        {
            std::lock_guard lk(send_mu_);
            stop_beat_ = true;
        }
        beat_cv_.notify_all();
        if (beat_.joinable()) { beat_.join(); }
    }

    /// Build everything, answer `ready` (or the error that stopped start-up). False: exit.
    bool start(const RankSpawn & s) {
        spawn_ = s;
        set_busy(0);  // start-up beats too (seq 0): reading the weights can be long
        beat_ = std::thread([this] { beat_loop(); });
        LinkMsg ready;
        ready.op   = static_cast<uint32_t>(LinkOp::ready);
        ready.rank = s.rank;
        try {
            const auto & c = s.cfg;
            // The group first (a sharded worker all-reduces from its first step). The shm segment
            // came with the config (start-up) or comes with comm_connect (a rebuild).
            comm_ = make_rank_comm(s, [this](int64_t) { return link_.take_fd(); });
            comm_->connect(s.generation);
            model_cfg_ = model::load_model_config(c.model_dir);
            model::WorkerConfig wcfg = c.worker;
            wcfg.tp_size = c.tensor_parallel_size;  // rank r of T: its shard, collectives through comm_
            if (std::getenv("FD_TEST_PAUSE_AT") != nullptr && wcfg.ep_size > 1) {
                wcfg.test_ep_dispatch_hook = [rank = s.rank] { test_pause_at("ep_dispatch", rank); };
            }
            auto worker = std::make_unique<model::Worker>(model_cfg_, model::read_tensor_index(c.model_dir), wcfg, comm_.get());
            comm_->use_backend(&worker->backend());  // nccl: the backend's stream; shm/gloo on cuda: staged through host memory
            ex_ = make_local_executor(std::move(worker), weights::make_weight_source(c.source), s.rank, /*hold_fetched=*/true);
            fill_state(ready);
        } catch (const Error & e) {
            ready.status = static_cast<int32_t>(e.code());
            set_field(ready.text, e.what());
        } catch (const std::exception & e) {
            ready.status = static_cast<int32_t>(Errc::internal);
            set_field(ready.text, e.what());
        }
        return answer(ready) && ready.status == 0;
    }

    /// True when the daemon said shutdown; false when the link closed or broke.
    bool serve() {
        for (;;) {
            LinkMsg m;
            // Idle until the daemon asks; a second at a time, so a vanished daemon is noticed
            // even if the kernel never closes our end.
            const auto r = link_.recv(m, std::chrono::steady_clock::now() + std::chrono::seconds(1));
            if (r == LinkSocket::Recv::timeout) {
                if (::getppid() == 1) { return false; }
                continue;
            }
            if (r == LinkSocket::Recv::closed) { return false; }
            const auto op = static_cast<LinkOp>(m.op);
            if (op == LinkOp::shutdown) {
                comm_->disconnect();
                answer(m);
                return true;
            }
            set_busy(m.seq);
            liveness::tick();  // a request taken: progress
            const bool inline_step = op == LinkOp::forward || op == LinkOp::swap_kv || op == LinkOp::draft_mtp ||
                                     (op == LinkOp::probe && m.bytes > 0);
            if (inline_step && link_.stream()) {
                // The step's arrays (or the swap's block lists) follow the request inline; the buffer
                // only grows, up to kInlineMaxBytes. A longer length is refused before anything is
                // allocated; the bytes after it cannot be skipped, so the link is closed (the daemon
                // sees this rank fail, and a node agent rejoins).
                const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                                             std::chrono::duration<double>(std::max(1.0, 0.9 * spawn_.cfg.timeout_s)));
                try {
                    if (recv_inline(link_, m, inline_, deadline) != LinkSocket::Recv::ok) { return false; }
                } catch (const Error & e) {
                    log::get("rank")->error("rank {}: {}; closing the link", spawn_.rank, e.what());
                    return false;
                }
            }
            LinkMsg reply = handle(op, m);
            reply.op   = m.op;
            reply.seq  = m.seq;
            reply.rank = spawn_.rank;
            if (reply.status != 0) { reply.detail_bytes = 0; }
            if (!answer(reply)) { return false; }  // busy_ is false from here: no beat follows the reply
            if (reply.detail_bytes > 0 && !link_.send_payload(detail_.data(), detail_.size())) { return false; }
        }
    }

private:
    /// Run one request; a rank_call's detail is left in detail_ (reply.detail_bytes of it).
    LinkMsg handle(LinkOp op, const LinkMsg & m) {
        LinkMsg reply;
        detail_.clear();
        try {
            switch (op) {
                case LinkOp::forward: return forward(m);
                case LinkOp::probe: return probe(m);
                case LinkOp::draft_mtp: draft_mtp(m); break;
                case LinkOp::rank_call: {
                    // The table's row, on this rank's LocalExecutor (rank_ops.cpp). The test hook's
                    // phases are the ops' names (stage, commit, ...), and committed after a commit.
                    const RankRequest req = rank_request_from_msg(m);
                    test_pause_at(std::string(rank_op_name(req.op)).c_str(), spawn_.rank);
                    RankReport rep = std::move(ex_->rank_call(req)[0]);
                    if (req.op == RankOp::commit) { test_pause_at("committed", spawn_.rank); }
                    rank_report_to_msg(rep, reply);
                    detail_            = std::move(rep.detail);
                    reply.detail_bytes = static_cast<int64_t>(detail_.size());
                    break;
                }
                case LinkOp::swap_kv: {
                    if (!link_.stream() && static_cast<int64_t>(m.region_bytes) != region_.bytes()) { region_.remap(); }
                    if (link_.stream()) { check_inline_swap(m.bytes, m.n_swap_out, m.n_swap_in); }
                    const auto [out, in] = swap_lists(link_.stream() ? static_cast<void *>(inline_.data()) : region_.data(), m.n_swap_out);
                    FD_CHECK(m.n_swap_bg >= 0 && m.n_swap_bg <= m.n_swap_out, "swap_kv: {} background copies of {}", m.n_swap_bg, m.n_swap_out);
                    ex_->swap_kv(out, m.n_swap_out - m.n_swap_bg, in, m.n_swap_in, out + (m.n_swap_out - m.n_swap_bg), m.n_swap_bg);
                    break;
                }
                case LinkOp::comm_connect:
                    test_pause_at("comm_connect", spawn_.rank);
                    comm_->connect(m.generation);
                    break;
                case LinkOp::comm_disconnect: comm_->disconnect(); break;
                default: fail(Errc::internal, "rank {}: unknown link op {}", spawn_.rank, m.op);
            }
        } catch (const Error & e) {
            reply.status = static_cast<int32_t>(e.code());
            set_field(reply.text, e.what());
        } catch (const std::exception & e) {
            reply.status = static_cast<int32_t>(Errc::internal);
            set_field(reply.text, e.what());
        }
        fill_state(reply);
        return reply;
    }

    /// The link's cost alone: decode the step like forward() (region_bytes 0: none), no model.
    LinkMsg probe(const LinkMsg & m) {
        if (link_.stream()) {
            if (m.bytes > 0) {
                check_inline_step(inline_.data(), m.bytes);
                step_decode(inline_.data(), batch_);
            }
        } else if (m.region_bytes > 0) {
            if (static_cast<int64_t>(m.region_bytes) != region_.bytes()) { region_.remap(); }
            step_decode(region_.data(), batch_);
        }
        return LinkMsg{};
    }

    LinkMsg forward(const LinkMsg & m) {
        test_pause_at("forward", spawn_.rank);
        LinkMsg reply;
        void * step = nullptr;
        if (link_.stream()) {
            FD_CHECK(spawn_.rank != 0, "rank 0 runs on node 0");
            check_inline_step(inline_.data(), m.bytes);
            step = inline_.data();
        } else {
            if (static_cast<int64_t>(m.region_bytes) != region_.bytes()) { region_.remap(); }
            step = region_.data();
        }
        step_decode(step, batch_);
        auto * h = static_cast<RegionHeader *>(step);
        float * out = nullptr;
        if (spawn_.rank == 0) {
            out = step_logits(step);
        } else {
            scratch_.resize(batch_.logits_rows.size() * static_cast<size_t>(model_cfg_.vocab_size));
            out = scratch_.data();
        }
        // Dropping a step half-way is only safe alone: with peers, every rank must reach every
        // all-reduce, so a group finishes the step.
        const bool done = ex_->forward(batch_, out, spawn_.cfg.tensor_parallel_size == 1 ? &h->abandon : nullptr);
        // R3: rank 0's routes go beside its logits (every rank routed the same tokens identically).
        if (done && spawn_.rank == 0 && h->route_cols > 0) {
            const int32_t * routes = ex_->step_routes();
            FD_CHECK(routes != nullptr && h->route_cols == model::route_cols(model_cfg_),
                     "rank 0 has no routes of {} columns for a step that asked for them", h->route_cols);
            std::memcpy(step_routes(step), routes, static_cast<size_t>(h->n_tokens) * h->route_cols * sizeof(int32_t));
        }
        reply.status = done ? 0 : kLinkAbandoned;
        return reply;
    }

    /// The MTP draft work of the last step on this rank's shard (draft_wire.h); rank 0 writes the
    /// drafts into the region (every rank computed the same ones: Worker::mtp_argmax).
    void draft_mtp(const LinkMsg & m) {
        void * batch = nullptr;
        if (link_.stream()) {
            FD_CHECK(spawn_.rank != 0, "rank 0 runs on node 0");
            check_inline_draft(inline_.data(), m.bytes);
            batch = inline_.data();
        } else {
            if (static_cast<int64_t>(m.region_bytes) != region_.bytes()) { region_.remap(); }
            batch = region_.data();
        }
        draft_decode(batch, draft_batch_, spawn_.cfg.worker.block_size);
        ex_->draft_mtp(draft_batch_, drafts_);
        if (spawn_.rank != 0) { return; }
        const int32_t n = static_cast<const DraftHeader *>(batch)->n_drafts;
        FD_CHECK(static_cast<int64_t>(drafts_.size()) == n, "rank 0 drafted {} tokens for {} wanted", drafts_.size(), n);
        std::copy(drafts_.begin(), drafts_.end(), draft_out(batch));
    }

    void fill_state(LinkMsg & m) const {
        if (!ex_) { return; }
        m.weight_bytes   = ex_->weight_bytes();
        m.kv_bytes       = ex_->kv_bytes();
        m.mtp_cache_bytes = ex_->mtp_cache_bytes();
        m.comm_connected = comm_ && comm_->connected();
        if (m.rss_bytes == 0) { m.rss_bytes = process_rss_bytes(); }
        try {
            ex_->refresh_rank_devices(0.0);  // cuda: cudaMemGetInfo now; cpu: nothing
        } catch (const Error & e) {
            log::get("rank")->warn("rank {}: device memory not measured: {}", spawn_.rank, e.what());
        }
        const auto devs = ex_->rank_devices();
        if (devs.empty()) { return; }
        RankDevice d = devs[0];
        d.comm_connected = m.comm_connected != 0;
        const auto n = nccl_comm_counts();
        d.nccl_comms_live    = n.live;
        d.nccl_comms_created = n.inits;
        rank_device_to_msg(d, m);
    }

    /// Beats from now on, for request `seq`.
    void set_busy(uint64_t seq) {
        std::lock_guard lk(send_mu_);
        busy_ = true;
        seq_  = seq;
    }

    /// The reply (or `ready`): no beat follows it until the next request.
    bool answer(const LinkMsg & m) {
        std::lock_guard lk(send_mu_);
        busy_ = false;
        return link_.send(m);
    }

    /// Every beat_interval_s (--rank-heartbeat-s / 10) while busy: one `beat` with the seconds since the main loop
    /// last progressed (fd/liveness.h). Idle ranks send nothing (no one reads their link then).
    void beat_loop() {
        const auto every = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            std::chrono::duration<double>(beat_interval_s(spawn_.cfg.heartbeat_s)));
        std::unique_lock lk(send_mu_);
        while (!stop_beat_) {
            beat_cv_.wait_for(lk, every, [this] { return stop_beat_; });
            if (stop_beat_ || !busy_) { continue; }
            if (link_.hung_up()) {
                // The daemon gave this rank up (stuck past --rank-stuck-s, or a wakeup rebuilding
                // the group) and closed its link while the main loop is still in a request: nothing
                // can come of it. Exit as serve() does on a closed link, so a remote node's agent
                // sees the exit and rejoins (a probe: a stuck rank on node 1 kept its node out of
                // every wakeup).
                log::get("rank")->error("rank {}: the daemon closed the link while a request was in progress; exiting", spawn_.rank);
                std::_Exit(3);
            }
            LinkMsg b;
            b.op               = static_cast<uint32_t>(LinkOp::beat);
            b.seq              = seq_;
            b.rank             = spawn_.rank;
            b.since_progress_s = liveness::seconds_since_progress();
            link_.send_beat(b);
        }
    }

    LinkSocket                 link_;
    std::mutex                 send_mu_;    ///< one sender at a time (a stream link's records must not interleave)
    std::condition_variable    beat_cv_;
    std::thread                beat_;
    bool                       busy_ = false, stop_beat_ = false;  ///< (send_mu_)
    uint64_t                   seq_ = 0;                          ///< the request being worked on (send_mu_)
    SharedRegion               region_;
    RankSpawn                  spawn_;
    model::ModelConfig         model_cfg_;
    std::unique_ptr<Executor>  ex_;
    std::unique_ptr<Comm>      comm_;
    model::StepBatch           batch_;
    model::DraftBatch          draft_batch_;  ///< the last draft_mtp request's (block tables point into the region)
    std::vector<int32_t>       drafts_;
    std::vector<float>         scratch_;
    std::vector<int64_t>       inline_;  ///< a remote rank's step arrays (8-byte aligned)
    std::string                detail_;  ///< the last rank_call's RankReport::detail
};

}  // namespace

int rank_process_main(int argc, char ** argv) {
    if (argc < 5) {
        std::fprintf(stderr, "%s is for fdrollout's own rank processes\n", kRankProcessFlag);
        return 2;
    }
    // Die with the daemon; the daemon alone decides when ranks stop (a terminal's Ctrl-C reaches
    // the whole process group, and the daemon drains first).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != static_cast<pid_t>(std::atoll(argv[4]))) { return 1; }
    std::signal(SIGINT, SIG_IGN);
    std::signal(SIGTERM, SIG_IGN);  // systemd and `timeout` signal the whole group; the daemon drains, then stops its ranks
    std::signal(SIGPIPE, SIG_IGN);
    LinkSocket link(std::atoi(argv[2]));
    std::vector<char> buf(1 << 20);
    const int64_t n = link.recv_bytes(buf.data(), buf.size());
    if (n <= 0) { return 1; }
    RankSpawn spawn;
    try {
        spawn = rank_spawn_from_json(json::parse(buf.data(), buf.data() + n));
        log::setup(spawn.cfg.log_level, spawn.cfg.log_format);
    } catch (const std::exception & e) {
        std::fprintf(stderr, "fdrollout rank: bad configuration: %s\n", e.what());
        return 1;
    }
    RankServer server(std::move(link), std::atoi(argv[3]));
    if (!server.start(spawn)) { return 1; }
    log::get("rank")->info("rank {}/{} ready (pid {})", spawn.rank, spawn.cfg.tensor_parallel_size, ::getpid());
    // 0 only when the daemon said shutdown: a node agent rejoins on anything else.
    return server.serve() ? 0 : 3;
}

}  // namespace fd::runtime
