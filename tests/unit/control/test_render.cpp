// control::render_v1 / render_error / status_json: a typed outcome into each shape, against
// hand-written bodies (SPEC §3, §4; docs/peer_aliases.md): a renamed or dropped field fails here.
#include "fd/control/render.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

using fd::control::ControlOutcome;
using fd::control::Peer;
using fd::engine::ControlOp;
using nlohmann::json;

namespace {

json body(const fd::control::ControlReply & r) {
    CHECK(r.content_type == "application/json");
    return json::parse(r.body);
}

/// An update_weights rank entry: fetch + stage (sync_cost) 0.25 s, commit (update_cost) 0.5 s.
fd::runtime::RankReport update_cost(int32_t rank) {
    return {.rank = rank, .version = "v7", .bytes = 1000 + rank, .fetch_s = 0.125, .stage_s = 0.125, .commit_s = 0.5, .rss_bytes = 4096};
}

}  // namespace

TEST_CASE("render: pause / abort results, V1 shape") {
    ControlOutcome o{.op = ControlOp::pause};
    o.result.is_paused = true;
    o.result.elapsed_s = 0.5;
    o.result.pause_mode = fd::engine::PauseMode::keep;
    o.result.n_kept = 3;
    auto r = fd::control::render_v1(o);
    CHECK(r.http_status == 200);
    CHECK(body(r) == json::parse(R"({"status":"success","result":{"is_paused":true,"elapsed_s":0.5,"mode":"keep","aborted":0,"kept":3,"tier_copies_waited":0}})"));
    o.result.pause_mode = fd::engine::PauseMode::wait;
    o.result.n_drained = 2;
    CHECK(body(fd::control::render_v1(o))["result"] ==
          json::parse(R"({"is_paused":true,"elapsed_s":0.5,"mode":"wait","aborted":0,"drained":2,"tier_copies_waited":0})"));
    ControlOutcome a{.op = ControlOp::abort_request};
    a.result.n_aborted = 4;
    CHECK(body(fd::control::render_v1(a))["result"] == json::parse(R"({"is_paused":false,"elapsed_s":0.0,"aborted":4})"));
}

TEST_CASE("render: sleep, wakeup, update, commit, drop, flush results, V1 shape") {
    ControlOutcome s{.op = ControlOp::sleep};
    s.result.tags_done = {"kv_cache", "weight"};
    s.result.freed_weight_bytes = 100;
    s.result.freed_kv_bytes = 50;
    s.result.rss_before_bytes = 9;
    s.result.rss_after_bytes = 8;
    s.result.ranks = {{.rank = 0, .freed_bytes = 75, .rss_bytes = 7}};
    CHECK(body(fd::control::render_v1(s))["result"] == json::parse(R"({"is_paused":false,"elapsed_s":0.0,"tags":["kv_cache","weight"],
        "skipped":[],"freed_bytes":{"weight":100,"kv_cache":50},"aborted":0,"rss_before_bytes":9,"rss_after_bytes":8,
        "ranks":[{"rank":0,"rss_bytes":7,"freed_bytes":75}]})"));
    // expert parallel (issue 23): sleep(weight) also reports the dispatch/combine buffers it freed
    s.result.freed_ep_buffer_bytes = 30;
    CHECK(body(fd::control::render_v1(s))["result"]["freed_bytes"] == json::parse(R"({"weight":100,"kv_cache":50,"ep_buffer":30})"));

    ControlOutcome u{.op = ControlOp::update_weights};
    u.result.is_paused = true;
    u.result.version = "v7";
    u.result.bytes = 2001;
    u.result.checksum_verified = true;
    u.result.staged = true;
    u.result.ranks = {update_cost(0), update_cost(1)};
    CHECK(body(fd::control::render_v1(u))["result"] == json::parse(R"({"is_paused":true,"elapsed_s":0.0,"version":"v7","bytes":2001,
        "checksum_verified":true,"staged":true,"ranks":[
        {"rank":0,"rss_bytes":4096,"version":"v7","bytes":1000,"sync_cost":0.25,"update_cost":0.5,"total_cost":0.75},
        {"rank":1,"rss_bytes":4096,"version":"v7","bytes":1001,"sync_cost":0.25,"update_cost":0.5,"total_cost":0.75}]})"));

    ControlOutcome w{.op = ControlOp::wakeup};
    w.result.tags_done = {"weight"};
    w.result.tags_skipped = {"kv_cache"};
    w.result.version = "v7";
    w.result.bytes = 12;
    CHECK(body(fd::control::render_v1(w))["result"] == json::parse(R"({"is_paused":false,"elapsed_s":0.0,"tags":["weight"],
        "skipped":["kv_cache"],"version":"v7","bytes":12,"ranks":[]})"));

    ControlOutcome c{.op = ControlOp::commit_weights};
    c.result.version = "v8";
    CHECK(body(fd::control::render_v1(c))["result"] == json::parse(R"({"is_paused":false,"elapsed_s":0.0,"version":"v8","ranks":[]})"));

    ControlOutcome d{.op = ControlOp::drop_staged_weights};
    CHECK(body(fd::control::render_v1(d))["result"]["dropped_version"].is_null());
    d.result.version = "v9";
    CHECK(body(fd::control::render_v1(d))["result"]["dropped_version"] == "v9");

    ControlOutcome f{.op = ControlOp::flush_cache};
    f.result.n_host_blocks_flushed = 5;
    CHECK(body(fd::control::render_v1(f))["result"] == json::parse(R"({"is_paused":false,"elapsed_s":0.0,"host_blocks_flushed":5})"));
    CHECK(body(fd::control::render_v1(ControlOutcome{.op = ControlOp::resume}))["result"] ==
          json::parse(R"({"is_paused":false,"elapsed_s":0.0})"));
}

TEST_CASE("render: is_paused answers both FastDeploy forms; legacy answers FastDeploy's") {
    ControlOutcome q{.op = ControlOp::is_paused};
    q.state = fd::engine::EngineState{.paused = true, .kv_asleep = true, .weights_valid = true, .weight_version = "v3"};
    const json inner = json::parse(R"({"is_paused":true,"pause_draining":false,"sleeping_tags":["kv_cache"],"weights_valid":true,"weight_version":"v3"})");
    json want = inner;
    want["result"] = inner;
    want["status"] = "success";
    CHECK(body(fd::control::render_v1(q)) == want);

    ControlOutcome l{.op = ControlOp::clear_load_weight, .legacy = fd::control::LegacyAnswer{404, "clear model weight timeout", "sleep: boom"}};
    auto r = fd::control::render_v1(l);
    CHECK(r.http_status == 404);
    CHECK(body(r) == json::parse(R"({"msg":"clear model weight timeout","error":"sleep: boom"})"));
    CHECK_FALSE(l.ok());
    l.legacy = fd::control::LegacyAnswer{200, "model weight is cleared"};
    CHECK(body(fd::control::render_v1(l)) == json::parse(R"({"msg":"model weight is cleared"})"));
    CHECK(l.ok());
    l.legacy = fd::control::LegacyAnswer{.http_status = 404, .msg = "Dynamic Load Weight Disabled.", .disabled = true};
    r = fd::control::render_v1(l);
    CHECK(r.http_status == 404);
    CHECK(body(r) == json::parse(R"({"error":{"message":"Dynamic Load Weight Disabled.","type":"not_found","param":null,
        "code":"dynamic_load_weight_disabled"}})"));
}

TEST_CASE("render: an error, in V1 and in each peer's shape, with the table's status") {
    ControlOutcome e{.op = ControlOp::update_weights, .error = fd::Error(fd::Errc::wrong_state, "pause first")};
    CHECK_FALSE(e.ok());
    CHECK(fd::control::http_status(e) == 409);
    CHECK(fd::control::error_message(e) == "pause first");
    auto v1 = fd::control::render_v1(e);
    CHECK(v1.http_status == 409);
    CHECK(body(v1) == json::parse(R"({"status":"error","error":{"type":"wrong_state","message":"pause first"}})"));
    auto vllm = fd::control::render_error(e, Peer::vllm);
    CHECK(vllm.http_status == 409);
    CHECK(body(vllm) == json::parse(R"({"error":"pause first"})"));
    auto sglang = fd::control::render_error(e, Peer::sglang);
    CHECK(sglang.http_status == 409);
    CHECK(body(sglang) == json::parse(R"({"error":{"message":"pause first"}})"));
    auto fdr = fd::control::render_error(ControlOutcome{.error = fd::Error(fd::Errc::timeout, "late")}, Peer::fdrollout);
    CHECK(fdr.http_status == 504);
    CHECK(body(fdr) == json::parse(R"({"status":"error","error":{"type":"timeout","message":"late"}})"));
    ControlOutcome ok{.op = ControlOp::resume};
    CHECK(fd::control::http_status(ok) == 200);
    CHECK(fd::control::error_message(ok).empty());
}

TEST_CASE("render: status_json names the state, the legacy word and the counts") {
    fd::control::StatusReport s;
    s.stats.state.paused = true;
    s.stats.state.weight_asleep = true;
    s.stats.state.weight_version = "v5";
    s.stats.state.staged_version = "v6";
    s.stats.n_running = 2;
    s.stats.n_kv_blocks_used = 3;
    s.stats.n_kv_blocks_free = 5;
    s.stats.n_kv_blocks_total = 8;
    s.model = "m";
    s.model_weights_status = fd::shm::WeightsStatus::cleared;
    s.rss_bytes = 123;
    const json j = fd::control::status_json(s);
    CHECK(j["status"] == "ok");
    CHECK(j["state"] == "sleeping");
    CHECK(j["is_paused"] == true);
    CHECK(j["pause_mode"] == "abort");
    CHECK(j["sleeping_tags"] == json::array({"weight"}));
    CHECK(j["weight_version"] == "v5");
    CHECK(j["staged_weight_version"] == "v6");
    CHECK(j["model_weights_status"] == -2);
    CHECK(j["model"] == "m");
    CHECK(j["num_requests_running"] == 2);
    CHECK(j["kv_blocks"] == json::parse(R"({"used":3,"free":5,"total":8})"));
    CHECK(j["rss_bytes"] == 123);
    CHECK(j["device_memory"].is_null());
    CHECK(j["progress"].is_null());
    CHECK(j["expert_parallel_size"] == 1);
    CHECK(j["comm_group_on_weight_sleep"].is_null());  // no group (uni)
    s.stats.state.comm_group = "connected";
    s.stats.state.expert_parallel_size = 2;
    s.stats.state.comm_group_kept_on_sleep = true;
    CHECK(fd::control::status_json(s)["comm_group_on_weight_sleep"] == "kept");
    CHECK(fd::control::status_json(s)["expert_parallel_size"] == 2);
    s.stats.state.comm_group_kept_on_sleep = false;
    CHECK(fd::control::status_json(s)["comm_group_on_weight_sleep"] == "destroyed");
    s.draining = true;
    CHECK(fd::control::status_json(s)["state"] == "draining");
}
