// fd/checkpoint/model_config.h — the architecture of a Hugging Face checkpoint directory.
//
// Read from config.json (LlamaForCausalLM, Qwen2ForCausalLM, MiMoForCausalLM (Qwen2 + MTP layers), Qwen3ForCausalLM,
// MistralForCausalLM, and the mixture-of-experts Qwen3MoeForCausalLM, Qwen2MoeForCausalLM,
// MixtralForCausalLM: see MoeConfig), generation_config.json (stop ids; its sampling defaults:
// GenerationDefaults) and version.yaml (`step`, the weight version). Pure parsing: no tensors are touched.
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

enum class Arch { llama, qwen2, qwen3, mistral, qwen3_moe, qwen2_moe, mixtral };

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

/// The sparse MLP of a mixture-of-experts model (transformers' Qwen3MoeSparseMoeBlock,
/// Qwen2MoeSparseMoeBlock, MixtralSparseMoeBlock). Per token, in f32:
///   p = softmax(x · routerᵀ) over n_experts;  the top_k largest p (descending, ties: lower id);
///   renormalised to sum 1 when norm_topk_prob (Mixtral: always);
///   y = Σ_k p_k · expert_k(x)  (expert = SwiGLU MLP of width moe_intermediate_size), summed in
///   ascending expert id as transformers' index_add_ loop does;
///   Qwen2-MoE adds sigmoid(x · shared_expert_gateᵀ) · shared_expert(x) (width shared_intermediate).
/// Layer il is sparse when il is not in mlp_only_layers and (il + 1) % decoder_sparse_step == 0
/// (Mixtral: every layer); the others are dense MLPs of width intermediate_size.
struct MoeConfig {
    int32_t n_experts         = 0;      ///< num_experts (Qwen) / num_local_experts (Mixtral); 0 = dense model
    int32_t top_k             = 0;      ///< num_experts_per_tok, in [1, n_experts]
    int32_t intermediate      = 0;      ///< moe_intermediate_size (Mixtral: intermediate_size)
    int32_t shared_intermediate = 0;    ///< Qwen2-MoE shared_expert_intermediate_size; 0 = no shared expert
    bool    norm_topk_prob    = false;  ///< renormalise the top-k weights (Mixtral: true)
    std::vector<bool> sparse_layer;     ///< [n_layers] true = a sparse MoE block
    /// HF module prefix of the sparse block inside a layer: "mlp" (Qwen) or "block_sparse_moe" (Mixtral).
    std::string prefix = "mlp";
    /// Expert weight names under `prefix`.experts.N: gate, up, down ("gate_proj"/"up_proj"/
    /// "down_proj"; Mixtral "w1"/"w3"/"w2").
    std::string gate_name = "gate_proj", up_name = "up_proj", down_name = "down_proj";

    bool enabled() const { return n_experts > 0; }
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
    MoeConfig   moe;                        ///< mixture of experts (moe.enabled()), else dense
    /// MiMoForCausalLM's num_nextn_predict_layers: next-token-prediction (MTP) layers stored as
    /// model.mtp_layers.N.* (part of the state dict: every load path carries them; the draft
    /// proposer of --speculative-config method "mtp" runs layer 0). 0 for every other architecture.
    int32_t     n_mtp_layers      = 0;

    /// True when layer `il` runs the sparse MoE block (false for every layer of a dense model).
    bool is_moe_layer(int il) const { return moe.enabled() && moe.sparse_layer[static_cast<size_t>(il)]; }
    /// True when some layer runs a dense MLP of width intermediate_size.
    bool has_dense_layer() const;

    int32_t q_dim() const { return n_heads * head_dim; }
    int32_t kv_dim() const { return n_kv_heads * head_dim; }
};

/// Parse `dir`/config.json and `dir`/generation_config.json.
/// Errors   fd::Error{invalid_checkpoint} naming the file and field: missing or unreadable file,
///          unsupported architecture, missing/non-positive sizes, n_heads % n_kv_heads != 0,
///          unsupported hidden_act, rope_scaling type (named), attention_bias / mlp_bias where
///          unsupported, MoE fields on a dense architecture, quantization_config,
///          partial_rotary_factor != 1; for MoE architectures (MoeConfig): num_experts /
///          num_local_experts missing, 0 or inconsistent, num_experts_per_tok 0 or > experts,
///          moe_intermediate_size missing, decoder_sparse_step < 1, mlp_only_layers out of
///          range, a routing type other than softmax top-k (scoring_func, topk_method,
///          n_group / topk_group, routed_scaling_factor != 1), each naming the field.
ModelConfig load_model_config(const std::filesystem::path & dir);

/// The first field of the math that differs between the model being served (`running`) and a
/// checkpoint's config (`fresh`), as "name: <fresh> (the running model: <running>)", or nullopt
/// when they compute the same function shape-for-shape: architecture, sizes, heads, head_dim,
/// rms_norm_eps, rope_theta and rope_scaling, tied embeddings, q/k/v biases, q/k norms, the
/// sliding window, every MoE field (experts, top-k, widths, norm_topk_prob, sparse layers) and
/// the MTP layers. Not compared: token ids, max_position_embeddings (neither changes the weights'
/// function). A weight update keeps the running model's structure, so a checkpoint whose config
/// differs here would be served with the wrong math (an update to num_experts_per_tok 2 still
/// routed top-4). Errors: none.
std::optional<std::string> model_config_difference(const ModelConfig & running, const ModelConfig & fresh);

/// A start-up problem serving `cfg` with sequences of up to `max_model_len` tokens (an active
/// sliding window shorter than max_model_len, naming the field), or nullopt when none.
std::optional<std::string> check_max_model_len(const ModelConfig & cfg, int32_t max_model_len);

/// The RoPE inverse frequencies of `cfg`, [head_dim / 2] f32: theta^(-2j/head_dim) scaled as
/// rope_scaling says (transformers _compute_{default,linear_scaling,llama3,dynamic_ntk}_rope_parameters;
/// the attention factor of these types is 1).
std::vector<float> rope_inv_freq(const ModelConfig & cfg);

/// The sampling defaults a checkpoint's generation_config.json recommends, as vLLM's
/// `--generation-config auto` takes them (ModelConfig.get_diff_sampling_param): temperature, top_p,
/// top_k, min_p, repetition_penalty and max_new_tokens. vLLM reads GenerationConfig.to_diff_dict(),
/// so a value equal to transformers' own default (temperature 1.0, top_p 1.0, top_k 50,
/// repetition_penalty 1.0) is not taken; null is not taken either. Unset fields: none.
struct GenerationDefaults {
    std::optional<float>   temperature;         ///< >= 0; 0 = greedy
    std::optional<float>   top_p;               ///< (0, 1]
    std::optional<int32_t> top_k;               ///< -1 or 0 (off), or >= 1
    std::optional<float>   min_p;               ///< [0, 1]
    std::optional<float>   repetition_penalty;  ///< (0, 100]
    std::optional<int32_t> max_new_tokens;      ///< >= 1: vLLM's default max_tokens, which caps every request

    bool empty() const { return !temperature && !top_p && !top_k && !min_p && !repetition_penalty && !max_new_tokens; }
    /// "temperature=0.6, top_p=0.9" (vLLM's names: max_new_tokens reads max_tokens); "" when empty.
    std::string describe() const;
};

/// The sampling fields of `dir`/generation_config.json (GenerationDefaults); empty when the file is
/// absent. Errors  fd::Error{invalid_checkpoint} naming the file and field when the file is not a
/// JSON object or a field is not a number in its range (a default every request would be refused
/// with is a start-up error, not a 400 per request).
GenerationDefaults read_generation_defaults(const std::filesystem::path & dir);

/// vLLM's --override-generation-config (ModelConfig.get_diff_sampling_param: the generation
/// config, then `config.update(override)`): the sampling fields of the JSON object `overrides`
/// replace `base`'s, taken as given (1.0 too, unlike the file); a null clears one. Keys that are
/// not sampling fields are not taken, as vLLM does, and are listed in `ignored` (when given).
/// Errors  fd::Error{invalid_argument} naming the flag: not JSON, not an object, a field out of
/// its range (GenerationDefaults' ranges).
GenerationDefaults override_generation_defaults(GenerationDefaults base, const std::string & overrides,
                                                std::vector<std::string> * ignored = nullptr);

/// The top-level `step` of `dir`/version.yaml (read with yaml-cpp) as a string ("step: 42" →
/// "42"), or nullopt if the file or a top-level `step` is absent (a `step:` nested under another
/// key is not the version). Errors  fd::Error{invalid_checkpoint} naming the file if it is not
/// YAML, not a mapping, or its `step` is not 1-128 of [A-Za-z0-9._-].
std::optional<std::string> read_version_step(const std::filesystem::path & dir);

}  // namespace fd::model
