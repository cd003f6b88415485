// control::parse_command — the one validation of a control command, whichever transport carried it.
#include "fd/control/render.h"
#include "fd/control/request.h"

#include <doctest/doctest.h>

using fd::control::parse_command;
using fd::engine::ControlOp;
using fd::shm::MailboxCommand;

namespace {

/// The param() of the error parse(wire) throws ("" if it does not throw).
std::string rejected_param(const MailboxCommand & wire) {
    try {
        parse_command(wire);
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::invalid_argument);
        return e.param();
    }
    return "";
}

}  // namespace

TEST_CASE("control request: every wire op name maps to its verb and back") {
    for (const char * op : {"pause", "resume", "is_paused", "status", "sleep", "wakeup", "update_weights", "commit_weights",
                            "drop_staged_weights", "flush_cache", "clear_load_weight", "update_model_weight"}) {
        const auto r = parse_command({.op = op});
        CHECK(fd::engine::wire_name(r.op) == op);
    }
    CHECK(rejected_param({.op = "pause_all"}) == "op");
    CHECK(rejected_param({.op = ""}) == "op");
}

TEST_CASE("control request: tags only for sleep/wakeup, empty = both, unknown tag refused") {
    auto both = parse_command({.op = "sleep"});
    CHECK(both.tags.weight);
    CHECK(both.tags.kv_cache);
    auto kv = parse_command({.op = "wakeup", .tags = " kv_cache "});
    CHECK(!kv.tags.weight);
    CHECK(kv.tags.kv_cache);
    CHECK(rejected_param({.op = "sleep", .tags = "weight,foo"}) == "tags");
    CHECK(rejected_param({.op = "pause", .tags = "weight"}) == "tags");
    CHECK(!both.tags.cuda_graph);  // no tags = weight + kv_cache, as vLLM and FastDeploy
    auto g = parse_command({.op = "sleep", .tags = "cuda_graph"});
    CHECK((!g.tags.weight && !g.tags.kv_cache && g.tags.cuda_graph));
    CHECK(rejected_param({.op = "sleep", .tags = "cuda_graphs"}) == "tags");
    // a non-empty list naming no tag is malformed (the empty text alone means weight + kv_cache)
    CHECK(rejected_param({.op = "sleep", .tags = ",,,"}) == "tags");
    CHECK(rejected_param({.op = "sleep", .tags = " "}) == "tags");
    CHECK(rejected_param({.op = "wakeup", .tags = ", ,"}) == "tags");
}

TEST_CASE("control request: TagSet text is the wire's tags, in one order, and parses back") {
    using fd::engine::TagSet;
    CHECK(TagSet{}.text().empty());
    CHECK(TagSet::all().text() == "weight,kv_cache,cuda_graph");
    CHECK(TagSet{false, true, true}.text() == "kv_cache,cuda_graph");
    for (const TagSet t : {TagSet{true, false, false}, TagSet{false, true, false}, TagSet{false, false, true}, TagSet{true, false, true},
                           TagSet::all()}) {
        const TagSet back = fd::engine::parse_tags(t.text());
        CHECK((back.weight == t.weight && back.kv_cache == t.kv_cache && back.cuda_graph == t.cuda_graph));
    }
    const TagSet dup = fd::engine::parse_tags(" cuda_graph, weight ,cuda_graph");
    CHECK(dup.text() == "weight,cuda_graph");
}

TEST_CASE("control request: version syntax is checked here, for update_weights only") {
    auto r = parse_command({.op = "update_weights", .version = "step-42.a_b", .verify_checksum = true});
    CHECK(r.op == ControlOp::update_weights);
    CHECK(*r.version == "step-42.a_b");
    CHECK(r.verify_checksum);
    CHECK(!parse_command({.op = "update_weights"}).version);
    for (const char * bad : {"", ".", "..", "a/b", "v 1", "v\n1"}) {
        CHECK(rejected_param({.op = "update_weights", .version = std::string(bad)}) == "version");
    }
    CHECK(rejected_param({.op = "update_weights", .version = std::string(129, 'a')}) == "version");
    CHECK(rejected_param({.op = "pause", .version = std::string("1")}) == "version");
    CHECK(rejected_param({.op = "sleep", .verify_checksum = true}) == "verify_checksum");
}

TEST_CASE("control request: two-phase update fields") {
    auto stage = parse_command({.op = "update_weights", .version = std::string("v2"), .commit = false});
    CHECK(!stage.commit);
    CHECK(parse_command({.op = "update_weights"}).commit);  // the default (and older shm clients) commit
    auto commit = parse_command({.op = "commit_weights", .version = std::string("v2")});
    CHECK(commit.op == ControlOp::commit_weights);
    CHECK(*commit.version == "v2");
    CHECK(!parse_command({.op = "commit_weights"}).version);
    CHECK(rejected_param({.op = "commit_weights", .version = std::string("a/b")}) == "version");
    CHECK(rejected_param({.op = "commit_weights", .verify_checksum = true}) == "verify_checksum");
    CHECK(rejected_param({.op = "drop_staged_weights", .version = std::string("v2")}) == "version");
    CHECK(rejected_param({.op = "pause", .commit = false}) == "commit");
    CHECK(rejected_param({.op = "flush_cache", .tags = "weight"}) == "tags");
}

TEST_CASE("control request: pause modes, only for pause") {
    using fd::engine::PauseMode;
    CHECK(parse_command({.op = "pause"}).pause_mode == PauseMode::abort);
    CHECK(parse_command({.op = "pause", .mode = "abort"}).pause_mode == PauseMode::abort);
    CHECK(parse_command({.op = "pause", .mode = "wait"}).pause_mode == PauseMode::wait);
    CHECK(parse_command({.op = "pause", .mode = "keep"}).pause_mode == PauseMode::keep);
    CHECK(rejected_param({.op = "pause", .mode = "Keep"}) == "mode");
    CHECK(rejected_param({.op = "pause", .mode = "?"}) == "mode");  // what the watcher makes of an unknown shm byte
    CHECK(rejected_param({.op = "sleep", .mode = "wait"}) == "mode");
    CHECK(rejected_param({.op = "resume", .mode = "keep"}) == "mode");
}

TEST_CASE("control request: abort takes exactly one of request_id and abort_all") {
    auto one = parse_command({.op = "abort", .request_id = "cmpl-0123456789abcdef"});
    CHECK(one.op == ControlOp::abort_request);
    CHECK(one.request_id == "cmpl-0123456789abcdef");
    CHECK(!one.abort_all);
    CHECK(parse_command({.op = "abort", .abort_all = true}).abort_all);
    CHECK(rejected_param({.op = "abort"}) == "request_id");
    CHECK(rejected_param({.op = "abort", .request_id = "x", .abort_all = true}) == "request_id");
    CHECK(rejected_param({.op = "abort", .request_id = "has space"}) == "request_id");
    CHECK(rejected_param({.op = "abort", .request_id = std::string(129, 'a')}) == "request_id");
    CHECK(parse_command({.op = "abort", .request_id = std::string(128, 'a')}).request_id.size() == 128);
    CHECK(rejected_param({.op = "pause", .request_id = "x"}) == "request_id");
    CHECK(rejected_param({.op = "abort", .version = std::string("v1"), .request_id = "x"}) == "version");
}

TEST_CASE("control request: an error reply carries the table's status and type") {
    const auto r = fd::control::error_reply(fd::Error(fd::Errc::invalid_argument, "bad tag", "tags"));
    CHECK(r.http_status == 400);
    CHECK(r.content_type == "application/json");
    CHECK(r.body == R"({"error":{"message":"bad tag","type":"invalid_argument"},"status":"error"})");
}
