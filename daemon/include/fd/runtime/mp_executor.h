// fd/runtime/mp_executor.h — the multi-process executor: one OS process per rank
// (--distributed-executor-backend mp), and the rank process's own main.
//
// The daemon spawns each rank as `fdrollout --fd-rank-process <link fd> <region fd>` (fork +
// exec of its own binary; the two fds are the only things it inherits besides stdout/stderr),
// sends it its configuration over the link, and waits for `ready`: the rank has read its weights,
// built its Worker and joined the communication group (Gloo over TCP, rendezvous through the
// TcpStore this executor hosts at --master-addr:--master-port). From then on every Executor call
// is one request to every rank and one reply from each (fd/runtime/rank_link.h), with a deadline:
// a rank that dies is noticed at once (its end of the link closes), one that hangs when the
// deadline passes; either fails the call with rank_failed naming it and stays failed until
// recover(). Control calls succeed only when every rank acknowledges; stage_weights drops every
// staged copy when any rank fails. With nnodes > 1 the ranks of node k > 0 are started there by
// `fdrollout --node-rank k` (fd/runtime/node_join.h) and reach this executor over authenticated
// TCP links instead (same records; the step inline); recover() then waits for those nodes to
// rejoin. Called from the engine thread only.
#pragma once

#include "fd/runtime/executor.h"
#include "fd/runtime/world.h"
#include "fd/weights/weight_source.h"

#include <memory>
#include <string>

namespace fd::runtime {

/// Everything a rank process needs; also what the daemon sends it (as JSON) at spawn.
struct MpExecutorConfig {
    int32_t     tensor_parallel_size = 1;   ///< ranks in the group
    std::string model_dir;                  ///< --model: every rank reads its initial weights here
    model::WorkerConfig worker;             ///< per rank (rank is set per process); n_threads per rank
    weights::SourceConfig source;           ///< every rank builds its own weight source
    std::string master_addr = "127.0.0.1";  ///< the TcpStore's address (this daemon hosts it)
    int32_t     master_port = 0;            ///< 0 = any free port (single node); nnodes > 1: where nodes join
    int32_t     nnodes = 1;                 ///< hosts: this daemon (node 0) runs ranks [0, tp/nnodes), node k the next tp/nnodes
    std::string dist_token;                 ///< nnodes > 1: the nodes' shared join secret (load_dist_token)
    bool        shutdown_comm_group_if_worker_idle = true;  ///< sleep(weight) disconnects the group; wakeup reconnects
    DistBackend dist_backend = DistBackend::automatic;  ///< gloo | shm (a segment per generation, every rank on this host) | nccl | automatic (resolve_dist_backend)
    double      timeout_s = 900.0;          ///< --control-timeout-s: every wait on a rank, start-up included
    /// --rank-heartbeat-s: every wait on a rank watches it. One that exits fails the wait at once
    /// (its pidfd, its link's hang-up). Each rank process beats over its link every heartbeat_s / 10
    /// while it works on a request (remote ranks included); one that sends nothing for heartbeat_s
    /// past its due beat (stopped, frozen, its node unreachable) is failed between 1 and 1.2 x
    /// heartbeat_s after it stopped (a local rank's /proc state, looked at as often, names a SIGSTOP). At start-up a rank is held to its beat
    /// only once its first beat came (exec and loading the binary are not beaten).
    double      heartbeat_s = 3.0;
    /// --rank-stuck-s: a rank that beats but whose main loop made no progress (no kernel job, no
    /// weight bytes moved, no request taken, fd/liveness.h) for stuck_s while the daemon waits on
    /// it is failed as stuck (within stuck_s + heartbeat_s / 10). Waits with a bound of their own
    /// (a peer inside a collective, an rsync child) count as progress: a rank waiting on a stuck
    /// peer is not the one named.
    double      stuck_s = 30.0;
    std::string rank_binary;                ///< the fdrollout binary to exec; empty = this process's own
    std::string log_level = "info", log_format = "text";
};

/// Spawn the ranks and wait until all are ready. With nnodes > 1, first wait (timeout_s) until
/// every other node has joined at master_addr:master_port (fd/runtime/node_join.h); the
/// rendezvous store then takes any free port on master_addr.
/// Errors  fd::Error{rank_failed} naming a rank that exited or did not become ready within
///         timeout_s (its own error message when it sent one), or a node that never joined;
///         invalid_argument when the master port cannot be bound (in use).
std::unique_ptr<Executor> make_mp_executor(const MpExecutorConfig & cfg, const model::ModelConfig & model_cfg);

/// The step link's own cost, for fd_executor_bench: one round trip to every rank that runs no
/// model. With `batch` (else nullptr: an empty step), the daemon encodes it into the shared region
/// as forward() does and each rank decodes it (remote ranks: inline), then answers at once.
/// Errors  fd::Error{invalid_argument} when `ex` is not a multi-process executor; rank_failed as
///         forward().
void probe_step_link(Executor & ex, const model::StepBatch * batch);

/// argv[1] of a rank process.
inline constexpr const char * kRankProcessFlag = "--fd-rank-process";

/// main() of a rank process: `fdrollout --fd-rank-process <link fd> <region fd>`. Serves the
/// link until the daemon says shutdown or its end closes. Returns the process exit code.
int rank_process_main(int argc, char ** argv);

}  // namespace fd::runtime
