// fd/checkpoint/layout.h — the model's weights in inference layout, sharded per tensor-parallel rank.
// This file (plan_layout) is the ONE home of the TP sharding: the Worker's loader
// (fd/model/weights.h, fd_core) and RolloutModel (fd/publish/rollout_model.h, fd_publish) both
// read it. Library fd_checkpoint (with the config and safetensors readers): no engine, no kernels.
//
// The rollout keeps each weight in the checkpoint's own dtype and [out, in] layout, with the
// tensors the forward pass reads together fused along dim 0 (vLLM's packed modules):
//   model.layers.N.self_attn.qkv_proj.weight  [(q_dim + 2*kv_dim)/T, hidden]  rows q | k | v
//   model.layers.N.self_attn.qkv_proj.bias    [(q_dim + 2*kv_dim)/T]          (Qwen2)
//   model.layers.N.mlp.gate_up_proj.weight    [2*intermediate/T, hidden]      rows gate | up
// and every other tensor under its Hugging Face name (embed_tokens, o_proj, down_proj, the norms
// incl. Qwen3's self_attn.q_norm / k_norm [head_dim], model.norm, lm_head when untied).
// T = tp size (1: the whole model).
//
// A sparse MoE layer (ModelConfig::is_moe_layer; P = model.layers.N.mlp, Mixtral's
// model.layers.N.block_sparse_moe) has, instead of mlp.gate_up_proj / mlp.down_proj:
//   P.gate.weight                         [n_experts, hidden]   router, replicated
//   P.experts.E.gate_up_proj.weight       [2*moe_ff/T, hidden]  rows gate | up  (Mixtral: experts.E.w13.weight, w1 | w3)
//   P.experts.E.down_proj.weight          [hidden, moe_ff/T]    (Mixtral: experts.E.w2.weight)
//   P.shared_expert.gate_up_proj.weight   [2*shared_ff/T, hidden]  (Qwen2-MoE)
//   P.shared_expert.down_proj.weight      [hidden, shared_ff/T]    (Qwen2-MoE)
//   P.shared_expert_gate.weight           [1, hidden]              (Qwen2-MoE, replicated)
// every gate_up of the layer's experts in expert order, then every down. Each expert is cut like
// the dense MLP (TP-MoE: rows of gate and up, columns of down); an expert-parallel layout
// would instead keep a slice of the experts whole on each rank. A checkpoint may hold the experts
// per expert (HF names P.experts.E.gate_proj/up_proj/down_proj.weight, Mixtral's w1/w3/w2) or
// stacked (P.experts.gate_up_proj [E, 2*moe_ff, hidden], P.experts.down_proj [E, hidden, moe_ff]):
// split_stacked_experts turns the stacked form into per-expert views when the index is read.
//
// Sharding of rank r of T (Megatron / vLLM; Shard below):
//   qkv_proj (+bias)  rows:  rows [r*q_dim/T, (r+1)*q_dim/T) of q_proj, the same fraction of
//                            k_proj and of v_proj (whole heads), stacked q | k | v
//   gate_up_proj      rows:  rows [r*ff/T, (r+1)*ff/T) of gate_proj and of up_proj
//   o_proj            cols:  columns [r*q_dim/T, (r+1)*q_dim/T)        → [hidden, q_dim/T]
//   down_proj         cols:  columns [r*ff/T, (r+1)*ff/T)              → [hidden, ff/T]
//   embed_tokens      rows:  vocab rows [r*vocab/T, (r+1)*vocab/T)     → [vocab/T, hidden]
//   lm_head           rows:  the same vocab rows (tied: embed_tokens' slice is the head)
//   norms             replicated (q_norm / k_norm too: per head, the same for every head)
// A row slice is one contiguous range of the checkpoint tensor; a column slice is one range per
// row (strided reads). Loading, wakeup and update_weights are parallel reads into one arena
// (F16 is the exception: it is widened to f32 at load).
//
// The layout is planned once, from the first checkpoint; every later checkpoint (wakeup,
// update) must have the same names, shapes and dtypes. Pure functions of their arguments.
#pragma once

#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fd::model {

/// How an inference tensor is split across tensor-parallel ranks.
enum class Shard : uint8_t {
    replicated,  ///< every rank holds it whole (norms)
    rows,        ///< column parallel: each part's rows split into T equal ranges (qkv, gate_up, embed, lm_head)
    cols,        ///< row parallel: the input columns split into T equal ranges (o_proj, down_proj)
};

/// Which rank of how many tensor-parallel ranks a layout is for.
struct TpRank {
    int32_t rank = 0;
    int32_t size = 1;
    /// Expert-parallel size (--enable-expert-parallel: = size; 1 = off). ep > 1: expert rank
    /// e = rank % ep holds experts [e*E/ep, (e+1)*E/ep) of each sparse layer WHOLE (Shard::
    /// replicated, names keep the global expert id) and no other expert; Qwen2-MoE's shared
    /// expert is whole on every rank. Attention, embeddings and dense MLPs stay tp-sliced.
    int32_t ep = 1;
};

/// The experts [begin, end) of `n_experts` that rank `tp.rank` holds (all of them at ep 1).
std::pair<int32_t, int32_t> rank_experts(int32_t n_experts, TpRank tp);

/// Check that `tp_size` (>= 1) divides every dimension the sharding splits; with expert
/// parallelism (`ep` > 1) the experts' widths are not split and `ep` must divide the experts.
/// Errors  fd::Error{invalid_argument} naming the dimension (num_attention_heads,
///         num_key_value_heads, intermediate_size, vocab_size, num_experts) and both numbers,
///         or expert parallelism on a dense model.
void check_tp_divides(const ModelConfig & cfg, int32_t tp_size, int32_t ep = 1);

/// Rows [row0, row0 + rows) of an inference tensor come from training (HF) tensor `hf_name`:
/// dim 0: its rows [src0, src0 + rows) (every column); dim 1: its columns [src0, src0 + cols)
/// of every row (then rows = the HF tensor's rows, cols = the inference tensor's).
struct WeightPart {
    std::string hf_name;
    int64_t     row0 = 0;
    int64_t     rows = 0;
    fd::DType   dtype = fd::DType::f32;  ///< as stored in the checkpoint the layout was planned from
    int         dim  = 0;            ///< 0: a row range, 1: a column range
    int64_t     src0 = 0;            ///< first HF row (dim 0) or column (dim 1) taken
    std::vector<int64_t> hf_shape;   ///< the whole training tensor's shape
};

/// One tensor of the rollout's state dict (of one rank).
struct InferenceTensor {
    std::string             name;        ///< inference name, e.g. model.layers.0.self_attn.qkv_proj.weight
    std::vector<int64_t>    shape;       ///< [rows, cols] or [n], outermost first; this rank's shard
    Shard                   shard = Shard::replicated;
    fd::DType               dtype = fd::DType::f32;  ///< in memory: the checkpoint's f32 / bf16; F16 → f32
    int64_t                 offset = 0;  ///< bytes into the weights arena, 64-byte aligned
    int64_t                 bytes  = 0;
    std::vector<WeightPart> parts;       ///< training tensors stacked along dim 0, in order
};

struct WeightLayout {
    std::vector<InferenceTensor> tensors;        ///< in arena order
    int64_t                      arena_bytes = 0;
    bool                         tied_lm_head = false;  ///< lm_head reads embed_tokens
    TpRank                       tp;             ///< the rank this layout's shards are for

    /// nullptr if `name` is not an inference tensor.
    const InferenceTensor * find(std::string_view name) const;
};

/// One tensor the model expects, in HF (training) naming.
struct ExpectedTensor {
    std::string          name;
    std::vector<int64_t> shape;
    bool                 optional = false;  ///< e.g. lm_head.weight of a tied model
};

/// Every tensor a checkpoint of `cfg` must (or may) hold.
std::vector<ExpectedTensor> expected_tensors(const ModelConfig & cfg);

/// Check `idx` against `cfg` (first load, HF names): every required tensor present with the
/// right shape, no unknown names (rotary_emb.inv_freq is ignored).
/// Errors  fd::Error{invalid_checkpoint} naming the file and tensor.
void validate_checkpoint(const ModelConfig & cfg, const TensorIndex & idx);

/// Rank `tp.rank`'s inference layout of `cfg` with the dtypes of `idx`: a fused tensor whose
/// parts share a dtype keeps it (F16 becomes f32); mixed parts become f32. `idx` is a full HF
/// checkpoint (validate_checkpoint) or the rank's state dict in inference names (every tensor
/// under its inference name: a snapshot or ipc record; dtypes are then the stored ones).
/// Errors  fd::Error{invalid_argument} from check_tp_divides, or rank outside [0, tp.size);
///         fd::Error{invalid_checkpoint} when a tensor is in neither form.
WeightLayout plan_layout(const ModelConfig & cfg, const TensorIndex & idx, TpRank tp = {});

/// Check that `idx` can refill `layout` (load, wakeup, update, any weight source). With expert
/// parallelism (layout.tp.ep > 1) the experts of other ranks in `idx` are skipped (each rank
/// checks its own; together the ranks check the whole set). Otherwise: every
/// inference tensor present either under its inference name with the layout's (this rank's)
/// shape and memory dtype (snapshots, ipc records) or as its training parts with the whole
/// HF shapes and dtypes first loaded (HF checkpoints; only this rank's slices are read);
/// lm_head.weight of a tied model and rotary_emb.inv_freq are allowed and ignored; any other
/// name is an error. An unfused sharded tensor (o_proj, down_proj, embed, lm_head) whose name
/// is its HF name is told apart by its shape (the rank's shard, or the whole tensor).
/// With `cfg` (the model `layout` was planned from), a tensor whose shape is another tensor-
/// parallel size's shard of it is refused naming that tp and the one to publish for.
/// Errors  fd::Error{invalid_checkpoint} naming the file and tensor.
void validate_against_layout(const WeightLayout & layout, const TensorIndex & idx, const ModelConfig * cfg = nullptr);

/// " (layer L, expert E)" when `name` is an expert's tensor (model.layers.L.*.experts.E.*), else "".
std::string expert_of(std::string_view name);

/// Replace every stacked expert tensor of `idx` — `model.layers.L.<P>.experts.gate_up_proj[.weight]`
/// [E, 2*I, H] and `...experts.down_proj[.weight]` [E, H, I] — by per-expert views of the same
/// bytes under the per-expert HF names (P = block_sparse_moe: w1 | w3 and w2, else gate_proj |
/// up_proj and down_proj): expert e's gate is rows [e*2I, e*2I+I) of the first, its up the next
/// I rows, its down the e-th [H, I] block of the second. Called by read_tensor_index and
/// read_tensor_files, so every file source accepts both forms.
/// Errors  fd::Error{invalid_checkpoint} naming the tensor and layer: a stacked tensor that is
///         not 3-D, whose 2*I is odd, or an expert given both stacked and per expert (duplicate).
void split_stacked_experts(TensorIndex & idx);

/// transformers v5 names Mixtral's sparse block `mlp` (its conversion_mapping.py:
/// `block_sparse_moe.gate` → `mlp.gate`; experts' w1 | w3 stacked into `mlp.experts.gate_up_proj`
/// [E, 2*I, H], w2 into `mlp.experts.down_proj` [E, H, I]). For a Mixtral `cfg` this renames
/// `model.layers.L.mlp.gate.weight` → `model.layers.L.block_sparse_moe.gate.weight` and the
/// per-expert views split_stacked_experts made of the stacked tensors,
/// `model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight` →
/// `model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight`, so the one layout serves both
/// namings (errors then name the v4 names). Any other architecture, or an index without such
/// names: unchanged. Returns whether anything was renamed.
/// Errors  fd::Error{invalid_checkpoint} naming layer and expert when one tensor is given under
///         both names.
bool alias_v5_mixtral_names(const ModelConfig & cfg, TensorIndex & idx);

/// `idx` itself, or (alias_v5_mixtral_names renames something) `storage` holding the renamed copy.
const TensorIndex & with_v4_names(const ModelConfig & cfg, const TensorIndex & idx, TensorIndex & storage);

/// True when `idx` holds inference tensor `it` as its own (this rank's) tensor rather than as
/// training parts: a fused name, or an unfused HF name with the rank's shard shape (at tp 1
/// both forms are the same bytes).
bool holds_inference_form(const InferenceTensor & it, const TensorIndex & idx);

}  // namespace fd::model
