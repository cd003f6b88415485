// fd/publish/rollout_model.h — the rollout's state dict per tensor-parallel rank, for trainer
// authors (SPEC §5, docs/weight_sources.md). Library fd_publish: links fd_layout (config,
// safetensors reader, the sharding layout), never the engine (fd_core) or the kernels.
//
// A trainer that publishes weights with `ipc_snapshot` or `ipc` must hand the rollout tensors in
// the rollout's own (inference) names, shapes and dtypes for each rank. RolloutModel computes
// them from a Hugging Face checkpoint directory (config.json + the safetensors headers; no
// tensor data is read), and says where each inference tensor comes from in training (HF) names.
//
// Inference names (per layer N; everything else keeps its HF name):
//   model.layers.N.self_attn.qkv_proj.weight  [(q_dim + 2*kv_dim)/T, hidden]   rows q | k | v
//   model.layers.N.self_attn.qkv_proj.bias    [(q_dim + 2*kv_dim)/T]           (Qwen2)
//   model.layers.N.mlp.gate_up_proj.weight    [2*intermediate/T, hidden]       rows gate | up
// with q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim, T = tp_size.
//
// Sharding of rank r (Megatron / vLLM; column parallel = split the output rows of [out, in],
// row parallel = split the input columns) — computed by plan_layout (fd/checkpoint/layout.h), the
// same code the daemon's loader shards with:
//   qkv_proj         column parallel: rows [r*q_dim/T, (r+1)*q_dim/T) of q_proj, the same
//                    fraction of k_proj and of v_proj (whole kv heads), stacked q | k | v
//   gate_up_proj     column parallel: rows [r*ff/T, (r+1)*ff/T) of gate_proj and of up_proj
//   o_proj           row parallel:    columns [r*q_dim/T, (r+1)*q_dim/T)   → [hidden, q_dim/T]
//   down_proj        row parallel:    columns [r*ff/T, (r+1)*ff/T)         → [hidden, ff/T]
//   embed_tokens     vocab parallel:  rows [r*vocab/T, (r+1)*vocab/T)      → [vocab/T, hidden]
//   lm_head          column parallel: rows [r*vocab/T, ...) (absent when tied to embed_tokens)
//   *layernorm, model.norm, self_attn.q_norm / k_norm (Qwen3, [head_dim])  replicated
// Dtypes: the checkpoint's F32 or BF16 (a fused tensor whose parts differ, and F16, are F32).
//
// Mixture of experts (docs/architectures.md): each expert is one more fused gate_up_proj (Mixtral
// w13) and one down_proj (w2). Without expert parallelism (TP-MoE) every rank holds every expert,
// sliced like the dense MLP. With expert parallelism (`expert_parallel`, the daemon's
// --enable-expert-parallel: ep = tp) rank r holds experts [r*E/tp, (r+1)*E/tp) of every sparse
// layer WHOLE and no other expert (Qwen2-MoE's shared expert whole on every rank); attention,
// embeddings, dense MLPs and the head stay tp-sliced. A record cut for one form is refused by the
// other (the expert shapes differ).
#pragma once

#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/checkpoint/layout.h"

#include <cstddef>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fd::publish {

using fd::DType;
using model::ModelConfig;
using model::TensorIndex;
using model::WeightLayout;

/// One tensor of a rank's state dict.
struct StateTensor {
    std::string          name;   ///< inference name
    std::vector<int64_t> shape;  ///< outermost first; [rows, cols] or [n]
    fd::DType            dtype = fd::DType::f32;

    int64_t numel() const;
    int64_t nbytes() const { return numel() * model::dtype_size(dtype); }
};

/// Rows [dst_row0, dst_row0 + (end - begin)) of an inference tensor on one rank are the slice
/// [begin, end) along `dim` of training tensor `hf_name` (dim 0 = rows, 1 = columns; for a
/// column slice every row of the HF tensor is taken, so dst rows = HF rows).
struct TrainingSlice {
    std::string hf_name;
    int         dim      = 0;
    int64_t     begin    = 0;
    int64_t     end      = 0;
    int64_t     dst_row0 = 0;
};

/// Where one inference tensor of one rank comes from.
struct RankTensorSource {
    StateTensor                tensor;
    std::vector<TrainingSlice> slices;  ///< in dst row order; together they fill the tensor
};

class RolloutModel {
public:
    /// From a checkpoint directory (config.json + safetensors headers, any layout
    /// read_tensor_index accepts). Errors  fd::Error{invalid_checkpoint} (bad config/checkpoint,
    /// from load_model_config / read_tensor_index / validate_checkpoint);
    /// fd::Error{invalid_argument} when tp_size < 1 or n_heads, n_kv_heads, intermediate_size
    /// or vocab_size is not divisible by tp_size (the message names the dimension).
    /// `expert_parallel`: the layout of a daemon started with --enable-expert-parallel (see the
    /// top of this file); fd::Error{invalid_argument} on a dense model or when tp_size does not
    /// divide num_experts (naming both numbers).
    RolloutModel(const std::filesystem::path & model_dir, int tp_size, bool expert_parallel = false);
    /// From an already parsed config and a validated index (HF names; transformers v5's Mixtral
    /// names are read as the v4 ones, alias_v5_mixtral_names). Errors  as above.
    RolloutModel(ModelConfig cfg, const TensorIndex & idx, int tp_size, bool expert_parallel = false);

    const ModelConfig &  config() const { return cfg_; }
    int                  tp_size() const { return tp_; }
    /// The expert-parallel size: tp_size with expert_parallel, else 1.
    int                  ep_size() const { return ep_; }
    /// The experts [begin, end) of each sparse layer rank `rank` holds: all of them (0, E) when
    /// not expert parallel, (0, 0) for a dense model.
    /// Errors  fd::Error{invalid_argument} when rank is outside [0, tp_size).
    std::pair<int32_t, int32_t> rank_experts(int rank) const;
    /// The TP = 1 inference layout (plan_layout): names, unsharded shapes, memory dtypes.
    const WeightLayout & layout() const { return layout_; }
    /// Rank `rank`'s layout: exactly what the Worker of that rank plans and holds.
    /// Errors  fd::Error{invalid_argument} when rank is outside [0, tp_size).
    const WeightLayout & rank_layout(int rank) const;

    /// Rank `rank`'s state dict, in the rollout's arena order.
    /// Errors  fd::Error{invalid_argument} when rank is outside [0, tp_size).
    std::vector<StateTensor> state_dict(int rank) const;

    /// Inference name → its training (HF) names, in stacking order (q, k, v / gate, up; a
    /// one-element list for an unfused tensor), over every rank (every expert). `rank` >= 0:
    /// only the tensors that rank holds (under expert parallelism: only its experts).
    /// Errors  fd::Error{invalid_argument} when rank is outside [-1, tp_size).
    std::map<std::string, std::vector<std::string>> name_mappings_to_training(int rank = -1) const;

    /// Rank `rank`'s state dict with the HF slices each tensor is made of.
    /// Errors  fd::Error{invalid_argument} when rank is outside [0, tp_size).
    std::vector<RankTensorSource> training_slices(int rank) const;

    /// Fill `dst` ([src.tensor.nbytes()] bytes) with the inference tensor `src` of one rank from
    /// the HF checkpoint `idx` (the one this model was built from, or one like it, under the v4
    /// names: pass a v5 Mixtral index through fd::model::with_v4_names first): reads the
    /// slices, converts F16 (or mixed) parts to F32 when the state dict says F32.
    /// Errors  fd::Error{invalid_checkpoint} naming the file and tensor (missing, short read,
    ///         other shape).
    static void gather(const RankTensorSource & src, const TensorIndex & idx, std::byte * dst);

private:
    void check_rank(int rank) const;

    ModelConfig  cfg_;
    WeightLayout layout_;
    std::vector<WeightLayout> rank_layouts_;  ///< [tp_size]
    int          tp_ = 1;
    int          ep_ = 1;
};

}  // namespace fd::publish
