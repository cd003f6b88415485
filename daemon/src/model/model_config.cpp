#include "fd/model/model_config.h"

#include "fd/file_io.h"
#include "fd/status.h"

#include <nlohmann/json.hpp>

#include <sstream>
#include <regex>

namespace fd::model {
namespace {

using nlohmann::json;

json read_json(const std::filesystem::path & file) {
    const auto text = read_small_file(file, 64 << 20, Errc::invalid_checkpoint);
    if (!text) { fail(Errc::invalid_checkpoint, "{}: cannot open: no such file", file.string()); }
    try {
        return json::parse(*text);
    } catch (const json::exception & e) {
        fail(Errc::invalid_checkpoint, "{}: not valid JSON: {}", file.string(), e.what());
    }
}

int32_t get_int(const json & j, const char * key, const std::filesystem::path & file,
                std::optional<int32_t> dflt = std::nullopt) {
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

std::vector<int32_t> id_list(const json & v) {
    std::vector<int32_t> out;
    if (v.is_number_integer()) { out.push_back(v.get<int32_t>()); }
    if (v.is_array()) {
        for (const auto & e : v) {
            if (e.is_number_integer()) { out.push_back(e.get<int32_t>()); }
        }
    }
    return out;
}

}  // namespace

ModelConfig load_model_config(const std::filesystem::path & dir) {
    const auto file = dir / "config.json";
    const json j    = read_json(file);
    ModelConfig c;
    const auto archs = j.value("architectures", json::array());
    c.architecture   = archs.is_array() && !archs.empty() && archs[0].is_string() ? archs[0].get<std::string>() : "";
    if (c.architecture == "LlamaForCausalLM") {
        c.arch = Arch::llama;
    } else if (c.architecture == "Qwen2ForCausalLM") {
        c.arch     = Arch::qwen2;
        c.qkv_bias = true;
    } else {
        fail(Errc::invalid_checkpoint,
             "{}: unsupported architecture '{}' (supported: LlamaForCausalLM, Qwen2ForCausalLM)",
             file.string(), c.architecture);
    }
    c.vocab_size        = get_int(j, "vocab_size", file);
    c.hidden_size       = get_int(j, "hidden_size", file);
    c.intermediate_size = get_int(j, "intermediate_size", file);
    c.n_layers          = get_int(j, "num_hidden_layers", file);
    c.n_heads           = get_int(j, "num_attention_heads", file);
    c.n_kv_heads        = get_int(j, "num_key_value_heads", file, c.n_heads);
    c.head_dim          = get_int(j, "head_dim", file, c.hidden_size / c.n_heads);
    c.max_position_embeddings = get_int(j, "max_position_embeddings", file, 2048);
    c.rms_norm_eps      = j.value("rms_norm_eps", 1e-6f);
    c.rope_theta        = j.value("rope_theta", 10000.0f);
    c.tie_word_embeddings = j.value("tie_word_embeddings", false);
    if (c.arch == Arch::llama && j.value("attention_bias", false)) { c.qkv_bias = true; }
    if (c.n_heads % c.n_kv_heads != 0) {
        fail(Errc::invalid_checkpoint, "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
             file.string(), c.n_heads, c.n_kv_heads);
    }
    if (c.head_dim % 2 != 0) { fail(Errc::invalid_checkpoint, "{}: head_dim {} must be even for RoPE", file.string(), c.head_dim); }
    const std::string act = j.value("hidden_act", std::string("silu"));
    if (act != "silu") { fail(Errc::invalid_checkpoint, "{}: hidden_act '{}' is not supported (silu only)", file.string(), act); }
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
        fail(Errc::invalid_checkpoint, "{}: rope_scaling is not supported yet", file.string());
    }
    c.bos_token_id = j.value("bos_token_id", 1);
    if (j.contains("eos_token_id")) { c.eos_token_ids = id_list(j["eos_token_id"]); }

    const auto gen_file = dir / "generation_config.json";
    if (std::filesystem::exists(gen_file)) {
        const json g = read_json(gen_file);
        if (g.contains("eos_token_id")) { c.eos_token_ids = id_list(g["eos_token_id"]); }
        if (g.contains("bos_token_id") && g["bos_token_id"].is_number_integer()) { c.bos_token_id = g["bos_token_id"]; }
    }
    return c;
}

std::optional<std::string> read_version_step(const std::filesystem::path & dir) {
    const auto file = dir / "version.yaml";
    const auto text = read_small_file(file, 1 << 20, Errc::invalid_checkpoint);
    if (!text) { return std::nullopt; }
    std::istringstream in(*text);
    static const std::regex kStep(R"(^\s*step\s*:\s*['"]?([A-Za-z0-9._-]{1,128})['"]?\s*(#.*)?$)");
    static const std::regex kStepKey(R"(^\s*step\s*:.*$)");
    std::string line;
    while (std::getline(in, line)) {
        if (!std::regex_match(line, kStepKey)) { continue; }
        std::smatch m;
        if (std::regex_match(line, m, kStep)) { return m[1].str(); }
        fail(Errc::invalid_checkpoint, "{}: malformed 'step' line '{}'", file.string(), line);
    }
    return std::nullopt;
}

}  // namespace fd::model
