// fd/half.h — the 16-bit float formats of checkpoints, widened to f32 exactly (every BF16 and
// F16 value, NaN/Inf and subnormals included, is representable in f32). Header-only, so the
// checkpoint readers (fd_checkpoint) widen without linking the kernels; the kernels' bulk
// bf16_to_f32 / f16_to_f32 (fd/kernels/ops.h) are loops over these.
#pragma once

#include <cstdint>
#include <cstring>

namespace fd {

/// The f32 whose upper 16 bits are `h` (BF16 is f32 truncated to 16 bits).
inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

/// IEEE 754 binary16 `h` as f32 (sign, 5-bit exponent, 10-bit mantissa; subnormals renormalized).
inline float f16_to_float(uint16_t h16) {
    const uint32_t h    = h16;
    const uint32_t sign = (h & 0x8000u) << 16;
    uint32_t       exp  = (h >> 10) & 0x1f;
    uint32_t       mant = h & 0x3ffu;
    uint32_t       bits;
    if (exp == 0x1f) {                      // inf / NaN
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {                  // normal
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {                 // zero
        bits = sign;
    } else {                                // subnormal: renormalize
        exp = 113;
        while ((mant & 0x400u) == 0) { mant <<= 1; --exp; }
        bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

}  // namespace fd
