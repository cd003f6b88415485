// fd/dtype.h — the one element-type enum of fdrollout's tensors.
//
// A tensor's dtype is how its floats are stored: in a checkpoint (safetensors "F32" / "BF16" /
// "F16"), in the rank's weight arena (f32 or bf16; F16 checkpoints are widened to f32 at load),
// in a weight stream's bucket, and in the kernels' arguments (a linear layer's weight, an
// embedding table, a device buffer checked for NaN/Inf). Before issue #22 these were three enums
// (`model::DType`, `kernels::WType`, `kernels::StoredType`) converted into each other at every
// boundary; they are aliases of this one now.
//
// The enumerator values are fixed (they travel as a byte: the kernels' template arguments,
// fd/shm/ipc_weights.h's IpcDType has the same numbering): f32 = 0, bf16 = 1, f16 = 2.
// Header-only; no dependency beyond the standard library.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace fd {

/// Element type of a stored tensor.
enum class DType : uint8_t {
    f32  = 0,  ///< IEEE 754 binary32
    bf16 = 1,  ///< bfloat16: the upper 16 bits of a binary32 (8 exponent bits, 7 mantissa bits)
    f16  = 2,  ///< IEEE 754 binary16 (5 exponent bits, 10 mantissa bits)
};

/// Number of DType values (for tables indexed by dtype).
inline constexpr int kDTypeCount = 3;

/// Bytes per element of `d`: 4 (f32) or 2 (bf16, f16).
constexpr int64_t dtype_size(DType d) { return d == DType::f32 ? 4 : 2; }

/// The safetensors name of `d`: "F32" | "BF16" | "F16" (what checkpoints, the weight-stream
/// wire and error messages say).
constexpr const char * dtype_name(DType d) {
    switch (d) {
        case DType::f32: return "F32";
        case DType::bf16: return "BF16";
        case DType::f16: return "F16";
    }
    return "?";
}

/// Parse a dtype name: safetensors' "F32" / "BF16" / "F16", or PyTorch's "float32" / "float",
/// "bfloat16", "float16" / "half", each optionally prefixed "torch." (what a trainer's
/// `str(tensor.dtype)` sends). Case-sensitive, as both spellings are.
/// Returns  the dtype, or std::nullopt for any other string (callers turn it into their own
///          error naming the field; see stream::parse_dtype_name).
constexpr std::optional<DType> parse_dtype(std::string_view s) {
    if (s.substr(0, 6) == "torch.") { s.remove_prefix(6); }
    if (s == "F32" || s == "float32" || s == "float") { return DType::f32; }
    if (s == "BF16" || s == "bfloat16") { return DType::bf16; }
    if (s == "F16" || s == "float16" || s == "half") { return DType::f16; }
    return std::nullopt;
}

}  // namespace fd
