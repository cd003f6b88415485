// RolloutModel (publish/src/rollout_model.cpp): state dict per TP rank, name mappings to
// training names, gather; the safetensors writer. The Qwen2-shaped checkpoint is written in a
// fresh temp dir by the test itself. Linked against fd_publish only (no engine).
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/checkpoint/layout.h"
#include "fd/publish/rollout_model.h"
#include "fd/publish/safetensors_write.h"
#include "fd/status.h"
#include "test_util.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>

namespace fs = std::filesystem;
using fd::Errc;
using fd::model::DType;
using fd::publish::RolloutModel;

namespace {

const fs::path kStories = fs::path(FD_SOURCE_DIR) / "models" / "stories260K";

using fd::test::TempDir;

/// `cfg` as config.json in `dir` and a model.safetensors with every tensor the config expects
/// (the optional ones only `with_optional`), F32, element k of each tensor = k.
fs::path write_ramp_checkpoint(const fs::path & dir, const nlohmann::json & cfg, bool with_optional) {
    std::ofstream(dir / "config.json") << cfg.dump();
    const auto c = fd::model::load_model_config(dir);
    std::vector<fd::publish::SafetensorsEntry> entries;
    for (const auto & t : fd::model::expected_tensors(c)) {
        if (with_optional || !t.optional) { entries.push_back({t.name, DType::f32, t.shape}); }
    }
    fd::publish::write_safetensors(dir / "model.safetensors", entries, [&](size_t i, std::byte * dst) {
        int64_t n = 1;
        for (int64_t d : entries[i].shape) { n *= d; }
        auto * f = reinterpret_cast<float *>(dst);
        for (int64_t k = 0; k < n; ++k) { f[k] = static_cast<float>(k); }
    });
    return dir;
}

/// A Qwen2-shaped checkpoint (qkv biases, GQA 4/2 heads, untied lm_head, F32) whose every
/// element equals its flat index within its tensor, so slices can be checked by value.
fs::path write_qwen2(const fs::path & dir) {
    const nlohmann::json cfg = {{"architectures", {"Qwen2ForCausalLM"}}, {"model_type", "qwen2"}, {"vocab_size", 96},
                                {"hidden_size", 32}, {"intermediate_size", 48}, {"num_hidden_layers", 2},
                                {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 8},
                                {"hidden_act", "silu"}, {"max_position_embeddings", 128}, {"rms_norm_eps", 1e-6},
                                {"tie_word_embeddings", false}, {"bos_token_id", 1}, {"eos_token_id", 2}};
    return write_ramp_checkpoint(dir, cfg, /*with_optional=*/true);
}

/// A Qwen3-shaped checkpoint (head_dim 16 != hidden 32 / 4 heads, q_norm/k_norm, tied), values
/// as write_qwen2's.
fs::path write_qwen3(const fs::path & dir) {
    const nlohmann::json cfg = {{"architectures", {"Qwen3ForCausalLM"}}, {"model_type", "qwen3"}, {"vocab_size", 96},
                                {"hidden_size", 32}, {"intermediate_size", 48}, {"num_hidden_layers", 2},
                                {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 16},
                                {"attention_bias", false}, {"use_sliding_window", false}, {"sliding_window", nullptr},
                                {"hidden_act", "silu"}, {"max_position_embeddings", 128}, {"rms_norm_eps", 1e-6},
                                {"tie_word_embeddings", true}, {"bos_token_id", 1}, {"eos_token_id", 2}};
    return write_ramp_checkpoint(dir, cfg, /*with_optional=*/false);
}

using fd::test::error_of;

/// Every inference tensor maps to HF tensors of the checkpoint, and every HF tensor is used once.
void check_mappings_cover(const fs::path & dir) {
    const RolloutModel m(dir, 1);
    const auto idx = fd::model::read_tensor_index(dir);
    const auto map = m.name_mappings_to_training();
    const auto sd  = m.state_dict(0);
    REQUIRE(map.size() == sd.size());
    std::multiset<std::string> used;
    for (const auto & t : sd) {
        CAPTURE(t.name);
        REQUIRE(map.count(t.name) == 1);
        for (const auto & hf : map.at(t.name)) {
            CHECK(idx.tensors.count(hf) == 1);
            used.insert(hf);
        }
    }
    for (const auto & [name, info] : idx.tensors) {
        if (m.layout().tied_lm_head && name == "lm_head.weight") { continue; }  // tied: read from embed_tokens
        CAPTURE(name);
        CHECK(used.count(name) == 1);
    }
}

}  // namespace

TEST_SUITE("model::rollout_model") {

TEST_CASE("name mappings cover every inference tensor of stories260K and map to checkpoint tensors") {
    check_mappings_cover(kStories);
    const RolloutModel m(kStories, 1);
    const auto map = m.name_mappings_to_training();
    CHECK(map.at("model.layers.0.self_attn.qkv_proj.weight") ==
          std::vector<std::string>{"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                   "model.layers.0.self_attn.v_proj.weight"});
    CHECK(map.at("model.layers.4.mlp.gate_up_proj.weight") ==
          std::vector<std::string>{"model.layers.4.mlp.gate_proj.weight", "model.layers.4.mlp.up_proj.weight"});
    CHECK(map.count("lm_head.weight") == 0);  // tied
    // TP=1 state dict = the Worker's layout.
    const auto sd = m.state_dict(0);
    REQUIRE(sd.size() == m.layout().tensors.size());
    for (size_t i = 0; i < sd.size(); ++i) {
        CHECK(sd[i].name == m.layout().tensors[i].name);
        CHECK(sd[i].shape == m.layout().tensors[i].shape);
        CHECK(sd[i].dtype == m.layout().tensors[i].dtype);
    }
}

TEST_CASE("name mappings cover a Qwen2 checkpoint (qkv bias, untied lm_head)") {
    TempDir d;
    write_qwen2(d.path);
    check_mappings_cover(d.path);
    const auto map = RolloutModel(d.path, 1).name_mappings_to_training();
    CHECK(map.at("model.layers.1.self_attn.qkv_proj.bias").size() == 3);
    CHECK(map.at("lm_head.weight") == std::vector<std::string>{"lm_head.weight"});
}

TEST_CASE("a Qwen3 checkpoint: q_norm/k_norm [head_dim] in the state dict, replicated on every rank, mapped to themselves") {
    TempDir d;
    write_qwen3(d.path);
    check_mappings_cover(d.path);
    const RolloutModel m(d.path, 2);
    const auto map = m.name_mappings_to_training();
    CHECK(map.at("model.layers.1.self_attn.q_norm.weight") == std::vector<std::string>{"model.layers.1.self_attn.q_norm.weight"});
    CHECK(map.at("model.layers.0.self_attn.k_norm.weight") == std::vector<std::string>{"model.layers.0.self_attn.k_norm.weight"});
    CHECK(map.count("lm_head.weight") == 0);
    const auto idx = fd::model::read_tensor_index(d.path);
    for (int r = 0; r < 2; ++r) {
        std::map<std::string, std::vector<int64_t>> shape;
        for (const auto & src : m.training_slices(r)) {
            shape[src.tensor.name] = src.tensor.shape;
            if (src.tensor.name.find("_norm.weight") == std::string::npos || src.tensor.name.find("self_attn") == std::string::npos) {
                continue;
            }
            std::vector<float> out(static_cast<size_t>(src.tensor.numel()));
            RolloutModel::gather(src, idx, reinterpret_cast<std::byte *>(out.data()));
            CHECK(out == std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});  // whole, on each rank
        }
        CHECK(shape.at("model.layers.0.self_attn.q_norm.weight") == std::vector<int64_t>{16});
        CHECK(shape.at("model.layers.1.self_attn.k_norm.weight") == std::vector<int64_t>{16});
        CHECK(shape.at("model.layers.0.self_attn.qkv_proj.weight") == std::vector<int64_t>{(64 + 32 + 32) / 2, 32});
        CHECK(shape.at("model.layers.0.self_attn.o_proj.weight") == std::vector<int64_t>{32, 32});
    }
}

TEST_CASE("tp=2 shapes follow the Megatron sharding") {
    const RolloutModel m(kStories, 2);  // hidden 64, 8 heads / 4 kv heads of 8, ff 172, vocab 512
    for (int r = 0; r < 2; ++r) {
        std::map<std::string, std::vector<int64_t>> shape;
        for (const auto & t : m.state_dict(r)) { shape[t.name] = t.shape; }
        CHECK(shape.at("model.embed_tokens.weight") == std::vector<int64_t>{256, 64});
        CHECK(shape.at("model.layers.0.self_attn.qkv_proj.weight") == std::vector<int64_t>{32 + 16 + 16, 64});
        CHECK(shape.at("model.layers.0.self_attn.o_proj.weight") == std::vector<int64_t>{64, 32});
        CHECK(shape.at("model.layers.0.mlp.gate_up_proj.weight") == std::vector<int64_t>{172, 64});
        CHECK(shape.at("model.layers.0.mlp.down_proj.weight") == std::vector<int64_t>{64, 86});
        CHECK(shape.at("model.layers.0.input_layernorm.weight") == std::vector<int64_t>{64});
        CHECK(shape.at("model.norm.weight") == std::vector<int64_t>{64});
    }
    TempDir d;
    write_qwen2(d.path);  // hidden 32, 4 heads / 2 kv heads of 8, ff 48, vocab 96
    const RolloutModel q(d.path, 2);
    std::map<std::string, fd::publish::StateTensor> t1;
    for (const auto & t : q.state_dict(1)) { t1[t.name] = t; }
    CHECK(t1.at("model.layers.0.self_attn.qkv_proj.bias").shape == std::vector<int64_t>{16 + 8 + 8});
    CHECK(t1.at("lm_head.weight").shape == std::vector<int64_t>{48, 32});
    CHECK(t1.at("model.layers.1.mlp.gate_up_proj.weight").shape == std::vector<int64_t>{48, 32});
}

TEST_CASE("gather copies the right rows and columns of each rank") {
    TempDir d;
    write_qwen2(d.path);
    const auto idx = fd::model::read_tensor_index(d.path);
    const RolloutModel m(d.path, 2);
    for (const auto & src : m.training_slices(1)) {
        std::vector<float> out(static_cast<size_t>(src.tensor.numel()));
        RolloutModel::gather(src, idx, reinterpret_cast<std::byte *>(out.data()));
        if (src.tensor.name == "model.layers.0.self_attn.qkv_proj.weight") {  // [32, 32]: q rows 16..31, k rows 8..15, v rows 8..15
            CHECK(out[0] == 16 * 32);                 // q_proj row 16, col 0
            CHECK(out[16 * 32] == 8 * 32);            // k_proj row 8
            CHECK(out[24 * 32 + 5] == 8 * 32 + 5);    // v_proj row 8, col 5
        }
        if (src.tensor.name == "model.layers.0.self_attn.qkv_proj.bias") {  // q 16..31 | k 8..15 | v 8..15
            CHECK(out[0] == 16);
            CHECK(out[16] == 8);
            CHECK(out[31] == 15);
        }
        if (src.tensor.name == "model.layers.0.mlp.down_proj.weight") {  // [32, 24] = columns 24..47 of [32, 48]
            CHECK(out[0] == 24);
            CHECK(out[24 + 3] == 48 + 27);
        }
        if (src.tensor.name == "model.embed_tokens.weight") { CHECK(out[0] == 48 * 32); }
    }
}

TEST_CASE("expert parallel: each rank lists only its experts, whole, and maps them to their HF names") {
    TempDir d;  // Mixtral-shaped: 8 experts top-2 of width 24 (intermediate_size), hidden 32
    const nlohmann::json cfg = {{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"}, {"vocab_size", 96},
                                {"hidden_size", 32}, {"intermediate_size", 24}, {"num_hidden_layers", 2},
                                {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 8},
                                {"num_local_experts", 8}, {"num_experts_per_tok", 2}, {"hidden_act", "silu"},
                                {"max_position_embeddings", 128}, {"rms_norm_eps", 1e-5}, {"tie_word_embeddings", false},
                                {"bos_token_id", 1}, {"eos_token_id", 2}};
    write_ramp_checkpoint(d.path, cfg, /*with_optional=*/true);
    const auto idx = fd::model::read_tensor_index(d.path);
    const RolloutModel m(d.path, 2, /*expert_parallel=*/true);
    CHECK(m.ep_size() == 2);
    CHECK(RolloutModel(d.path, 2).ep_size() == 1);
    CHECK(RolloutModel(d.path, 2).rank_experts(1) == std::pair<int32_t, int32_t>{0, 8});
    std::multiset<std::string> experts_seen;
    for (int r = 0; r < 2; ++r) {
        CAPTURE(r);
        CHECK(m.rank_experts(r) == std::pair<int32_t, int32_t>{4 * r, 4 * r + 4});
        const auto map = m.name_mappings_to_training(r);
        for (const auto & src : m.training_slices(r)) {
            const std::string & n = src.tensor.name;
            if (n.find(".experts.") == std::string::npos) { continue; }
            const int e = std::stoi(n.substr(n.find(".experts.") + 9));
            CAPTURE(n);
            CHECK((e >= 4 * r && e < 4 * r + 4));
            experts_seen.insert(n);
            CHECK(map.count(n) == 1);
            const std::string x = n.substr(0, n.rfind('.', n.size() - 8) + 1);  // ...experts.E.
            std::vector<float> out(static_cast<size_t>(src.tensor.numel()));
            RolloutModel::gather(src, idx, reinterpret_cast<std::byte *>(out.data()));
            if (n.ends_with("w13.weight")) {  // whole: w1's 24 rows, then w3's (each a ramp from 0)
                CHECK(src.tensor.shape == std::vector<int64_t>{48, 32});
                CHECK(map.at(n) == std::vector<std::string>{x + "w1.weight", x + "w3.weight"});
                CHECK(out[23 * 32 + 31] == 23 * 32 + 31);
                CHECK(out[24 * 32] == 0);
            } else {  // w2 whole: every column
                CHECK(src.tensor.shape == std::vector<int64_t>{32, 24});
                CHECK(map.at(n) == std::vector<std::string>{n});
                CHECK(out[31 * 24 + 23] == 31 * 24 + 23);
            }
        }
        std::map<std::string, std::vector<int64_t>> shape;
        for (const auto & t : m.state_dict(r)) { shape[t.name] = t.shape; }
        CHECK(shape.at("model.layers.0.block_sparse_moe.gate.weight") == std::vector<int64_t>{8, 32});  // router whole
        CHECK(shape.at("model.layers.0.self_attn.o_proj.weight") == std::vector<int64_t>{32, 16});       // attention tp-sliced
    }
    CHECK(experts_seen.size() == 2 * 8 * 2);  // 2 layers x 8 experts x (w13, w2), each on one rank only
    CHECK(std::set<std::string>(experts_seen.begin(), experts_seen.end()).size() == experts_seen.size());
    CHECK(m.name_mappings_to_training().size() == m.name_mappings_to_training(0).size() + 2 * 4 * 2);  // every rank's
    std::string what;
    CHECK(error_of([&] { RolloutModel(d.path, 3, true); }, &what) == Errc::invalid_argument);
    CHECK(what.find("num_experts = 8") != std::string::npos);
    CHECK(error_of([&] { RolloutModel(kStories, 1, true); }, &what) == Errc::invalid_argument);
    CHECK(what.find("dense") != std::string::npos);
    CHECK(error_of([&] { (void)m.name_mappings_to_training(2); }) == Errc::invalid_argument);
}

TEST_CASE("a tp that does not divide heads, kv heads, intermediate or vocab is invalid_argument") {
    CHECK(error_of([] { RolloutModel(kStories, 3); }) == Errc::invalid_argument);   // 8 heads
    CHECK(error_of([] { RolloutModel(kStories, 8); }) == Errc::invalid_argument);   // 4 kv heads
    CHECK(error_of([] { RolloutModel(kStories, 0); }) == Errc::invalid_argument);
    CHECK(error_of([] { RolloutModel(kStories, -2); }) == Errc::invalid_argument);
    const RolloutModel m(kStories, 4);  // 172 / 4 = 43
    CHECK(error_of([&] { m.state_dict(4); }) == Errc::invalid_argument);
    CHECK(error_of([&] { m.state_dict(-1); }) == Errc::invalid_argument);
    TempDir d;
    write_qwen2(d.path);  // ff 48, vocab 96, 2 kv heads: tp 4 breaks kv heads
    CHECK(error_of([&] { RolloutModel(d.path, 4); }) == Errc::invalid_argument);
    TempDir empty;
    CHECK(error_of([&] { RolloutModel(empty.path, 1); }) == Errc::invalid_checkpoint);
}

TEST_CASE("write_safetensors output is read back by read_tensor_index, data 8-byte aligned") {
    TempDir d;
    const std::vector<fd::publish::SafetensorsEntry> e = {{"a", DType::f32, {3}}, {"b", DType::bf16, {2, 3}}, {"c", DType::f16, {1}}};
    const int64_t n = fd::publish::write_safetensors(d.path / "x.safetensors", e, [&](size_t i, std::byte * dst) {
        std::memset(dst, static_cast<int>(i + 1), i == 0 ? 12 : i == 1 ? 12 : 2);
    });
    CHECK(n == 26);
    CHECK(!fs::exists(d.path / "x.safetensors.tmp"));
    const auto idx = fd::model::read_tensor_files(d.path, {d.path / "x.safetensors"});
    REQUIRE(idx.tensors.size() == 3);
    CHECK(idx.tensors.at("a").offset_bytes % 8 == 0);
    CHECK(idx.tensors.at("b").shape == std::vector<int64_t>{2, 3});
    CHECK(idx.tensors.at("b").dtype == DType::bf16);
    CHECK(idx.tensors.at("c").offset_bytes + 2 == static_cast<int64_t>(fs::file_size(d.path / "x.safetensors")));
    std::vector<uint8_t> raw(12);
    fd::model::read_tensor_raw(idx.tensors.at("b"), raw.data());
    CHECK(raw == std::vector<uint8_t>(12, 2));
    // A failing fill leaves neither the file nor the .tmp behind.
    CHECK(error_of([&] {
              fd::publish::write_safetensors(d.path / "y.safetensors", e, [](size_t, std::byte *) {
                  fd::fail(Errc::invalid_checkpoint, "boom");
              });
          }) == Errc::invalid_checkpoint);
    CHECK(!fs::exists(d.path / "y.safetensors"));
    CHECK(!fs::exists(d.path / "y.safetensors.tmp"));
}

}  // TEST_SUITE
