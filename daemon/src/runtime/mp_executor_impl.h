// mp_executor_impl.h — the MpExecutor class (internal to src/runtime/mp_executor*.cpp).
//
// mp_executor.cpp: construction, the Executor operations (step, weights, sleep, KV swap) and
// the request/reply round trip to every rank (call, gather, check_replies).
// mp_executor_ranks.cpp: the rank processes' lifecycle (start-up, failure, restart, shutdown,
// the comm group's rebuild) and what is measured of them (RSS, device memory).
// Public contract: fd/runtime/mp_executor.h. Called from the engine thread only, except the
// const measurements (rank_processes_rss_bytes, rank_devices) that other threads read.
#pragma once

#include "fd/comm/comm.h"
#include "fd/runtime/mp_executor.h"
#include "fd/runtime/node_join.h"
#include "fd/runtime/rank_link.h"
#include "fd/comm/tcp_store.h"

#include "draft_wire.h"
#include "rank_spawn.h"

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fd::runtime {

class MpExecutor final : public Executor {
public:
    MpExecutor(const MpExecutorConfig & cfg, const model::ModelConfig & model_cfg);
    ~MpExecutor() override { shutdown(); }

    int32_t world_size() const override { return cfg_.tensor_parallel_size; }
    World world() const override { return world_; }
    const model::ModelConfig & model_config() const override { return model_cfg_; }
    const char * backend() const override { return "mp"; }
    const char * comm_state() const override { return comm_connected_ ? "connected" : "disconnected"; }
    const char * comm_backend() const override { return dist_backend_name(cfg_.dist_backend); }
    int64_t rank_processes_rss_bytes() const override;
    int64_t weight_bytes() const override { return weight_bytes_; }
    int64_t kv_bytes() const override { return kv_bytes_; }

    bool forward(const model::StepBatch & batch, float * logits, const std::atomic<bool> * abandon) override;
    /// Rank 0 wrote the logits into the region: the engine reads them there (valid until the
    /// next call, which rewrites the region).
    const float * forward_in_place(const model::StepBatch & batch, const std::atomic<bool> * abandon) override;
    /// Rank 0 wrote them into the region after the logits (rank_link.h); until the next call.
    const int32_t * step_routes() const override { return routes_; }
    /// LinkOp::draft_mtp: the batch into the region (draft_wire.h), every rank drafts on its
    /// shard, rank 0's drafts read back from the region.
    void draft_mtp(const model::DraftBatch & db, std::vector<int32_t> & drafts) override;
    /// The ranks' MTP caches as their last replies reported them (LinkMsg::mtp_cache_bytes).
    int64_t mtp_cache_bytes() const override { return mtp_cache_bytes_; }
    /// probe_step_link(): forward()'s encode and round trip, without the model.
    void probe(const model::StepBatch * batch);

    /// One LinkOp::rank_call to every rank; the reports carry each rank's detail.
    std::vector<RankReport> rank_call(const RankRequest & req) override;
    std::vector<RankReport> stage_weights(const weights::FetchRequest & req) override;
    std::vector<RankReport> commit_weights() override;
    void drop_staged_weights() override { call_op({.op = RankOp::drop}); }
    std::vector<RankReport> release(MemoryTag tag) override;
    void swap_kv(const kv::BlockCopy * out, int64_t n_out, const kv::BlockCopy * in, int64_t n_in, const kv::BlockCopy * bg,
                 int64_t n_bg) override;
    std::vector<RankReport> acquire_kv() override;
    std::vector<RankReport> reload_weights(const weights::FetchRequest & req) override;

    std::vector<int32_t> failed_ranks() override;
    std::vector<RankDevice> rank_devices() const override;
    void refresh_rank_devices(double max_age_s) override;
    void recover() override;

private:
    using Clock = std::chrono::steady_clock;

    struct Rank {
        pid_t       pid = -1;
        LinkSocket  link;
        bool        failed = false;
        std::string why;
        int32_t     node = 0;
        bool        remote = false;          ///< on node > 0: a TCP link from its node agent, no pid here
        std::string model_dir, bind_addr;    ///< remote: the node's --model and its ranks' Gloo address
        int         pidfd = -1;              ///< local: readable once the process exits (-1: none)
        Clock::time_point stopped_since{};   ///< local: when it was first seen stopped ({}: running)
        Clock::time_point heard{};           ///< the current wait: when its request went or its last record came
        bool              beat_seen = false; ///< the current wait: a beat came (start-up holds a rank to its beat after its first)
    };

    // ---- the round trip to every rank (mp_executor.cpp)

    /// Collect one reply from each rank in `ranks` until `deadline` into replies_[r] (a `ready`
    /// or the answer to `seq`), reading its beats meanwhile. A rank whose link closes, whose
    /// process exits (pidfd), that sends no beat for heartbeat_s (or stays stopped that long), whose
    /// beat says it is stuck (stuck_s) or that misses the deadline is marked failed. Once one has failed,
    /// the others get kSurvivorGrace more to answer (they may be waiting on the dead one inside a
    /// collective), then the wait ends with them unanswered (their late replies are skipped by
    /// seq; recover() restarts every rank). A reply announcing a detail (detail_bytes) is followed
    /// by it: read into details_[r] whatever its seq. Allocation-free once warm (the step path).
    void gather(const std::vector<int32_t> & ranks, Clock::time_point deadline, const std::atomic<bool> * abandon, uint64_t seq);

    /// The detail rank `r`'s reply `m` announces, into details_[r]. False: the link broke.
    bool read_detail(int32_t r, const LinkMsg & m);

    /// Send `req` to every rank (or only the live ones) and gather the replies.
    /// Errors  rank_failed naming every failed rank when one was failed before or failed now.
    /// `payload` (n bytes) follows the request on stream links (remote ranks: the step inline).
    /// `only` >= 0: send to that rank alone (the others' replies_ stay as they were).
    /// `pass_fd` >= 0 travels with the request to every (local) rank.
    void call(LinkMsg req, const char * what, bool survivors_only = false, const std::atomic<bool> * abandon = nullptr,
              const void * payload = nullptr, size_t payload_n = 0, int32_t only = -1, int pass_fd = -1);

    /// Every rank has staged or reloaded: each lets go of its fetch (the last holder of the rsync
    /// source's shared dir removes it), before commit, so a rank killed later leaves nothing.
    void release_fetched_everywhere();

    /// call() and check_replies() for one rank operation (its message: rank_op_what(req.op)).
    void call_op(const RankRequest & req);
    void call_op(LinkOp op, const char * what);

    /// The first rank's error (every rank answered).
    void check_replies(const char * what) const;

    std::vector<RankReport> reports() const;

    void drop_on_survivors();

    // ---- the rank processes (mp_executor_ranks.cpp)

    /// Wait (timeout_s) for every other node's ranks to join, spawn this node's, configure all, wait ready.
    void start_all();

    /// `segment_fd` >= 0: the shm group's segment, passed with the config (local ranks only).
    void send_config(int32_t r, int segment_fd);

    void spawn(int32_t r, int segment_fd);

    /// Wait for `ready` from the freshly spawned ranks in `fresh`.
    void wait_ready(const std::vector<int32_t> & fresh);

    /// Rank `r`'s device memory from its control reply `m` (devs_, under dev_mu_).
    void note_device(int32_t r, const LinkMsg & m);

    [[noreturn]] void throw_failed(const char * what) const;

    /// Rank `r`'s process (local ranks) without waiting: marks it failed and returns true when it
    /// has exited, or has been stopped for heartbeat_s (first seen stopped at the last sample).
    bool check_process(int32_t r, Clock::time_point now);

    /// Rank `r`'s beat `m` (a stuck one is marked failed).
    void note_beat(int32_t r, const LinkMsg & m, Clock::time_point now);
    /// Rank `r` sent nothing for heartbeat_s: marks it failed and returns true.
    bool check_heard(int32_t r, Clock::time_point now, bool startup);

    /// Rank `r` is out until recover(): its link closed (`timed_out` false) or it missed a deadline.
    void mark_failed(int32_t r, bool timed_out, const std::string & what = {});

    void connect_group();

    /// shm: a fresh memfd segment for `generation` (the daemon's descriptor closes when the
    /// returned holder goes); gloo: none.
    comm::ShmCommSegment comm_segment(int64_t generation) const;

    /// Wait for rank `r`'s process to end (SIGKILL first when `kill`); bounded.
    void reap(int32_t r, bool kill);

    void shutdown();

    MpExecutorConfig                 cfg_;
    model::ModelConfig               model_cfg_;
    double                           wait_s_;
    std::string                      binary_;
    SpawnThread                      spawner_;   ///< every local rank is started (and so parented) there
    std::unique_ptr<JoinListener>    listener_;  ///< nnodes > 1: where other nodes' ranks join
    std::unique_ptr<comm::TcpStoreServer>  store_;
    /// 128 random bits (hex): the store answers only clients that send it first; the ranks get it
    /// in RankSpawn, so another local user who reaches the store's port reads and replaces nothing.
    std::string                            store_token_ = comm::new_store_token();
    World                            world_;     ///< the ranks: tp, nnodes, node_of, device_of (fd/runtime/world.h)
    SharedRegion                     region_;
    const int32_t *                  routes_ = nullptr;  ///< the last forward's routes in region_ (step_routes)
    std::vector<Rank>                ranks_;
    std::vector<std::atomic<pid_t>>  pids_;      ///< [world] live rank pids (0: none), read by other threads
    std::vector<std::atomic<int64_t>> remote_rss_;  ///< [world] RSS a rank on another node last reported (0: local / none)
    std::vector<LinkMsg>             replies_;   ///< [world] the latest call's answers
    std::vector<std::string>         details_;   ///< [world] the latest rank_call's RankReport::detail
    std::vector<int32_t>             targets_, live_, pending_, still_;
    std::vector<kv::BlockCopy>       swap_scratch_;  ///< swap_kv: out + background copies in one list
    std::vector<DraftRun>            draft_runs_;    ///< draft_mtp: draft_encode's scratch
    size_t                           n_lost_ = 0;     ///< ranks marked failed so far
    size_t                           lost_mark_ = 0;  ///< n_lost_ when the current call / start-up wait began
    static constexpr std::chrono::milliseconds kSurvivorGrace{10};  ///< see gather(): what a survivor gets after a loss
    uint64_t                         seq_ = 0;
    int64_t                          generation_ = 1;
    bool                             comm_connected_ = false;
    bool                             started_ = false;  ///< the first start-up went through (later ones are recover()'s)
    int64_t                          weight_bytes_ = 0, kv_bytes_ = 0;
    int64_t                          mtp_cache_bytes_ = 0;     ///< sum of the ranks' last LinkMsg::mtp_cache_bytes
    bool                             cuda_ = false;            ///< --device cuda: replies carry device memory
    bool                             shared_devices_ = false;  ///< two ranks of one node on one CUDA device
    Clock::time_point                last_control_{};          ///< the last call whose replies carried device memory
    mutable std::mutex               dev_mu_;
    std::vector<RankDevice>          devs_;                    ///< [world] each CUDA rank's last report (measured 0: none yet)
};

}  // namespace fd::runtime
