// MpExecutor: one OS process per rank, reached through rank links (fd/runtime/mp_executor.h).
// This file: construction, the Executor operations and the round trip to every rank; the rank
// processes' lifecycle and measurements are in mp_executor_ranks.cpp (class: mp_executor_impl.h).
#include "mp_executor_impl.h"

#include "fd/kernels/backend.h"
#include "fd/log.h"
#include "fd/status.h"

#include "mp_wire.h"

#include <poll.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

namespace fd::runtime {

MpExecutor::MpExecutor(const MpExecutorConfig & cfg, const model::ModelConfig & model_cfg)
    : cfg_(cfg), model_cfg_(model_cfg), wait_s_(std::max(0.2, 0.9 * cfg.timeout_s)) {
    world_ = World::make(cfg.tensor_parallel_size, cfg.nnodes,
                         cfg.worker.device == kernels::DeviceKind::cuda ? kernels::device_count(kernels::DeviceKind::cuda) : 1);
    cuda_  = cfg.worker.device == kernels::DeviceKind::cuda;
    std::vector<std::string> problems;
    cfg_.dist_backend = resolve_dist_backend(cfg.dist_backend, world_, cuda_, problems);
    FD_CHECK(cfg_.dist_backend == DistBackend::gloo || !world_.multi_node(),
             "--dist-backend {} with --nnodes {}: shm and nccl need every rank on one host", dist_backend_name(cfg_.dist_backend), cfg.nnodes);
    if (cuda_ && world_.ranks_per_device() > 1) {
        log::get("engine")->warn("{} ranks share {} CUDA device(s): rank r runs on device r mod {}. Fine for tests; each rank holds its "
                                 "own context and the group runs {} staged through host memory (NCCL refuses two ranks on one device)",
                                 world_.per_node(), world_.n_devices, world_.n_devices, dist_backend_name(cfg_.dist_backend));
    }
    if (cfg.nnodes > 1) {
        listener_ = std::make_unique<JoinListener>(
            cfg.master_addr, cfg.master_port,
            JoinExpect{.nnodes = cfg.nnodes, .tp = cfg.tensor_parallel_size, .fingerprint = model_fingerprint(cfg.model_dir),
                       .token = cfg.dist_token, .send_timeout_s = wait_s_});
        store_ = std::make_unique<comm::TcpStoreServer>(cfg.master_addr, 0, store_token_);
    } else {
        store_ = std::make_unique<comm::TcpStoreServer>(cfg.master_addr, cfg.master_port, store_token_);
    }
    binary_ = cfg.rank_binary.empty() ? std::filesystem::read_symlink("/proc/self/exe").string() : cfg.rank_binary;
    region_.create(step_layout(256, 64, 1024, model_cfg.vocab_size).total_bytes);
    ranks_.resize(static_cast<size_t>(cfg.tensor_parallel_size));
    for (int32_t r = 0; r < world_size(); ++r) {
        ranks_[r].node   = world_.node_of(r);
        ranks_[r].remote = world_.is_remote(r);
    }
    pids_ = std::vector<std::atomic<pid_t>>(ranks_.size());
    remote_rss_ = std::vector<std::atomic<int64_t>>(ranks_.size());
    replies_.resize(ranks_.size());
    details_.resize(ranks_.size());
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

bool MpExecutor::forward(const model::StepBatch & batch, float * logits, const std::atomic<bool> * abandon) {
    const float * in_place = forward_in_place(batch, abandon);
    if (!in_place) { return false; }
    std::memcpy(logits, in_place, batch.logits_rows.size() * static_cast<size_t>(model_cfg_.vocab_size) * sizeof(float));
    return true;
}

const float * MpExecutor::forward_in_place(const model::StepBatch & batch, const std::atomic<bool> * abandon) {
    const int32_t bs = cfg_.worker.block_size, vocab = model_cfg_.vocab_size, rc = model::route_cols(model_cfg_);
    routes_ = nullptr;
    int64_t need = step_encode(region_.data(), region_.bytes(), batch, bs, vocab, rc);
    if (need > region_.bytes()) {
        region_.resize(need + need / 2);
        need = step_encode(region_.data(), region_.bytes(), batch, bs, vocab, rc);
    }
    auto * h = static_cast<RegionHeader *>(region_.data());
    h->abandon.store(false, std::memory_order_relaxed);  // the link's send orders it before the rank reads
    LinkMsg req;
    req.op           = static_cast<uint32_t>(LinkOp::forward);
    req.region_bytes = static_cast<uint64_t>(region_.bytes());
    // Ranks on other nodes get the step's arrays inline (everything before the logits).
    const size_t inline_n = world_.multi_node() ? static_cast<size_t>(step_layout(h->n_tokens, h->n_logits, h->n_tables, vocab).logits) : 0;
    call(req, "forward", false, abandon, inline_n ? region_.data() : nullptr, inline_n);
    if (replies_[0].status == kLinkAbandoned) { return nullptr; }
    check_replies("forward");
    routes_ = runtime::step_routes(region_.data());  // rank 0 wrote them beside the logits (nullptr: not asked)
    return step_logits(region_.data());
}

void MpExecutor::draft_mtp(const model::DraftBatch & db, std::vector<int32_t> & drafts) {
    FD_CHECK(cfg_.worker.mtp_draft_tokens > 0, "draft_mtp without MTP drafts configured");
    const int32_t bs = cfg_.worker.block_size;
    int64_t need = draft_encode(region_.data(), region_.bytes(), db, bs, draft_runs_);
    if (need > region_.bytes()) {
        region_.resize(need + need / 2);
        need = draft_encode(region_.data(), region_.bytes(), db, bs, draft_runs_);
    }
    const auto * h = static_cast<const DraftHeader *>(region_.data());
    LinkMsg req;
    req.op           = static_cast<uint32_t>(LinkOp::draft_mtp);
    req.region_bytes = static_cast<uint64_t>(region_.bytes());
    // Ranks on other nodes get the batch inline (everything before the drafts, which rank 0 writes).
    const size_t inline_n =
        world_.multi_node() ? static_cast<size_t>(draft_layout(h->n_rows, h->n_chains, h->n_tables, h->n_drafts).drafts) : 0;
    call(req, "MTP drafts", false, nullptr, inline_n ? region_.data() : nullptr, inline_n);
    check_replies("MTP drafts");
    const int32_t * out = draft_out(region_.data());
    drafts.assign(out, out + h->n_drafts);
}

void MpExecutor::probe(const model::StepBatch * batch) {
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
        inline_n = world_.multi_node() ? static_cast<size_t>(step_layout(h->n_tokens, h->n_logits, h->n_tables, vocab).logits) : 0;
    }
    call(req, "link probe", false, nullptr, inline_n ? region_.data() : nullptr, inline_n);
    check_replies("link probe");
}

std::vector<RankReport> MpExecutor::rank_call(const RankRequest & req) {
    call_op(req);
    return reports();
}

std::vector<RankReport> MpExecutor::stage_weights(const weights::FetchRequest & req) {
    LinkMsg m;
    rank_request_to_msg({.op = RankOp::stage, .fetch = req}, m);
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

std::vector<RankReport> MpExecutor::commit_weights() {
    call_op({.op = RankOp::commit});
    return reports();
}

std::vector<RankReport> MpExecutor::release(MemoryTag tag) {
    const RankRequest req{.op = RankOp::release, .tag = tag};
    if (shared_devices_) {
        // Ranks sharing a device release one at a time: each one's cudaMemGetInfo delta
        // (device_freed_bytes) is then its own, not its neighbour's too.
        for (auto & m : replies_) { m.status = 0; }  // check_replies reads every rank's: none stale
        for (int32_t r = 0; r < world_size(); ++r) {
            LinkMsg m;
            rank_request_to_msg(req, m);
            call(m, "sleep", false, nullptr, nullptr, 0, r);
            check_replies("sleep");
        }
    } else {
        call_op(req);
    }
    auto reps = reports();
    if (tag == MemoryTag::weight && cfg_.shutdown_comm_group_if_worker_idle && comm_connected_) {
        call_op(LinkOp::comm_disconnect, "sleep (closing the communication group)");
        comm_connected_ = false;
    }
    return reps;
}

void MpExecutor::swap_kv(const kv::BlockCopy * out, int64_t n_out, const kv::BlockCopy * in, int64_t n_in, const kv::BlockCopy * bg,
                         int64_t n_bg) {
    if (n_bg > 0) {  // the background copies ride at the out list's end (rank_link.h)
        swap_scratch_.assign(out, out + n_out);
        swap_scratch_.insert(swap_scratch_.end(), bg, bg + n_bg);
        out   = swap_scratch_.data();
        n_out = static_cast<int64_t>(swap_scratch_.size());
    }
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
    m.n_swap_bg    = n_bg;
    // Ranks on other nodes get the block lists inline, like a step's arrays.
    const bool remote = world_.multi_node();
    call(m, "KV swap", false, nullptr, remote ? region_.data() : nullptr, remote ? static_cast<size_t>(need) : 0);
    check_replies("KV swap");
}

std::vector<RankReport> MpExecutor::acquire_kv() {
    call_op({.op = RankOp::acquire_kv});
    return reports();
}

std::vector<RankReport> MpExecutor::reload_weights(const weights::FetchRequest & req) {
    connect_group();
    LinkMsg m;
    rank_request_to_msg({.op = RankOp::reload, .fetch = req}, m);
    call(m, "wakeup (weights)");
    try {
        check_replies("wakeup (weights)");
    } catch (...) {
        // All or none: ranks that did load hand their copy back again.
        LinkMsg rel;
        rank_request_to_msg({.op = RankOp::release, .tag = MemoryTag::weight}, rel);
        try { call(rel, "wakeup (undo)", true); } catch (const Error &) {}
        throw;
    }
    auto reps = reports();
    release_fetched_everywhere();
    return reps;
}

void MpExecutor::gather(const std::vector<int32_t> & ranks, Clock::time_point deadline, const std::atomic<bool> * abandon, uint64_t seq) {
    pending_.assign(ranks.begin(), ranks.end());
    pollfd fds[128];  // [0, n): the pending ranks' links; [n, n + n_pidfd): the pidfds of the local ones among them
    int32_t pid_of[64];
    FD_CHECK(pending_.size() <= 64, "{} ranks on one node", pending_.size());
    // A stopped rank is looked at every heartbeat_s / 10 (5 ms .. 500 ms): caught within heartbeat_s + 2 looks (≤ 1.2 × heartbeat_s).
    const auto tick = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::clamp(cfg_.heartbeat_s / 10, 0.005, 0.5)));
    auto next_beat = Clock::now() + tick;
    const bool startup = seq == 0;
    for (int32_t r : pending_) {
        ranks_[r].heard     = Clock::now();
        ranks_[r].beat_seen = false;
    }
    bool abandoned = false, lost = n_lost_ != lost_mark_;  // a rank already lost since the call began (its send failed)
    if (lost) { deadline = std::min(deadline, Clock::now() + kSurvivorGrace); }
    while (!pending_.empty()) {
        const auto now = Clock::now();
        if (now >= deadline) {
            if (!lost) {
                for (int32_t r : pending_) { mark_failed(r, /*timed_out=*/true); }
            }
            return;  // after a loss: the survivors stay unanswered (see the header)
        }
        auto wait = std::chrono::ceil<std::chrono::milliseconds>(std::min(deadline, next_beat) - now);
        if (abandon) { wait = std::min(wait, std::chrono::milliseconds(2)); }
        const size_t n = pending_.size();
        size_t n_pidfd = 0;
        for (size_t i = 0; i < n; ++i) {
            fds[i] = {ranks_[pending_[i]].link.fd(), POLLIN, 0};
            if (ranks_[pending_[i]].pidfd >= 0) {
                fds[n + n_pidfd] = {ranks_[pending_[i]].pidfd, POLLIN, 0};
                pid_of[n_pidfd++] = static_cast<int32_t>(i);
            }
        }
        const int rc = ::poll(fds, n + n_pidfd, static_cast<int>(std::max<int64_t>(0, wait.count())));
        if (abandon && !abandoned && abandon->load(std::memory_order_relaxed)) {
            static_cast<RegionHeader *>(region_.data())->abandon.store(true);
            abandoned = true;
        }
        const size_t lost_before = n_lost_;
        // Liveness first: an exited process fails now, a stopped one at the heartbeat. Unless its
        // link has a record queued: a rank that answered (a start-up error naming the bad flag,
        // say) and then exited is read first, so its answer is not lost to the race; the next
        // poll sees the exit if the record was no reply.
        for (size_t j = 0; rc > 0 && j < n_pidfd; ++j) {
            if (fds[n + j].revents != 0 && fds[pid_of[j]].revents == 0) { check_process(pending_[pid_of[j]], Clock::now()); }
        }
        const bool look = Clock::now() >= next_beat;
        if (look) {
            for (int32_t r : pending_) { check_process(r, Clock::now()); }
            next_beat = Clock::now() + tick;
        }
        still_.clear();
        for (size_t i = 0; i < n; ++i) {
            const int32_t r = pending_[i];
            if (ranks_[r].failed) { continue; }
            if (rc <= 0 || fds[i].revents == 0) {
                // Nothing to read: has it beaten lately? (Records already queued are read first.)
                if (!(look && check_heard(r, Clock::now(), startup))) { still_.push_back(r); }
                continue;
            }
            LinkMsg & m = replies_[r];
            // poll said readable: a seqpacket record is whole, read it without a second poll.
            const auto got = ranks_[r].link.stream() ? ranks_[r].link.recv(m, Clock::now() + std::chrono::seconds(1))
                                                     : ranks_[r].link.try_recv(m);
            if (got == LinkSocket::Recv::timeout && !ranks_[r].link.stream()) {
                still_.push_back(r);  // readable but nothing whole yet: poll again
            } else if (got != LinkSocket::Recv::ok || !read_detail(r, m)) {
                mark_failed(r, /*timed_out=*/false);
            } else if (m.op == static_cast<uint32_t>(LinkOp::beat)) {
                note_beat(r, m, Clock::now());  // not a reply: wait on (unless it says stuck)
                if (!ranks_[r].failed) { still_.push_back(r); }
            } else if (m.op != static_cast<uint32_t>(LinkOp::ready) && m.seq != seq) {
                details_[r].clear();  // its detail too (read above): the answer awaited may carry none
                still_.push_back(r);  // a late answer to an older request
            } else {
                // It ran to answer this call: a stop seen before is over. Looks come once per tick, so
                // short steps answered between two looks left a stale stopped_since, and a later short
                // stop failed the rank as "stopped for" the whole span (a probe: two 0.6 s stops).
                ranks_[r].stopped_since = {};
                if (ranks_[r].remote && m.rss_bytes > 0) {
                    remote_rss_[r].store(m.rss_bytes, std::memory_order_relaxed);  // control replies carry it; steps do not
                }
                if (m.device_id >= 0) { note_device(r, m); }  // a CUDA rank's control reply
            }
        }
        pending_.swap(still_);
        if (n_lost_ != lost_before && !lost) {
            // The others may be waiting for the lost rank inside a collective: a moment to answer, no more.
            lost     = true;
            deadline = std::min(deadline, Clock::now() + kSurvivorGrace);
        }
    }
}

bool MpExecutor::read_detail(int32_t r, const LinkMsg & m) {
    if (m.detail_bytes <= 0) { return true; }
    if (m.detail_bytes > kRankDetailMaxBytes) { return false; }  // out of step: no rank sends that
    details_[r].resize(static_cast<size_t>(m.detail_bytes));
    // The detail follows its reply at once: the reply's deadline is no longer at stake here.
    return ranks_[r].link.recv_payload(details_[r].data(), details_[r].size(), Clock::now() + std::chrono::seconds(5)) ==
           LinkSocket::Recv::ok;
}

void MpExecutor::call(LinkMsg req, const char * what, bool survivors_only, const std::atomic<bool> * abandon,
                      const void * payload, size_t payload_n, int32_t only, int pass_fd) {
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
    req.seq    = ++seq_;
    lost_mark_ = n_lost_;
    if (payload) {
        FD_CHECK(static_cast<int64_t>(payload_n) <= kInlineMaxBytes, "{}: {} inline bytes exceed the link's bound of {} (kInlineMaxBytes)",
                 what, payload_n, kInlineMaxBytes);
        req.bytes = static_cast<int64_t>(payload_n);
    }
    live_.clear();
    for (int32_t r : targets) {
        replies_[r].status = 0;
        details_[r].clear();
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
        if (req.op != static_cast<uint32_t>(LinkOp::forward) && req.op != static_cast<uint32_t>(LinkOp::probe)) {
            mtp_cache_bytes_ = 0;  // every other reply carries the rank's (fill_state); a step's does not
            for (const auto & m : replies_) { mtp_cache_bytes_ += m.mtp_cache_bytes; }
        }
    }
}

void MpExecutor::release_fetched_everywhere() {
    try {
        call_op({.op = RankOp::release_fetched});
    } catch (...) {
        drop_on_survivors();
        throw;
    }
}

void MpExecutor::call_op(const RankRequest & req) {
    LinkMsg m;
    rank_request_to_msg(req, m);
    call(m, rank_op_what(req.op));
    check_replies(rank_op_what(req.op));
}

void MpExecutor::call_op(LinkOp op, const char * what) {
    LinkMsg m;
    m.op = static_cast<uint32_t>(op);
    call(m, what);
    check_replies(what);
}

void MpExecutor::check_replies(const char * what) const {
    for (const auto & m : replies_) {
        if (m.status > 0) {
            const auto code = static_cast<Errc>(m.status);
            throw Error(code, world_size() == 1 ? std::string(m.text) : fmt::format("rank {} ({}): {}", m.rank, what, m.text));
        }
    }
}

std::vector<RankReport> MpExecutor::reports() const {
    std::vector<RankReport> out;
    for (int32_t r = 0; r < world_size(); ++r) {
        out.push_back(rank_report_from_msg(replies_[r]));
        out.back().detail = details_[r];
    }
    return out;
}

void MpExecutor::drop_on_survivors() {
    LinkMsg m;
    rank_request_to_msg({.op = RankOp::drop}, m);
    try { call(m, "drop_staged_weights", true); } catch (const Error &) {}
}
void probe_step_link(Executor & ex, const model::StepBatch * batch) {
    auto * mp = dynamic_cast<MpExecutor *>(&ex);
    if (!mp) { fail(Errc::invalid_argument, "probe_step_link: the {} executor has no step link", ex.backend()); }
    mp->probe(batch);
}

std::unique_ptr<Executor> make_mp_executor(const MpExecutorConfig & cfg, const model::ModelConfig & model_cfg) {
    return std::make_unique<MpExecutor>(cfg, model_cfg);
}

}  // namespace fd::runtime
