// fd/engine/control.h: the in-process start/cancel gate of a queued control command (issue 12,
// defect 2) — exactly one of start() and cancel() wins, and a passed deadline never starts.
#include "fd/engine/control.h"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>

using fd::engine::LocalStartGate;
using Clock = std::chrono::steady_clock;

TEST_CASE("start gate: start and cancel race, exactly one wins") {
    int started = 0;
    for (int i = 0; i < 2000; ++i) {
        LocalStartGate gate(Clock::now() + std::chrono::hours(1));
        std::atomic<bool> go{false};
        bool s = false, c = false;
        std::thread engine([&] { while (!go.load()) {} s = gate.start(); });
        std::thread waiter([&] { while (!go.load()) {} c = gate.cancel(); });
        go.store(true);
        engine.join();
        waiter.join();
        CHECK(s != c);
        started += s;
        // Whatever won stays won.
        CHECK(gate.start() == false);
        CHECK(gate.cancel() == c);
    }
    MESSAGE("start won " << started << " of 2000");
}

TEST_CASE("start gate: past its deadline a command never starts, and cancelling it reports that it will not run") {
    LocalStartGate gate(Clock::now() - std::chrono::milliseconds(1));
    CHECK_FALSE(gate.start());
    CHECK(gate.cancel());
    LocalStartGate live(Clock::now() + std::chrono::seconds(60));
    CHECK(live.start());
    CHECK_FALSE(live.cancel());  // it started: the waiter must wait for its answer
}

TEST_CASE("pause modes: the three names round-trip, empty means abort, anything else is refused naming mode") {
    using fd::engine::PauseMode;
    for (const PauseMode m : {PauseMode::abort, PauseMode::wait, PauseMode::keep}) {
        CHECK(fd::engine::parse_pause_mode(fd::engine::to_string(m)) == m);
    }
    CHECK(fd::engine::parse_pause_mode("") == PauseMode::abort);
    for (const char * bad : {"ABORT", "finish", " wait", "keep "}) {
        try {
            fd::engine::parse_pause_mode(bad);
            FAIL("accepted " << bad);
        } catch (const fd::Error & e) {
            CHECK(e.code() == fd::Errc::invalid_argument);
            CHECK(e.param() == "mode");
        }
    }
}
