// fd/control/service.h — the control service: the one implementation of weight control below
// every transport (SPEC §3, §4, §6).
//
// A transport (the V1 and legacy HTTP routes, the vLLM/SGLang aliases, the shm mailbox) fills
// the wire form `shm::MailboxCommand`, and run() validates it into the one command type
// (control::parse_command, fd/control/request.h), runs it — engine operations through the
// engine inbox, the queries and the legacy pair here — and returns the typed outcome
// (fd/control/outcome.h). One render step (fd/control/render.h) makes the transport's bytes:
// handle() = run() + render_v1(), the answer of the V1 routes and the shm mailbox alike, so both
// give the same answer byte for byte; the aliases read the outcome's fields. The service also
// owns the legacy status word (fd/control/legacy.h) and releases the events a command held back
// (HeldEvents) once it has the outcome: the engine waits for no acknowledgement.
#pragma once

#include "fd/control/legacy.h"
#include "fd/control/outcome.h"
#include "fd/control/render.h"
#include "fd/engine/control.h"
#include "fd/shm/control_client.h"

#include <nlohmann/json_fwd.hpp>

#include <memory>
#include <string>

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

class ControlService {
public:
    /// `engine` must outlive the service, and the engine be stopped while the service lives
    /// (commands it answers at shutdown settle the legacy word through the service).
    ControlService(ControlConfig cfg, engine::Engine & engine);

    /// Run `cmd` and return its outcome. Blocks until the engine answers: at the command's
    /// deadline (cmd.gate; default now + control_timeout_s) a command the engine has not started
    /// yet is withdrawn (error `timeout`, nothing changed); one that started is waited for until
    /// control_timeout_s after receipt (then `timeout` saying it may still take effect). The
    /// legacy pair waits for the status word at most legacy_timeout_s.
    /// Never throws: every failure is the outcome's error.
    ControlOutcome run(engine::ControlCommand cmd);
    /// parse_command(wire) then run() with `gate` as the deadline; a parse error is the outcome's error.
    ControlOutcome run(const shm::MailboxCommand & wire, std::shared_ptr<engine::StartGate> gate = nullptr);
    /// run() rendered as the V1 answer (render_v1): what the V1 routes and the shm mailbox send.
    ControlReply handle(const shm::MailboxCommand & wire, std::shared_ptr<engine::StartGate> gate = nullptr);

    /// The daemon's state as GET /health and the mailbox `status` op report it (typed; and rendered).
    StatusReport   status_report() const;
    nlohmann::json status_json() const;

    /// The legacy status word (the shm watcher attaches it to the control block).
    LegacyWord &       legacy_word() { return legacy_; }
    const LegacyWord & legacy_word() const { return legacy_; }

    const ControlConfig & config() const { return cfg_; }

private:
    ControlOutcome run_checked(engine::ControlCommand cmd);

    ControlConfig     cfg_;
    engine::Engine &  engine_;
    LegacyWord        legacy_;
};

}  // namespace fd::control
