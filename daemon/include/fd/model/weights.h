// fd/model/weights.h — the model's weights in inference layout, and loading them.
//
// Owns one mmap-backed Arena holding every tensor as f32. Linear weights are fused and packed
// for kernels::matmul_packed:
//   wqkv    [q_dim + 2*kv_dim, hidden]   rows q_proj | k_proj | v_proj        (packed)
//   w_gate_up [2*intermediate, hidden]   rows gate_proj | up_proj             (packed)
//   wo [hidden, q_dim], w_down [hidden, intermediate], lm_head [vocab, hidden] (packed)
//   embed [vocab, hidden] (row lookup, unpacked); norms [hidden]; qkv bias [q_dim + 2*kv_dim]
// Loading validates every name, shape and dtype against the ModelConfig before a byte is
// copied; a failure leaves the arena untouched. Only the engine thread calls these.
#pragma once

#include "fd/arena.h"
#include "fd/model/model_config.h"
#include "fd/model/safetensors.h"

#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace fd::model {

struct LayerWeights {
    const float * attn_norm  = nullptr;  ///< [hidden]
    const float * wqkv       = nullptr;  ///< packed [q_dim + 2*kv_dim, hidden]
    const float * bqkv       = nullptr;  ///< [q_dim + 2*kv_dim] or nullptr
    const float * wo         = nullptr;  ///< packed [hidden, q_dim]
    const float * mlp_norm   = nullptr;  ///< [hidden]
    const float * w_gate_up  = nullptr;  ///< packed [2*intermediate, hidden]
    const float * w_down     = nullptr;  ///< packed [hidden, intermediate]
};

struct ModelWeights {
    const float *             embed      = nullptr;  ///< [vocab, hidden]
    std::vector<LayerWeights> layers;                ///< [n_layers]
    const float *             final_norm = nullptr;  ///< [hidden]
    const float *             lm_head    = nullptr;  ///< packed [vocab, hidden]
};

/// One tensor the model expects, in HF (training) naming.
struct ExpectedTensor {
    std::string          name;
    std::vector<int64_t> shape;
    bool                 optional = false;  ///< e.g. lm_head.weight of a tied model
};

/// Every tensor a checkpoint of `cfg` must (or may) hold.
std::vector<ExpectedTensor> expected_tensors(const ModelConfig & cfg);

/// Dtype of every tensor, by HF name (what an update must match).
using DTypeMap = std::map<std::string, DType>;

/// Check `idx` against `cfg`: every required tensor present with the right shape (and, when
/// `dtypes` is given, the same dtype), no unknown names (rotary_emb.inv_freq is ignored).
/// Errors  fd::Error{invalid_checkpoint} naming the file and tensor.
void validate_checkpoint(const ModelConfig & cfg, const TensorIndex & idx, const DTypeMap * dtypes = nullptr);

/// Fills `dst` [numel] with tensor `name` (HF naming) as f32.
using TensorReader = std::function<void(const std::string & name, float * dst)>;

/// Convert, fuse and pack every tensor into inference layout. With `arena` (reserved, empty),
/// allocates `w` from it; with `arena == nullptr`, overwrites the tensors `w` already points to
/// (in-place update: same config, same layout). Errors: whatever `read` throws.
void fill_weights(const ModelConfig & cfg, const TensorReader & read, Arena * arena, ModelWeights & w);

/// Arena bytes the weights of `cfg` need.
int64_t weights_arena_bytes(const ModelConfig & cfg);

/// Validate (dtypes too when given), then read, convert and pack every tensor into `arena`
/// (reserved here). Errors  fd::Error{invalid_checkpoint} (arena left released on failure).
ModelWeights load_weights(const ModelConfig & cfg, const TensorIndex & idx, Arena & arena, const DTypeMap * dtypes = nullptr);

}  // namespace fd::model
