// fd/model/model_config.h — the architecture of a Hugging Face checkpoint directory.
//
// Read from config.json (LlamaForCausalLM, Qwen2ForCausalLM), generation_config.json (stop ids)
// and version.yaml (`step`, the weight version). Pure parsing: no tensors are touched.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace fd::model {

enum class Arch { llama, qwen2 };

struct ModelConfig {
    Arch        arch              = Arch::llama;
    std::string architecture;               ///< as written in config.json, e.g. "LlamaForCausalLM"
    int32_t     vocab_size        = 0;
    int32_t     hidden_size       = 0;      ///< n_embd
    int32_t     intermediate_size = 0;      ///< MLP width
    int32_t     n_layers          = 0;
    int32_t     n_heads           = 0;
    int32_t     n_kv_heads        = 0;      ///< GQA: query head h reads kv head h / (n_heads / n_kv_heads)
    int32_t     head_dim          = 0;      ///< config `head_dim`, else hidden_size / n_heads
    int32_t     max_position_embeddings = 2048;
    float       rms_norm_eps      = 1e-6f;
    float       rope_theta        = 10000.0f;
    bool        tie_word_embeddings = false;
    bool        qkv_bias          = false;  ///< Qwen2: q/k/v projections carry biases
    int32_t     bos_token_id      = 1;
    std::vector<int32_t> eos_token_ids;     ///< generation_config.json eos_token_id, else config.json's

    int32_t q_dim() const { return n_heads * head_dim; }
    int32_t kv_dim() const { return n_kv_heads * head_dim; }
};

/// Parse `dir`/config.json and `dir`/generation_config.json.
/// Errors   fd::Error{invalid_checkpoint} naming the file and field: missing or unreadable file,
///          unsupported architecture, missing/non-positive sizes, n_heads % n_kv_heads != 0,
///          unsupported hidden_act or rope_scaling.
ModelConfig load_model_config(const std::filesystem::path & dir);

/// `step` from `dir`/version.yaml as a string ("step: 42" → "42"), or nullopt if the file or the
/// key is absent. Errors  fd::Error{invalid_checkpoint} if the file exists but `step` is malformed.
std::optional<std::string> read_version_step(const std::filesystem::path & dir);

}  // namespace fd::model
