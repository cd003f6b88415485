// The HTTP layer's own pieces that need no socket: query parsing, header lookup, the handler
// pool, and the result channel's notify hook the async bodies ride on.
#include "../../../daemon/src/api/http/handler_pool.h"
#include "../../../daemon/src/api/http/http_message.h"

#include "fd/engine/request.h"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

using namespace fd::api;

TEST_CASE("parse_query decodes %XX and '+', keeps repeats and empty values") {
    const auto q = parse_query("tags=weight%2Ckv_cache&a+b=c+d&flag&tags=x&=v&&e=%zz%4");
    REQUIRE(q.count("tags") == 2);
    auto [lo, hi] = q.equal_range("tags");
    CHECK(lo->second == "weight,kv_cache");
    CHECK(std::next(lo)->second == "x");
    CHECK(q.find("a b")->second == "c d");
    CHECK(q.find("flag")->second == "");
    CHECK(q.find("")->second == "v");
    CHECK(q.find("e")->second == "%zz%4");  // malformed escapes are kept as sent
    CHECK(parse_query("").empty());
    CHECK(url_decode("a+b%20c", false) == "a+b c");
}

TEST_CASE("Request and Response headers are case-insensitive") {
    Request req;
    req.headers.emplace("Content-Type", "application/json");
    CHECK(req.has_header("content-type"));
    CHECK(req.get_header_value("CONTENT-TYPE") == "application/json");
    CHECK(req.get_header_value("Authorization").empty());
    req.params = parse_query("tags=a&tags=b");
    CHECK(req.get_param_value_count("tags") == 2);
    CHECK(req.get_param_value("tags") == "a");

    Response res;
    res.set_content("{}", "application/json");
    res.set_header("content-type", "text/plain");
    CHECK(res.headers.size() == 1);
    CHECK(res.get_header_value("Content-Type") == "text/plain");
    CHECK(res.body == "{}");
}

TEST_CASE("HandlerPool grows while every thread is busy, up to its cap, and stop joins") {
    HandlerPool pool("test-pool", 1, 4);
    CHECK(pool.n_threads() == 1);
    std::promise<void> release;
    std::shared_future<void> gate = release.get_future().share();
    std::atomic<int> started{0};
    for (int i = 0; i < 6; ++i) {
        pool.post([&, gate] {
            ++started;
            gate.wait();
        });
    }
    for (int i = 0; i < 500 && started.load() < 4; ++i) { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }
    CHECK(started.load() == 4);  // four blocked tasks hold all four threads; two queue
    CHECK(pool.n_threads() == 4);
    release.set_value();
    for (int i = 0; i < 500 && started.load() < 6; ++i) { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }
    CHECK(started.load() == 6);
    pool.stop();
    pool.post([&] { ++started; });  // dropped after stop
    CHECK(started.load() == 6);
}

TEST_CASE("ResultChannel notify fires per event when streaming, per finishing event otherwise") {
    using fd::engine::ChoiceEvent;
    using fd::engine::FinishReason;
    for (const bool stream : {true, false}) {
        fd::engine::ResultChannel ch(2, stream);
        int n = 0;
        ch.push(ChoiceEvent{.choice = 0});  // before set_notify: no call (the reader pops once after subscribing)
        ch.set_notify([&] { ++n; });
        ch.push(ChoiceEvent{.choice = 0});
        ch.push(ChoiceEvent{.choice = 0, .finish = FinishReason::length});
        ch.push(ChoiceEvent{.choice = 1, .finish = FinishReason::stop});
        CHECK(n == (stream ? 3 : 2));
        CHECK(ch.pop_all(std::chrono::milliseconds(0)).size() == 4);
        CHECK(ch.done());
        ch.set_notify(nullptr);
        ch.push(ChoiceEvent{.choice = 0, .finish = FinishReason::stop});
        CHECK(n == (stream ? 3 : 2));
    }
}
