// load_model_config's architectures and math-changing fields (daemon/src/model/model_config.cpp):
// Qwen3 / Mistral, rope_scaling (llama3 inverse frequencies against values computed by a numpy
// transcription of transformers' _compute_llama3_parameters, tests/e2e/np_llama.py), and every
// unsupported field refused naming it.
#include "fd/checkpoint/model_config.h"
#include "fd/model/weights.h"
#include "fd/status.h"
#include "test_util.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>

namespace fs = std::filesystem;
using nlohmann::json;
using fd::model::load_model_config;
using fd::model::RopeType;

namespace {

/// A Llama-3.2-1B-like config.json (the real field set; sizes small).
json llama32() {
    return json::parse(R"({
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": false, "mlp_bias": false,
      "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
      "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32,
      "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16", "vocab_size": 128256})");
}

/// A Qwen3-0.6B-like config.json.
json qwen3() {
    return json::parse(R"({
      "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
      "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
      "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null,
      "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true, "use_sliding_window": false,
      "vocab_size": 151936})");
}

/// A Mistral-7B-v0.1-like config.json (sliding_window 4096).
json mistral() {
    return json::parse(R"({
      "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
      "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
      "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": false, "vocab_size": 32000})");
}

/// A Qwen2.5-0.5B-like config.json (sliding_window set, use_sliding_window false).
json qwen25() {
    return json::parse(R"({
      "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
      "max_position_embeddings": 32768, "max_window_layers": 21, "num_attention_heads": 14, "num_hidden_layers": 24,
      "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
      "tie_word_embeddings": true, "use_sliding_window": false, "vocab_size": 151936})");
}

fd::model::ModelConfig load(const json & j) {
    fd::test::TempDir d;
    std::ofstream(d.path / "config.json") << j.dump();
    return load_model_config(d.path);
}

/// load(j) throws invalid_checkpoint whose message contains every needle.
void refused(const json & j, const std::vector<std::string> & needles) {
    CAPTURE(j.dump());
    bool thrown = false;
    try {
        load(j);
    } catch (const fd::Error & e) {
        thrown = true;
        CHECK(e.code() == fd::Errc::invalid_checkpoint);
        const std::string msg = e.what();
        CAPTURE(msg);
        CHECK(msg.find("config.json") != std::string::npos);
        for (const auto & n : needles) { CHECK_MESSAGE(msg.find(n) != std::string::npos, "message lacks '" << n << "'"); }
    }
    CHECK_MESSAGE(thrown, "accepted a config that must be refused");
}

/// Plain RoPE frequencies, as transformers computes them.
float plain(double theta, int hd, int j) {
    return 1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * j) / static_cast<float>(hd));
}

}  // namespace

TEST_SUITE("model::model_config") {

TEST_CASE("llama3 rope_scaling inverse frequencies equal transformers' formula (Llama-3.1-8B and 3.2-1B values)") {
    // Reference: tests/e2e/np_llama.py rope_inv_freq (a numpy transcription of
    // transformers.modeling_rope_utils._compute_llama3_parameters), printed once with repr().
    json j = llama32();
    j["head_dim"] = 128;
    j["rope_scaling"]["factor"] = 8.0;  // Llama-3.1-8B
    auto c = load(j);
    CHECK(c.rope_scaling.type == RopeType::llama3);
    CHECK(c.rope_scaling.original_max_position_embeddings == 8192);
    auto inv = fd::model::rope_inv_freq(c);
    REQUIRE(inv.size() == 64);
    const std::vector<std::pair<int, double>> ref31 = {
        {0, 1.0}, {1, 0.8146172165870667},                                        // high frequency: unchanged
        {29, 0.0021665706299245358}, {30, 0.0013718936825171113}, {31, 0.0008567514596506953},
        {32, 0.0005248460220173001}, {33, 0.0003126936499029398}, {34, 0.0001785077911335975},  // smoothed
        {35, 9.556212899042293e-05}, {63, 3.068925877869333e-07}};                 // low: / factor
    for (auto [i, want] : ref31) {
        CAPTURE(i);
        CHECK(inv[i] == doctest::Approx(want).epsilon(2e-6));
    }
    c = load(llama32());  // Llama-3.2-1B: head_dim 64, factor 32
    inv = fd::model::rope_inv_freq(c);
    REQUIRE(inv.size() == 32);
    const std::vector<std::pair<int, double>> ref32 = {{0, 1.0}, {1, 0.6636012196540833}, {15, 0.0012905480107292533},
                                                       {16, 0.000429556705057621}, {17, 9.708286233944818e-05},
                                                       {18, 1.9461638657958247e-05}, {31, 9.41830720080361e-08}};
    for (auto [i, want] : ref32) {
        CAPTURE(i);
        CHECK(inv[i] == doctest::Approx(want).epsilon(2e-6));
    }
}

TEST_CASE("linear divides every frequency by factor; dynamic and default leave them; both spellings of the type") {
    json j = llama32();
    j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};  // the older spelling
    auto c = load(j);
    CHECK(c.rope_scaling.type == RopeType::linear);
    auto inv = fd::model::rope_inv_freq(c);
    for (int i = 0; i < 32; ++i) { CHECK(inv[i] == doctest::Approx(plain(500000.0, 64, i) / 4.0).epsilon(1e-6)); }
    j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
    c = load(j);
    CHECK(c.rope_scaling.type == RopeType::dynamic);
    inv = fd::model::rope_inv_freq(c);
    for (int i = 0; i < 32; ++i) { CHECK(inv[i] == plain(500000.0, 64, i)); }
    j["rope_scaling"] = {{"rope_type", "default"}};
    CHECK(load(j).rope_scaling.type == RopeType::plain);
    j["rope_scaling"] = nullptr;
    inv = fd::model::rope_inv_freq(load(j));
    for (int i = 0; i < 32; ++i) { CHECK(inv[i] == plain(500000.0, 64, i)); }
    // transformers v5 rope_parameters carries rope_theta too
    j.erase("rope_theta");
    j["rope_parameters"] = {{"rope_type", "linear"}, {"factor", 2.0}, {"rope_theta", 1000.0}};
    c = load(j);
    CHECK(c.rope_theta == 1000.0f);
    CHECK(fd::model::rope_inv_freq(c)[3] == doctest::Approx(plain(1000.0, 64, 3) / 2.0).epsilon(1e-6));
}

TEST_CASE("rope_scaling types other than default, linear, dynamic and llama3 are refused by name; bad parameters too") {
    for (const char * t : {"yarn", "longrope", "su", "mrope", "ntk"}) {
        json j = llama32();
        j["rope_scaling"] = {{"rope_type", t}, {"factor", 4.0}, {"original_max_position_embeddings", 4096}};
        refused(j, {"rope_scaling", std::string("'") + t + "'"});
    }
    json j = llama32();
    j["rope_scaling"].erase("low_freq_factor");
    refused(j, {"rope_scaling.low_freq_factor"});
    j = llama32();
    j["rope_scaling"]["high_freq_factor"] = 1.0;  // division by zero in the smoothing
    refused(j, {"high_freq_factor"});
    j = llama32();
    j["rope_scaling"] = {{"type", "linear"}};
    refused(j, {"rope_scaling.factor"});
    j = llama32();
    j["rope_scaling"] = "llama3";
    refused(j, {"rope_scaling"});
    j = llama32();
    j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}, {"original_max_position_embeddings", 4096}};
    refused(j, {"dynamic", "original_max_position_embeddings"});
    j = llama32();
    j["rope_theta"] = "500000";
    refused(j, {"rope_theta"});
}

TEST_CASE("rope_theta <= 0 and rms_norm_eps < 0 are refused naming the field (every logit was NaN, each request a 200)") {
    for (const json & theta : {json(0), json(-10000.0), json(1e300)}) {  // 1e300: inf as the f32 the forward uses
        json j = llama32();
        j["rope_theta"] = theta;
        refused(j, {"'rope_theta'"});
    }
    json j = qwen25();
    j.erase("rope_theta");
    j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 0.0}};  // transformers v5 keeps it there
    refused(j, {"'rope_theta'"});
    j = llama32();
    j["rms_norm_eps"] = -1e-5;
    refused(j, {"'rms_norm_eps'"});
    j["rms_norm_eps"] = 0;  // no epsilon: accepted
    CHECK(load(j).rms_norm_eps == 0.0f);
}

TEST_CASE("eos_token_id in config.json and generation_config.json: ids in [0, vocab) or a list of them; anything else refused") {
    const auto load_gen = [](const json & gen) {
        fd::test::TempDir d;
        std::ofstream(d.path / "config.json") << mistral().dump();
        std::ofstream(d.path / "generation_config.json") << gen.dump();
        return load_model_config(d.path);
    };
    CHECK(load_gen(json{{"eos_token_id", json::array({1, 2})}}).eos_token_ids == std::vector<int32_t>{1, 2});
    CHECK(load_gen(json{{"eos_token_id", 7}}).eos_token_ids == std::vector<int32_t>{7});
    CHECK(load_gen(json{{"eos_token_id", nullptr}}).eos_token_ids.empty());
    CHECK(load_gen(json::object()).eos_token_ids == std::vector<int32_t>{2});  // config.json's
    // each of these silently gave no stop id at all, and 2^32 + 1 wrapped to 1 (probes)
    for (const json & bad : {json::array({"1", 2}), json(1.0), json::array({json::array({2})}), json("2"), json(4294967297LL),
                           json(-1), json(32000), json(true)}) {
        CAPTURE(bad.dump());
        std::string what;
        CHECK(fd::test::error_of([&] { load_gen(json{{"eos_token_id", bad}}); }, &what) == fd::Errc::invalid_checkpoint);
        CHECK(what.find("generation_config.json: field 'eos_token_id'") != std::string::npos);
        json j = mistral();
        j["eos_token_id"] = bad;
        refused(j, {"config.json: field 'eos_token_id'"});
    }
    std::string what;
    CHECK(fd::test::error_of([&] { load_gen(json::array({1})); }, &what) == fd::Errc::invalid_checkpoint);
    CHECK(what.find("generation_config.json: not a JSON object") != std::string::npos);
}

TEST_CASE("read_generation_defaults: the sampling fields vLLM's --generation-config auto takes, refusing values out of range") {
    const auto defaults = [](const json & gen) {
        fd::test::TempDir d;
        std::ofstream(d.path / "generation_config.json") << gen.dump();
        return fd::model::read_generation_defaults(d.path);
    };
    {
        fd::test::TempDir d;  // no file: none
        CHECK(fd::model::read_generation_defaults(d.path).empty());
    }
    CHECK(defaults(json{{"bos_token_id", 1}, {"eos_token_id", json::array({1, 2})}}).empty());  // stories260K's: stop ids only
    // Qwen3-8B's generation_config.json
    auto g = defaults(json::parse(R"({"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [151645, 151643]})"));
    CHECK(g.temperature == 0.6f);
    CHECK(g.top_k == 20);
    CHECK(g.top_p == 0.95f);
    CHECK((!g.min_p && !g.repetition_penalty && !g.max_new_tokens));
    CHECK(g.describe() == "temperature=0.6, top_k=20, top_p=0.95");
    // transformers' own defaults are not taken (vLLM reads to_diff_dict()), nor nulls
    g = defaults(json{{"temperature", 1.0}, {"top_p", 1}, {"top_k", 50}, {"repetition_penalty", 1.0}, {"min_p", nullptr},
                      {"max_new_tokens", nullptr}});
    CHECK(g.empty());
    g = defaults(json{{"temperature", 0}, {"min_p", 0.05}, {"repetition_penalty", 1.1}, {"max_new_tokens", 2048}, {"top_k", 0}});
    CHECK(g.temperature == 0.0f);
    CHECK(g.min_p == 0.05f);
    CHECK(g.repetition_penalty == 1.1f);
    CHECK(g.max_new_tokens == 2048);
    CHECK(g.top_k == 0);
    CHECK(g.describe() == "repetition_penalty=1.1, temperature=0, top_k=0, min_p=0.05, max_tokens=2048");
    for (const auto & [key, bad] : std::vector<std::pair<std::string, json>>{
             {"temperature", -0.1}, {"temperature", "0.7"}, {"top_p", 0}, {"top_p", 1.5}, {"top_k", -2}, {"top_k", 2.5},
             {"min_p", 2}, {"repetition_penalty", 0}, {"max_new_tokens", 0}, {"max_new_tokens", 1.5}, {"top_k", true}}) {
        CAPTURE(key);
        CAPTURE(bad.dump());
        std::string what;
        CHECK(fd::test::error_of([&] { defaults(json{{key, bad}}); }, &what) == fd::Errc::invalid_checkpoint);
        CHECK(what.find("generation_config.json: field '" + key + "'") != std::string::npos);
    }
}

TEST_CASE("override_generation_defaults: vLLM's --override-generation-config, the config updated by the override's fields") {
    fd::model::GenerationDefaults base;
    base.temperature = 0.6f;
    base.top_k       = 20;
    std::vector<std::string> ignored;
    // as given (1.0 is taken: vLLM updates the diff dict with the override), a null clears the
    // model's, keys that are not sampling fields are not taken and are named
    auto g = fd::model::override_generation_defaults(base, R"({"temperature": 1.0, "top_k": null, "max_new_tokens": 64, "do_sample": true})",
                                                     &ignored);
    CHECK(g.temperature == 1.0f);
    CHECK(!g.top_k);
    CHECK(g.max_new_tokens == 64);
    CHECK(g.describe() == "temperature=1, max_tokens=64");
    CHECK(ignored == std::vector<std::string>{"do_sample"});
    CHECK(fd::model::override_generation_defaults({}, "{}").empty());
    for (const std::string bad : {R"({"top_p": 0})", R"({"temperature": "0.7"})", R"({"max_new_tokens": 1.5})", "[1]", "{temperature: 1}",
                                R"({"temperature": 1e400})"}) {
        CAPTURE(bad);
        std::string what;
        CHECK(fd::test::error_of([&] { fd::model::override_generation_defaults(base, bad); }, &what) == fd::Errc::invalid_argument);
        CHECK(what.find("--override-generation-config") != std::string::npos);
    }
}

TEST_CASE("Qwen3: q_norm/k_norm [head_dim] tensors, head_dim 128 != hidden/heads (and its default), no q/k/v bias") {
    auto c = load(qwen3());
    CHECK(c.arch == fd::model::Arch::qwen3);
    CHECK(c.qk_norm);
    CHECK_FALSE(c.qkv_bias);
    CHECK(c.head_dim == 128);
    CHECK(c.q_dim() == 2048);
    CHECK(c.tie_word_embeddings);
    CHECK(c.sliding_window == 0);
    std::map<std::string, std::vector<int64_t>> shape;
    for (const auto & t : fd::model::expected_tensors(c)) { shape[t.name] = t.shape; }
    CHECK(shape.at("model.layers.27.self_attn.q_norm.weight") == std::vector<int64_t>{128});
    CHECK(shape.at("model.layers.0.self_attn.k_norm.weight") == std::vector<int64_t>{128});
    CHECK(shape.at("model.layers.0.self_attn.q_proj.weight") == std::vector<int64_t>{2048, 1024});
    CHECK(shape.count("model.layers.0.self_attn.q_proj.bias") == 0);
    json j = qwen3();
    j.erase("head_dim");
    CHECK(load(j).head_dim == 128);  // Qwen3Config's default
    j = qwen3();
    j["attention_bias"] = true;
    refused(j, {"attention_bias"});
}

TEST_CASE("MiMo: a Qwen2 decoder whose num_nextn_predict_layers MTP layers are in the state dict (vLLM mimo_mtp.py names)") {
    // MiMo-7B's config.json fields (sizes small): Qwen2 plus num_nextn_predict_layers.
    json j = qwen25();
    j["architectures"] = {"MiMoForCausalLM"};
    j["num_nextn_predict_layers"] = 1;
    auto c = load(j);
    CHECK(c.arch == fd::model::Arch::qwen2);
    CHECK(c.qkv_bias);
    CHECK(c.n_mtp_layers == 1);
    std::map<std::string, std::vector<int64_t>> shape;
    for (const auto & t : fd::model::expected_tensors(c)) { shape[t.name] = t.shape; }
    const std::string p = "model.mtp_layers.0.";
    CHECK(shape.at(p + "input_proj.weight") == std::vector<int64_t>{896, 2 * 896});  // [hidden | token] -> hidden
    for (const char * norm : {"token_layernorm.weight", "hidden_layernorm.weight", "final_layernorm.weight", "input_layernorm.weight",
                              "post_attention_layernorm.weight"}) {
        CHECK(shape.at(p + norm) == std::vector<int64_t>{896});
    }
    CHECK(shape.at(p + "self_attn.q_proj.weight") == std::vector<int64_t>{896, 896});
    CHECK(shape.at(p + "self_attn.k_proj.bias") == std::vector<int64_t>{128});
    CHECK(shape.at(p + "mlp.down_proj.weight") == std::vector<int64_t>{896, 4864});
    CHECK(shape.count("model.mtp_layers.1.input_proj.weight") == 0);
    CHECK(shape.count("model.layers.24.input_layernorm.weight") == 0);
    // The inference layout fuses the block's q|k|v and gate|up like the decoder's.
    j["num_nextn_predict_layers"] = 0;
    CHECK(load(j).n_mtp_layers == 0);
    auto q2 = load(qwen25());
    CHECK(q2.n_mtp_layers == 0);  // a Qwen2 checkpoint never has them
    j["num_nextn_predict_layers"] = -1;
    refused(j, {"num_nextn_predict_layers"});
}

TEST_CASE("Mistral: Llama math; an active sliding_window limits max_model_len, naming the field") {
    auto c = load(mistral());
    CHECK(c.arch == fd::model::Arch::mistral);
    CHECK_FALSE(c.qkv_bias);
    CHECK_FALSE(c.qk_norm);
    CHECK(c.sliding_window == 4096);
    CHECK_FALSE(fd::model::check_max_model_len(c, 4096));
    const auto why = fd::model::check_max_model_len(c, 4097);
    REQUIRE(why);
    CHECK(why->find("sliding_window = 4096") != std::string::npos);
    CHECK(why->find("--max-model-len 4096") != std::string::npos);
    json j = mistral();
    j["sliding_window"] = nullptr;  // v0.2 / v0.3
    c = load(j);
    CHECK(c.sliding_window == 0);
    CHECK_FALSE(fd::model::check_max_model_len(c, 32768));
    j["sliding_window"] = -5;
    refused(j, {"sliding_window"});
}

TEST_CASE("Qwen2/Qwen3 sliding windows count only when use_sliding_window reaches a layer (transformers' layer_types)") {
    CHECK(load(qwen25()).sliding_window == 0);  // use_sliding_window false
    json j = qwen25();
    j["use_sliding_window"] = true;             // max_window_layers 21 < 24 layers: layers 21..23 slide
    auto c = load(j);
    CHECK(c.sliding_window == 32768);
    CHECK(c.sliding_window_field.find("use_sliding_window") != std::string::npos);
    CHECK(fd::model::check_max_model_len(c, 32769));
    CHECK_FALSE(fd::model::check_max_model_len(c, 32768));
    j["max_window_layers"] = 24;                // no layer slides
    CHECK(load(j).sliding_window == 0);
    j["layer_types"] = json::array();
    for (int i = 0; i < 24; ++i) { j["layer_types"].push_back(i == 5 ? "sliding_attention" : "full_attention"); }
    CHECK(load(j).sliding_window == 32768);     // explicit layer_types win
    j = qwen3();
    j["use_sliding_window"] = true;
    j["sliding_window"] = 4096;
    j["max_window_layers"] = 0;
    CHECK(load(j).sliding_window == 4096);
}

TEST_CASE("fields that change the math and are not implemented are refused, naming the field") {
    json j = llama32();
    j["attention_bias"] = true;
    refused(j, {"attention_bias"});
    j = llama32();
    j["mlp_bias"] = true;
    refused(j, {"mlp_bias"});
    j = llama32();
    j["hidden_act"] = "gelu";
    refused(j, {"hidden_act", "gelu"});
    j = mistral();
    j["num_local_experts"] = 8;  // Mixtral's field
    refused(j, {"num_local_experts"});
    j = qwen3();
    j["num_experts"] = 128;      // Qwen3-MoE's field
    refused(j, {"num_experts"});
    j = llama32();
    j["n_routed_experts"] = 64;
    refused(j, {"n_routed_experts"});
    j = qwen25();
    j["quantization_config"] = {{"quant_method", "awq"}, {"bits", 4}};
    refused(j, {"quantization_config", "awq"});
    j = llama32();
    j["partial_rotary_factor"] = 0.5;
    refused(j, {"partial_rotary_factor"});
    j = llama32();
    j["tie_word_embeddings"] = "yes";
    refused(j, {"tie_word_embeddings"});
    // What transformers itself ignores for the architecture, or what does not change the math, loads.
    j = llama32();
    j["pretraining_tp"] = 2;
    j["sliding_window"] = 16;       // LlamaAttention has no sliding window
    j["num_experts"] = 0;
    CHECK(load(j).sliding_window == 0);
    j = mistral();
    j["attention_bias"] = false;
    j["bos_token_id"] = nullptr;  // some real configs
    CHECK(load(j).bos_token_id == 1);
}

}  // TEST_SUITE
