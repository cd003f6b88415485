// The control block: creation and reclaim (daemon), opening and validation (fdctl), the seqlock
// snapshot and the mailbox call. See fd/shm/control_block.h for the protocol.
#include "fd/shm/control_client.h"
#include "fd/trust.h"

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <linux/futex.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <thread>

namespace fd::shm {

namespace bip = boost::interprocess;

std::string block_name(int port) { return "fdrollout." + std::to_string(port); }

int64_t now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int64_t monotonic_ns() {
    timespec ts{};
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

void futex_wait(std::atomic<uint32_t> & word, uint32_t expected, int64_t timeout_us) {
    timespec ts{static_cast<time_t>(timeout_us / 1000000), static_cast<long>((timeout_us % 1000000) * 1000)};
    ::syscall(SYS_futex, reinterpret_cast<uint32_t *>(&word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t> & word) {
    ::syscall(SYS_futex, reinterpret_cast<uint32_t *>(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

namespace {

std::string shm_path(int port) { return "/dev/shm/" + block_name(port); }

void map(bip::shared_memory_object & obj, ControlBlock *& out, std::shared_ptr<void> & holder) {
    auto region = std::make_shared<bip::mapped_region>(obj, bip::read_write);
    out    = static_cast<ControlBlock *>(region->get_address());
    holder = region;
}

/// Why `b` is not ours to read, or empty.
std::string layout_problem(const ControlBlock & b, size_t mapped) {
    if (mapped < 16) { return fmt::format("it is only {} bytes", mapped); }
    if (b.magic != kControlBlockMagic) { return "it has another magic (not an fdrollout control block)"; }
    if (b.abi_version != kControlBlockAbiVersion) {
        return fmt::format("it has ABI version {}, this build speaks {} (fdrollout and fdctl from different versions?)", b.abi_version,
                           kControlBlockAbiVersion);
    }
    if (b.size_bytes != sizeof(ControlBlock) || mapped < sizeof(ControlBlock)) {
        return fmt::format("it is {} bytes (its header says {}), expected {}", mapped, b.size_bytes, sizeof(ControlBlock));
    }
    return {};
}

/// fdctl's trust check of the block open on `fd`: owned by the daemon's user (ours, or for root
/// the owner of the pid the block names) and no group/other permission bits.
void check_block_owner(int fd, const std::string & path) {
    struct stat st{};
    if (::fstat(fd, &st) != 0) { fail(Errc::internal, "{}: fstat failed: {}", path, std::strerror(errno)); }
    const uid_t me = ::geteuid();
    if (me != 0 && st.st_uid != me) {
        fail(Errc::forbidden,
             "control block {} is owned by uid {}, not by you (uid {}): refusing it, another local user could have planted it "
             "to forge answers or swallow commands. Run fdctl as the daemon's user; if no fdrollout of yours runs on this port, "
             "have its owner or root remove it",
             path, st.st_uid, me);
    }
    if ((st.st_mode & 077) != 0) {
        fail(Errc::forbidden, "control block {} has mode {:04o}: other users can read or write it, so refusing it "
                              "(fdrollout creates it 0600; remove it as its owner or root and restart the daemon)",
             path, st.st_mode & 07777);
    }
}

/// Root's half of the owner check, once the block is mapped: the block's owner must be the user
/// running the pid it names (a planted block names some live process of another user).
void check_block_pid_owner(int fd, const ControlBlock & b, const std::string & path) {
    if (::geteuid() != 0) { return; }
    struct stat st{}, proc{};
    const int64_t pid = b.pid.load();
    if (::fstat(fd, &st) != 0 || pid <= 0 || ::stat(fmt::format("/proc/{}", pid).c_str(), &proc) != 0) { return; }  // dead: stale, said later
    if (proc.st_uid != st.st_uid) {
        fail(Errc::forbidden, "control block {} is owned by uid {} but names pid {}, which runs as uid {}: refusing a block "
                              "not created by its daemon (remove it as root)",
             path, st.st_uid, pid, proc.st_uid);
    }
}

}  // namespace

MappedBlock MappedBlock::create(int port) {
    const std::string name = block_name(port);
    for (int attempt = 0; attempt < 2; ++attempt) {
        try {
            bip::permissions perm;
            perm.set_permissions(0600);
            bip::shared_memory_object obj(bip::create_only, name.c_str(), bip::read_write, perm);
            obj.truncate(sizeof(ControlBlock));
            MappedBlock m;
            map(obj, m.block_, m.region_);
            ::fchmod(obj.get_mapping_handle().handle, 0600);  // whatever the umask
            ControlBlock & b = *m.block_;
            std::memset(static_cast<void *>(&b), 0, sizeof b);
            b.abi_version = kControlBlockAbiVersion;
            b.size_bytes  = sizeof(ControlBlock);
            b.pid.store(::getpid());
            b.pid_start_ticks.store(process_start_ticks(::getpid()));
            b.port.store(port);
            b.heartbeat_ms.store(now_ms());
            std::atomic_thread_fence(std::memory_order_release);
            b.magic = kControlBlockMagic;  // last: a reader seeing the magic sees the rest
            m.owner_ = std::shared_ptr<void>(nullptr, [name](void *) { bip::shared_memory_object::remove(name.c_str()); });
            return m;
        } catch (const bip::interprocess_exception & e) {
            if (e.get_error_code() != bip::already_exists_error || attempt > 0) {
                fail(Errc::internal, "cannot create control block {}: {}", shm_path(port), e.what());
            }
        }
        // It exists: reclaim it if its daemon is gone, refuse if one is alive. Only a block of
        // this user, mode 0600, is read at all: another user's block is neither trusted nor
        // removed (forbidden), so nobody can plant one for this daemon or its fdctl callers.
        bip::shared_memory_object obj;
        try {
            bip::shared_memory_object(bip::open_only, name.c_str(), bip::read_write).swap(obj);
        } catch (const bip::interprocess_exception & e) {
            if (e.get_error_code() == bip::not_found_error) { continue; }  // removed meanwhile: create again
            fail(Errc::forbidden, "control block {} exists and cannot be opened ({}): it belongs to another user; "
                                  "remove it as its owner or root", shm_path(port), e.what());
        }
        check_trusted(obj.get_mapping_handle().handle, shm_path(port), Trust::secret);
        bip::offset_t size = 0;
        obj.get_size(size);
        MappedBlock old;
        if (size > 0) { map(obj, old.block_, old.region_); }
        const std::string problem = size > 0 ? layout_problem(*old.block_, static_cast<size_t>(size)) : "it is empty";
        // magic, ABI and pid sit at fixed offsets in every ABI (static_asserts), so a live daemon
        // of another version is recognized whatever its block's size (ABI 2 was smaller).
        const auto header_bytes = static_cast<bip::offset_t>(offsetof(ControlBlock, pid) + sizeof(int64_t));
        if (!problem.empty() && size >= header_bytes && old.block_->magic == kControlBlockMagic && pid_alive(old.block_->pid.load())) {
            fail(Errc::invalid_argument, "control block {}: {}; a running fdrollout of another version owns it", shm_path(port), problem);
        }
        if (problem.empty() && pid_alive(old.block_->pid.load(), old.block_->pid_start_ticks.load()) && old.block_->pid.load() != ::getpid()) {
            fail(Errc::wrong_state, "a live fdrollout (pid {}) already owns port {} ({}); stop it or choose another --port",
                 old.block_->pid.load(), port, shm_path(port));
        }
        bip::shared_memory_object::remove(name.c_str());  // stale (dead owner) or foreign junk: reclaim
    }
    fail(Errc::internal, "cannot create control block {}", shm_path(port));
}

MappedBlock MappedBlock::open(int port) {
    const std::string name = block_name(port);
    try {
        bip::shared_memory_object obj(bip::open_only, name.c_str(), bip::read_write);
        check_block_owner(obj.get_mapping_handle().handle, shm_path(port));
        bip::offset_t size = 0;
        obj.get_size(size);
        MappedBlock m;
        // A daemon creates, sizes and fills the block, magic last: until then it is starting up,
        // which callers (fdctl wait) treat like "not there yet", not like a foreign block.
        const auto starting = [&] {
            return Error(Errc::unreachable, fmt::format("fdrollout on port {} is starting up (control block {} not ready yet)", port, shm_path(port)));
        };
        if (size == 0) { throw starting(); }
        if (size < 16) {  // not even a header
            fail(Errc::invalid_argument, "control block {} has {} bytes, expected {}", shm_path(port), size, sizeof(ControlBlock));
        }
        // The header first: a block of another ABI (an older or newer fdrollout, whose size
        // differs) is named as such, not as a size mismatch; layout_problem checks the size last.
        map(obj, m.block_, m.region_);
        if (__atomic_load_n(&m.block_->magic, __ATOMIC_ACQUIRE) == 0) { throw starting(); }
        const std::string problem = layout_problem(*m.block_, static_cast<size_t>(size));
        if (!problem.empty()) { fail(Errc::invalid_argument, "refusing control block {}: {}", shm_path(port), problem); }
        check_block_pid_owner(obj.get_mapping_handle().handle, *m.block_, shm_path(port));
        return m;
    } catch (const bip::interprocess_exception & e) {
        if (e.get_error_code() == bip::not_found_error) {
            fail(Errc::unreachable, "no fdrollout on port {} (no control block {}); start the daemon or check --port", port, shm_path(port));
        }
        if (e.get_error_code() == bip::security_error) {
            fail(Errc::forbidden, "cannot open control block {}: {} (it is mode 0600: run fdctl as the daemon's user)", shm_path(port), e.what());
        }
        fail(Errc::invalid_argument, "cannot open control block {}: {} (it is mode 0600: run as the daemon's user)", shm_path(port), e.what());
    }
}

void MappedBlock::remove(int port) { bip::shared_memory_object::remove(block_name(port).c_str()); }

void publish_state(ControlBlock & b, const StateSnapshot & s) {
    const uint64_t seq = b.state_seq.load(std::memory_order_relaxed);
    b.state_seq.store(seq + 1, std::memory_order_relaxed);  // odd: writing
    std::atomic_thread_fence(std::memory_order_release);
    std::memcpy(static_cast<void *>(&b.state), &s, sizeof s);
    b.state_seq.store(seq + 2, std::memory_order_release);
}

StateSnapshot read_state(const ControlBlock & b) {
    StateSnapshot s;
    for (;;) {
        const uint64_t before = b.state_seq.load(std::memory_order_acquire);
        if (before & 1) { std::this_thread::yield(); continue; }
        std::memcpy(&s, static_cast<const void *>(&b.state), sizeof s);
        std::atomic_thread_fence(std::memory_order_acquire);
        if (b.state_seq.load(std::memory_order_relaxed) == before) { return s; }
    }
}

bool daemon_alive(const ControlBlock & b, int64_t stale_ms) {
    return pid_alive(b.pid.load(), b.pid_start_ticks.load()) && now_ms() - b.heartbeat_ms.load() <= stale_ms;
}

namespace {

void copy_field(char * dst, size_t cap, const std::string & src) {
    const size_t n = std::min(cap - 1, src.size());
    std::memcpy(dst, src.data(), n);
    dst[n] = '\0';
}

}  // namespace

bool command_pending(const MailboxSlot & b, uint32_t seq) {
    return b.cmd_state.load(std::memory_order_acquire) == cmd_state_word(seq, CmdState::posted) && monotonic_ns() < b.cmd_deadline_ns;
}

bool try_start_command(MailboxSlot & b, uint32_t seq) {
    if (monotonic_ns() >= b.cmd_deadline_ns) {
        try_cancel_command(b, seq);  // expired: whoever moves it out of posted, it never runs
        return false;
    }
    uint64_t expected = cmd_state_word(seq, CmdState::posted);
    return b.cmd_state.compare_exchange_strong(expected, cmd_state_word(seq, CmdState::started), std::memory_order_acq_rel);
}

bool try_cancel_command(MailboxSlot & b, uint32_t seq) {
    uint64_t expected = cmd_state_word(seq, CmdState::posted);
    if (b.cmd_state.compare_exchange_strong(expected, cmd_state_word(seq, CmdState::cancelled), std::memory_order_acq_rel)) { return true; }
    return expected == cmd_state_word(seq, CmdState::cancelled);
}

MailboxReply mailbox_call(ControlBlock & block, const MailboxCommand & cmd, int64_t timeout_ms) {
    if (cmd.request_id.size() >= sizeof(MailboxSlot::cmd_request_id)) {  // never truncated into another id
        fail(Errc::invalid_argument, "request id of {} bytes is too long (at most {}); nothing was sent", cmd.request_id.size(),
             sizeof(MailboxSlot::cmd_request_id) - 1);
    }
    const int64_t start_ms = now_ms();
    const int64_t deadline = start_ms + timeout_ms;
    const int64_t me       = ::getpid();
    const int64_t pid      = block.pid.load();
    const int64_t pid_start = block.pid_start_ticks.load();
    const int     port     = block.port.load();
    auto stalled_note = [&] {
        const int64_t age = now_ms() - block.heartbeat_ms.load();
        return age > kHeartbeatStaleMs
                   ? fmt::format("; fdrollout (pid {}) is alive but its heartbeat is {:.1f} s old: stopped (SIGSTOP) or stalled", pid, age / 1000.0)
                   : std::string();
    };
    // Before the command is posted: a dead pid is "gone", a deadline passed is a timeout, and
    // either way nothing was sent.
    auto check = [&](const char * waiting_for) {
        if (!pid_alive(pid, pid_start)) { fail(Errc::unreachable, "fdrollout (pid {}) on port {} is gone (waiting for {}); nothing was sent", pid, port, waiting_for); }
        if (now_ms() > deadline) {
            fail(Errc::timeout, "gave up waiting for {} after {} ms (--timeout){}; nothing was sent, nothing changed", waiting_for, timeout_ms,
                 stalled_note());
        }
    };
    // 1. A free slot's lock; a dead holder's lock is taken over. An idle slot first: a slot whose
    //    command is still unanswered (its caller killed mid-call) would make this call wait for
    //    that command (a probe: every later call took the dead caller's slot and waited out its
    //    pause's drain while three slots sat idle). Every slot busy (kMailboxSlots calls in
    //    flight): wait for one.
    MailboxSlot * slot = nullptr;
    for (;;) {
        check("a free mailbox slot (every one is held by another fdctl call)");
        for (int pass = 0; pass < 2 && slot == nullptr; ++pass) {
            for (MailboxSlot & s : block.mailbox) {
                if (pass == 0 && s.ack_seq.load(std::memory_order_acquire) != s.cmd_seq.load()) { continue; }
                int64_t owner = 0;
                if (s.owner_pid.compare_exchange_strong(owner, me) || (!pid_alive(owner) && s.owner_pid.compare_exchange_strong(owner, me))) {
                    slot = &s;
                    break;
                }
            }
        }
        if (slot != nullptr) { break; }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    MailboxSlot & b = *slot;
    struct Unlock {
        MailboxSlot & b;
        int64_t       me;
        ~Unlock() { int64_t e = me; b.owner_pid.compare_exchange_strong(e, 0); }
    } unlock{b, me};
    // 2. The slot's previous command (perhaps of a client that died) must be answered first; the
    //    daemon answers dropped ones too.
    for (uint32_t a; (a = b.ack_seq.load(std::memory_order_acquire)) != b.cmd_seq.load();) {
        check("the previous command to finish");
        futex_wait(b.ack_seq, a, 10000);
    }
    // 3. Write the command and its deadline, post it, ring the doorbell.
    copy_field(b.cmd_op, sizeof b.cmd_op, cmd.op);
    copy_field(b.cmd_tags, sizeof b.cmd_tags, cmd.tags);
    copy_field(b.cmd_version, sizeof b.cmd_version, cmd.version.value_or(""));
    copy_field(b.cmd_request_id, sizeof b.cmd_request_id, cmd.request_id);
    b.cmd_abort_all       = cmd.abort_all ? 1 : 0;
    b.cmd_has_version     = cmd.version.has_value();
    b.cmd_verify_checksum = cmd.verify_checksum;
    b.cmd_stage_only      = cmd.commit ? 0 : 1;
    b.cmd_pause_mode      = cmd.op == "flush_cache" ? (cmd.mode == "device" ? 1 : 0)  // flush_cache: 1 keeps the host KV tier
                            : cmd.mode == "wait" ? 1 : cmd.mode == "keep" ? 2 : 0;       // the daemon validates; fdctl checked the name
    const int64_t  left_ms = std::clamp<int64_t>(deadline - now_ms(), 0, int64_t{1} << 40);  // ~34 years: no ns overflow
    b.cmd_deadline_ns      = monotonic_ns() + left_ms * 1000000;
    const uint32_t seq     = b.cmd_seq.load() + 1;
    b.cmd_state.store(cmd_state_word(seq, CmdState::posted), std::memory_order_release);
    b.cmd_seq.store(seq, std::memory_order_release);
    block.doorbell.fetch_add(1, std::memory_order_release);
    futex_wake(block.doorbell);
    // 4. Wait for the answer. At the deadline, withdraw the command unless it has started: the
    //    CAS decides, so what we report is what happened.
    for (uint32_t a; (a = b.ack_seq.load(std::memory_order_acquire)) != seq;) {
        const bool started = b.cmd_state.load(std::memory_order_acquire) == cmd_state_word(seq, CmdState::started);
        if (!pid_alive(pid, pid_start)) {
            if (started) {
                fail(Errc::unreachable, "fdrollout (pid {}) on port {} died while running {}: its outcome is unknown (check the next daemon's state)",
                     pid, port, cmd.op);
            }
            fail(Errc::unreachable, "fdrollout (pid {}) on port {} is gone; {} never started, nothing changed", pid, port, cmd.op);
        }
        if (now_ms() > deadline) {
            if (!started && try_cancel_command(b, seq)) {
                fail(Errc::timeout, "{} did not start within {} ms (--timeout){}; withdrawn: it will not run, nothing changed", cmd.op, timeout_ms,
                     stalled_note());
            }
            // It started before the deadline: its answer is the outcome. Wait while the daemon
            // lives and its heartbeat is fresh (the daemon bounds its own wait by --control-timeout-s).
            if (now_ms() - block.heartbeat_ms.load() > kHeartbeatStaleMs) {
                fail(Errc::timeout, "{} started before the deadline but fdrollout (pid {}) then stopped answering{}: its outcome is "
                                    "unknown until it answers (check fdctl status)", cmd.op, pid, stalled_note());
            }
        }
        futex_wait(b.ack_seq, a, std::clamp<int64_t>((deadline - now_ms()) * 1000, 1000, 50000));
    }
    MailboxReply r;
    r.http_status = b.result_http_status;
    r.body.assign(b.result_body, std::min<size_t>(b.result_len, kResultCap - 1));
    return r;
}

}  // namespace fd::shm
