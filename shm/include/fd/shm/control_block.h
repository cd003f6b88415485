// fd/shm/control_block.h — THE control-plane contract between fdrollout and fdctl (SPEC §6).
//
// One POSIX shared-memory block per daemon port, /dev/shm/fdrollout.<port>, mode 0600, created
// by the daemon (Boost.Interprocess) and opened by fdctl. The layout is an ABI: it opens with
// magic, abi_version and size_bytes, and static_asserts pin its size and offsets; bump
// kControlBlockAbiVersion on any change. Readers refuse a block with another magic or ABI.
//
// Who writes what:
//   daemon only   pid, port, heartbeat_ms, v1_update_weights, the state snapshot (seqlock
//                 `state_seq`: odd while writing), ack_seq, result_*
//   fdctl only    a slot's command (cmd_*) and cmd_seq, while holding that slot's lock
//   both          legacy_status (the FastDeploy status word; CAS transitions), doorbell
// Mailbox protocol (per slot; the block has kMailboxSlots, each answered by its own daemon
// thread, so calls in different slots run side by side as HTTP calls do): a client takes the
// lock of a free slot (owner_pid: 0 = free; a dead owner's lock is taken over), waits until
// ack_seq == cmd_seq (the slot's previous command is done), fills cmd_* and cmd_deadline_ns,
// stores cmd_state = (seq, posted), cmd_seq = seq, bumps doorbell and futex-wakes it; the
// daemon answers with result_* and stores ack_seq = cmd_seq, futex-waking ack_seq — for every
// command, also one it dropped. Futex words are 32-bit and process-shared.
//
// ABI history: 2 → 3 added cmd_request_id (after cmd_version) and cmd_abort_all (a pad byte), so
// `fdctl abort` works over shm; 3 → 4 added pid_start_ticks (a reused pid is not the daemon) and
// made the one mailbox kMailboxSlots slots (with one, a
// `fdctl pause --mode wait` draining for minutes made every other shm call, status and abort
// included, time out). An fdctl and a daemon of different ABIs refuse each other's block
// before anything is written (fdctl: exit 10 "it has ABI version N, this build speaks M"): a
// command is never misread.
//
// Start/cancel handshake (issue #12, defect 2): cmd_state leaves `posted` exactly once, by CAS:
//   posted → started    the daemon, just before the engine runs the command, only if
//                       CLOCK_MONOTONIC (system-wide) is still before cmd_deadline_ns;
//   posted → cancelled  the client when its --timeout runs out, or the daemon when it finds the
//                       deadline passed: the command is dropped (a logged line), never run.
// So the client's reported outcome is the truth: its cancel won → "timeout, nothing changed";
// it lost → the command started before the deadline, and the client reports its answer.
#pragma once

#include "fd/process.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace fd::shm {

inline constexpr uint64_t kControlBlockMagic      = 0x4243'4c4c'4f52'4446ULL;  // "FDROLLCB" little-endian
inline constexpr uint32_t kControlBlockAbiVersion = 4;  ///< 4: kMailboxSlots mailbox slots (3: one; cmd_request_id, cmd_abort_all)
inline constexpr size_t   kVersionCap             = 136;    ///< weight_version bytes incl. NUL (versions are <= 128)
inline constexpr size_t   kResultCap              = 32768;  ///< result JSON bytes incl. NUL
inline constexpr size_t   kRequestIdCap           = 136;    ///< abort request id bytes incl. NUL (ids are <= 128)

/// Engine state as the daemon last published it (read under the seqlock).
struct StateSnapshot {
    uint8_t  paused;
    uint8_t  weight_asleep;
    uint8_t  kv_asleep;
    uint8_t  weights_valid;
    uint8_t  draining;
    uint8_t  pad_[3];
    int32_t  model_weights_status;         ///< copy of legacy_status at publish time
    int32_t  n_running;
    int64_t  published_ms;                 ///< CLOCK_REALTIME ms of this snapshot
    char     weight_version[kVersionCap];  ///< NUL-terminated
};

/// Mailbox command names (ASCII, NUL-terminated in cmd_op).
inline constexpr size_t kOpCap = 32;

/// The state half of cmd_state (low 32 bits; the high 32 bits are the command's seq).
enum class CmdState : uint32_t { idle = 0, posted = 1, started = 2, cancelled = 3 };

/// cmd_state value of command `seq` in state `st`.
constexpr uint64_t cmd_state_word(uint32_t seq, CmdState st) { return (uint64_t{seq} << 32) | static_cast<uint32_t>(st); }

/// One mailbox slot: one fdctl call at a time holds it (owner_pid), posts its command and waits
/// for the answer in it. The block has kMailboxSlots of them, each served by its own daemon
/// thread, so a long call (pause --mode wait, clear) does not hold up a status or an abort.
struct MailboxSlot {
    std::atomic<int64_t>  owner_pid;           ///< writer lock; 0 = free
    std::atomic<uint32_t> cmd_seq;
    std::atomic<uint32_t> ack_seq;
    std::atomic<uint64_t> cmd_state;           ///< cmd_state_word(seq, CmdState): the start/cancel handshake
    int64_t  cmd_deadline_ns;                  ///< CLOCK_MONOTONIC ns: not started by then = dropped
    char     cmd_op[kOpCap];                   ///< "pause", "sleep", "update_weights", "status", ...
    char     cmd_tags[64];                     ///< sleep/wakeup `tags` as the user wrote them
    char     cmd_version[kVersionCap];         ///< update_weights version ("" = none)
    char     cmd_request_id[kRequestIdCap];    ///< abort: completion id or X-Request-Id ("" with cmd_abort_all = every request)
    uint8_t  cmd_verify_checksum;
    uint8_t  cmd_has_version;
    uint8_t  cmd_stage_only;                   ///< update_weights: 1 = stage only ("commit": false); 0 = commit
    uint8_t  cmd_pause_mode;                   ///< pause: 0 abort, 1 wait, 2 keep; flush_cache: 1 keep the host KV tier
    uint8_t  cmd_abort_all;                    ///< abort: 1 = every request (cmd_request_id empty)
    uint8_t  pad_[3];
    int32_t  result_http_status;               ///< the status the V1 HTTP route would answer
    uint32_t result_len;
    char     result_body[kResultCap];          ///< the body the V1 HTTP route would answer
};

/// Mailbox slots per block: at most this many fdctl calls are in flight over shm at once; one
/// more waits (within its --timeout) for a slot to free.
inline constexpr int kMailboxSlots = 4;

struct ControlBlock {
    // --- header (never moves) ---
    uint64_t magic;
    uint32_t abi_version;
    uint32_t size_bytes;
    // --- daemon identity and liveness ---
    std::atomic<int64_t>  pid;
    std::atomic<int32_t>  port;
    std::atomic<int32_t>  v1_update_weights;   ///< the daemon's FD_ENABLE_V1_UPDATE_WEIGHTS
    std::atomic<int64_t>  heartbeat_ms;        ///< CLOCK_REALTIME ms, refreshed every ~100 ms
    std::atomic<int64_t>  pid_start_ticks;     ///< the daemon's start time (/proc/PID/stat field 22): a later process reusing the pid is not it (ABI 4)
    // --- state snapshot (seqlock) ---
    std::atomic<uint64_t> state_seq;
    StateSnapshot         state;
    // --- legacy status word (SPEC §4): NORMAL 0, UPDATING 1, CLEARING -1, CLEARED -2 ---
    std::atomic<int32_t>  legacy_status;
    std::atomic<uint32_t> doorbell;            ///< bumped (and futex-woken) after any client posts in any slot
    // --- mailbox (ABI 4: kMailboxSlots slots; ABI 3 had one) ---
    MailboxSlot           mailbox[kMailboxSlots];
};

static_assert(std::is_standard_layout_v<ControlBlock>);
static_assert(std::atomic<int64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free);
static_assert(offsetof(ControlBlock, magic) == 0 && offsetof(ControlBlock, abi_version) == 8 &&
              offsetof(ControlBlock, size_bytes) == 12 && offsetof(ControlBlock, pid) == 16);
static_assert(offsetof(MailboxSlot, cmd_request_id) == offsetof(MailboxSlot, cmd_version) + kVersionCap);
static_assert(sizeof(MailboxSlot) == 33184 && offsetof(ControlBlock, mailbox) == 224);
static_assert(sizeof(ControlBlock) == 224 + kMailboxSlots * 33184, "ControlBlock is an ABI: bump kControlBlockAbiVersion when it changes");

/// Shared-memory object name of the block for `port` ("fdrollout.8000" → /dev/shm/fdrollout.8000).
std::string block_name(int port);

/// Wall-clock milliseconds (CLOCK_REALTIME), the heartbeat unit.
int64_t now_ms();

/// CLOCK_MONOTONIC nanoseconds: the same clock in every process of the machine (the deadline unit;
/// std::chrono::steady_clock reads it too).
int64_t monotonic_ns();

// The daemon's liveness and start time (pid, pid_start_ticks): fd::pid_alive, fd/process.h.

/// Futex wait on a process-shared 32-bit word while it equals `expected`, at most `timeout_us`.
void futex_wait(std::atomic<uint32_t> & word, uint32_t expected, int64_t timeout_us);
/// Wake every waiter on `word`.
void futex_wake(std::atomic<uint32_t> & word);

}  // namespace fd::shm
