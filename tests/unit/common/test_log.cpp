// fd::log's JSON formatter (daemon/src/log.cpp): each record is one line that a real JSON
// parser (nlohmann) reads back to the same fields, whatever the message holds; and the
// throughput line (daemon/src/api/throughput_logger.cpp) computed from two stats snapshots.
#include "fd/api/throughput_logger.h"
#include "fd/log.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <ctime>
#include <string>

TEST_CASE("json log lines parse back to the logged fields") {
    auto f = fd::log::make_json_formatter();
    const std::string nasty = "quote \" backslash \\ newline \n tab \t bell \x07 utf-8 \xc3\xa9 {braces} %v";
    spdlog::details::log_msg msg(spdlog::source_loc{}, "access", spdlog::level::warn, nasty);
    spdlog::memory_buf_t buf;
    f->format(msg, buf);
    const std::string line(buf.data(), buf.size());
    REQUIRE(line.back() == '\n');
    CHECK(line.find('\n') == line.size() - 1);  // exactly one line
    const auto j = nlohmann::json::parse(line);
    CHECK(j.at("msg").get<std::string>() == nasty);
    CHECK(j.at("logger") == "access");
    CHECK(j.at("level") == "warning");
    CHECK(j.at("pid").is_number_integer());
    // the time is the record's, in UTC, to the millisecond
    const auto secs = std::chrono::duration_cast<std::chrono::seconds>(msg.time.time_since_epoch()).count();
    const std::time_t t = secs;
    std::tm tm{};
    gmtime_r(&t, &tm);
    char want[32];
    std::strftime(want, sizeof want, "%Y-%m-%dT%H:%M:%S", &tm);
    CHECK(j.at("time").get<std::string>().substr(0, 19) == want);
    CHECK(j.at("time").get<std::string>().size() == 24);  // ...SS.mmmZ
}

TEST_CASE("setup refuses an unknown format or level") {
    CHECK_THROWS_AS(fd::log::setup("info", "xml"), fd::Error);
    CHECK_THROWS_AS(fd::log::setup("loud", "text"), fd::Error);
}

TEST_CASE("the throughput line is rates over the interval, silent when idle") {
    fd::engine::EngineStats a, b;
    CHECK(fd::api::ThroughputLogger::format_line(a, b, 10.0).empty());
    b.n_tokens_prompt_total    = 500;
    b.n_tokens_generated_total = 2000;
    b.n_running = 3;
    b.n_kv_blocks_used  = 25;
    b.n_kv_blocks_total = 200;
    b.n_requests_total  = 4;
    b.state.weight_version = "v7";
    CHECK(fd::api::ThroughputLogger::format_line(a, b, 10.0) ==
          "throughput: prompt 50.0 tok/s, generation 200.0 tok/s | running 3, waiting 0 | KV 12.5% used | new requests 4 | weight_version v7");
    a = b;  // nothing moved, but requests still run: still worth a line
    CHECK_FALSE(fd::api::ThroughputLogger::format_line(a, b, 10.0).empty());
}
