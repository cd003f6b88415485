// fd/control/shm_watcher.h — the daemon side of the shared-memory control block (SPEC §6).
//
// Owns the block of one port: creates it at start (reclaiming a stale one, refusing if a live
// daemon owns it), removes it on clean exit. Threads:
//   - heartbeat: every 100 ms refreshes heartbeat_ms and the state snapshot (seqlock);
//   - one per mailbox slot (shm::kMailboxSlots): sleeps on the doorbell futex; on a command in
//     its slot it reads the slot's fields in wire form (control::read_mailbox), calls the
//     control service (the same code the V1 HTTP routes call, which takes concurrent calls as
//     HTTP makes them), writes the rendered V1 answer and acknowledges. So a long call in one
//     slot (pause --mode wait) never holds up a status or an abort in another.
// The service's legacy status word lives in this block while the watcher runs (attached at
// construction, detached at stop).
// It never mutates engine state itself: every operation goes through the engine inbox.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "fd/control/service.h"
#include "fd/engine/engine.h"
#include "fd/shm/control_client.h"

#include <atomic>
#include <mutex>
#include <thread>

namespace fd::control {

class ShmWatcher {
public:
    /// Take over `block` (from shm::MappedBlock::create(port), done before the model loads so a
    /// taken port fails fast) and attach the service's legacy status word to it. Commands go to
    /// `service`, which must outlive the watcher.
    ShmWatcher(shm::MappedBlock block, int port, engine::Engine & engine, ControlService & service);
    ~ShmWatcher();

    /// Add `key` to every mailbox `status` answer (before start()): `json_text()` gives its value
    /// as JSON text, as /health adds it (the weight stream's state: "weight_stream"). An answer
    /// that would then outgrow the block's result (kResultCap) goes without it (logged).
    void add_status_field(std::string key, std::function<std::string()> json_text);

    void start();
    /// Stop both threads and remove the block.
    void stop();

private:
    void heartbeat_loop();
    void mailbox_loop(int slot);
    void publish();
    void add_status_fields(ControlReply & r) const;  ///< status_fields_ into a status answer's body

    int                port_;
    engine::Engine &   engine_;
    ControlService &   service_;
    shm::MappedBlock   block_;
    std::atomic<bool>  stop_{false};
    std::thread        heartbeat_;
    std::vector<std::thread> mailbox_;   ///< one per slot
    std::mutex         publish_mu_;      ///< publish() is the seqlock's one writer at a time
    std::vector<std::pair<std::string, std::function<std::string()>>> status_fields_;
};

}  // namespace fd::control
