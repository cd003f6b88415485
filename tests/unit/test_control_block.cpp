// The shm contract: creation and refusal rules, the seqlock snapshot under a concurrent writer
// process, the mailbox round trip, and a dead client's lock being taken over.
#include "fd/shm/control_client.h"
#include "fd/shm/names.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>
#include <thread>

namespace {

int test_port() {
    static std::mt19937 rng(std::random_device{}());
    return 40000 + static_cast<int>(rng() % 20000);
}

/// Answer one mailbox command like the daemon's watcher does (echo op and tags).
void serve_one(fd::shm::ControlBlock & b) {
    uint32_t rung = b.doorbell.load();
    while (b.cmd_seq.load() == b.ack_seq.load()) { fd::shm::futex_wait(b.doorbell, rung, 100000); rung = b.doorbell.load(); }
    const uint32_t seq = b.cmd_seq.load(std::memory_order_acquire);
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
        CHECK_THROWS_WITH_AS(fd::shm::MappedBlock::create(port), doctest::Contains("already owns port"), fd::Error);
        // Its owner died: reclaimed.
        block->pid.store(999999);
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
        CHECK(block->mailbox_owner_pid.load() == 0);
        block->mailbox_owner_pid.store(999999);  // a client killed while holding the lock
        block->heartbeat_ms.store(fd::shm::now_ms());
        const auto r2 = fd::shm::mailbox_call(*block, {"pause", "", std::nullopt, false}, 5000);
        CHECK(r2.body == R"({"op":"pause","tags":""})");
        daemon.join();
        // nobody answers: timeout, not a hang
        block->heartbeat_ms.store(fd::shm::now_ms());
        CHECK_THROWS_WITH_AS(fd::shm::mailbox_call(*block, {"status", "", std::nullopt, false}, 300), doctest::Contains("within 300 ms"), fd::Error);
        fd::shm::MappedBlock::remove(port);
    }

    TEST_CASE("version and tag syntax") {
        CHECK(fd::shm::is_valid_version("step-42.v_1"));
        for (const char * bad : {"", ".", "..", "a/b", "a b", "ü"}) { CHECK_FALSE(fd::shm::is_valid_version(bad)); }
        CHECK_FALSE(fd::shm::is_valid_version(std::string(129, 'x')));
        CHECK(fd::shm::parse_tag_list("") == std::vector<std::string>{"weight", "kv_cache"});
        CHECK(fd::shm::parse_tag_list(" kv_cache , ") == std::vector<std::string>{"kv_cache"});
        CHECK(fd::shm::parse_tag_list("kv_cache,weight") == std::vector<std::string>{"weight", "kv_cache"});
        CHECK_THROWS_AS(fd::shm::parse_tag_list("weights"), fd::Error);
    }
}
