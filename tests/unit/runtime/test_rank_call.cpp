// The rank-call table (fd/runtime/rank_call.h) through both executors: `describe`, a rank op
// added as one Worker method (layout) plus one row, answers through the in-process executor
// (uni) and through two rank processes (mp, tp=2) with each rank's own shard; the references are
// the checkpoint's own tensors (HF names and bytes from the safetensors headers) and the
// config's dimensions, not the layout code. The wire: a request's fields and a detail larger
// than one seqpacket record cross a real link.
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/runtime/executor.h"
#include "fd/runtime/mp_executor.h"
#include "fd/status.h"

#include "../../../daemon/src/runtime/mp_wire.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <string>
#include <thread>

using namespace fd;
using json = nlohmann::json;

namespace {

namespace fs = std::filesystem;

const fs::path kModel = fs::path(FD_SOURCE_DIR) / "models/stories260K";

model::WorkerConfig worker_config() { return {.n_threads = 1, .n_blocks = 4, .max_model_len = 64}; }

std::unique_ptr<runtime::Executor> make_uni(const model::ModelConfig & cfg) {
    auto worker = std::make_unique<model::Worker>(cfg, model::read_tensor_index(kModel), worker_config());
    return runtime::make_local_executor(std::move(worker), weights::make_normal_source(kModel));
}

std::unique_ptr<runtime::Executor> make_mp(const model::ModelConfig & cfg, int32_t tp) {
    return runtime::make_mp_executor({.tensor_parallel_size = tp, .model_dir = kModel.string(), .worker = worker_config(),
                                      .source = {.strategy = weights::LoadStrategy::normal, .model_dir = kModel, .tp = tp},
                                      .dist_backend = runtime::DistBackend::gloo, .timeout_s = 60.0, .heartbeat_s = 30.0,
                                      .rank_binary = FDROLLOUT_BIN, .log_level = "warn"},
                                     cfg);
}

/// name -> tensor of one describe detail.
std::map<std::string, json> by_name(const json & d) {
    std::map<std::string, json> out;
    for (const auto & t : d.at("tensors")) { out[t.at("name").get<std::string>()] = t; }
    return out;
}

int64_t sum_bytes(const json & d) {
    int64_t n = 0;
    for (const auto & t : d.at("tensors")) { n += t.at("bytes").get<int64_t>(); }
    return n;
}

}  // namespace

TEST_CASE("rank call: describe on the in-process rank lists every tensor with the checkpoint's bytes and the config's shapes") {
    const auto cfg = model::load_model_config(kModel);
    auto ex = make_uni(cfg);
    const auto reps = ex->rank_call({.op = runtime::RankOp::describe});
    REQUIRE(reps.size() == 1);
    CHECK(reps[0].rank == 0);
    CHECK(reps[0].freed_bytes == -1);
    const json d = json::parse(reps[0].detail);
    CHECK(d.at("rank") == 0);
    CHECK(d.at("tp_size") == 1);
    CHECK(d.at("weight_bytes").get<int64_t>() == ex->weight_bytes());
    // Every byte of the checkpoint is in memory once (stories260K: f32), but for the lm_head.weight
    // it stores beside the embedding that a tied model reads instead.
    REQUIRE(cfg.tie_word_embeddings);
    CHECK(d.at("tied_lm_head") == true);
    const auto idx = model::read_tensor_index(kModel);
    int64_t hf_bytes = 0;
    for (const auto & [name, t] : idx.tensors) {
        if (name != "lm_head.weight") { hf_bytes += t.numel() * model::dtype_size(t.dtype); }
    }
    CHECK(sum_bytes(d) == hf_bytes);
    const auto t = by_name(d);
    const int64_t hidden = cfg.hidden_size, q = cfg.q_dim(), kv = cfg.kv_dim();
    CHECK(t.at("model.embed_tokens.weight").at("shape") == json::array({cfg.vocab_size, hidden}));
    CHECK(t.at("model.layers.0.self_attn.qkv_proj.weight").at("shape") == json::array({q + 2 * kv, hidden}));
    CHECK(t.at("model.layers.0.self_attn.o_proj.weight").at("shape") == json::array({hidden, q}));
    CHECK(t.at("model.layers.0.mlp.gate_up_proj.weight").at("shape") == json::array({2 * cfg.intermediate_size, hidden}));
    CHECK(t.at("model.layers.0.mlp.down_proj.weight").at("shape") == json::array({hidden, cfg.intermediate_size}));
    CHECK(t.at("model.norm.weight").at("shape") == json::array({hidden}));
    CHECK(t.at("model.norm.weight").at("dtype") == "F32");
    // A rank op without a detail answers none.
    CHECK(ex->rank_call({.op = runtime::RankOp::mem_info})[0].detail.empty());
}

TEST_CASE("rank call: describe through two rank processes (mp, tp=2): each rank its own shard, together the in-process rank's tensors") {
    const auto cfg = model::load_model_config(kModel);
    const json whole = json::parse(make_uni(cfg)->rank_call({.op = runtime::RankOp::describe})[0].detail);
    auto ex = make_mp(cfg, 2);
    const auto reps = ex->rank_call({.op = runtime::RankOp::describe});
    REQUIRE(reps.size() == 2);
    const auto w = by_name(whole);
    int64_t sharded_whole = 0, replicated_whole = 0;
    for (const auto & [name, t] : w) { (t.at("shard") == "replicated" ? replicated_whole : sharded_whole) += t.at("bytes").get<int64_t>(); }
    CHECK(sharded_whole > 0);
    CHECK(replicated_whole > 0);
    int64_t total = 0;
    for (int32_t r = 0; r < 2; ++r) {
        CAPTURE(r);
        CHECK(reps[r].rank == r);
        const json d = json::parse(reps[r].detail);
        CHECK(d.at("rank") == r);
        CHECK(d.at("tp_size") == 2);
        const auto t = by_name(d);
        REQUIRE(t.size() == w.size());
        for (const auto & [name, mine] : t) {
            CAPTURE(name);
            REQUIRE(w.count(name) == 1);
            const json & full = w.at(name);
            const auto shard = mine.at("shard").get<std::string>();
            CHECK(shard == full.at("shard").get<std::string>());
            json want = full.at("shape");
            if (shard == "rows") { want[0] = want[0].get<int64_t>() / 2; }
            if (shard == "cols") { want[1] = want[1].get<int64_t>() / 2; }
            CHECK(mine.at("shape") == want);
        }
        total += sum_bytes(d);
    }
    // Sharded bytes split in two, replicated ones held by both ranks.
    CHECK(total == sharded_whole + 2 * replicated_whole);
    // The other rows run through the same path: a bare release / acquire of the KV pool on both ranks.
    const auto rel = ex->rank_call({.op = runtime::RankOp::release, .tag = runtime::MemoryTag::kv_cache});
    REQUIRE(rel.size() == 2);
    CHECK(rel[0].freed_bytes > 0);
    CHECK(rel[1].freed_bytes == rel[0].freed_bytes);
    CHECK(ex->rank_call({.op = runtime::RankOp::acquire_kv}).size() == 2);
}

TEST_CASE("rank call: a request's op, tag and fetch fields, and a detail of several records, cross a seqpacket link") {
    using namespace fd::runtime;
    RankRequest req{.op = RankOp::release, .tag = MemoryTag::kv_swap};
    req.fetch.version         = "step-7";
    req.fetch.serving_version = "step-6";
    req.fetch.verify_checksum = true;
    LinkMsg out;
    rank_request_to_msg(req, out);
    std::string detail(3 * LinkSocket::kPayloadChunk + 123, '\0');
    for (size_t i = 0; i < detail.size(); ++i) { detail[i] = static_cast<char>('a' + i % 26); }
    out.detail_bytes = static_cast<int64_t>(detail.size());

    auto [a, b] = make_link_pair();
    // More than the socket buffer holds: the sender runs while the receiver reads (as a rank and the daemon do).
    bool sent = false;
    std::thread sender([&] { sent = a.send(out) && a.send_payload(detail.data(), detail.size()); });
    LinkMsg in;
    REQUIRE(b.recv(in, std::chrono::steady_clock::now() + std::chrono::seconds(5)) == LinkSocket::Recv::ok);
    CHECK(in.op == static_cast<uint32_t>(LinkOp::rank_call));
    const RankRequest got = rank_request_from_msg(in);
    CHECK(got.op == RankOp::release);
    CHECK(got.tag == MemoryTag::kv_swap);
    CHECK(got.fetch.version == std::optional<std::string>("step-7"));
    CHECK(got.fetch.serving_version == "step-6");
    CHECK(got.fetch.verify_checksum);
    std::string back(static_cast<size_t>(in.detail_bytes), '\0');
    REQUIRE(b.recv_payload(back.data(), back.size(), std::chrono::steady_clock::now() + std::chrono::seconds(5)) == LinkSocket::Recv::ok);
    sender.join();
    CHECK(sent);
    CHECK(back == detail);

    // An op outside the table is refused, not run.
    LinkMsg bad = out;
    bad.rank_op = kRankOpCount;
    CHECK_THROWS_AS(rank_request_from_msg(bad), Error);
    CHECK(rank_op_name(RankOp::describe) == "describe");
    CHECK(std::string(rank_op_what(RankOp::commit)) == "update_weights (commit)");
}
