// Mixture-of-experts checkpoints (issue 23): config.json of Qwen3-MoE / Qwen2-MoE / Mixtral read
// with transformers' semantics (the real configs' field sets: Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B,
// Mixtral-8x7B-v0.1), bad MoE configs refused naming the field, the expert tensors of the
// layout (per expert, TP-sliced like the dense MLP) and the stacked export form split into
// per-expert views; a missing, duplicated or mis-shaped expert is refused naming layer and expert.
#include "fd/checkpoint/layout.h"
#include "fd/checkpoint/stored_names.h"
#include "fd/checkpoint/model_config.h"
#include "fd/status.h"
#include "test_util.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <functional>
#include <set>

namespace fs = std::filesystem;
using nlohmann::json;
using namespace fd::model;

namespace {

json qwen3_30b_a3b() {
    return json::parse(R"({
      "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643,
      "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
      "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
      "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": true,
      "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
      "num_key_value_heads": 4, "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
      "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null, "tie_word_embeddings": false,
      "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
}

json qwen15_moe() {
    return json::parse(R"({
      "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
      "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632,
      "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe", "num_attention_heads": 16,
      "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
      "sliding_window": 32768, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
      "use_sliding_window": false, "vocab_size": 151936, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
      "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": false,
      "output_router_logits": false, "router_aux_loss_coef": 0.001})");
}

json mixtral_8x7b() {
    return json::parse(R"({
      "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
      "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
      "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
      "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
      "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": null,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 32000})");
}

ModelConfig load(const json & j) {
    fd::test::TempDir d;
    std::ofstream(d.path / "config.json") << j.dump();
    return load_model_config(d.path);
}

/// `fn` throws `code` whose message holds every needle.
void refused_with(const std::function<void()> & fn, fd::Errc code, const std::vector<std::string> & needles) {
    std::string msg;
    CHECK(fd::test::error_of(fn, &msg) == code);
    CAPTURE(msg);
    for (const auto & n : needles) { CHECK_MESSAGE(msg.find(n) != std::string::npos, "message lacks '" << n << "'"); }
}

void refused(const json & j, const std::vector<std::string> & needles) {
    CAPTURE(j.dump());
    std::vector<std::string> all = needles;
    all.push_back("config.json");
    refused_with([&] { load(j); }, fd::Errc::invalid_checkpoint, all);
}

/// A small Qwen3-MoE config: 3 layers, layer 1 dense (mlp_only_layers), 4 experts top-2.
json small_qwen3_moe() {
    json j = qwen3_30b_a3b();
    j.update({{"hidden_size", 16}, {"num_attention_heads", 2}, {"num_key_value_heads", 2}, {"head_dim", 8},
              {"num_hidden_layers", 3}, {"intermediate_size", 24}, {"moe_intermediate_size", 8}, {"num_experts", 4},
              {"num_experts_per_tok", 2}, {"vocab_size", 32}, {"mlp_only_layers", {1}}, {"eos_token_id", 2}});  // eos inside the vocabulary
    return j;
}

/// An in-memory index holding `expected` with their shapes (no files: layout checks only).
TensorIndex index_of(const std::vector<ExpectedTensor> & expected) {
    TensorIndex idx;
    idx.source = "mem";
    int64_t off = 0;
    for (const auto & e : expected) {
        if (e.optional) { continue; }
        TensorInfo t;
        t.name = e.name;
        t.shape = e.shape;
        t.file = "mem/model.safetensors";
        t.offset_bytes = off;
        t.size_bytes = t.numel() * 4;
        off += t.size_bytes;
        idx.tensors[e.name] = t;
    }
    return idx;
}

}  // namespace

TEST_SUITE("checkpoint::moe") {

TEST_CASE("Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B and Mixtral-8x7B configs read with transformers' semantics") {
    ModelConfig c = load(qwen3_30b_a3b());
    CHECK(c.arch == Arch::qwen3_moe);
    CHECK(c.qk_norm);
    CHECK_FALSE(c.qkv_bias);
    CHECK(c.head_dim == 128);
    CHECK(c.moe.n_experts == 128);
    CHECK(c.moe.top_k == 8);
    CHECK(c.moe.intermediate == 768);
    CHECK(c.moe.norm_topk_prob);
    CHECK(c.moe.shared_intermediate == 0);
    CHECK(c.moe.prefix == "mlp");
    for (int il = 0; il < 48; ++il) { CHECK(c.is_moe_layer(il)); }
    CHECK_FALSE(c.has_dense_layer());

    c = load(qwen15_moe());
    CHECK(c.arch == Arch::qwen2_moe);
    CHECK(c.qkv_bias);  // Qwen2MoeConfig.qkv_bias defaults to true
    CHECK(c.head_dim == 128);  // hidden / heads
    CHECK(c.moe.n_experts == 60);
    CHECK(c.moe.top_k == 4);
    CHECK(c.moe.intermediate == 1408);
    CHECK(c.moe.shared_intermediate == 5632);
    CHECK_FALSE(c.moe.norm_topk_prob);

    c = load(mixtral_8x7b());
    CHECK(c.arch == Arch::mixtral);
    CHECK(c.moe.n_experts == 8);
    CHECK(c.moe.top_k == 2);
    CHECK(c.moe.intermediate == 14336);  // Mixtral's experts are intermediate_size wide
    CHECK(c.moe.norm_topk_prob);         // always renormalised
    CHECK(c.moe.prefix == "block_sparse_moe");
    CHECK(c.moe.gate_name == "w1");
    CHECK(c.moe.up_name == "w3");
    CHECK(c.moe.down_name == "w2");
    CHECK(c.sliding_window == 0);

    // Qwen3MoeConfig's defaults: num_experts_per_tok 8, norm_topk_prob false, head_dim derived.
    json j = qwen3_30b_a3b();
    j.erase("num_experts_per_tok");
    j.erase("norm_topk_prob");
    j.erase("head_dim");
    c = load(j);
    CHECK(c.moe.top_k == 8);
    CHECK_FALSE(c.moe.norm_topk_prob);
    CHECK(c.head_dim == 64);
}

TEST_CASE("decoder_sparse_step and mlp_only_layers pick the dense layers as transformers' DecoderLayer does") {
    json j = qwen3_30b_a3b();
    j["num_hidden_layers"] = 6;
    j["decoder_sparse_step"] = 2;   // (il + 1) % 2 == 0: layers 1, 3, 5
    j["mlp_only_layers"] = {3};
    ModelConfig c = load(j);
    const std::vector<bool> want = {false, true, false, false, false, true};
    for (int il = 0; il < 6; ++il) {
        CAPTURE(il);
        CHECK(c.is_moe_layer(il) == want[static_cast<size_t>(il)]);
    }
    CHECK(c.has_dense_layer());
}

TEST_CASE("bad MoE configs stop start-up naming the field; aux-loss fields are fine") {
    json j = qwen3_30b_a3b();
    j["num_experts_per_tok"] = 0;
    refused(j, {"num_experts_per_tok", "0"});
    j = qwen3_30b_a3b();
    j["num_experts_per_tok"] = 129;
    refused(j, {"num_experts_per_tok", "129", "128"});
    j = mixtral_8x7b();
    j["num_experts_per_tok"] = 9;
    refused(j, {"num_experts_per_tok", "num_local_experts"});
    j = qwen3_30b_a3b();
    j["num_local_experts"] = 64;  // both names, different counts
    refused(j, {"inconsistent", "num_experts", "num_local_experts", "128", "64"});
    j = qwen3_30b_a3b();
    j.erase("num_experts");
    refused(j, {"num_experts"});
    j = qwen3_30b_a3b();
    j["num_experts"] = 0;
    refused(j, {"num_experts", "0"});
    j = qwen3_30b_a3b();
    j.erase("moe_intermediate_size");
    refused(j, {"moe_intermediate_size"});
    j = qwen3_30b_a3b();
    j["decoder_sparse_step"] = 0;
    refused(j, {"decoder_sparse_step"});
    j = qwen3_30b_a3b();
    j["mlp_only_layers"] = {48};
    refused(j, {"mlp_only_layers", "48"});
    j = qwen3_30b_a3b();
    j["scoring_func"] = "sigmoid";  // DeepSeek-V3's routing
    refused(j, {"scoring_func", "sigmoid"});
    j = qwen3_30b_a3b();
    j["topk_method"] = "noaux_tc";
    refused(j, {"topk_method", "noaux_tc"});
    j = qwen3_30b_a3b();
    j["n_group"] = 8;
    refused(j, {"n_group"});
    j = qwen3_30b_a3b();
    j["routed_scaling_factor"] = 2.5;
    refused(j, {"routed_scaling_factor"});
    j = mixtral_8x7b();
    j["n_shared_experts"] = 2;
    refused(j, {"n_shared_experts"});
    // training-only fields load
    j = mixtral_8x7b();
    j["router_aux_loss_coef"] = 0.5;
    j["router_jitter_noise"] = 0.1;
    j["output_router_logits"] = true;
    j["routed_scaling_factor"] = 1.0;
    CHECK(load(j).moe.n_experts == 8);
}

TEST_CASE("layout: router whole, each expert's gate|up rows and down columns sliced like the dense MLP under tp") {
    const ModelConfig c = load(small_qwen3_moe());
    const auto expected = expected_tensors(c);
    const TensorIndex idx = index_of(expected);
    validate_checkpoint(c, idx);
    for (int r = 0; r < 2; ++r) {
        const WeightLayout L = plan_layout(c, idx, {r, 2});
        const InferenceTensor * router = L.find("model.layers.0.mlp.gate.weight");
        REQUIRE(router != nullptr);
        CHECK(router->shape == std::vector<int64_t>{4, 16});
        CHECK(router->shard == Shard::replicated);
        const InferenceTensor * gu = L.find("model.layers.2.mlp.experts.3.gate_up_proj.weight");
        REQUIRE(gu != nullptr);
        CHECK(gu->shape == std::vector<int64_t>{8, 16});  // 2 * 8 / 2 rows
        REQUIRE(gu->parts.size() == 2);
        CHECK(gu->parts[0].hf_name == "model.layers.2.mlp.experts.3.gate_proj.weight");
        CHECK(gu->parts[0].src0 == r * 4);
        CHECK(gu->parts[1].hf_name == "model.layers.2.mlp.experts.3.up_proj.weight");
        const InferenceTensor * dn = L.find("model.layers.2.mlp.experts.3.down_proj.weight");
        REQUIRE(dn != nullptr);
        CHECK(dn->shape == std::vector<int64_t>{16, 4});
        CHECK(dn->parts[0].dim == 1);
        CHECK(dn->parts[0].src0 == r * 4);
        // layer 1 is dense (mlp_only_layers): the dense MLP, no router
        CHECK(L.find("model.layers.1.mlp.gate_up_proj.weight") != nullptr);
        CHECK(L.find("model.layers.1.mlp.gate.weight") == nullptr);
        CHECK(L.find("model.layers.0.mlp.gate_up_proj.weight") == nullptr);
    }
    // tp must divide moe_intermediate_size (8): 3 does not
    refused_with([&] { check_tp_divides(c, 3); }, fd::Errc::invalid_argument, {"num_attention_heads"});
    json j = small_qwen3_moe();
    j["num_attention_heads"] = 4;
    j["num_key_value_heads"] = 4;
    j["head_dim"] = 4;
    j["moe_intermediate_size"] = 6;
    const ModelConfig c4 = load(j);
    refused_with([&] { check_tp_divides(c4, 4); }, fd::Errc::invalid_argument, {"moe_intermediate_size", "6"});
}

TEST_CASE("layout under expert parallelism: rank r holds experts [r*E/2, (r+1)*E/2) whole and no other; attention stays sliced") {
    const ModelConfig c = load(small_qwen3_moe());  // 4 experts of width 8, hidden 16, 2 heads of 8
    const auto expected = expected_tensors(c);
    const TensorIndex idx = index_of(expected);
    for (int r = 0; r < 2; ++r) {
        CAPTURE(r);
        const WeightLayout L = plan_layout(c, idx, {r, 2, 2});
        CHECK(rank_experts(4, {r, 2, 2}) == std::pair<int32_t, int32_t>{2 * r, 2 * r + 2});
        for (int e = 0; e < 4; ++e) {
            CAPTURE(e);
            const bool mine = e / 2 == r;
            const InferenceTensor * gu = L.find(fmt::format("model.layers.2.mlp.experts.{}.gate_up_proj.weight", e));
            const InferenceTensor * dn = L.find(fmt::format("model.layers.0.mlp.experts.{}.down_proj.weight", e));
            CHECK((gu != nullptr) == mine);
            CHECK((dn != nullptr) == mine);
            if (!mine) { continue; }
            CHECK(gu->shape == std::vector<int64_t>{16, 16});  // 2 * 8 rows: whole
            CHECK(gu->shard == Shard::replicated);
            CHECK(gu->parts[0].src0 == 0);
            CHECK(gu->parts[1].rows == 8);
            CHECK(dn->shape == std::vector<int64_t>{16, 8});
            CHECK(dn->parts[0].dim == 0);
        }
        CHECK(L.find("model.layers.0.mlp.gate.weight")->shape == std::vector<int64_t>{4, 16});
        CHECK(L.find("model.layers.0.self_attn.qkv_proj.weight")->shape == std::vector<int64_t>{24, 16});  // (q 16 + k 16 + v 16) / 2: sliced
        CHECK(L.find("model.layers.1.mlp.gate_up_proj.weight")->shape == std::vector<int64_t>{24, 16});    // dense layer: 2 * 24 / 2
        validate_against_layout(L, idx);  // the other rank's experts in the index are skipped
    }
    // Each rank checks its own experts: a missing expert 3 is rank 1's error, named; rank 0 does not read it.
    TensorIndex miss = idx;
    miss.tensors.erase("model.layers.2.mlp.experts.3.up_proj.weight");
    validate_against_layout(plan_layout(c, idx, {0, 2, 2}), miss);
    refused_with([&] { validate_against_layout(plan_layout(c, idx, {1, 2, 2}), miss); }, fd::Errc::invalid_checkpoint,
                 {"experts.3.up_proj", "expert 3"});
    // A mis-shaped own expert (a TP-MoE slice where the whole expert is expected) is refused by name.
    TensorIndex half = idx;
    half.tensors.at("model.layers.0.mlp.experts.1.down_proj.weight").shape = {16, 4};
    refused_with([&] { validate_against_layout(plan_layout(c, idx, {0, 2, 2}), half); }, fd::Errc::invalid_checkpoint,
                 {"experts.1.down_proj", "[16, 4]"});
    // Start-up rules: ep must divide the experts (naming both); EP needs a MoE model; widths are not split.
    refused_with([&] { check_tp_divides(c, 3, 3); }, fd::Errc::invalid_argument, {"num_experts = 4", "expert parallel size 3"});
    ModelConfig dense = c;
    dense.moe.n_experts = 0;
    refused_with([&] { check_tp_divides(dense, 2, 2); }, fd::Errc::invalid_argument, {"--enable-expert-parallel", "dense"});
    json j = small_qwen3_moe();
    j["moe_intermediate_size"] = 6;  // 6 % 4 != 0: refused under TP-MoE, fine under EP (experts whole)
    j["num_attention_heads"] = 4;
    j["num_key_value_heads"] = 4;
    j["head_dim"] = 4;
    j["intermediate_size"] = 8;
    const ModelConfig c6 = load(j);
    check_tp_divides(c6, 4, 4);
    refused_with([&] { check_tp_divides(c6, 4); }, fd::Errc::invalid_argument, {"moe_intermediate_size"});
}

TEST_CASE("Qwen2-MoE's shared expert and gate, Mixtral's w1|w3 and w2 under block_sparse_moe") {
    json j = qwen15_moe();
    j.update({{"hidden_size", 16}, {"num_attention_heads", 2}, {"num_key_value_heads", 2}, {"num_hidden_layers", 1},
              {"moe_intermediate_size", 8}, {"shared_expert_intermediate_size", 12}, {"num_experts", 3},
              {"num_experts_per_tok", 2}, {"vocab_size", 32}, {"eos_token_id", 2}});
    ModelConfig c = load(j);
    WeightLayout L = plan_layout(c, index_of(expected_tensors(c)), {1, 2});
    REQUIRE(L.find("model.layers.0.mlp.shared_expert.gate_up_proj.weight") != nullptr);
    CHECK(L.find("model.layers.0.mlp.shared_expert.gate_up_proj.weight")->shape == std::vector<int64_t>{12, 16});
    CHECK(L.find("model.layers.0.mlp.shared_expert.down_proj.weight")->shape == std::vector<int64_t>{16, 6});
    CHECK(L.find("model.layers.0.mlp.shared_expert_gate.weight")->shape == std::vector<int64_t>{1, 16});
    CHECK(L.find("model.layers.0.self_attn.qkv_proj.bias") != nullptr);

    j = mixtral_8x7b();
    j.update({{"hidden_size", 16}, {"num_attention_heads", 2}, {"num_key_value_heads", 1}, {"num_hidden_layers", 1},
              {"intermediate_size", 8}, {"num_local_experts", 3}, {"vocab_size", 32}});
    c = load(j);
    const auto expected = expected_tensors(c);
    std::set<std::string> names;
    for (const auto & e : expected) { names.insert(e.name); }
    CHECK(names.count("model.layers.0.block_sparse_moe.gate.weight"));
    CHECK(names.count("model.layers.0.block_sparse_moe.experts.2.w1.weight"));
    CHECK(names.count("model.layers.0.block_sparse_moe.experts.2.w3.weight"));
    CHECK(names.count("model.layers.0.block_sparse_moe.experts.2.w2.weight"));
    L = plan_layout(c, index_of(expected), {});
    const InferenceTensor * w13 = L.find("model.layers.0.block_sparse_moe.experts.2.w13.weight");
    REQUIRE(w13 != nullptr);
    CHECK(w13->parts[0].hf_name == "model.layers.0.block_sparse_moe.experts.2.w1.weight");
    CHECK(w13->parts[1].hf_name == "model.layers.0.block_sparse_moe.experts.2.w3.weight");
}

TEST_CASE("the complete expert set is checked: a missing, extra or mis-shaped expert names layer and expert") {
    const ModelConfig c = load(small_qwen3_moe());
    const auto expected = expected_tensors(c);
    TensorIndex idx = index_of(expected);
    idx.tensors.erase("model.layers.2.mlp.experts.1.up_proj.weight");
    refused_with([&] { validate_checkpoint(c, idx); }, fd::Errc::invalid_checkpoint,
                 {"model.layers.2.mlp.experts.1.up_proj.weight", "layer 2, expert 1", "missing"});
    idx = index_of(expected);
    idx.tensors["model.layers.0.mlp.experts.0.down_proj.weight"].shape = {16, 9};
    refused_with([&] { validate_checkpoint(c, idx); }, fd::Errc::invalid_checkpoint, {"layer 0, expert 0", "[16, 9]", "[16, 8]"});
    idx = index_of(expected);
    TensorInfo extra = idx.tensors.at("model.layers.0.mlp.experts.0.gate_proj.weight");
    extra.name = "model.layers.0.mlp.experts.4.gate_proj.weight";  // a fifth expert of four
    idx.tensors[extra.name] = extra;
    refused_with([&] { validate_checkpoint(c, idx); }, fd::Errc::invalid_checkpoint, {"layer 0, expert 4", "4 experts"});
    // a refill (update) is checked against the layout the same way
    const WeightLayout L = plan_layout(c, index_of(expected), {});
    idx = index_of(expected);
    idx.tensors.erase("model.layers.0.mlp.experts.3.gate_proj.weight");
    refused_with([&] { validate_against_layout(L, idx); }, fd::Errc::invalid_checkpoint, {"layer 0, expert 3", "missing"});
}

TEST_CASE("stacked experts [E, 2I, H] / [E, H, I] become per-expert views of the same bytes; a duplicate is refused") {
    const ModelConfig c = load(small_qwen3_moe());
    // per-expert index of the model, then layer 0's experts replaced by the stacked pair
    TensorIndex idx = index_of(expected_tensors(c));
    for (int e = 0; e < 4; ++e) {
        for (const char * leaf : {"gate_proj", "up_proj", "down_proj"}) {
            idx.tensors.erase(fmt::format("model.layers.0.mlp.experts.{}.{}.weight", e, leaf));
        }
    }
    TensorInfo gu;
    gu.name = "model.layers.0.mlp.experts.gate_up_proj";
    gu.shape = {4, 16, 16};
    gu.dtype = DType::bf16;
    gu.file = "mem/x.safetensors";
    gu.offset_bytes = 1000;
    gu.size_bytes = 4 * 16 * 16 * 2;
    TensorInfo dn = gu;
    dn.name = "model.layers.0.mlp.experts.down_proj";
    dn.shape = {4, 16, 8};
    dn.offset_bytes = 5000;
    dn.size_bytes = 4 * 16 * 8 * 2;
    idx.tensors[gu.name] = gu;
    idx.tensors[dn.name] = dn;
    TensorIndex split = idx;
    split_stacked_experts(split);
    CHECK(split.tensors.count(gu.name) == 0);
    const TensorInfo & up2 = split.tensors.at("model.layers.0.mlp.experts.2.up_proj.weight");
    CHECK(up2.shape == std::vector<int64_t>{8, 16});
    CHECK(up2.offset_bytes == 1000 + (2 * 16 + 8) * 16 * 2);  // expert 2's rows 8..15 of gate|up
    CHECK(up2.size_bytes == 8 * 16 * 2);
    CHECK(up2.file == gu.file);
    const TensorInfo & gate0 = split.tensors.at("model.layers.0.mlp.experts.0.gate_proj.weight");
    CHECK(gate0.offset_bytes == 1000);
    const TensorInfo & down3 = split.tensors.at("model.layers.0.mlp.experts.3.down_proj.weight");
    CHECK(down3.shape == std::vector<int64_t>{16, 8});
    CHECK(down3.offset_bytes == 5000 + 3 * 16 * 8 * 2);
    // with the stacked pair the checkpoint is complete
    validate_checkpoint(c, split);
    // the weight stream's view: each stacked tensor's per-expert names in file order, nothing for the others
    const auto views = stacked_expert_views(idx);
    CHECK(views.size() == 2);
    CHECK(views.at(gu.name).size() == 8);
    CHECK(views.at(gu.name)[0] == "model.layers.0.mlp.experts.0.gate_proj.weight");
    CHECK(views.at(gu.name)[1] == "model.layers.0.mlp.experts.0.up_proj.weight");
    CHECK(views.at(gu.name)[7] == "model.layers.0.mlp.experts.3.up_proj.weight");
    CHECK(views.at(dn.name) == std::vector<std::string>{"model.layers.0.mlp.experts.0.down_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight",
                                                        "model.layers.0.mlp.experts.2.down_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"});
    CHECK(stacked_expert_views(split).empty());
    // an expert given both ways is a duplicate, named
    TensorIndex dup = idx;
    TensorInfo one = gate0;
    dup.tensors[one.name] = one;
    refused_with([&] { split_stacked_experts(dup); }, fd::Errc::invalid_checkpoint,
                 {"layer 0 expert 0", "given twice", "model.layers.0.mlp.experts.gate_up_proj"});
    // a stacked tensor of the wrong rank, or the wrong expert count
    TensorIndex bad = idx;
    bad.tensors[gu.name].shape = {64, 16};
    refused_with([&] { split_stacked_experts(bad); }, fd::Errc::invalid_checkpoint, {"gate_up_proj", "layer 0", "3-D"});
    bad = idx;
    bad.tensors[gu.name].shape = {3, 16, 16};
    bad.tensors[dn.name].shape = {3, 16, 8};
    split_stacked_experts(bad);  // three experts' views: expert 3 is then missing
    refused_with([&] { validate_checkpoint(c, bad); }, fd::Errc::invalid_checkpoint, {"layer 0, expert 3", "missing"});
}

TEST_CASE("transformers v5's Mixtral names (mlp.gate, stacked mlp.experts.*) are read as block_sparse_moe's; both is refused") {
    json j = mixtral_8x7b();
    j.update({{"hidden_size", 16}, {"num_attention_heads", 2}, {"num_key_value_heads", 1}, {"num_hidden_layers", 2},
              {"intermediate_size", 8}, {"num_local_experts", 3}, {"vocab_size", 32}});
    const ModelConfig c = load(j);
    // the v4 index, then layer 1's block under v5's names: the router renamed, the experts stacked
    const TensorIndex v4 = index_of(expected_tensors(c));
    TensorIndex v5 = v4;
    TensorInfo router = v5.tensors.at("model.layers.1.block_sparse_moe.gate.weight");
    v5.tensors.erase(router.name);
    router.name = "model.layers.1.mlp.gate.weight";
    v5.tensors[router.name] = router;
    for (int e = 0; e < 3; ++e) {
        for (const char * w : {"w1", "w3", "w2"}) { v5.tensors.erase(fmt::format("model.layers.1.block_sparse_moe.experts.{}.{}.weight", e, w)); }
    }
    TensorInfo gu;
    gu.name = "model.layers.1.mlp.experts.gate_up_proj";
    gu.shape = {3, 16, 16};  // [E, 2I, H]
    gu.file = "mem/x.safetensors";
    gu.offset_bytes = 4096;
    gu.size_bytes = 3 * 16 * 16 * 4;
    TensorInfo dn = gu;
    dn.name = "model.layers.1.mlp.experts.down_proj";
    dn.shape = {3, 16, 8};  // [E, H, I]
    dn.offset_bytes = 65536;
    dn.size_bytes = 3 * 16 * 8 * 4;
    v5.tensors[gu.name] = gu;
    v5.tensors[dn.name] = dn;
    split_stacked_experts(v5);
    TensorIndex renamed;
    const TensorIndex & got = with_v4_names(c, v5, renamed);
    CHECK(&got == &renamed);
    validate_checkpoint(c, got);  // complete under the v4 names
    CHECK(got.tensors.count("model.layers.1.mlp.gate.weight") == 0);
    const TensorInfo & w3 = got.tensors.at("model.layers.1.block_sparse_moe.experts.2.w3.weight");
    CHECK(w3.shape == std::vector<int64_t>{8, 16});
    CHECK(w3.offset_bytes == 4096 + (2 * 16 + 8) * 16 * 4);  // expert 2's up rows (w3) of gate | up
    CHECK(got.tensors.at("model.layers.1.block_sparse_moe.experts.1.w2.weight").offset_bytes == 65536 + 16 * 8 * 4);
    // a v4 index, or another architecture, is left as it is
    TensorIndex unused;
    CHECK(&with_v4_names(c, v4, unused) == &v4);
    const ModelConfig q = load(small_qwen3_moe());
    TensorIndex qi = index_of(expected_tensors(q));
    CHECK_FALSE(alias_v5_mixtral_names(q, qi));
    CHECK(qi.tensors.count("model.layers.0.mlp.gate.weight") == 1);
    // one tensor under both names
    TensorIndex both = v5;
    both.tensors["model.layers.1.block_sparse_moe.experts.0.w2.weight"] = v4.tensors.at("model.layers.1.block_sparse_moe.experts.0.w2.weight");
    refused_with([&] { alias_v5_mixtral_names(c, both); }, fd::Errc::invalid_checkpoint,
                 {"layer 1 expert 0", "given twice", "model.layers.1.mlp.experts.0.down_proj.weight"});
}

}  // TEST_SUITE
