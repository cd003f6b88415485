// fd/control/service.h — the control service: the one implementation of weight control below
// every transport (SPEC §3, §4, §6).
//
// A transport (the HTTP control routes, the shm mailbox) turns what it received into the wire
// form `shm::MailboxCommand` (op name, tags text, version, verify flag), calls
// ControlRequest::parse — the only place a control command is validated (op, tags, version
// syntax) — and hands the result to ControlService::handle, which runs it through the engine
// inbox and returns the reply the transport sends as is. Both transports therefore give the same
// answer, byte for byte, and neither knows about engine results, the legacy status word or JSON
// shapes.
#pragma once

#include "fd/engine/control.h"
#include "fd/shm/control_client.h"
#include "fd/status.h"

#include <nlohmann/json_fwd.hpp>

#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace fd::engine { class Engine; }

namespace fd::control {

struct ControlConfig {
    bool        dynamic_load_weight = false; ///< enables sleep/wakeup/update_weights and the legacy routes
    bool        v1_update_weights   = false; ///< FD_ENABLE_V1_UPDATE_WEIGHTS: legacy routes = V1 sleep/wakeup
    double      control_timeout_s   = 900.0; ///< longest a V1 control call waits for the engine before 504
    double      legacy_timeout_s    = 300.0; ///< legacy clear/update wait for the status word (SPEC §4)
    std::string served_model_name;           ///< reported by status (/health)
    std::string rsync_config;                ///< --rsync-config as given (FastDeploy's `rsync_config` body field must equal it)
};

/// Every command a control transport can carry. V1 verbs, queries, and the legacy pair.
enum class ControlVerb {
    pause, resume, is_paused, status, sleep, wakeup, update_weights,
    commit_weights,       ///< two-phase update, phase 2: the staged version goes live
    drop_staged_weights,  ///< two-phase update: discard the staged version
    flush_cache,          ///< drop the prefix cache (vLLM /reset_prefix_cache, SGLang /flush_cache)
    abort,                ///< end one request (by id) or every request, without pausing (POST /v1/abort)
    clear_load_weight, update_model_weight,
};

/// The wire name of `v` ("pause", ..., "update_model_weight") — the mailbox op and the route's last path segment.
std::string_view to_string(ControlVerb v);

/// One validated control command.
struct ControlRequest {
    ControlVerb                verb = ControlVerb::status;
    engine::TagSet             tags;              ///< sleep/wakeup; empty text = both tags
    std::optional<std::string> version;           ///< update_weights, commit_weights; syntax checked
    bool                       verify_checksum = false;
    bool                       commit = true;     ///< update_weights: false = stage and validate only
    engine::PauseMode          pause_mode = engine::PauseMode::abort;  ///< pause
    std::string                request_id;        ///< abort: 1..128 printable ASCII, no spaces
    bool                       abort_all = false; ///< abort: every request (request_id then empty)
    std::string                weight_dir;        ///< update_weights: an absolute checkpoint dir (prime-rl's /update_weights)
    bool                       reload_base = false;  ///< update_weights: the base --model (prime-rl's /reload_weights)
    bool                       keep_prefix_cache = false;  ///< pause: do not flush the prefix cache (an update still does)
    bool                       keep_host_tier = false; ///< flush_cache: wire mode "device" (the host KV tier is kept); "" | "all" = both tiers
    /// The caller's deadline and start/cancel handshake (set by the transport after parse; null =
    /// the deadline is now + control_timeout_s). A state-changing command not started by the
    /// deadline is dropped, never run, and answered 504 `timeout` saying nothing changed.
    std::shared_ptr<engine::StartGate> gate;

    /// Validate a command in wire form. Checks the op name, that tags are only given to
    /// sleep/wakeup and name known tags, the version syntax ([A-Za-z0-9._-]{1,128}, not '.'
    /// or '..'; only for update_weights and commit_weights), verify_checksum and commit=false
    /// only for update_weights, mode (abort|wait|keep) only for pause (all|device for flush_cache), request_id / abort_all
    /// only for abort (exactly one of them).
    /// Errors  fd::Error{invalid_argument} with param() naming the offending field.
    static ControlRequest parse(const shm::MailboxCommand & wire);
};

/// A finished control answer: status, content type and body exactly as the V1 HTTP route sends.
struct ControlReply {
    int         http_status = 200;
    std::string content_type = "application/json";
    std::string body;
};

/// `{"status":"error","error":{"type","message"}}` with the error table's HTTP status (SPEC §3).
ControlReply error_reply(const Error & e);

class ControlService {
public:
    ControlService(ControlConfig cfg, engine::Engine & engine);

    /// Run `req` and return its reply. Blocks until the engine answers: at the request's deadline
    /// (req.gate; default now + control_timeout_s) a command the engine has not started yet is
    /// withdrawn (504 `timeout`, nothing changed); one that started is waited for until
    /// control_timeout_s after receipt (then 504 saying it may still take effect). The legacy
    /// pair waits for the status word at most legacy_timeout_s.
    /// Never throws: every failure is an error reply.
    ControlReply handle(const ControlRequest & req);
    /// parse() then handle() with `gate` as the request's deadline; a parse error is its error reply.
    ControlReply handle(const shm::MailboxCommand & wire, std::shared_ptr<engine::StartGate> gate = nullptr);

    /// The daemon's state as GET /health and the mailbox `status` op report it.
    nlohmann::json status_json() const;

    const ControlConfig & config() const { return cfg_; }

private:
    ControlReply run(const ControlRequest & req);

    ControlConfig     cfg_;
    engine::Engine &  engine_;
};

}  // namespace fd::control
