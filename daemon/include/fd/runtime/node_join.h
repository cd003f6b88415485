// fd/runtime/node_join.h — ranks on several hosts (--nnodes > 1): how node k > 0 joins node 0.
//
// Node 0's daemon listens at --master-addr:--master-port (a JoinListener). Node k runs
// `fdrollout --nnodes N --node-rank k --master-addr A --master-port P --model DIR` (a node
// agent, node_agent_main): for each of its local ranks it opens one TCP connection to A:P,
// authenticates it, spawns the rank process with that connection as its step link, and rejoins
// (new connections, new rank processes) whenever one of its ranks exits, until node 0 shuts the
// ranks down or stays unreachable past the timeout.
//
// The join handshake, on each connection (fixed-size records, then the ordinary rank link):
//   node → master  JoinHello     magic, nnodes, node_rank, tp, rank, model fingerprint, model dir,
//                                the node's bind address, a random client nonce
//   master → node  JoinChallenge a random server nonce, HMAC-SHA256(token, "fd-join-server" |
//                                client nonce | server nonce): the node checks the master holds
//                                the token before it runs anything the master sends
//   node → master  JoinProof     HMAC-SHA256(token, "fd-join-client" | server nonce | hello)
//   master → node  JoinVerdict   0 = accepted (the connection is parked for that rank until the
//                                executor takes it), else an Errc and the reason (wrong token,
//                                different model config.json, different --tensor-parallel-size
//                                or --nnodes, a rank outside the node's range, or - wrong_state -
//                                a rank already joined and still connected: a second copy of
//                                node k started by mistake is refused, never parked)
// The token never crosses the wire; a recorded handshake cannot be replayed (fresh nonces). The
// step traffic after the join is not encrypted: run multi-host ranks on a private network.
#pragma once

#include "fd/runtime/rank_link.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace fd::runtime {

/// The shared join secret: the contents of `token_file` (whitespace trimmed), else the
/// environment variable FD_DIST_TOKEN.
/// Errors  fd::Error{forbidden} when the file is not a regular file owned by this user with no
///         group/other permission bits (chmod 600); invalid_argument when neither is given, the
///         file cannot be read, or the token is shorter than 16 bytes.
std::string load_dist_token(const std::string & token_file);

/// FNV-1a 64 of the model's config.json bytes: nodes must serve the same model config.
/// Errors  fd::Error{invalid_checkpoint} when config.json cannot be read.
uint64_t model_fingerprint(const std::filesystem::path & model_dir);

/// What the master expects of every joining node.
struct JoinExpect {
    int32_t     nnodes = 1, tp = 1;
    uint64_t    fingerprint = 0;
    std::string token;
    double      handshake_timeout_s = 10.0;  ///< one connection's handshake
    double      send_timeout_s = 60.0;       ///< a joined link's send timeout (a stuck remote rank)
};

/// A rank link that arrived from another node.
struct JoinedLink {
    LinkSocket  link;
    int32_t     node_rank = 0;
    std::string model_dir;  ///< the node's --model (paths may differ between hosts)
    std::string bind_addr;  ///< where the node's ranks bind Gloo
    std::string peer;       ///< "ip:port" the connection came from
};

/// Node 0's side: accepts, authenticates and parks joining rank links (a thread of its own).
class JoinListener {
public:
    /// Listen on host:port. Errors  fd::Error{invalid_argument} naming the address when it cannot be bound.
    JoinListener(const std::string & host, int port, JoinExpect expect);
    ~JoinListener();
    int port() const { return port_; }

    /// The newest parked link for global rank `rank` (one whose peer is still connected),
    /// waiting until `deadline`; nullopt when none arrived.
    std::optional<JoinedLink> take(int32_t rank, std::chrono::steady_clock::time_point deadline);

    /// The executor serves rank `rank` on the taken link `fd` (kept as a duplicate here): joins for
    /// that rank are refused (wrong_state) while the link's peer is connected.
    void mark_serving(int32_t rank, int fd);
    /// The executor let go of rank `rank`'s link (failed, recovering, shutting down): call before
    /// closing it, so the duplicate does not keep the connection open. Idempotent.
    void mark_gone(int32_t rank);

private:
    void serve();
    void handshake(int fd, const std::string & peer);

    JoinExpect                      expect_;
    int                             listen_fd_ = -1, port_ = 0;
    std::atomic<bool>               stop_{false};
    std::mutex                      mu_;
    std::condition_variable         cv_;
    std::map<int32_t, JoinedLink>   parked_;
    std::map<int32_t, int>          serving_;   ///< rank → duplicate fd of the link the executor serves
    std::thread                     thread_;
};

/// Node k's side of one join: connect to master_addr:master_port (binding `bind_addr` when not
/// empty), retrying until `deadline`, and run the handshake for global rank `rank`.
/// Returns the accepted link; the JoinedLink's bind_addr is the address the link left from.
/// Errors  fd::Error{rank_failed} when no master answers before the deadline; the master's
///         Errc (forbidden, invalid_argument, ...) with its reason when it refuses the join;
///         forbidden when the master does not prove it holds the token.
struct JoinRequest {
    int32_t     nnodes = 1, node_rank = 0, tp = 1, rank = 0;
    std::string master_addr, bind_addr, model_dir, token;
    int32_t     master_port = 0;
    uint64_t    fingerprint = 0;
    double      send_timeout_s = 10.0;
};
JoinedLink join_master(const JoinRequest & req, std::chrono::steady_clock::time_point deadline);

/// What a node agent needs (from the daemon's own flags).
struct NodeAgentConfig {
    int32_t     nnodes = 1, node_rank = 1, tp = 1;
    std::string master_addr, node_addr, model_dir, token, rank_binary;
    int32_t     master_port = 0;
    double      timeout_s = 900.0;  ///< --control-timeout-s: joining (and rejoining) gives up after this
};

/// main() of node k > 0: join, run the node's ranks, rejoin when one exits. Returns the exit code:
/// 0 when node 0 shut the ranks down or a signal in `signals` arrived, else the Errc's exit code.
int node_agent_main(const NodeAgentConfig & cfg, const sigset_t & signals);

}  // namespace fd::runtime
