// The shm contract: creation and refusal rules, the seqlock snapshot under a concurrent writer
// process, the mailbox round trip, a dead client's lock being taken over, the start/cancel
// handshake (a stalled daemon is a timeout and the withdrawn command never runs) and fdctl's
// owner/mode check.
#include "fd/shm/control_client.h"
#include "fd/shm/names.h"

#include <doctest/doctest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <atomic>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

namespace {

int test_port() {
    static std::mt19937 rng(std::random_device{}());
    return 40000 + static_cast<int>(rng() % 20000);
}

/// Answer one mailbox command in slot `slot` like the daemon's watcher does (echo op and tags).
void serve_one(fd::shm::ControlBlock & block, int slot = 0) {
    auto & b = block.mailbox[slot];
    uint32_t rung = block.doorbell.load();
    while (b.cmd_seq.load() == b.ack_seq.load()) { fd::shm::futex_wait(block.doorbell, rung, 100000); rung = block.doorbell.load(); }
    const uint32_t seq = b.cmd_seq.load(std::memory_order_acquire);
    REQUIRE(fd::shm::try_start_command(b, seq));
    const std::string body = std::string("{\"op\":\"") + b.cmd_op + "\",\"tags\":\"" + b.cmd_tags + "\"}";
    std::memcpy(b.result_body, body.c_str(), body.size() + 1);
    b.result_len         = static_cast<uint32_t>(body.size());
    b.result_http_status = 200;
    b.ack_seq.store(seq, std::memory_order_release);
    fd::shm::futex_wake(b.ack_seq);
}

}  // namespace

TEST_SUITE("shm::control_block") {
    TEST_CASE("a created block is private, validated on open, and refused to a second owner") {
        const int port = test_port();
        auto block = fd::shm::MappedBlock::create(port);
        struct stat st{};
        REQUIRE(::stat(("/dev/shm/" + fd::shm::block_name(port)).c_str(), &st) == 0);
        CHECK((st.st_mode & 0777) == 0600);
        CHECK(block->magic == fd::shm::kControlBlockMagic);
        CHECK(block->abi_version == fd::shm::kControlBlockAbiVersion);
        CHECK(block->pid.load() == ::getpid());
        auto reader = fd::shm::MappedBlock::open(port);
        CHECK(reader->size_bytes == sizeof(fd::shm::ControlBlock));
        // Another "daemon" (a live pid that is not us) owns it: refused.
        block->pid.store(::getppid());
        block->pid_start_ticks.store(fd::process_start_ticks(::getppid()));
        CHECK_THROWS_WITH_AS(fd::shm::MappedBlock::create(port), doctest::Contains("already owns port"), fd::Error);
        // The pid lives but was reused by another process (its start time differs): reclaimed.
        block->pid_start_ticks.store(fd::process_start_ticks(::getppid()) + 1);
        auto reclaimed = fd::shm::MappedBlock::create(port);
        CHECK(reclaimed->pid.load() == ::getpid());
        // Its owner died: reclaimed.
        reclaimed->pid.store(999999);
        auto again = fd::shm::MappedBlock::create(port);
        CHECK(again->pid.load() == ::getpid());
        fd::shm::MappedBlock::remove(port);
    }

    TEST_CASE("readers refuse another magic or ABI version and report a missing block as unreachable") {
        const int port = test_port();
        CHECK_THROWS_WITH_AS(fd::shm::MappedBlock::open(port), doctest::Contains("no fdrollout on port"), fd::Error);
        {
            auto block = fd::shm::MappedBlock::create(port);
            block->abi_version = 7;
            CHECK_THROWS_WITH_AS(fd::shm::MappedBlock::open(port), doctest::Contains("ABI version 7"), fd::Error);
            block->abi_version = fd::shm::kControlBlockAbiVersion;
            block->magic       = 42;
            CHECK_THROWS_WITH_AS(fd::shm::MappedBlock::open(port), doctest::Contains("another magic"), fd::Error);
            // Created but not filled yet (magic is written last): a daemon starting up, which
            // `fdctl wait` must treat as "not there yet" (unreachable), not as a foreign block.
            block->magic = 0;
            try {
                fd::shm::MappedBlock::open(port);
                FAIL("opened a block without magic");
            } catch (const fd::Error & e) {
                CHECK(e.code() == fd::Errc::unreachable);
                CHECK(std::string(e.what()).find("starting up") != std::string::npos);
            }
        }
        fd::shm::MappedBlock::remove(port);
    }

    TEST_CASE("the seqlock never shows a half-written snapshot to a reader in another process") {
        const int port = test_port();
        auto block = fd::shm::MappedBlock::create(port);
        const pid_t child = ::fork();
        if (child == 0) {  // writer: every snapshot has all fields equal to i
            for (int i = 0; i < 200000; ++i) {
                fd::shm::StateSnapshot s{};
                s.n_running = i;
                s.model_weights_status = i;
                s.published_ms = i;
                std::memset(s.weight_version, 'a' + i % 26, sizeof s.weight_version - 1);
                fd::shm::publish_state(*block, s);
            }
            ::_exit(0);
        }
        int torn = 0, reads = 0;
        for (; reads < 200000; ++reads) {
            const auto s = fd::shm::read_state(*block);
            if (s.n_running != s.model_weights_status || s.published_ms != s.n_running ||
                (s.n_running > 0 && s.weight_version[0] != 'a' + s.n_running % 26) || s.weight_version[100] != s.weight_version[0]) {
                ++torn;
            }
        }
        int status = 0;
        ::waitpid(child, &status, 0);
        CHECK(torn == 0);
        CHECK(fd::shm::read_state(*block).n_running == 199999);
        fd::shm::MappedBlock::remove(port);
    }

    TEST_CASE("a mailbox call gets its own answer, and a dead client's lock is taken over") {
        const int port = test_port();
        auto block = fd::shm::MappedBlock::create(port);
        block->heartbeat_ms.store(fd::shm::now_ms());
        std::thread daemon([&] { serve_one(*block); serve_one(*block); });
        const auto r = fd::shm::mailbox_call(*block, {"sleep", "weight", std::nullopt, false}, 5000);
        CHECK(r.http_status == 200);
        CHECK(r.body == R"({"op":"sleep","tags":"weight"})");
        CHECK(block->mailbox[0].owner_pid.load() == 0);
        for (auto & slot : block->mailbox) { slot.owner_pid.store(999999); }  // clients killed while holding every slot
        block->heartbeat_ms.store(fd::shm::now_ms());
        const auto r2 = fd::shm::mailbox_call(*block, {"pause", "", std::nullopt, false}, 5000);
        CHECK(r2.body == R"({"op":"pause","tags":""})");
        daemon.join();
        // nobody answers: timeout, not a hang
        block->heartbeat_ms.store(fd::shm::now_ms());
        CHECK_THROWS_WITH_AS(fd::shm::mailbox_call(*block, {"status", "", std::nullopt, false}, 300), doctest::Contains("within 300 ms"), fd::Error);
        fd::shm::MappedBlock::remove(port);
    }

    TEST_CASE("a stopped daemon (live pid, stale heartbeat) is a timeout; the withdrawn command never starts") {
        const int port = test_port();
        auto block = fd::shm::MappedBlock::create(port);
        block->heartbeat_ms.store(fd::shm::now_ms() - 60000);  // our own (live) pid, a heartbeat a minute old
        try {
            fd::shm::mailbox_call(*block, {"pause", "", std::nullopt, false}, 300);
            FAIL("a stalled daemon answered");
        } catch (const fd::Error & e) {
            CHECK(e.code() == fd::Errc::timeout);  // not unreachable: the pid lives
            CHECK(std::string(e.what()).find("withdrawn: it will not run") != std::string::npos);
            CHECK(std::string(e.what()).find("heartbeat") != std::string::npos);
        }
        auto & slot = block->mailbox[0];
        const uint32_t seq = slot.cmd_seq.load();
        CHECK(seq == 1);
        CHECK(slot.cmd_state.load() == fd::shm::cmd_state_word(seq, fd::shm::CmdState::cancelled));
        // The daemon, continued (SIGCONT), finds it withdrawn: it may not start it.
        CHECK_FALSE(fd::shm::command_pending(slot, seq));
        CHECK_FALSE(fd::shm::try_start_command(slot, seq));
        // A dead pid is "gone" (exit 8), and nothing is posted.
        block->pid.store(999999);
        try {
            fd::shm::mailbox_call(*block, {"pause", "", std::nullopt, false}, 300);
            FAIL("a dead daemon answered");
        } catch (const fd::Error & e) {
            CHECK(e.code() == fd::Errc::unreachable);
        }
        CHECK(slot.cmd_seq.load() == seq);
        fd::shm::MappedBlock::remove(port);
    }

    TEST_CASE("start and cancel race: exactly one wins, and a passed deadline refuses the start") {
        const int port = test_port();
        auto block = fd::shm::MappedBlock::create(port);
        auto & b = block->mailbox[0];
        int started = 0, cancelled = 0;
        for (uint32_t seq = 1; seq <= 2000; ++seq) {
            b.cmd_deadline_ns = fd::shm::monotonic_ns() + 60'000'000'000;
            b.cmd_state.store(fd::shm::cmd_state_word(seq, fd::shm::CmdState::posted));
            std::atomic<bool> go{false};
            bool s = false, c = false;
            std::thread daemon([&] { while (!go.load()) {} s = fd::shm::try_start_command(b, seq); });
            std::thread client([&] { while (!go.load()) {} c = fd::shm::try_cancel_command(b, seq); });
            go.store(true);
            daemon.join();
            client.join();
            CHECK(s != c);
            started += s;
            cancelled += c;
            // A stale gate of an older command can never move the current one.
            CHECK_FALSE(fd::shm::try_start_command(b, seq - 1));
            CHECK_FALSE(fd::shm::try_cancel_command(b, seq - 1));
        }
        CHECK(started + cancelled == 2000);
        MESSAGE("start won " << started << ", cancel won " << cancelled);
        b.cmd_deadline_ns = fd::shm::monotonic_ns() - 1;  // expired: the daemon drops it and says so in the word
        b.cmd_state.store(fd::shm::cmd_state_word(7, fd::shm::CmdState::posted));
        CHECK_FALSE(fd::shm::command_pending(b, 7));
        CHECK_FALSE(fd::shm::try_start_command(b, 7));
        CHECK(b.cmd_state.load() == fd::shm::cmd_state_word(7, fd::shm::CmdState::cancelled));
        fd::shm::MappedBlock::remove(port);
    }

    TEST_CASE("a command started before the deadline is waited for and its real answer reported") {
        const int port = test_port();
        auto block = fd::shm::MappedBlock::create(port);
        auto & b = block->mailbox[0];
        block->heartbeat_ms.store(fd::shm::now_ms());
        std::atomic<bool> done{false};
        std::thread heartbeat([&] { while (!done.load()) { block->heartbeat_ms.store(fd::shm::now_ms()); std::this_thread::sleep_for(std::chrono::milliseconds(20)); } });
        std::thread daemon([&] {
            uint32_t rung = block->doorbell.load();
            while (b.cmd_seq.load() == b.ack_seq.load()) { fd::shm::futex_wait(block->doorbell, rung, 100000); rung = block->doorbell.load(); }
            const uint32_t seq = b.cmd_seq.load();
            REQUIRE(fd::shm::try_start_command(b, seq));
            std::this_thread::sleep_for(std::chrono::milliseconds(600));  // runs past the client's 200 ms
            std::memcpy(b.result_body, "{\"ok\":1}", 9);
            b.result_len = 8;
            b.result_http_status = 200;
            b.ack_seq.store(seq, std::memory_order_release);
            fd::shm::futex_wake(b.ack_seq);
        });
        const auto r = fd::shm::mailbox_call(*block, {"pause", "", std::nullopt, false}, 200);
        CHECK(r.http_status == 200);
        CHECK(r.body == R"({"ok":1})");
        daemon.join();
        done.store(true);
        heartbeat.join();
        fd::shm::MappedBlock::remove(port);
    }

    TEST_CASE("fdctl refuses a control block open to other users or not owned by the daemon's user") {
        const int port = test_port();
        auto block = fd::shm::MappedBlock::create(port);
        const std::string path = "/dev/shm/" + fd::shm::block_name(port);
        REQUIRE(::chmod(path.c_str(), 0666) == 0);
        try {
            fd::shm::MappedBlock::open(port);
            FAIL("opened a 0666 block");
        } catch (const fd::Error & e) {
            CHECK(e.code() == fd::Errc::forbidden);
            CHECK(std::string(e.what()).find("mode 0666") != std::string::npos);
        }
        REQUIRE(::chmod(path.c_str(), 0600) == 0);
        CHECK_NOTHROW(fd::shm::MappedBlock::open(port));
        if (::geteuid() == 0) {
            // Root: the block must belong to the user running the pid it names (here: us, root).
            REQUIRE(::chown(path.c_str(), 65534, 65534) == 0);
            try {
                fd::shm::MappedBlock::open(port);
                FAIL("root opened a block owned by uid 65534 naming a root pid");
            } catch (const fd::Error & e) {
                CHECK(e.code() == fd::Errc::forbidden);
                CHECK(std::string(e.what()).find("uid 65534") != std::string::npos);
            }
        } else {
            MESSAGE("not root: the foreign-owner case is covered by tests/e2e/test_reliability_users.py as root");
        }
        fd::shm::MappedBlock::remove(port);
    }

    TEST_CASE("a killed daemon its parent has not reaped (a zombie) is dead, not alive") {
        const pid_t child = ::fork();
        if (child == 0) { ::pause(); ::_exit(0); }
        CHECK(fd::pid_alive(child));
        CHECK(fd::pid_alive(child, fd::process_start_ticks(child)));
        CHECK_FALSE(fd::pid_alive(child, fd::process_start_ticks(child) + 1));  // another process on a reused pid
        ::kill(child, SIGKILL);
        for (int i = 0; i < 200 && fd::pid_alive(child); ++i) { std::this_thread::sleep_for(std::chrono::milliseconds(5)); }
        CHECK(::kill(child, 0) == 0);                  // still a zombie: kill(pid, 0) alone says alive
        CHECK_FALSE(fd::pid_alive(child));
        // A block naming it is reclaimed by the next daemon on its port, and fdctl says "gone".
        const int port = test_port();
        {
            auto block = fd::shm::MappedBlock::create(port);
            block->pid.store(child);
            block->heartbeat_ms.store(fd::shm::now_ms());
            CHECK_FALSE(fd::shm::daemon_alive(*block));
            CHECK_THROWS_WITH_AS(fd::shm::mailbox_call(*block, {.op = "status"}, 5000), doctest::Contains("is gone"), fd::Error);
            auto again = fd::shm::MappedBlock::create(port);  // the next daemon on the port
            CHECK(again->pid.load() == ::getpid());
        }
        int status = 0;
        ::waitpid(child, &status, 0);
        fd::shm::MappedBlock::remove(port);
    }

    TEST_CASE("version and tag syntax") {
        CHECK(fd::shm::is_valid_version("step-42.v_1"));
        for (const char * bad : {"", ".", "..", "a/b", "a b", "ü", ".pull.lock", ".hold-v1", ".incoming-v1-1", ".tmp-x", ".v"}) { CHECK_FALSE(fd::shm::is_valid_version(bad)); }
        CHECK_FALSE(fd::shm::is_valid_version(std::string(129, 'x')));
        CHECK(fd::shm::parse_tag_list("") == std::vector<std::string>{"weight", "kv_cache"});
        CHECK(fd::shm::parse_tag_list(" kv_cache , ") == std::vector<std::string>{"kv_cache"});
        CHECK(fd::shm::parse_tag_list("kv_cache,weight") == std::vector<std::string>{"weight", "kv_cache"});
        CHECK(fd::shm::parse_tag_list("cuda_graph,kv_cache") == std::vector<std::string>{"kv_cache", "cuda_graph"});
        CHECK_THROWS_AS(fd::shm::parse_tag_list("weights"), fd::Error);
    }

    TEST_CASE("request id syntax: 1..128 printable ASCII, no spaces (fits cmd_request_id)") {
        CHECK(fd::shm::is_valid_request_id("cmpl-0123abcd"));
        CHECK(fd::shm::is_valid_request_id(std::string(128, 'x')));
        for (const char * bad : {"", "a b", "a\tb", "ü"}) { CHECK_FALSE(fd::shm::is_valid_request_id(bad)); }
        CHECK_FALSE(fd::shm::is_valid_request_id(std::string(129, 'x')));
        CHECK(128 < fd::shm::kRequestIdCap);
    }

    TEST_CASE("abort's request id and abort_all travel in the block (ABI 3); one too long is refused before anything is sent") {
        const int port = test_port();
        auto block = fd::shm::MappedBlock::create(port);
        block->heartbeat_ms.store(fd::shm::now_ms());
        std::string seen_id;
        int seen_all = -1;
        auto & slot = block->mailbox[0];
        std::thread daemon([&] {
            uint32_t rung = block->doorbell.load();
            while (slot.cmd_seq.load() == slot.ack_seq.load()) { fd::shm::futex_wait(block->doorbell, rung, 100000); rung = block->doorbell.load(); }
            seen_id  = std::string(slot.cmd_request_id, strnlen(slot.cmd_request_id, sizeof slot.cmd_request_id));
            seen_all = slot.cmd_abort_all;
            serve_one(*block);
        });
        fd::shm::MailboxCommand cmd{.op = "abort", .request_id = std::string(128, 'r')};
        CHECK(fd::shm::mailbox_call(*block, cmd, 5000).http_status == 200);
        daemon.join();
        CHECK(seen_id == std::string(128, 'r'));
        CHECK(seen_all == 0);
        const uint32_t seq = slot.cmd_seq.load();
        cmd.request_id = std::string(fd::shm::kRequestIdCap, 'r');
        CHECK_THROWS_WITH_AS(fd::shm::mailbox_call(*block, cmd, 300), doctest::Contains("too long"), fd::Error);
        CHECK(slot.cmd_seq.load() == seq);  // nothing was posted
        fd::shm::MappedBlock::remove(port);
    }

    TEST_CASE("a long call in one slot does not hold up a call in another; with every slot held, a call times out saying so") {
        const int port = test_port();
        auto block = fd::shm::MappedBlock::create(port);
        block->heartbeat_ms.store(fd::shm::now_ms());
        std::atomic<bool> status_answered{false};
        // The daemon's slot-0 thread holds its command (pause --mode wait draining) until the
        // status call in slot 1 has its answer; the slot-1 thread answers at once.
        std::thread slot0([&] {
            auto & b = block->mailbox[0];
            uint32_t rung = block->doorbell.load();
            while (b.cmd_seq.load() == b.ack_seq.load()) { fd::shm::futex_wait(block->doorbell, rung, 100000); rung = block->doorbell.load(); }
            const uint32_t seq = b.cmd_seq.load();
            REQUIRE(fd::shm::try_start_command(b, seq));
            for (int i = 0; i < 500 && !status_answered.load(); ++i) { std::this_thread::sleep_for(std::chrono::milliseconds(10)); }
            std::memcpy(b.result_body, "{\"paused\":true}", 16);
            b.result_len = 15;
            b.result_http_status = 200;
            b.ack_seq.store(seq, std::memory_order_release);
            fd::shm::futex_wake(b.ack_seq);
        });
        std::thread slot1([&] { serve_one(*block, 1); });
        std::thread long_call([&] {
            const auto r = fd::shm::mailbox_call(*block, {.op = "pause", .mode = "wait"}, 10000);
            CHECK(r.body == R"({"paused":true})");
            CHECK(status_answered.load());  // answered after the status, not before
        });
        while (block->mailbox[0].owner_pid.load() == 0) { std::this_thread::sleep_for(std::chrono::milliseconds(1)); }
        const auto t0 = std::chrono::steady_clock::now();
        const auto r = fd::shm::mailbox_call(*block, {.op = "status"}, 3000);
        status_answered.store(true);
        CHECK(r.body == R"({"op":"status","tags":""})");
        CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
        long_call.join();
        slot0.join();
        slot1.join();
        // Every slot held by a live caller (our own pid stands in for four fdctl processes): the
        // fifth call waits for a slot, then times out saying why, having posted nothing.
        for (auto & slot : block->mailbox) { slot.owner_pid.store(::getppid()); }
        try {
            fd::shm::mailbox_call(*block, {.op = "status"}, 300);
            FAIL("a call got a slot that was held");
        } catch (const fd::Error & e) {
            CHECK(e.code() == fd::Errc::timeout);
            CHECK(std::string(e.what()).find("free mailbox slot") != std::string::npos);
            CHECK(std::string(e.what()).find("nothing was sent") != std::string::npos);
        }
        fd::shm::MappedBlock::remove(port);
    }

    TEST_CASE("a block of the previous ABI (3, one mailbox, smaller) is named by its ABI, not by its size") {
        const int port = test_port();
        const std::string path = "/dev/shm/" + fd::shm::block_name(port);
        {
            std::ofstream f(path, std::ios::binary);
            std::vector<char> bytes(33400, 0);  // ABI 3's size
            const uint64_t magic = fd::shm::kControlBlockMagic;
            const uint32_t abi = 3, size = 33400;
            std::memcpy(bytes.data(), &magic, 8);
            std::memcpy(bytes.data() + 8, &abi, 4);
            std::memcpy(bytes.data() + 12, &size, 4);
            f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
        }
        ::chmod(path.c_str(), 0600);
        CHECK_THROWS_WITH_AS(fd::shm::MappedBlock::open(port), doctest::Contains("ABI version 3, this build speaks 4"), fd::Error);
        // ... and a new daemon on that port neither reads nor removes the block of a live old one
        {
            std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
            const int64_t pid = ::getppid();  // alive, not us
            f.seekp(16);
            f.write(reinterpret_cast<const char *>(&pid), 8);
        }
        CHECK_THROWS_WITH_AS(fd::shm::MappedBlock::create(port), doctest::Contains("another version owns it"), fd::Error);
        struct stat st{};
        CHECK(::stat(path.c_str(), &st) == 0);
        ::unlink(path.c_str());
    }
}
