// kernels/cpu/linear_bf16_avx2.h — the AVX2 + FMA path of the bf16 compute mode
// (linear_bf16_avx2.cpp). Internal to kernels/cpu: linear_bf16.cpp's public functions call these
// when the isa is Bf16Isa::avx2. Each gives the bits of the portable path (bf16_portable.h).
#pragma once

#include "fd/kernels/ops.h"
#include "fd/kernels/thread_pool.h"

#include <cstdint>

namespace fd::kernels::detail {

/// Whether this CPU has AVX2 and FMA (cpuid, checked once); false where the compiler cannot
/// target them (not x86-64 GCC / Clang).
bool cpu_has_avx2_fma();

/// round_to_bf16 (cpu_ops.h) with AVX2: out [n] bf16 bits;  x [n] f32. CPU must have AVX2.
void round_to_bf16_avx2(uint16_t * out, const float * x, int64_t n);

/// dpbf16_step (cpu_ops.h) with AVX2 FMAs: acc [16] f32 modified;  a, b [32] bf16 bits.
void dpbf16_step_avx2(float * acc, const uint16_t * a, const uint16_t * b);

/// linear_bf16 (cpu_ops.h) with AVX2 FMAs, same contract, shapes and bits:
/// out [n_rows, n_out] f32 written;  x [n_rows, n_in] f32;  w [n_out, n_in] `wtype`;
/// bias [n_out] f32 or nullptr. n_rows, n_out >= 1. CPU must have AVX2 and FMA.
void linear_bf16_avx2(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
                      int64_t n_out, int64_t n_in, ThreadPool * pool);

}  // namespace fd::kernels::detail
