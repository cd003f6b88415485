// kernels/cpu/linear_packed.h — linear's many-row path (linear_packed.cpp). Internal to
// kernels/cpu: fd::kernels::linear (matmul.cpp) calls it for more rows than its row-streaming
// tiles take.
#pragma once

#include "fd/kernels/ops.h"
#include "fd/kernels/thread_pool.h"

#include <cstdint>

namespace fd::kernels::detail {

/// fd::kernels::linear (cpu_ops.h) on packed operands: the same contract, shapes and bitwise
/// results as every other path of linear, for any n_rows >= 1 and n_out >= 1 (linear sends it
/// every call of more than 8 rows). x is packed once per call
/// over `pool`; each task owns a range of output strips for every row.
/// Errors   std::bad_alloc when its scratch cannot be mapped.
void linear_packed(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
                   int64_t n_out, int64_t n_in, ThreadPool * pool);

}  // namespace fd::kernels::detail
