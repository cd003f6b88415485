// What the multi-process executor and its rank processes exchange besides the step: the spawn
// configuration (JSON, the first message on a link) and the control fields of a LinkMsg.
#pragma once

#include "fd/runtime/mp_executor.h"
#include "fd/runtime/rank_call.h"
#include "fd/runtime/rank_link.h"

#include <nlohmann/json.hpp>

#include <algorithm>

namespace fd::runtime {

/// How often a busy rank beats (fd/runtime/rank_link.h, LinkOp::beat): --rank-heartbeat-s / 10,
/// 5 ms .. 0.5 s. The daemon fails a rank silent for heartbeat_s + this: between 1 and 1.2 x
/// heartbeat_s after it stopped (its look at the silence runs every heartbeat_s / 10 too).
inline double beat_interval_s(double heartbeat_s) { return std::clamp(heartbeat_s / 10, 0.005, 0.5); }

/// The configuration a rank process starts from.
struct RankSpawn {
    MpExecutorConfig cfg;
    int32_t          rank       = 0;
    int64_t          generation = 1;  ///< comm group generation to join at start-up
    int32_t          store_port = 0;  ///< the TcpStore's actual port
    std::string      store_token;     ///< what the TcpStore asks of its clients (random per executor)
    std::string      bind_addr;       ///< where this rank's Gloo pairs bind; empty = cfg.master_addr (node 0)
};
// The rank's CUDA device is not sent: each host computes rank_device_id() from its own visible
// devices (cfg.nnodes travels for that).

nlohmann::json rank_spawn_to_json(const RankSpawn & s);
/// Errors  fd::Error{invalid_argument} on a malformed configuration.
RankSpawn rank_spawn_from_json(const nlohmann::json & j);

void fetch_request_to_msg(const weights::FetchRequest & req, LinkMsg & m);
weights::FetchRequest fetch_request_from_msg(const LinkMsg & m);
/// A rank_call request: op rank_call, the RankOp, its fetch request and tag.
void rank_request_to_msg(const RankRequest & req, LinkMsg & m);
/// Errors  fd::Error{internal} on a RankOp or tag outside the lists (a link out of step).
RankRequest rank_request_from_msg(const LinkMsg & m);
/// A report's fixed fields (RankReport::detail travels after the reply: LinkMsg::detail_bytes).
void rank_report_to_msg(const RankReport & r, LinkMsg & m);
RankReport rank_report_from_msg(const LinkMsg & m);
/// A CUDA rank's device fields of a control reply (m.device_id < 0: a CPU rank, nothing written / read).
void rank_device_to_msg(const RankDevice & d, LinkMsg & m);
RankDevice rank_device_from_msg(const LinkMsg & m);
/// The device rank `rank` of `tp` ranks over `nnodes` hosts runs on: its index on its node
/// (rank mod tp/nnodes) modulo the `n_devices` its host sees (>= 1).
int32_t rank_device_id(int32_t rank, int32_t tp, int32_t nnodes, int32_t n_devices);

}  // namespace fd::runtime
