// fd/control/render.h — the one render step: a typed ControlOutcome (fd/control/outcome.h) into
// the bytes a transport sends. The V1 body serves the V1 and legacy HTTP routes and the shm
// mailbox reply (fdctl prints it), so both transports answer byte for byte the same; the peer
// error shapes serve the vLLM/SGLang aliases (docs/peer_aliases.md). JSON is built here only.
#pragma once

#include "fd/control/outcome.h"

#include <nlohmann/json_fwd.hpp>

#include <string>

namespace fd::control {

/// A finished answer: HTTP status, content type and body.
struct ControlReply {
    int         http_status = 200;
    std::string content_type = "application/json";
    std::string body;
};

/// The V1 answer (SPEC §3, §4):
///   error         {"status":"error","error":{"type","message"}} with the error table's status;
///   engine op     {"status":"success","result":{...}}: is_paused, elapsed_s and the op's fields
///                 (pause: mode, aborted, kept|drained; sleep: tags, skipped, freed_bytes{weight,
///                 kv_cache, kv_swap}, aborted, rss_*_bytes, ranks, device_bytes_freed; wakeup:
///                 tags, skipped, version, bytes, ranks; update_weights: version, bytes,
///                 checksum_verified, staged, ranks; commit_weights: version, ranks;
///                 drop_staged_weights: dropped_version; flush_cache: host_blocks_flushed;
///                 abort_request: aborted);
///   is_paused     {"is_paused", "sleeping_tags", "weights_valid", "weight_version", "status":
///                 "success", "result": {the same four}} (both FastDeploy forms);
///   status        status_json();
///   legacy        {"msg"[, "error"]}, or FastDeploy's 404 error object when disabled.
ControlReply render_v1(const ControlOutcome & o);

/// `{"status":"error","error":{"type","message"}}` with the error table's HTTP status (SPEC §3).
ControlReply error_reply(const Error & e);

/// The GET /health body (docs/http_api.md).
nlohmann::json status_json(const StatusReport & s);

/// The per-rank array of an engine result (V1's `ranks`: rank, rss_bytes, and either freed_bytes
/// or version / bytes / sync_cost / update_cost / total_cost), for routes that build their own body.
nlohmann::json rank_reports_json(const engine::ControlResult & r);

/// The error answers of the peers' aliases, each with the error table's status of o.error (a
/// failed legacy answer: its status and msg):
enum class Peer {
    vllm,       ///< {"error": message}
    sglang,     ///< {"error": {"message": message}}
    fdrollout,  ///< {"status": "error", "error": {"type", "message"}} (prime-rl's routes)
};
ControlReply render_error(const ControlOutcome & o, Peer peer);

/// The failed outcome's HTTP status and message (200 and "" when it succeeded).
int         http_status(const ControlOutcome & o);
std::string error_message(const ControlOutcome & o);

/// Tags asleep, in order: "weight", "kv_cache".
std::vector<std::string> sleeping_tags(const engine::EngineState & st);

}  // namespace fd::control
