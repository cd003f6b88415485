#include "fd/control/shm_watcher.h"

#include "fd/control/request.h"
#include "fd/log.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>

namespace fd::control {
namespace {

/// The mailbox command `seq`'s start/cancel handshake, in its slot (see fd/shm/control_block.h):
/// the same CAS fdctl withdraws it with, so exactly one side wins.
class BlockStartGate final : public engine::StartGate {
public:
    BlockStartGate(shm::MappedBlock block, int slot, uint32_t seq) : block_(std::move(block)), b_(block_->mailbox[slot]), seq_(seq) {}
    bool start() override { return shm::try_start_command(b_, seq_); }
    bool cancel() override { return shm::try_cancel_command(b_, seq_); }
    std::chrono::steady_clock::time_point deadline() const override {
        // steady_clock is CLOCK_MONOTONIC, the clock fdctl wrote the deadline in.
        return std::chrono::steady_clock::time_point(std::chrono::nanoseconds(b_.cmd_deadline_ns));
    }

private:
    shm::MappedBlock    block_;  ///< keeps the mapping alive while the engine may still hold the command
    shm::MailboxSlot &  b_;
    uint32_t            seq_;
};

}  // namespace

ShmWatcher::ShmWatcher(shm::MappedBlock block, int port, engine::Engine & engine, ControlService & service)
    : port_(port), engine_(engine), service_(service), block_(std::move(block)) {
    block_->v1_update_weights.store(service_.config().v1_update_weights ? 1 : 0);
    service_.legacy_word().attach(&block_->legacy_status);
    publish();
    log::get("control")->info("control block /dev/shm/{} ready (mode 0600)", shm::block_name(port));
}

ShmWatcher::~ShmWatcher() { stop(); }

void ShmWatcher::add_status_field(std::string key, std::function<std::string()> json_text) {
    status_fields_.emplace_back(std::move(key), std::move(json_text));
}

void ShmWatcher::start() {
    heartbeat_ = std::thread([this] { heartbeat_loop(); });
    for (int i = 0; i < shm::kMailboxSlots; ++i) { mailbox_.emplace_back([this, i] { mailbox_loop(i); }); }
}

void ShmWatcher::stop() {
    if (stop_.exchange(true)) { return; }
    shm::futex_wake(block_->doorbell);
    if (heartbeat_.joinable()) { heartbeat_.join(); }
    for (auto & t : mailbox_) { t.join(); }
    service_.legacy_word().detach();  // the word outlives the block (commands finishing at shutdown settle it)
    block_->pid.store(0);
    shm::MappedBlock::remove(port_);
}

void ShmWatcher::publish() {
    const auto st = engine_.stats();
    shm::StateSnapshot s{};
    s.paused               = st.state.paused;
    s.weight_asleep        = st.state.weight_asleep;
    s.kv_asleep            = st.state.kv_asleep;
    s.weights_valid        = st.state.weights_valid;
    s.draining             = engine_.draining();
    s.model_weights_status = block_->legacy_status.load();
    s.n_running            = static_cast<int32_t>(st.n_running);
    s.published_ms         = shm::now_ms();
    std::strncpy(s.weight_version, st.state.weight_version.c_str(), sizeof s.weight_version - 1);
    shm::publish_state(*block_, s);
    block_->heartbeat_ms.store(shm::now_ms());
}

void ShmWatcher::heartbeat_loop() {
    while (!stop_.load()) {
        {
            std::lock_guard lk(publish_mu_);
            publish();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
}

void ShmWatcher::add_status_fields(ControlReply & r) const {
    try {
        nlohmann::json body = nlohmann::json::parse(r.body);
        if (!body.is_object()) { return; }
        for (const auto & [key, fn] : status_fields_) { body[key] = nlohmann::json::parse(fn()); }
        std::string text = body.dump();
        if (text.size() >= shm::kResultCap) {
            log::get("control")->warn("status over shm: {} B with the added fields outgrows the control block's {} B; answered without them",
                                      text.size(), shm::kResultCap);
            return;
        }
        r.body = std::move(text);
    } catch (const std::exception & e) {
        log::get("control")->warn("status over shm: could not add the extra fields: {}", e.what());
    }
}

void ShmWatcher::mailbox_loop(int slot) {
    auto & b = block_->mailbox[slot];
    uint32_t rung = block_->doorbell.load();
    while (!stop_.load()) {
        shm::futex_wait(block_->doorbell, rung, 100000);
        rung = block_->doorbell.load(std::memory_order_acquire);
        const uint32_t seq = b.cmd_seq.load(std::memory_order_acquire);
        if (seq == b.ack_seq.load()) { continue; }
        const shm::MailboxCommand cmd = read_mailbox(b);
        ControlReply r;
        if (!shm::command_pending(b, seq)) {
            // fdctl withdrew it, or its deadline passed while we were stopped or busy: never run it.
            shm::try_cancel_command(b, seq);
            log::get("control")->warn("dropped mailbox command '{}': its caller's deadline passed (or it gave up) before it could start; not run",
                                      cmd.op);
            r = error_reply(Error(Errc::timeout, fmt::format("{} was not started before the caller's deadline: dropped, nothing changed", cmd.op)));
        } else {
            r = service_.handle(cmd, std::make_shared<BlockStartGate>(block_, slot, seq));
            if (cmd.op == "status" && r.http_status == 200 && !status_fields_.empty()) { add_status_fields(r); }
        }
        {
            std::lock_guard lk(publish_mu_);
            publish();  // the snapshot reflects the command before the client sees the answer
        }
        const size_t n = std::min(r.body.size(), shm::kResultCap - 1);
        std::memcpy(b.result_body, r.body.data(), n);
        b.result_body[n]     = '\0';
        b.result_len         = static_cast<uint32_t>(n);
        b.result_http_status = r.http_status;
        b.ack_seq.store(seq, std::memory_order_release);
        shm::futex_wake(b.ack_seq);
    }
}

}  // namespace fd::control
