// fd/model/weights.h — loading the model's weights into one arena in the inference layout of
// fd/checkpoint/layout.h (the ONE home of the TP sharding), and pointing the forward pass at them.
// Only the engine thread calls these.
#pragma once

#include "fd/kernels/backend.h"
#include "fd/kernels/ops.h"
#include "fd/kernels/thread_pool.h"
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/checkpoint/layout.h"

#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace fd::model {

struct FillOptions {
    bool   check_finite = true;  ///< refuse NaN/Inf (checked on each piece right after it is read)
    double timeout_s    = 0.0;   ///< > 0: no new piece is read after this many seconds (a hung file system)
    /// nullptr: `base` is host memory, written in place. Else `base` is this backend's memory
    /// (a device region): each chunk is read, checked and widened in a host bounce buffer
    /// (pinned where the backend has alloc_pinned_host; one per pool thread, each at most
    /// 16 MiB) and then upload()ed, one upload at a time.
    kernels::Backend * upload_to = nullptr;
};

/// Read every inference tensor of `layout` from the checkpoint `idx` into `base`
/// ([layout.arena_bytes] bytes, 64-byte aligned): only the rank's slices (a column slice is
/// read row by row). Bytes stored in the memory dtype are copied
/// by pread in chunks of <= 8 MiB spread over `pool` (nullptr = caller only), each read in
/// 256 KiB pieces that are checked for NaN/Inf while still in cache (F32/BF16/F16 bits, before
/// widening); others are read, checked and widened to f32. Every file is opened without
/// blocking, must be a regular file and the one whose header `idx` was read from (st_dev/ino).
/// A tied model whose checkpoint also stores a different lm_head.weight: a warning log.
/// With opt.upload_to the same bytes reach `base` through bounce buffers (see FillOptions).
/// A tensor on a CUDA IPC allocation (TensorInfo::on_cuda_ipc) is copied device to device when
/// opt.upload_to is a CUDA backend and no widening is needed, its NaN/Inf check run on the
/// device (Backend::find_nonfinite); otherwise it is copied to host and handled as a file read.
/// On error `base` holds a partial copy (callers fill a staging arena).
/// Errors   fd::Error{invalid_checkpoint} naming the file and tensor (cannot open, not a regular
///          file, short read, a NaN/Inf value and its element index); source_unavailable when a
///          file was replaced since it was indexed; timeout past `opt.timeout_s`.
void fill_weights(const WeightLayout & layout, const TensorIndex & idx, std::byte * base, kernels::ThreadPool * pool,
                  const FillOptions & opt = {});

/// A linear weight as the kernels read it: [n_out, n_in] in `type`.
struct LinearWeight {
    const void * w    = nullptr;
    fd::DType    type = fd::DType::f32;  ///< f32 or bf16 (F16 checkpoints are widened at load)
};

/// One rank's sparse MoE block (fd/checkpoint/layout.h; T = tp size, moe_ff = moe_intermediate_size).
struct MoeWeights {
    LinearWeight router;                         ///< [n_experts, hidden] (replicated)
    std::vector<kernels::ExpertWeights> experts; ///< [n_experts] gate_up [2*moe_ff/T, hidden], down [hidden, moe_ff/T]; expert parallel: T = 1 and only this rank's experts (the others null)
    LinearWeight shared_gate_up;                 ///< [2*shared_ff/T, hidden] (Qwen2-MoE) or w nullptr
    LinearWeight shared_down;                    ///< [hidden, shared_ff/T]
    LinearWeight shared_gate;                    ///< [1, hidden] (replicated)
};

/// One rank's layer (T = tp size; T = 1: the whole layer).
struct LayerWeights {
    const float * attn_norm = nullptr;  ///< [hidden] f32
    LinearWeight  qkv;                  ///< [(q_dim + 2*kv_dim)/T, hidden]
    const float * bqkv      = nullptr;  ///< [(q_dim + 2*kv_dim)/T] f32 or nullptr
    const float * q_norm    = nullptr;  ///< [head_dim] f32 (Qwen3) or nullptr
    const float * k_norm    = nullptr;  ///< [head_dim] f32 (Qwen3) or nullptr
    LinearWeight  o;                    ///< [hidden, q_dim/T]
    const float * mlp_norm  = nullptr;  ///< [hidden] f32
    LinearWeight  gate_up;              ///< [2*intermediate/T, hidden] (dense layers)
    LinearWeight  down;                 ///< [hidden, intermediate/T] (dense layers)
    MoeWeights    moe;                  ///< sparse layers (ModelConfig::is_moe_layer); else empty
};

/// One MiMo next-token-prediction layer (model.mtp_layers.N.*; vLLM MiMoMultiTokenPredictorLayer):
///   x = input_proj([hidden_norm(h) | token_norm(embed(t))]);  x = block(x);  out = final_norm(x)
struct MtpWeights {
    const float * token_norm  = nullptr;  ///< [hidden] f32 token_layernorm
    const float * hidden_norm = nullptr;  ///< [hidden] f32 hidden_layernorm
    LinearWeight  input_proj;             ///< [hidden, 2*hidden] columns: hidden | token embedding
    LayerWeights  block;                  ///< a dense decoder block (whole: tp 1)
    const float * final_norm  = nullptr;  ///< [hidden] f32 final_layernorm
};

/// Pointers into one filled arena, plus f32 copies of the small 1-D tensors (norms, biases).
struct ModelWeights {
    LinearWeight              embed;       ///< [vocab/T, hidden] (row lookup; the rank's vocab rows)
    std::vector<LayerWeights> layers;      ///< [n_layers]
    const float *             final_norm = nullptr;  ///< [hidden] f32
    LinearWeight              lm_head;     ///< [vocab/T, hidden] (embed when tied)
    std::vector<MtpWeights>   mtp;         ///< [n_mtp_layers] (ModelConfig::n_mtp_layers)
    std::vector<float>        small_f32;   ///< backing store of the f32 norms and biases
};

/// Point a ModelWeights at the tensors of `layout` in `base` (filled by fill_weights).
/// `device` nullptr: `base` is host memory and the small f32 tensors live in small_f32. Else
/// `base` is `device`'s memory: the small tensors are download()ed, widened, and uploaded into
/// `small_store` (grown to fit once; same address while the layout is the same), which the
/// returned pointers then point into (small_f32 keeps the host copy).
ModelWeights bind_weights(const ModelConfig & cfg, const WeightLayout & layout, const std::byte * base,
                          kernels::Backend * device = nullptr, kernels::ScratchBuffer * small_store = nullptr);

}  // namespace fd::model
