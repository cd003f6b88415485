// fd/checkpoint/model_config.h — the architecture of a Hugging Face checkpoint directory.
//
// Read from config.json (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
// MistralForCausalLM), generation_config.json (stop ids) and version.yaml (`step`, the weight
// version). Pure parsing: no tensors are touched.
//
// Every config field that changes the forward pass and that fdrollout does not implement is a
// start-up error naming the field, never ignored (docs/architectures.md lists them). A field
// Hugging Face itself ignores for an architecture (e.g. `sliding_window` of a Llama) is ignored.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace fd::model {

enum class Arch { llama, qwen2, qwen3, mistral };

/// `rope_scaling` (or transformers v5 `rope_parameters`): how the RoPE inverse frequencies are
/// derived from rope_theta (transformers modeling_rope_utils.ROPE_INIT_FUNCTIONS).
enum class RopeType {
    plain,    ///< absent, null or rope_type "default"
    linear,   ///< inv_freq / factor
    llama3,   ///< Llama-3.1/3.2: low frequencies / factor, high kept, medium smoothed
    dynamic,  ///< dynamic NTK: equals plain for positions < max_position_embeddings (HF), which
              ///< max_model_len never exceeds
};

struct RopeScaling {
    RopeType    type = RopeType::plain;
    std::string name = "default";          ///< rope_type as written ("type" in older configs)
    double      factor = 1.0;              ///< linear, llama3, dynamic
    double      low_freq_factor  = 1.0;    ///< llama3
    double      high_freq_factor = 4.0;    ///< llama3
    int32_t     original_max_position_embeddings = 0;  ///< llama3
};

struct ModelConfig {
    Arch        arch              = Arch::llama;
    std::string architecture;               ///< as written in config.json, e.g. "LlamaForCausalLM"
    int32_t     vocab_size        = 0;
    int32_t     hidden_size       = 0;      ///< n_embd
    int32_t     intermediate_size = 0;      ///< MLP width
    int32_t     n_layers          = 0;
    int32_t     n_heads           = 0;
    int32_t     n_kv_heads        = 0;      ///< GQA: query head h reads kv head h / (n_heads / n_kv_heads)
    int32_t     head_dim          = 0;      ///< config `head_dim`, else hidden_size / n_heads (Qwen3: 128)
    int32_t     max_position_embeddings = 2048;
    float       rms_norm_eps      = 1e-6f;
    float       rope_theta        = 10000.0f;
    RopeScaling rope_scaling;
    bool        tie_word_embeddings = false;
    bool        qkv_bias          = false;  ///< Qwen2: q/k/v projections carry biases
    bool        qk_norm           = false;  ///< Qwen3: per-head RMSNorm q_norm/k_norm [head_dim] on q and k before RoPE
    /// > 0: the model attends only to the last `sliding_window` tokens (Mistral `sliding_window`,
    /// Qwen2/3 with `use_sliding_window`). Not implemented: start-up refuses a max_model_len
    /// above it (check_max_model_len). 0: full attention.
    int32_t     sliding_window    = 0;
    std::string sliding_window_field;       ///< the config field(s) that made it active, for messages
    int32_t     bos_token_id      = 1;
    std::vector<int32_t> eos_token_ids;     ///< generation_config.json eos_token_id, else config.json's

    int32_t q_dim() const { return n_heads * head_dim; }
    int32_t kv_dim() const { return n_kv_heads * head_dim; }
};

/// Parse `dir`/config.json and `dir`/generation_config.json.
/// Errors   fd::Error{invalid_checkpoint} naming the file and field: missing or unreadable file,
///          unsupported architecture, missing/non-positive sizes, n_heads % n_kv_heads != 0,
///          unsupported hidden_act, rope_scaling type (named), attention_bias / mlp_bias where
///          unsupported, MoE fields, quantization_config, partial_rotary_factor != 1.
ModelConfig load_model_config(const std::filesystem::path & dir);

/// A start-up problem serving `cfg` with sequences of up to `max_model_len` tokens (an active
/// sliding window shorter than max_model_len, naming the field), or nullopt when none.
std::optional<std::string> check_max_model_len(const ModelConfig & cfg, int32_t max_model_len);

/// The RoPE inverse frequencies of `cfg`, [head_dim / 2] f32: theta^(-2j/head_dim) scaled as
/// rope_scaling says (transformers _compute_{default,linear_scaling,llama3,dynamic_ntk}_rope_parameters;
/// the attention factor of these types is 1).
std::vector<float> rope_inv_freq(const ModelConfig & cfg);

/// The top-level `step` of `dir`/version.yaml (read with yaml-cpp) as a string ("step: 42" →
/// "42"), or nullopt if the file or a top-level `step` is absent (a `step:` nested under another
/// key is not the version). Errors  fd::Error{invalid_checkpoint} naming the file if it is not
/// YAML, not a mapping, or its `step` is not 1-128 of [A-Za-z0-9._-].
std::optional<std::string> read_version_step(const std::filesystem::path & dir);

}  // namespace fd::model
