// fd/shm/control_client.h — both sides of the control block: the daemon's owner (create,
// publish, answer, remove) and fdctl's client (open, call, read state).
#pragma once

#include "fd/shm/control_block.h"
#include "fd/status.h"

#include <memory>
#include <optional>
#include <string>

namespace fd::shm {

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

    /// Open the existing block of `port` and check magic, ABI and size.
    /// Errors  fd::Error{unreachable} if there is none (no daemon); {invalid_argument} on a
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
    std::string                op;              ///< "pause", "resume", "is_paused", "sleep", "wakeup", "update_weights", "commit_weights", "drop_staged_weights", "flush_cache", "clear_load_weight", "update_model_weight", "status"
    std::string                tags;            ///< sleep/wakeup
    std::optional<std::string> version;         ///< update_weights, commit_weights
    bool                       verify_checksum = false;
    bool                       commit = true;   ///< update_weights: false = stage only (two-phase update)
};

/// The daemon's answer: exactly what the V1 HTTP route answers.
struct MailboxReply {
    int         http_status = 0;
    std::string body;
};

/// Client side: send `cmd` and wait for the answer, at most `timeout_ms` in total.
/// Errors  fd::Error{unreachable} if the daemon is gone (dead pid or stale heartbeat) before or
///         while waiting; {timeout} if the lock or the answer does not come in time.
MailboxReply mailbox_call(ControlBlock & b, const MailboxCommand & cmd, int64_t timeout_ms);

/// Client side: the daemon is alive (pid exists, heartbeat within `stale_ms`).
bool daemon_alive(const ControlBlock & b, int64_t stale_ms = 2000);

}  // namespace fd::shm
