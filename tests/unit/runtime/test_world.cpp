// World (daemon/src/runtime/world.cpp): placement against hand-computed values, the slices
// against the sharding plan_layout (checkpoint/src/layout.cpp) computes on its own, and the
// `auto` --dist-backend rule.
#include "fd/checkpoint/layout.h"
#include "fd/runtime/world.h"
#include "fd/status.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>

using fd::runtime::DistBackend;
using fd::runtime::Slice;
using fd::runtime::World;

namespace {

fd::model::ModelConfig tiny_config() {
    fd::model::ModelConfig c;
    c.architecture      = "LlamaForCausalLM";
    c.vocab_size        = 512;
    c.hidden_size       = 64;
    c.intermediate_size = 172;
    c.n_layers          = 1;
    c.n_heads           = 8;
    c.n_kv_heads        = 4;
    c.head_dim          = 8;
    c.tie_word_embeddings = true;
    return c;
}

/// An index of every required tensor of `cfg` (f32, HF names): what plan_layout plans from.
fd::model::TensorIndex index_of(const fd::model::ModelConfig & cfg) {
    fd::model::TensorIndex idx;
    for (const auto & e : fd::model::expected_tensors(cfg)) {
        if (e.optional) { continue; }
        fd::model::TensorInfo t{.name = e.name, .dtype = fd::model::DType::f32, .shape = e.shape};
        idx.tensors.emplace(e.name, t);
    }
    return idx;
}

/// The first training part of inference tensor `name` in rank r's layout.
const fd::model::WeightPart & part(const fd::model::WeightLayout & l, const std::string & name, size_t i = 0) {
    const auto * t = l.find(name);
    REQUIRE(t != nullptr);
    REQUIRE(t->parts.size() > i);
    return t->parts[i];
}

}  // namespace

TEST_CASE("World: node_of, local_index, first_rank and device_of by hand") {
    // tp 8 over 2 hosts with 2 devices each: node 0 runs ranks 0..3, node 1 ranks 4..7.
    const World w = World::make(8, 2, 2);
    CHECK(w.per_node() == 4);
    const int node[8]  = {0, 0, 0, 0, 1, 1, 1, 1};
    const int local[8] = {0, 1, 2, 3, 0, 1, 2, 3};
    const int dev[8]   = {0, 1, 0, 1, 0, 1, 0, 1};
    for (int r = 0; r < 8; ++r) {
        CAPTURE(r);
        CHECK(w.node_of(r) == node[r]);
        CHECK(w.local_index(r) == local[r]);
        CHECK(w.device_of(r) == dev[r]);
        CHECK(w.is_remote(r) == (node[r] != 0));
    }
    CHECK(w.first_rank(0) == 0);
    CHECK(w.first_rank(1) == 4);
    CHECK(w.ranks_per_device() == 2);
    CHECK(w.multi_node());
    // One host, 8 devices: each rank its own device.
    const World one = World::make(8, 1, 8);
    CHECK(one.device_of(5) == 5);
    CHECK(one.ranks_per_device() == 1);
    CHECK_FALSE(one.multi_node());
    // Each host counts its own devices from 0: tp 4 over 2 hosts of 4 devices, rank 3 is node 1's
    // second rank, on that host's device 1 (not device 3).
    CHECK(World::make(4, 2, 4).device_of(3) == 1);
    CHECK(World::make(4, 2, 4).device_of(2) == 0);
    // cpu (no device count): everything on "device" 0.
    CHECK(World::make(2, 1, 0).device_of(1) == 0);
}

TEST_CASE("World::make refuses what cannot be placed, naming the flags") {
    std::vector<std::string> problems;
    World::make(4, 3, 1, problems);
    REQUIRE(problems.size() == 1);
    CHECK(problems[0] == "--nnodes 3 must divide --tensor-parallel-size 4 (each node runs tp/nnodes ranks)");
    problems.clear();
    World::make(0, 1, 1, problems);
    REQUIRE(problems.size() == 1);
    CHECK(problems[0] == "--tensor-parallel-size 0 must be >= 1");
    problems.clear();
    World::make(4, 1, 1, problems, 3);
    CHECK(problems.size() == 1);
    CHECK_THROWS_AS(World::make(2, 4, 1), fd::Error);
}

TEST_CASE("World slices by hand: heads, kv heads, ff, vocab and experts") {
    const auto cfg = tiny_config();
    const World w  = World::make(4, 1, 1);
    CHECK(w.heads(cfg, 0) == Slice{0, 2});
    CHECK(w.heads(cfg, 3) == Slice{6, 8});
    CHECK(w.kv_heads(cfg, 2) == Slice{2, 3});
    CHECK(w.ff(cfg, 1) == Slice{43, 86});
    CHECK(w.ff(cfg, 3) == Slice{129, 172});
    CHECK(w.vocab(cfg, 2) == Slice{256, 384});
    // ep = 2 inside tp = 4: expert rank r mod 2; 6 experts, 3 each.
    const World e = World::make(4, 1, 1, 2);
    CHECK(e.experts(6, 0) == Slice{0, 3});
    CHECK(e.experts(6, 1) == Slice{3, 6});
    CHECK(e.experts(6, 2) == Slice{0, 3});
    // ep = 1: every rank every expert.
    CHECK(w.experts(6, 3) == Slice{0, 6});
    // One expert's width (moe_intermediate_size 96): split under TP-MoE, whole under EP; ff stays the dense MLP's.
    auto moe = cfg;
    moe.moe.n_experts    = 8;
    moe.moe.intermediate = 96;
    const World ep4 = World::make(4, 1, 1, 4);
    CHECK(w.expert_ff(moe, 1) == Slice{24, 48});
    CHECK(ep4.expert_ff(moe, 1) == Slice{0, 96});
    CHECK(ep4.ff(moe, 1) == Slice{43, 86});
    // and plan_layout's experts are World's: expert rank 3 of 4 holds experts [6, 8)
    CHECK(fd::model::rank_experts(8, ep4.tp_rank(3)) == std::pair<int32_t, int32_t>{6, 8});
    CHECK(ep4.experts(8, 3) == Slice{6, 8});
}

TEST_CASE("World slices equal the shards plan_layout cuts for every rank") {
    const auto cfg = tiny_config();
    const auto idx = index_of(cfg);
    for (int tp : {1, 2, 4}) {
        const World w = World::make(tp, 1, 1);
        for (int r = 0; r < tp; ++r) {
            CAPTURE(tp);
            CAPTURE(r);
            const auto l = fd::model::plan_layout(cfg, idx, {.rank = r, .size = tp});
            const std::string L = "model.layers.0.";
            // qkv rows: q part = this rank's heads, k part = its kv heads (rows of head_dim each).
            CHECK(part(l, L + "self_attn.qkv_proj.weight", 0).src0 == w.heads(cfg, r).begin * cfg.head_dim);
            CHECK(part(l, L + "self_attn.qkv_proj.weight", 0).rows == w.heads(cfg, r).size() * cfg.head_dim);
            CHECK(part(l, L + "self_attn.qkv_proj.weight", 1).src0 == w.kv_heads(cfg, r).begin * cfg.head_dim);
            CHECK(part(l, L + "self_attn.qkv_proj.weight", 1).rows == w.kv_heads(cfg, r).size() * cfg.head_dim);
            // gate_up rows and down_proj columns: the ff slice.
            CHECK(part(l, L + "mlp.gate_up_proj.weight", 0).src0 == w.ff(cfg, r).begin);
            CHECK(part(l, L + "mlp.gate_up_proj.weight", 0).rows == w.ff(cfg, r).size());
            CHECK(part(l, L + "mlp.down_proj.weight").src0 == w.ff(cfg, r).begin);
            // embed rows: the vocab slice.
            CHECK(part(l, "model.embed_tokens.weight").src0 == w.vocab(cfg, r).begin);
            CHECK(part(l, "model.embed_tokens.weight").rows == w.vocab(cfg, r).size());
        }
    }
}

TEST_CASE("resolve_dist_backend: the auto rule and the refusals") {
    std::vector<std::string> p;
    // cpu: shm on one host, gloo across hosts.
    CHECK(resolve_dist_backend(DistBackend::automatic, World::make(2, 1, 1), false, p) == DistBackend::shm);
    CHECK(resolve_dist_backend(DistBackend::automatic, World::make(2, 2, 1), false, p) == DistBackend::gloo);
    // cuda, one host: nccl only when every rank has its own device and tp > 1.
    CHECK(resolve_dist_backend(DistBackend::automatic, World::make(2, 1, 2), true, p) == DistBackend::nccl);
    CHECK(resolve_dist_backend(DistBackend::automatic, World::make(2, 1, 1), true, p) == DistBackend::shm);
    CHECK(resolve_dist_backend(DistBackend::automatic, World::make(1, 1, 1), true, p) == DistBackend::shm);
    CHECK(resolve_dist_backend(DistBackend::automatic, World::make(4, 2, 2), true, p) == DistBackend::gloo);
    CHECK(p.empty());
    // An explicit choice is kept; the ones the world cannot run are named.
    CHECK(resolve_dist_backend(DistBackend::gloo, World::make(2, 1, 1), false, p) == DistBackend::gloo);
    CHECK(p.empty());
    resolve_dist_backend(DistBackend::shm, World::make(2, 2, 1), false, p);
    resolve_dist_backend(DistBackend::nccl, World::make(2, 1, 1), false, p);
    resolve_dist_backend(DistBackend::nccl, World::make(2, 1, 1), true, p);
    REQUIRE(p.size() == 3);
    CHECK(p[0].find("--dist-backend shm needs every rank on one host") != std::string::npos);
    CHECK(p[1].find("--dist-backend nccl needs --device cuda") != std::string::npos);
    CHECK(p[2].find("puts 2 ranks on each of the 1 visible CUDA device(s)") != std::string::npos);
    CHECK(fd::runtime::parse_dist_backend("auto") == DistBackend::automatic);
    CHECK_FALSE(fd::runtime::parse_dist_backend("mpi").has_value());
    CHECK(fd::runtime::parse_executor_kind("mp") == fd::runtime::ExecutorKind::mp);
    CHECK_FALSE(fd::runtime::parse_executor_kind("ray").has_value());
}
