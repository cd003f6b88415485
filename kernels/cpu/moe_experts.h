// kernels/cpu/moe_experts.h — the CPU backend's routed-expert GEMMs (moe_experts.cpp). Internal
// to kernels/cpu: CpuBackend::moe_experts (cpu_backend.cpp) calls it a segment of the plan at a
// time and scatter-adds the outputs itself (Backend::scale_add_rows, the one accumulation every
// path shares: EP's combine too).
#pragma once

#include "fd/kernels/backend.h"
#include "fd/kernels/moe.h"
#include "fd/kernels/thread_pool.h"

#include <cstdint>

namespace fd::kernels::detail {

/// Groups of up to this many rows run on the expert tiles (register tiles of 1..6 rows, the
/// expert's weights streamed from memory once); larger groups on kernels::linear.
constexpr int64_t kMoeSmallRows = 16;

/// Floats of scratch moe_expert_outputs uses per (token, expert) pair (its caller sizes segments
/// by it).
int64_t moe_scratch_floats_per_pair(int64_t n_embd, int64_t n_ff);

/// Expert outputs of the pairs of plan experts [i0, i1) (pairs p in [plan.begin[i0],
/// plan.begin[i1]), in plan order):
///   ye[p - begin[i0], :] = down_e(silu(gate_e · x[rows[p]]) * (up_e · x[rows[p]]))
/// each linear bitwise kernels::linear's result for that row (the same FMA chain per output:
/// 16 lanes over k ascending, bf16 widened, one fixed lane reduction), so a row's output depends
/// only on its own route, never on the group size or the tiling: batch invariant.
/// All gate_up linears of the segment run first, then all down linears (each group on whole-k
/// register tiles sized to its rows; the next weights prefetched as the current tile ends, the
/// next expert's too), so the weights stream as one sequence.
/// Shapes  ye [n_pairs, n_embd] f32 written;  x [n_rows, n_embd] f32;  experts [n_experts] host,
///         gate_up [2 n_ff, n_embd] and down [n_embd, n_ff] of f32 or bf16.
/// Threads one pool call per phase over (expert, output range) tasks; groups above
///         kMoeSmallRows run kernels::linear on the whole pool.
/// Errors  std::bad_alloc when the per-thread scratch cannot be mapped.
void moe_expert_outputs(float * ye, const float * x, const MoePlan & plan, int64_t i0, int64_t i1,
                        const ExpertWeights * experts, int64_t n_embd, int64_t n_ff, ThreadPool * pool);

}  // namespace fd::kernels::detail
