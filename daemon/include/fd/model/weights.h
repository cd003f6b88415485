// fd/model/weights.h — the model's weights in inference layout, and loading them.
//
// The rollout keeps each weight in the checkpoint's own dtype and [out, in] layout, with the
// tensors the forward pass reads together fused along dim 0 (vLLM's packed modules):
//   model.layers.N.self_attn.qkv_proj.weight  [q_dim + 2*kv_dim, hidden]  rows q | k | v
//   model.layers.N.self_attn.qkv_proj.bias    [q_dim + 2*kv_dim]          (Qwen2)
//   model.layers.N.mlp.gate_up_proj.weight    [2*intermediate, hidden]    rows gate | up
// and every other tensor under its Hugging Face name (embed_tokens, o_proj, down_proj, the norms
// incl. Qwen3's self_attn.q_norm / k_norm [head_dim], model.norm, lm_head when untied). A fused tensor's parts are consecutive row ranges, so every
// byte of the inference layout is one contiguous range of one checkpoint tensor: loading,
// wakeup and update_weights are plain parallel reads into one arena (F16 is the exception: it
// is widened to f32 at load).
//
// The layout is planned once, from the first checkpoint; every later checkpoint (wakeup,
// update) must have the same names, shapes and dtypes. Only the engine thread calls these.
#pragma once

#include "fd/kernels/ops.h"
#include "fd/model/model_config.h"
#include "fd/model/safetensors.h"

#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace fd::model {

/// Rows [row0, row0 + rows) of an inference tensor come from training (HF) tensor `hf_name`.
struct WeightPart {
    std::string hf_name;
    int64_t     row0 = 0;
    int64_t     rows = 0;
    DType       dtype = DType::f32;  ///< as stored in the checkpoint the layout was planned from
};

/// One tensor of the rollout's state dict.
struct InferenceTensor {
    std::string             name;        ///< inference name, e.g. model.layers.0.self_attn.qkv_proj.weight
    std::vector<int64_t>    shape;       ///< [rows, cols] or [n], outermost first
    DType                   dtype = DType::f32;  ///< in memory: the checkpoint's f32 / bf16; F16 → f32
    int64_t                 offset = 0;  ///< bytes into the weights arena, 64-byte aligned
    int64_t                 bytes  = 0;
    std::vector<WeightPart> parts;       ///< training tensors stacked along dim 0, in order
};

struct WeightLayout {
    std::vector<InferenceTensor> tensors;        ///< in arena order
    int64_t                      arena_bytes = 0;
    bool                         tied_lm_head = false;  ///< lm_head reads embed_tokens

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

/// The inference layout of `cfg` with the dtypes of `idx` (already validated): a fused tensor
/// whose parts share a dtype keeps it (F16 becomes f32); mixed parts become f32.
WeightLayout plan_layout(const ModelConfig & cfg, const TensorIndex & idx);

/// Check that `idx` can refill `layout` (wakeup, update, any weight source): every inference
/// tensor present either under its inference name with the layout's shape and memory dtype
/// (snapshots, ipc records) or, for fused tensors, as its training parts with the shapes and
/// dtypes first loaded (HF checkpoints); lm_head.weight of a tied model and
/// rotary_emb.inv_freq are allowed and ignored; any other name is an error.
/// Errors  fd::Error{invalid_checkpoint} naming the file and tensor.
void validate_against_layout(const WeightLayout & layout, const TensorIndex & idx);

struct FillOptions {
    bool   check_finite = true;  ///< refuse NaN/Inf (checked on each piece right after it is read)
    double timeout_s    = 0.0;   ///< > 0: no new piece is read after this many seconds (a hung file system)
};

/// Read every inference tensor of `layout` from the checkpoint `idx` into `base`
/// ([layout.arena_bytes] bytes, 64-byte aligned). Bytes stored in the memory dtype are copied
/// by pread in chunks of <= 8 MiB spread over `pool` (nullptr = caller only), each read in
/// 256 KiB pieces that are checked for NaN/Inf while still in cache (F32/BF16/F16 bits, before
/// widening); others are read, checked and widened to f32. Every file is opened without
/// blocking, must be a regular file and the one whose header `idx` was read from (st_dev/ino).
/// A tied model whose checkpoint also stores a different lm_head.weight: a warning log.
/// On error `base` holds a partial copy (callers fill a staging arena).
/// Errors   fd::Error{invalid_checkpoint} naming the file and tensor (cannot open, not a regular
///          file, short read, a NaN/Inf value and its element index); source_unavailable when a
///          file was replaced since it was indexed; timeout past `opt.timeout_s`.
void fill_weights(const WeightLayout & layout, const TensorIndex & idx, std::byte * base, kernels::ThreadPool * pool,
                  const FillOptions & opt = {});

/// A linear weight as the kernels read it: [n_out, n_in] in `type`.
struct LinearWeight {
    const void *   w    = nullptr;
    kernels::WType type = kernels::WType::f32;
};

struct LayerWeights {
    const float * attn_norm = nullptr;  ///< [hidden] f32
    LinearWeight  qkv;                  ///< [q_dim + 2*kv_dim, hidden]
    const float * bqkv      = nullptr;  ///< [q_dim + 2*kv_dim] f32 or nullptr
    const float * q_norm    = nullptr;  ///< [head_dim] f32 (Qwen3) or nullptr
    const float * k_norm    = nullptr;  ///< [head_dim] f32 (Qwen3) or nullptr
    LinearWeight  o;                    ///< [hidden, q_dim]
    const float * mlp_norm  = nullptr;  ///< [hidden] f32
    LinearWeight  gate_up;              ///< [2*intermediate, hidden]
    LinearWeight  down;                 ///< [hidden, intermediate]
};

/// Pointers into one filled arena, plus f32 copies of the small 1-D tensors (norms, biases).
struct ModelWeights {
    LinearWeight              embed;       ///< [vocab, hidden] (row lookup)
    std::vector<LayerWeights> layers;      ///< [n_layers]
    const float *             final_norm = nullptr;  ///< [hidden] f32
    LinearWeight              lm_head;     ///< [vocab, hidden] (embed when tied)
    std::vector<float>        small_f32;   ///< backing store of the f32 norms and biases
};

/// Point a ModelWeights at the tensors of `layout` in `base` (filled by fill_weights).
ModelWeights bind_weights(const ModelConfig & cfg, const WeightLayout & layout, const std::byte * base);

}  // namespace fd::model
