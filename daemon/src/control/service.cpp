// The control service (SPEC §3, §4, §6): every control command from every transport runs here —
// the engine operations through the engine inbox, the queries and the legacy pair here — and
// comes back as one typed outcome (fd/control/outcome.h); render.cpp shapes it.
#include "fd/control/service.h"

#include "fd/arena.h"
#include "fd/control/request.h"
#include "fd/engine/engine.h"
#include "fd/progress.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace fd::control {
namespace {

/// Releases held events kHoldFor after the service has its reply, on a thread of its own: the
/// reply is written by the transport meanwhile (the HTTP I/O thread, the mailbox), before the
/// aborted requests' handlers wake and compete with it for the CPUs (measured: releasing at once
/// made a pause at B=64 take 3 decode steps instead of 0.5, docs/benchmarks.md). The same bound
/// the engine's acknowledgement wait had; nothing waits for an acknowledgement.
class DelayedRelease {
public:
    static constexpr std::chrono::microseconds kHoldFor{2000};
    static DelayedRelease & instance() {
        static DelayedRelease r;
        return r;
    }
    void add(std::shared_ptr<engine::HeldEvents> held) {
        {
            std::lock_guard lk(mu_);
            q_.push_back({std::chrono::steady_clock::now() + kHoldFor, std::move(held)});
        }
        cv_.notify_one();
    }
    ~DelayedRelease() {
        {
            std::lock_guard lk(mu_);
            stop_ = true;
        }
        cv_.notify_one();
        thread_.join();  // releases what is left
    }

private:
    DelayedRelease() : thread_([this] { loop(); }) {}
    void loop() {
        std::unique_lock lk(mu_);
        for (;;) {
            if (q_.empty()) {
                if (stop_) { return; }
                cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
                continue;
            }
            if (!stop_ && std::chrono::steady_clock::now() < q_.front().first) {
                cv_.wait_until(lk, q_.front().first);
                continue;
            }
            auto held = std::move(q_.front().second);
            q_.pop_front();
            lk.unlock();
            held->release();
            lk.lock();
        }
    }
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::pair<std::chrono::steady_clock::time_point, std::shared_ptr<engine::HeldEvents>>> q_;
    bool stop_ = false;
    std::thread thread_;
};

using engine::ControlCommand;
using engine::ControlOp;
using engine::ControlResult;

/// Post `cmd` and wait for the engine's answer. At the gate's deadline a command not yet
/// started is withdrawn (the gate's CAS decides, so the answer is the truth); one that started is
/// waited for until `timeout_s` after `received`.
ControlResult run_engine(engine::Engine & engine, ControlCommand cmd, std::chrono::steady_clock::time_point received, double timeout_s) {
    const auto gate  = cmd.gate;
    const auto what  = std::string(wire_name(cmd.op));
    // (+2 s: a pause mode=wait answers `timeout` itself at the gate's deadline; that answer wins)
    const auto limit = std::max(gate->deadline() + std::chrono::seconds(2),
                                received + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s)));
    auto fut = engine.control(std::move(cmd));
    if (fut.wait_until(gate->deadline()) != std::future_status::ready) {
        if (gate->cancel()) {
            fail(Errc::timeout, "{} was not started before the caller's deadline (fdctl's --timeout; over HTTP X-Request-Timeout / "
                                "X-Request-Deadline; else --control-timeout-s {} s): withdrawn, it will not run; nothing changed", what, timeout_s);
        }
        if (fut.wait_until(limit) != std::future_status::ready) {
            // The bound actually waited, not the flag alone (a probe: "within 2 s" after 3 s).
            const double waited = std::chrono::duration<double>(limit - received).count();
            fail(Errc::timeout, "{} started but did not finish within {:.1f} s of its receipt (the later of the request's deadline + 2 s "
                                "and --control-timeout-s {} s): it is still running and may still take effect; check /health", what, waited,
                 timeout_s);
        }
    }
    return fut.get();
}

}  // namespace

ControlService::ControlService(ControlConfig cfg, engine::Engine & engine) : cfg_(std::move(cfg)), engine_(engine) {}

ControlOutcome ControlService::run(const shm::MailboxCommand & wire, std::shared_ptr<engine::StartGate> gate) {
    ControlCommand cmd;
    try {
        cmd = parse_command(wire);
    } catch (const Error & e) {
        ControlOutcome o;
        o.error = e;
        return o;
    }
    cmd.gate = std::move(gate);
    return run(std::move(cmd));
}

ControlReply ControlService::handle(const shm::MailboxCommand & wire, std::shared_ptr<engine::StartGate> gate) {
    return render_v1(run(wire, std::move(gate)));
}

ControlOutcome ControlService::run(ControlCommand cmd) {
    const ControlOp op = cmd.op;
    try {
        ControlOutcome o = run_checked(std::move(cmd));
        // The reply is decided: the aborted requests' final events go once it is out (the
        // explicit ack: DelayedRelease), whatever the transport.
        if (o.result.held) { DelayedRelease::instance().add(std::move(o.result.held)); }
        return o;
    } catch (const Error & e) {
        return {.op = op, .error = e};
    } catch (const std::exception & e) {
        return {.op = op, .error = Error(Errc::internal, e.what())};
    }
}

ControlOutcome ControlService::run_checked(ControlCommand cmd) {
    const auto received = std::chrono::steady_clock::now();
    if (!cmd.gate) {
        cmd.gate = std::make_shared<engine::LocalStartGate>(
            received + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(cfg_.control_timeout_s)));
    }
    ControlOutcome o{.op = cmd.op};
    auto on_engine = [&](ControlCommand c) {
        o.op = c.op;
        // Whenever the engine finishes it (also after we stopped waiting), the legacy word follows the state.
        c.on_done = [this](const ControlResult &) { legacy_.settle(engine_.stats().state); };
        o.result = run_engine(engine_, std::move(c), received, cfg_.control_timeout_s);
        if (o.result.error) { o.error = o.result.error; }
        return o;
    };
    switch (cmd.op) {
        case ControlOp::is_paused: o.state = engine_.stats().state; return o;
        case ControlOp::status: o.status = status_report(); return o;
        case ControlOp::sleep:
        case ControlOp::wakeup:
        case ControlOp::update_weights:
        case ControlOp::commit_weights:
        case ControlOp::drop_staged_weights:
            if (!cfg_.dynamic_load_weight) {
                fail(Errc::not_found, "/v1/{} needs dynamic weight loading; start fdrollout with --dynamic-load-weight", wire_name(cmd.op));
            }
            return on_engine(std::move(cmd));
        case ControlOp::pause:
        case ControlOp::resume:
        case ControlOp::flush_cache:
        case ControlOp::abort_request: return on_engine(std::move(cmd));
        case ControlOp::clear_load_weight:
        case ControlOp::update_model_weight: break;
    }
    // The legacy pair (SPEC §4).
    if (!cfg_.dynamic_load_weight) {
        o.legacy = LegacyAnswer{.http_status = 404, .msg = "Dynamic Load Weight Disabled.", .disabled = true};
        return o;
    }
    const bool clear = cmd.op == ControlOp::clear_load_weight;
    if (cfg_.v1_update_weights) {
        return on_engine(ControlCommand{.op = clear ? ControlOp::sleep : ControlOp::wakeup, .tags = {true, true}, .gate = cmd.gate});
    }
    // The legacy pair moves the status word itself: same rule, it starts only before the deadline.
    if (!cmd.gate->start()) {
        fail(Errc::timeout, "{} was not started before the request's deadline: withdrawn, nothing changed", wire_name(cmd.op));
    }
    o.legacy = run_legacy(engine_, legacy_, cmd.op, cfg_.legacy_timeout_s);
    return o;
}

StatusReport ControlService::status_report() const {
    StatusReport s;
    s.stats                = engine_.stats();
    s.draining             = engine_.draining();
    s.model                = cfg_.served_model_name;
    s.compute_dtype        = engine_.config().compute_dtype;
    s.model_weights_status = legacy_.status();
    s.rss_bytes            = process_rss_bytes() + engine_.rank_processes_rss_bytes();  // the daemon and its rank processes
    s.devices              = engine_.rank_devices();
    // Its `op` is the one the phase recorded when it began, not the engine state read a moment
    // earlier (that read can predate the operation's start: `op` would be null).
    s.progress = Progress::current().snapshot();
    s.taken    = std::chrono::steady_clock::now();
    return s;
}

nlohmann::json ControlService::status_json() const { return control::status_json(status_report()); }

}  // namespace fd::control
