// fd/api/throughput_logger.h — the periodic throughput line (vLLM's "Avg prompt throughput"):
//   throughput: prompt 812.4 tok/s, generation 1520.3 tok/s | running 12, waiting 0 | KV 37.5% used | new requests 40 | weight_version 7
// logged at info by the `stats` logger every `interval_s` while there is work (tokens moved
// since the last line, or requests running or waiting); an idle daemon logs nothing.
// Owns one thread that only reads Engine::stats().
#pragma once

#include "fd/engine/engine.h"

#include <condition_variable>
#include <mutex>
#include <thread>

namespace fd::api {

class ThroughputLogger {
public:
    /// `interval_s` <= 0: never logs (start() does nothing).
    ThroughputLogger(const engine::Engine & engine, double interval_s) : engine_(engine), interval_s_(interval_s) {}
    ~ThroughputLogger() { stop(); }

    void start();
    /// Wakes and joins the thread (at most one line more).
    void stop();

    /// The line for two stats snapshots `dt_s` seconds apart, or "" when nothing happened.
    static std::string format_line(const engine::EngineStats & before, const engine::EngineStats & now, double dt_s);

private:
    const engine::Engine &  engine_;
    double                  interval_s_;
    std::mutex              mu_;
    std::condition_variable cv_;
    bool                    stop_ = false;
    std::thread             thread_;
};

}  // namespace fd::api
