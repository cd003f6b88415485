#include "fd/checkpoint/model_config.h"

#include "fd/file_io.h"
#include "fd/status.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <type_traits>

namespace fd::model {
namespace {

using nlohmann::json;
using std::filesystem::path;

json read_json(const path & file) {
    const auto text = read_small_file(file, 64 << 20, Errc::invalid_checkpoint);
    if (!text) { fail(Errc::invalid_checkpoint, "{}: cannot open: no such file", file.string()); }
    try {
        return json::parse(*text);
    } catch (const json::exception & e) {
        fail(Errc::invalid_checkpoint, "{}: not valid JSON: {}", file.string(), e.what());
    }
}

bool absent(const json & j, const char * key) {
    auto it = j.find(key);
    return it == j.end() || it->is_null();
}

int32_t get_int(const json & j, const char * key, const path & file, std::optional<int32_t> dflt = std::nullopt) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) {
        if (dflt) { return *dflt; }
        fail(Errc::invalid_checkpoint, "{}: missing field '{}'", file.string(), key);
    }
    if (!it->is_number_integer() || it->get<int64_t>() <= 0 || it->get<int64_t>() > (1 << 30)) {
        fail(Errc::invalid_checkpoint, "{}: field '{}' must be a positive integer", file.string(), key);
    }
    return it->get<int32_t>();
}

/// A finite number (`key` of `j`, reported as `where`), or `dflt` when absent.
double get_number(const json & j, const char * key, const path & file, std::optional<double> dflt,
                  const std::string & where = {}) {
    auto it = j.find(key);
    const std::string name = where.empty() ? key : where + "." + key;
    if (it == j.end() || it->is_null()) {
        if (dflt) { return *dflt; }
        fail(Errc::invalid_checkpoint, "{}: missing field '{}'", file.string(), name);
    }
    if (!it->is_number() || !std::isfinite(it->get<double>())) {
        fail(Errc::invalid_checkpoint, "{}: field '{}' must be a number, got {}", file.string(), name, it->dump());
    }
    return it->get<double>();
}

bool get_bool(const json & j, const char * key, const path & file) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) { return false; }
    if (!it->is_boolean()) { fail(Errc::invalid_checkpoint, "{}: field '{}' must be true or false, got {}", file.string(), key, it->dump()); }
    return it->get<bool>();
}

/// A token id list field (`key` of `file`): an id or a list of ids, each an integer in
/// [0, vocab_size); null = none. Anything else (a string, a float, a nested list, an id past the
/// vocabulary or int32) is refused naming the file and field: dropping it silently meant no stop id.
std::vector<int32_t> id_list(const json & v, const path & file, const char * key, int32_t vocab_size) {
    std::vector<int32_t> out;
    if (v.is_null()) { return out; }
    const auto one = [&](const json & e) {
        if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() >= vocab_size) {
            fail(Errc::invalid_checkpoint, "{}: field '{}' must be a token id or a list of token ids, integers in [0, vocab_size {}), got {}",
                 file.string(), key, vocab_size, v.dump());
        }
        out.push_back(static_cast<int32_t>(e.get<int64_t>()));
    };
    if (v.is_array()) {
        for (const auto & e : v) { one(e); }
    } else {
        one(v);
    }
    return out;
}

/// rope_scaling (transformers <= 4.x) or rope_parameters (v5, which also holds rope_theta).
void parse_rope(const json & j, const path & file, ModelConfig & c) {
    std::string where = "rope_scaling";
    const json * rs = nullptr;
    if (!absent(j, "rope_parameters")) {
        where = "rope_parameters";
        rs    = &j["rope_parameters"];
    } else if (!absent(j, "rope_scaling")) {
        rs = &j["rope_scaling"];
    }
    if (rs == nullptr) { return; }
    if (!rs->is_object()) {
        fail(Errc::invalid_checkpoint, "{}: field '{}' must be an object or null, got {}", file.string(), where, rs->dump());
    }
    if (where == "rope_parameters") { c.rope_theta = static_cast<float>(get_number(*rs, "rope_theta", file, c.rope_theta, where)); }
    if (!absent(*rs, "partial_rotary_factor") && get_number(*rs, "partial_rotary_factor", file, 1.0, where) != 1.0) {
        fail(Errc::invalid_checkpoint, "{}: {}.partial_rotary_factor {} is not supported (RoPE over the whole head only)",
             file.string(), where, (*rs)["partial_rotary_factor"].dump());
    }
    // transformers: rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    const char * type_key = rs->contains("rope_type") ? "rope_type" : "type";
    const json   type     = rs->value(type_key, json("default"));
    if (!type.is_string()) {
        fail(Errc::invalid_checkpoint, "{}: field '{}.{}' must be a string, got {}", file.string(), where, type_key, type.dump());
    }
    RopeScaling & r = c.rope_scaling;
    r.name = type.get<std::string>();
    auto factor = [&] {
        const double f = get_number(*rs, "factor", file, std::nullopt, where);
        if (f <= 0) { fail(Errc::invalid_checkpoint, "{}: field '{}.factor' must be > 0, got {}", file.string(), where, f); }
        return f;
    };
    if (r.name == "default") {
        r.type = RopeType::plain;
    } else if (r.name == "linear") {
        r.type   = RopeType::linear;
        r.factor = factor();
    } else if (r.name == "dynamic") {
        r.type   = RopeType::dynamic;
        r.factor = factor();
        // HF scales the base only once a sequence passes max_position_embeddings (which
        // max_model_len never does); a config that asks for another threshold is not that.
        if (!absent(*rs, "original_max_position_embeddings")) {
            const int32_t o = get_int(*rs, "original_max_position_embeddings", file);
            if (o < c.max_position_embeddings) {
                fail(Errc::invalid_checkpoint, "{}: {} type 'dynamic' with original_max_position_embeddings {} < "
                     "max_position_embeddings {} is not supported", file.string(), where, o, c.max_position_embeddings);
            }
        }
    } else if (r.name == "llama3") {
        r.type             = RopeType::llama3;
        r.factor           = factor();
        r.low_freq_factor  = get_number(*rs, "low_freq_factor", file, std::nullopt, where);
        r.high_freq_factor = get_number(*rs, "high_freq_factor", file, std::nullopt, where);
        r.original_max_position_embeddings = get_int(*rs, "original_max_position_embeddings", file);
        if (!(r.low_freq_factor > 0 && r.high_freq_factor > r.low_freq_factor)) {
            fail(Errc::invalid_checkpoint, "{}: {} type 'llama3' needs 0 < low_freq_factor < high_freq_factor, got {} and {}",
                 file.string(), where, r.low_freq_factor, r.high_freq_factor);
        }
    } else {
        fail(Errc::invalid_checkpoint, "{}: {} type '{}' is not supported (supported: default, linear, dynamic, llama3)",
             file.string(), where, r.name);
    }
}

/// The MoE fields of Qwen3MoeConfig / Qwen2MoeConfig / MixtralConfig (MoeConfig), checked
/// against each other; a routing scheme other than softmax → top-k is refused naming the field.
void parse_moe(const json & j, const path & file, ModelConfig & c) {
    if (c.arch != Arch::qwen3_moe && c.arch != Arch::qwen2_moe && c.arch != Arch::mixtral) { return; }
    const std::string f = file.string();
    MoeConfig & m = c.moe;
    const bool mixtral = c.arch == Arch::mixtral;
    // MixtralConfig names the count num_local_experts, the Qwen configs num_experts (and
    // transformers maps each name onto the other): both given must agree.
    const char * count_key = mixtral ? "num_local_experts" : "num_experts";
    const char * other_key = mixtral ? "num_experts" : "num_local_experts";
    auto count = [&](const char * key) -> int64_t {
        const json & v = j[key];
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (1 << 20)) {
            fail(Errc::invalid_checkpoint, "{}: field '{}' must be a positive integer, got {}", f, key, v.dump());
        }
        return v.get<int64_t>();
    };
    if (absent(j, count_key) && absent(j, other_key)) {
        fail(Errc::invalid_checkpoint, "{}: {} needs field '{}' (the number of experts)", f, c.architecture, count_key);
    }
    const int64_t n = !absent(j, count_key) ? count(count_key) : count(other_key);
    if (!absent(j, count_key) && !absent(j, other_key) && count(other_key) != n) {
        fail(Errc::invalid_checkpoint, "{}: inconsistent expert counts: '{}' = {} but '{}' = {}", f, count_key, n, other_key,
             count(other_key));
    }
    if (n == 0) {
        fail(Errc::invalid_checkpoint, "{}: field '{}' is 0: {} needs experts (serve a dense checkpoint with its dense "
             "architecture)", f, count_key, c.architecture);
    }
    m.n_experts = static_cast<int32_t>(n);
    if (!absent(j, "num_experts_per_tok") && j["num_experts_per_tok"].is_number_integer() && j["num_experts_per_tok"].get<int64_t>() == 0) {
        fail(Errc::invalid_checkpoint, "{}: field 'num_experts_per_tok' is 0: every token must go to at least one expert", f);
    }
    m.top_k = get_int(j, "num_experts_per_tok", file, mixtral ? 2 : c.arch == Arch::qwen2_moe ? 4 : 8);
    if (m.top_k > m.n_experts) {
        fail(Errc::invalid_checkpoint, "{}: field 'num_experts_per_tok' = {} is more than the {} experts ('{}')", f, m.top_k,
             m.n_experts, count_key);
    }
    if (mixtral) {
        m.intermediate     = c.intermediate_size;  // MixtralBlockSparseTop2MLP: ffn_dim = intermediate_size
        m.norm_topk_prob   = true;                 // softmax then top-k then renormalise, always
        m.prefix           = "block_sparse_moe";
        m.gate_name        = "w1";
        m.up_name          = "w3";
        m.down_name        = "w2";
        m.sparse_layer.assign(static_cast<size_t>(c.n_layers), true);
    } else {
        m.intermediate   = get_int(j, "moe_intermediate_size", file);
        m.norm_topk_prob = get_bool(j, "norm_topk_prob", file);  // both Qwen configs default to false
        if (c.arch == Arch::qwen2_moe && !absent(j, "shared_expert_intermediate_size")) {
            m.shared_intermediate = get_int(j, "shared_expert_intermediate_size", file);
        } else if (c.arch == Arch::qwen2_moe) {
            m.shared_intermediate = 5632;  // Qwen2MoeConfig's default
        }
        const json step = j.value("decoder_sparse_step", json(1));
        if (!step.is_number_integer() || step.get<int64_t>() < 1) {
            fail(Errc::invalid_checkpoint, "{}: field 'decoder_sparse_step' must be a positive integer, got {}", f, step.dump());
        }
        std::vector<bool> mlp_only(static_cast<size_t>(c.n_layers), false);
        if (!absent(j, "mlp_only_layers")) {
            if (!j["mlp_only_layers"].is_array()) {
                fail(Errc::invalid_checkpoint, "{}: field 'mlp_only_layers' must be a list of layer indices, got {}", f,
                     j["mlp_only_layers"].dump());
            }
            for (const json & l : j["mlp_only_layers"]) {
                if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= c.n_layers) {
                    fail(Errc::invalid_checkpoint, "{}: field 'mlp_only_layers' holds {}, not a layer index in [0, {})", f, l.dump(),
                         c.n_layers);
                }
                mlp_only[l.get<size_t>()] = true;
            }
        }
        m.sparse_layer.resize(static_cast<size_t>(c.n_layers));
        for (int il = 0; il < c.n_layers; ++il) {  // Qwen{2,3}MoeDecoderLayer.__init__
            m.sparse_layer[static_cast<size_t>(il)] = !mlp_only[static_cast<size_t>(il)] && (il + 1) % step.get<int64_t>() == 0;
        }
    }
    // Routing schemes of other MoE families (DeepSeek, GLM, ...): not softmax → top-k.
    if (!absent(j, "scoring_func") && j["scoring_func"] != json("softmax")) {
        fail(Errc::invalid_checkpoint, "{}: 'scoring_func': {} is not supported (softmax routing only)", f, j["scoring_func"].dump());
    }
    if (!absent(j, "topk_method") && j["topk_method"] != json("greedy")) {
        fail(Errc::invalid_checkpoint, "{}: 'topk_method': {} is not supported (plain top-k routing only)", f, j["topk_method"].dump());
    }
    for (const char * grouped : {"n_group", "topk_group"}) {
        if (!absent(j, grouped) && !(j[grouped].is_number_integer() && j[grouped].get<int64_t>() <= 1)) {
            fail(Errc::invalid_checkpoint, "{}: '{}': {} (group-limited routing) is not supported", f, grouped, j[grouped].dump());
        }
    }
    if (!absent(j, "routed_scaling_factor") && get_number(j, "routed_scaling_factor", file, 1.0) != 1.0) {
        fail(Errc::invalid_checkpoint, "{}: 'routed_scaling_factor': {} is not supported (expert weights are not rescaled)", f,
             j["routed_scaling_factor"].dump());
    }
    for (const char * shared : {"n_shared_experts", "num_shared_experts"}) {
        if (!absent(j, shared) && !(j[shared].is_number() && j[shared].get<double>() == 0)) {
            fail(Errc::invalid_checkpoint, "{}: '{}': {} is not supported for {} (Qwen2-MoE's shared_expert_intermediate_size is)",
                 f, shared, j[shared].dump(), c.architecture);
        }
    }
}

/// Fields that change the math and are not implemented: a start-up error naming each.
void refuse_unsupported(const json & j, const path & file, ModelConfig & c) {
    const std::string f = file.string();
    const std::string act = j.contains("hidden_act") && j["hidden_act"].is_string() ? j["hidden_act"].get<std::string>()
                                                                                   : absent(j, "hidden_act") ? "silu" : j["hidden_act"].dump();
    if (act != "silu") { fail(Errc::invalid_checkpoint, "{}: hidden_act '{}' is not supported (silu only)", f, act); }
    for (const char * moe : {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}) {
        if (!c.moe.enabled() && !absent(j, moe) && !(j[moe].is_number() && j[moe].get<double>() == 0)) {
            fail(Errc::invalid_checkpoint, "{}: '{}': {} — {} is a dense architecture; mixture-of-experts models are served as "
                 "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM or MixtralForCausalLM", f, moe, j[moe].dump(), c.architecture);
        }
    }
    if (!absent(j, "quantization_config")) {
        const json & q = j["quantization_config"];
        fail(Errc::invalid_checkpoint, "{}: 'quantization_config' ({}) is not supported: fdrollout serves F32/BF16/F16 weights", f,
             q.is_object() && q.contains("quant_method") ? q["quant_method"].dump() : q.dump());
    }
    if (!absent(j, "partial_rotary_factor") && get_number(j, "partial_rotary_factor", file, 1.0) != 1.0) {
        fail(Errc::invalid_checkpoint, "{}: partial_rotary_factor {} is not supported (RoPE over the whole head only)", f,
             j["partial_rotary_factor"].dump());
    }
    // attention_bias: Llama and Qwen3 put biases on q/k/v/o (HF); Qwen2 always has q/k/v
    // biases and no field; Mistral has none and ignores the field.
    if ((c.arch == Arch::llama || c.arch == Arch::qwen3 || c.arch == Arch::qwen3_moe) && get_bool(j, "attention_bias", file)) {
        fail(Errc::invalid_checkpoint, "{}: 'attention_bias': true is not supported for {} (biases on q/k/v/o_proj)", f, c.architecture);
    }
    if (c.arch == Arch::llama && get_bool(j, "mlp_bias", file)) {
        fail(Errc::invalid_checkpoint, "{}: 'mlp_bias': true is not supported (biases on gate/up/down_proj)", f);
    }
    // Sliding-window attention (not implemented; fine while max_model_len <= the window).
    if ((c.arch == Arch::mistral || c.arch == Arch::mixtral) && !absent(j, "sliding_window")) {
        c.sliding_window       = get_int(j, "sliding_window", file);
        c.sliding_window_field = "sliding_window";
    }
    const bool qwen = c.arch == Arch::qwen2 || c.arch == Arch::qwen3 || c.arch == Arch::qwen2_moe || c.arch == Arch::qwen3_moe;
    if (qwen && get_bool(j, "use_sliding_window", file) && !absent(j, "sliding_window")) {
        bool any = false;
        if (!absent(j, "layer_types")) {
            if (!j["layer_types"].is_array()) { fail(Errc::invalid_checkpoint, "{}: field 'layer_types' must be a list", f); }
            for (const auto & t : j["layer_types"]) { any = any || t == "sliding_attention"; }
        } else {  // transformers: layer i slides when use_sliding_window and i >= max_window_layers
            const json mwl = j.value("max_window_layers", json(28));  // Qwen2Config's default
            if (!mwl.is_number_integer() || mwl.get<int64_t>() < 0) {
                fail(Errc::invalid_checkpoint, "{}: field 'max_window_layers' must be a non-negative integer, got {}", f, mwl.dump());
            }
            any = mwl.get<int64_t>() < c.n_layers;
        }
        if (any) {
            c.sliding_window       = get_int(j, "sliding_window", file);
            c.sliding_window_field = "use_sliding_window with sliding_window";
        }
    }
}

}  // namespace

ModelConfig load_model_config(const path & dir) {
    const auto file = dir / "config.json";
    const json j    = read_json(file);
    if (!j.is_object()) { fail(Errc::invalid_checkpoint, "{}: not a JSON object", file.string()); }
    ModelConfig c;
    const auto archs = j.value("architectures", json::array());
    c.architecture   = archs.is_array() && !archs.empty() && archs[0].is_string() ? archs[0].get<std::string>() : "";
    if (c.architecture == "LlamaForCausalLM") {
        c.arch = Arch::llama;
    } else if (c.architecture == "Qwen2ForCausalLM" || c.architecture == "MiMoForCausalLM") {
        c.arch     = Arch::qwen2;  // MiMo: a Qwen2 decoder plus num_nextn_predict_layers MTP layers
        c.qkv_bias = true;
    } else if (c.architecture == "Qwen3ForCausalLM") {
        c.arch    = Arch::qwen3;
        c.qk_norm = true;
    } else if (c.architecture == "MistralForCausalLM") {
        c.arch = Arch::mistral;
    } else if (c.architecture == "Qwen3MoeForCausalLM") {
        c.arch    = Arch::qwen3_moe;
        c.qk_norm = true;
    } else if (c.architecture == "Qwen2MoeForCausalLM") {
        c.arch     = Arch::qwen2_moe;
        c.qkv_bias = j.value("qkv_bias", json(true)) != json(false);  // Qwen2MoeConfig.qkv_bias, default true
    } else if (c.architecture == "MixtralForCausalLM") {
        c.arch = Arch::mixtral;
    } else {
        fail(Errc::invalid_checkpoint,
             "{}: unsupported architecture '{}' (supported: LlamaForCausalLM, Qwen2ForCausalLM, MiMoForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, "
             "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM)",
             file.string(), c.architecture);
    }
    c.vocab_size        = get_int(j, "vocab_size", file);
    c.hidden_size       = get_int(j, "hidden_size", file);
    // A Qwen MoE model whose every layer is sparse never reads intermediate_size (HF defaults it).
    c.intermediate_size = get_int(j, "intermediate_size", file,
                                  c.arch == Arch::qwen3_moe ? std::optional<int32_t>(6144)
                                  : c.arch == Arch::qwen2_moe ? std::optional<int32_t>(5632) : std::nullopt);
    c.n_layers          = get_int(j, "num_hidden_layers", file);
    c.n_heads           = get_int(j, "num_attention_heads", file);
    c.n_kv_heads        = get_int(j, "num_key_value_heads", file, c.n_heads);
    // Qwen3Config's head_dim defaults to 128; the others derive it.
    c.head_dim          = get_int(j, "head_dim", file, c.arch == Arch::qwen3 ? 128 : c.hidden_size / c.n_heads);  // Qwen3Moe: derived
    c.max_position_embeddings = get_int(j, "max_position_embeddings", file, 2048);
    c.rms_norm_eps      = static_cast<float>(get_number(j, "rms_norm_eps", file, 1e-6));
    c.rope_theta        = static_cast<float>(get_number(j, "rope_theta", file, 10000.0));
    c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", file);
    if (c.n_heads % c.n_kv_heads != 0) {
        fail(Errc::invalid_checkpoint, "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
             file.string(), c.n_heads, c.n_kv_heads);
    }
    if (c.head_dim % 2 != 0) { fail(Errc::invalid_checkpoint, "{}: head_dim {} must be even for RoPE", file.string(), c.head_dim); }
    parse_rope(j, file, c);  // rope_parameters may hold rope_theta
    // The forward divides by theta^(2j/d) and sqrt(mean + eps): either out of range makes every
    // logit NaN (each request "succeeds" with token 0), so refuse them here, as rope_scaling.factor.
    if (!(c.rope_theta > 0) || !std::isfinite(c.rope_theta)) {
        fail(Errc::invalid_checkpoint, "{}: field 'rope_theta' must be > 0 (a finite float), got {}", file.string(), c.rope_theta);
    }
    if (!(c.rms_norm_eps >= 0) || !std::isfinite(c.rms_norm_eps)) {
        fail(Errc::invalid_checkpoint, "{}: field 'rms_norm_eps' must be >= 0 (a finite float), got {}", file.string(), c.rms_norm_eps);
    }
    parse_moe(j, file, c);
    refuse_unsupported(j, file, c);
    if (c.architecture == "MiMoForCausalLM") {
        const bool zero = j.contains("num_nextn_predict_layers") && j["num_nextn_predict_layers"] == json(0);
        c.n_mtp_layers  = zero ? 0 : get_int(j, "num_nextn_predict_layers", file, 0);
    }
    if (j.contains("bos_token_id") && j["bos_token_id"].is_number_integer()) { c.bos_token_id = j["bos_token_id"]; }  // may be null
    if (j.contains("eos_token_id")) { c.eos_token_ids = id_list(j["eos_token_id"], file, "eos_token_id", c.vocab_size); }

    const auto gen_file = dir / "generation_config.json";
    if (std::filesystem::exists(gen_file)) {
        const json g = read_json(gen_file);
        if (!g.is_object()) { fail(Errc::invalid_checkpoint, "{}: not a JSON object", gen_file.string()); }
        if (g.contains("eos_token_id")) { c.eos_token_ids = id_list(g["eos_token_id"], gen_file, "eos_token_id", c.vocab_size); }
        if (g.contains("bos_token_id") && g["bos_token_id"].is_number_integer()) { c.bos_token_id = g["bos_token_id"]; }
    }
    return c;
}

namespace {

/// The sampling fields of `g` into `d` (GenerationDefaults). `diff`: a value equal to
/// transformers' own default is not taken (the file, as vLLM reads GenerationConfig.to_diff_dict());
/// `null_unsets`: a null clears the field (an override, as vLLM's dict update does), else null is
/// not taken. A value out of range fails with `code`, naming `where` and the field, then `hint`.
void sampling_fields(const json & g, const std::string & where, Errc code, bool diff, bool null_unsets, const char * hint,
                     GenerationDefaults & d) {
    const auto number = [&](const char * key, std::optional<double> hf, const char * range, auto ok, auto & field) {
        auto it = g.find(key);
        if (it == g.end()) { return; }
        if (it->is_null()) {
            if (null_unsets) { field.reset(); }
            return;
        }
        const double v = it->is_number() ? it->get<double>() : std::nan("");
        if (!std::isfinite(v) || !ok(v)) { fail(code, "{}: field '{}' must be {}, got {}{}", where, key, range, it->dump(), hint); }
        if (diff && hf && v == *hf) { return; }
        field = static_cast<typename std::remove_reference_t<decltype(field)>::value_type>(v);
    };
    const auto integral = [](double v) { return v == std::floor(v) && std::abs(v) <= (1 << 30); };
    number("temperature", 1.0, "in [0, 100]", [](double x) { return x >= 0 && x <= 100; }, d.temperature);
    number("top_p", 1.0, "in (0, 1]", [](double x) { return x > 0 && x <= 1; }, d.top_p);
    number("top_k", 50.0, "an integer >= -1", [&](double x) { return integral(x) && x >= -1; }, d.top_k);
    number("min_p", std::nullopt, "in [0, 1]", [](double x) { return x >= 0 && x <= 1; }, d.min_p);
    number("repetition_penalty", 1.0, "in (0, 100]", [](double x) { return x > 0 && x <= 100; }, d.repetition_penalty);
    number("max_new_tokens", std::nullopt, "an integer >= 1", [&](double x) { return integral(x) && x >= 1; }, d.max_new_tokens);
}

constexpr const char * kSamplingKeys[] = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens"};

}  // namespace

GenerationDefaults read_generation_defaults(const path & dir) {
    GenerationDefaults d;
    const auto file = dir / "generation_config.json";
    if (!std::filesystem::exists(file)) { return d; }
    const json g = read_json(file);
    if (!g.is_object()) { fail(Errc::invalid_checkpoint, "{}: not a JSON object", file.string()); }
    sampling_fields(g, file.string(), Errc::invalid_checkpoint, /*diff=*/true, /*null_unsets=*/false,
                    " (start with --generation-config vllm to ignore the model's sampling defaults)", d);
    return d;
}

GenerationDefaults override_generation_defaults(GenerationDefaults base, const std::string & overrides, std::vector<std::string> * ignored) {
    json g;
    try {
        g = json::parse(overrides);
    } catch (const json::exception & e) {  // parse_error, and out_of_range for a number past a double (1e400)
        fail(Errc::invalid_argument, "--override-generation-config: not JSON ({}); e.g. '{{\"temperature\": 0.6}}'", e.what());
    }
    if (!g.is_object()) { fail(Errc::invalid_argument, "--override-generation-config: a JSON object is expected, got {}", g.dump()); }
    sampling_fields(g, "--override-generation-config", Errc::invalid_argument, /*diff=*/false, /*null_unsets=*/true, "", base);
    if (ignored) {
        for (const auto & [key, value] : g.items()) {
            if (std::find(std::begin(kSamplingKeys), std::end(kSamplingKeys), key) == std::end(kSamplingKeys)) { ignored->push_back(key); }
        }
    }
    return base;
}

std::string GenerationDefaults::describe() const {
    std::string out;
    const auto add = [&](const char * name, const auto & v) {
        if (v) { out += fmt::format("{}{}={}", out.empty() ? "" : ", ", name, *v); }
    };
    add("repetition_penalty", repetition_penalty);
    add("temperature", temperature);
    add("top_k", top_k);
    add("top_p", top_p);
    add("min_p", min_p);
    add("max_tokens", max_new_tokens);
    return out;
}

bool ModelConfig::has_dense_layer() const {
    for (int il = 0; il < n_layers; ++il) {
        if (!is_moe_layer(il)) { return true; }
    }
    return false;
}

std::optional<std::string> check_max_model_len(const ModelConfig & c, int32_t max_model_len) {
    if (c.sliding_window > 0 && max_model_len > c.sliding_window) {
        return fmt::format("config.json: {} = {} makes attention sliding-window, which is not supported: sequences must fit the "
                           "window, so pass --max-model-len {} or less (it is {})", c.sliding_window_field, c.sliding_window,
                           c.sliding_window, max_model_len);
    }
    return std::nullopt;
}

std::vector<float> rope_inv_freq(const ModelConfig & c) {
    const int64_t half = c.head_dim / 2;
    const RopeScaling & r = c.rope_scaling;
    std::vector<float> inv(static_cast<size_t>(half));
    for (int64_t j = 0; j < half; ++j) {
        // transformers: 1 / base ** (arange(0, dim, 2).float() / dim), in f32
        const float base = 1.0f / std::pow(c.rope_theta, static_cast<float>(2 * j) / static_cast<float>(c.head_dim));
        double f = base;
        switch (r.type) {
            case RopeType::plain:
            case RopeType::dynamic: break;  // dynamic: base unchanged while seq_len <= max_position_embeddings
            case RopeType::linear: f = base / r.factor; break;
            case RopeType::llama3: {  // transformers _compute_llama3_parameters
                const double old_len  = r.original_max_position_embeddings;
                const double low_wl   = old_len / r.low_freq_factor;
                const double high_wl  = old_len / r.high_freq_factor;
                const double wavelen  = 2 * std::numbers::pi / base;
                if (wavelen > low_wl) {
                    f = base / r.factor;
                } else if (wavelen >= high_wl) {  // medium: interpolate
                    const double smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
                    f = (1 - smooth) * base / r.factor + smooth * base;
                }
                break;
            }
        }
        inv[static_cast<size_t>(j)] = static_cast<float>(f);
    }
    return inv;
}
std::optional<std::string> read_version_step(const std::filesystem::path & dir) {
    const auto file = dir / "version.yaml";
    const auto text = read_small_file(file, 1 << 20, Errc::invalid_checkpoint);
    if (!text) { return std::nullopt; }
    YAML::Node doc;
    try {
        doc = YAML::Load(*text);
    } catch (const YAML::Exception & e) {
        fail(Errc::invalid_checkpoint, "{}: not YAML: {}", file.string(), e.what());
    }
    if (!doc || doc.IsNull()) { return std::nullopt; }  // an empty file
    if (!doc.IsMap()) { fail(Errc::invalid_checkpoint, "{}: expected a mapping with a top-level 'step'", file.string()); }
    const YAML::Node step = doc["step"];  // the top-level key only: a nested `step:` is another thing's
    if (!step) { return std::nullopt; }
    // A file appended to (`echo "step: $N" >> version.yaml` every step) holds `step` more than
    // once: yaml-cpp answers the first, PyYAML (the trainer's reader) the last, so either choice
    // can name other bytes than the trainer thinks. Refused, naming the file.
    const auto steps = std::count_if(doc.begin(), doc.end(), [](const auto & kv) { return kv.first.IsScalar() && kv.first.Scalar() == "step"; });
    if (steps > 1) { fail(Errc::invalid_checkpoint, "{}: 'step' appears {} times at the top level (write the file, do not append to it)", file.string(), steps); }
    const std::string value = step.IsScalar() ? step.Scalar() : std::string();
    // As a version in a request (shm::is_valid_version): never starting with '.' (a probe:
    // `step: ..` became the served weight_version, where {"version": ".."} is a 400).
    const bool ok = !value.empty() && value.size() <= 128 && value[0] != '.' && std::all_of(value.begin(), value.end(), [](char ch) {
        return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
    });
    if (!ok) {
        fail(Errc::invalid_checkpoint, "{}: malformed 'step' '{}' (want 1-128 of A-Z a-z 0-9 . _ -, not starting with '.')", file.string(),
             step.IsScalar() ? value : std::string(step.IsNull() ? "" : "a mapping or list"));
    }
    return value;
}

std::optional<std::string> model_config_difference(const ModelConfig & running, const ModelConfig & fresh) {
    std::optional<std::string> out;
    auto cmp = [&](const char * name, const auto & a, const auto & b) {
        if (!out && !(a == b)) { out = fmt::format("{}: {} (the running model: {})", name, b, a); }
    };
    const auto & ra = running.rope_scaling;
    const auto & rb = fresh.rope_scaling;
    const auto & ma = running.moe;
    const auto & mb = fresh.moe;
    cmp("architectures", running.architecture, fresh.architecture);
    cmp("vocab_size", running.vocab_size, fresh.vocab_size);
    cmp("hidden_size", running.hidden_size, fresh.hidden_size);
    cmp("intermediate_size", running.intermediate_size, fresh.intermediate_size);
    cmp("num_hidden_layers", running.n_layers, fresh.n_layers);
    cmp("num_attention_heads", running.n_heads, fresh.n_heads);
    cmp("num_key_value_heads", running.n_kv_heads, fresh.n_kv_heads);
    cmp("head_dim", running.head_dim, fresh.head_dim);
    cmp("rms_norm_eps", running.rms_norm_eps, fresh.rms_norm_eps);
    cmp("rope_theta", running.rope_theta, fresh.rope_theta);
    cmp("rope_scaling.rope_type", ra.name, rb.name);
    cmp("rope_scaling.factor", ra.factor, rb.factor);
    cmp("rope_scaling.low_freq_factor", ra.low_freq_factor, rb.low_freq_factor);
    cmp("rope_scaling.high_freq_factor", ra.high_freq_factor, rb.high_freq_factor);
    cmp("rope_scaling.original_max_position_embeddings", ra.original_max_position_embeddings, rb.original_max_position_embeddings);
    cmp("tie_word_embeddings", running.tie_word_embeddings, fresh.tie_word_embeddings);
    cmp("q/k/v biases", running.qkv_bias, fresh.qkv_bias);
    cmp("q_norm/k_norm", running.qk_norm, fresh.qk_norm);
    cmp("sliding_window", running.sliding_window, fresh.sliding_window);
    cmp("num_experts", ma.n_experts, mb.n_experts);
    cmp("num_experts_per_tok", ma.top_k, mb.top_k);
    cmp("moe_intermediate_size", ma.intermediate, mb.intermediate);
    cmp("shared_expert_intermediate_size", ma.shared_intermediate, mb.shared_intermediate);
    cmp("norm_topk_prob", ma.norm_topk_prob, mb.norm_topk_prob);
    if (!out && ma.sparse_layer != mb.sparse_layer) {
        out = "decoder_sparse_step / mlp_only_layers: another set of sparse MoE layers than the running model's";
    }
    cmp("num_nextn_predict_layers", running.n_mtp_layers, fresh.n_mtp_layers);
    return out;
}

}  // namespace fd::model
