// fd/shm/control_client.h — both sides of the control block: the daemon's owner (create,
// publish, answer, remove) and fdctl's client (open, call, read state).
#pragma once

#include "fd/shm/control_block.h"
#include "fd/status.h"

#include <memory>
#include <optional>
#include <string>

namespace fd::shm {

/// A heartbeat older than this (ms) means the daemon is stopped or stalled (its pid may live).
inline constexpr int64_t kHeartbeatStaleMs = 2000;

/// Mapping of a control block (RAII; unmaps on destruction).
class MappedBlock {
public:
    MappedBlock() = default;

    ControlBlock * get() const { return block_; }
    ControlBlock * operator->() const { return block_; }
    ControlBlock & operator*() const { return *block_; }

    /// Create a fresh block for `port` (mode 0600). A block left by a dead daemon is reclaimed.
    /// Errors  fd::Error{wrong_state} if a live daemon owns it; {invalid_argument} if it has another
    ///         magic/ABI (message says how to clean up); {internal} on a system error.
    static MappedBlock create(int port);

    /// Open the existing block of `port` (fdctl) and check who owns it, then magic, ABI and size.
    /// The block must belong to the daemon's user — the caller's effective uid, or for root the
    /// owner of the pid recorded in the block — and have no group/other permission bits: another
    /// local user could otherwise plant a block that forges answers or swallows commands.
    /// Errors  fd::Error{unreachable} if there is none (no daemon); {forbidden} on a wrong owner
    ///         or mode (the message names both and what to do); {invalid_argument} on a
    ///         magic/ABI/size mismatch (a different fdrollout version) or if it cannot be opened.
    static MappedBlock open(int port);

    /// Remove the name (daemon, on clean exit).
    static void remove(int port);

private:
    std::shared_ptr<void> region_;   ///< the Boost.Interprocess mapped_region, type-erased
    std::shared_ptr<void> owner_;    ///< create() only: removes the name when the last copy goes,
                                     ///< so a daemon that fails after creating it leaves nothing
    ControlBlock *        block_ = nullptr;
};

/// Daemon side: write the state snapshot under the seqlock.
void publish_state(ControlBlock & b, const StateSnapshot & s);

/// Read a consistent snapshot (retries while the daemon writes).
StateSnapshot read_state(const ControlBlock & b);

/// One mailbox command as a client sends it.
struct MailboxCommand {
    std::string                op;              ///< "pause", "resume", "is_paused", "sleep", "wakeup", "update_weights", "commit_weights", "drop_staged_weights", "flush_cache", "abort", "clear_load_weight", "update_model_weight", "status"
    std::string                tags;            ///< sleep/wakeup
    std::optional<std::string> version;         ///< update_weights, commit_weights
    bool                       verify_checksum = false;
    bool                       commit = true;   ///< update_weights: false = stage only (two-phase update)
    std::string                mode;            ///< pause: "" | "abort" | "wait" | "keep"; flush_cache: "" | "all" | "device" (the block carries it as cmd_pause_mode)
    std::string                request_id;      ///< abort: a completion id or X-Request-Id (the block carries it as cmd_request_id)
    bool                       abort_all = false; ///< abort: every request, without pausing (cmd_abort_all)
    /// update_weights only, HTTP only (prime-rl's routes; the shm block does not carry them):
    /// load the complete HF checkpoint in this absolute directory instead of the --load-strategy
    /// source (the daemon's user must own it), or (reload_base) the base --model checkpoint.
    std::string                weight_dir;
    bool                       reload_base = false;
    /// update_weights only, HTTP only (a delta weight stream's commit): write this weight delta
    /// file (fd/weights/weight_delta.h) in place into every rank's weights and into weight_dir,
    /// which must be the checkpoint dir the serving weights came from.
    std::string                weight_delta;
    /// update_weights only, HTTP only (a landed weight stream, fd/stream/landing.h): not "" = every
    /// rank opens a landing listening on this address; weight_land = every rank's landing must be
    /// complete, then all commit. land_timeout_s bounds each rank's wait (seconds).
    std::string                land_host;
    bool                       weight_land = false;
    double                     land_timeout_s = 0;
    bool                       land_delta = false;        ///< with land_host / weight_land: a delta landing (applied in place at the commit)
    bool                       keep_prefix_cache = false; ///< pause: keep the prefix cache (prime-rl's clear_cache=false; HTTP only, the block has no field)
};

/// The daemon's answer: exactly what the V1 HTTP route answers.
struct MailboxReply {
    int         http_status = 0;
    std::string body;
};

/// Client side: take a free mailbox slot (a dead holder's is taken over; with every slot busy,
/// wait for one), send `cmd` in it with the deadline now + `timeout_ms` (CLOCK_MONOTONIC) and wait
/// for the answer. If the daemon has not started the command by the deadline the call withdraws it
/// (cmd_state posted → cancelled, see control_block.h), so it never runs; if it did start in
/// time, the call waits for its answer as long as the daemon's heartbeat stays fresh.
/// A live pid with a stale heartbeat (SIGSTOP, a stall) is a timeout, never "gone".
/// Errors  fd::Error{invalid_argument} if cmd.request_id does not fit cmd_request_id (nothing sent);
///         {unreachable} if the daemon's pid is gone (the message says whether the
///         command had started); {timeout} if the lock, the previous command or the start does
///         not come before the deadline (the message says nothing changed), or if a started
///         command's daemon stalls past the deadline (the message says its outcome is unknown).
MailboxReply mailbox_call(ControlBlock & b, const MailboxCommand & cmd, int64_t timeout_ms);

/// Client side: the daemon is alive (pid exists, heartbeat within `stale_ms`).
bool daemon_alive(const ControlBlock & b, int64_t stale_ms = kHeartbeatStaleMs);

/// Daemon side: is command `seq` of slot `s` still waiting to start (posted, deadline not passed)?
bool command_pending(const MailboxSlot & s, uint32_t seq);
/// Daemon side, just before running command `seq` of slot `s`: posted → started, only before its
/// deadline (past it, posted → cancelled). True = run it; false = drop it (withdrawn or expired).
bool try_start_command(MailboxSlot & s, uint32_t seq);
/// Either side: posted → cancelled. True = command `seq` of slot `s` will never run; false = it
/// had started (or was already cancelled: see the word).
bool try_cancel_command(MailboxSlot & s, uint32_t seq);

}  // namespace fd::shm
