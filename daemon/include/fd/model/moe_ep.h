// fd/model/moe_ep.h — expert parallelism's dispatch and combine (--enable-expert-parallel).
//
// Rank r of ep holds experts [r*E/ep, (r+1)*E/ep) whole (fd/checkpoint/layout.h, TpRank::ep).
// Attention stays tensor-parallel, so after its all-reduce every rank holds the hidden state of
// every token of the step, bitwise the same, and routes them identically (the router is
// replicated, routing is per token on the host in f32). Hence:
//   dispatch  is a local selection: rank r takes, from the step's plan (kernels::moe_plan: pairs
//             (token, expert) grouped by expert ascending, tokens ascending), the contiguous
//             range of pairs whose experts it owns and runs each of its experts on its tokens'
//             rows; the expert's output rows  expert_e(x_t)  (unweighted) land, in plan order, as
//             rows of its send buffer;
//   combine   is one all-gather (Comm::all_gather) of those rows, padded to the largest rank's
//             count; then every rank makes exactly Backend::moe_experts' accumulation (the same
//             scale_add_rows calls: rows, routing weights, experts ascending, from 0), so for
//             each token its top-k experts are added in ascending id, as at tp = 1. (Sending the
//             weighted rows instead would change the bits where the kernel fuses w · y + out into
//             one FMA.)
// So the block's output is bitwise that of Backend::moe_experts at tp = 1 on every rank and for
// every ep (the gather copies, it never sums), and the caller does not all-reduce it. The price
// of the fixed order: each rank receives the output row of every (token, expert) pair, n·top_k
// rows (padded to ep · the largest rank's count), where an all-reduce of per-rank partial sums
// (vLLM's EP with tp attention) moves n rows but sums in an order that depends on ep.
//
// Buffers: the send and receive rows live in the rank's `ep_buffer` allocator tag
// (fd/memory/allocator.h): released with the weights on sleep, mapped again on wakeup.
#pragma once

#include "fd/comm/comm.h"
#include "fd/kernels/backend.h"
#include "fd/kernels/moe.h"

#include <cstdint>
#include <vector>

namespace fd::model {

/// One expert-parallel routed-experts call.
struct MoeEpCall {
    const kernels::MoePlan &       plan;        ///< the step's plan over ALL experts (moe_plan)
    const kernels::ExpertWeights * experts;     ///< [n_experts]; only [e_begin, e_end) are read
    int32_t                        n_experts = 0;
    int32_t                        ep        = 1;  ///< ranks the experts are spread over (= comm's world)
    int32_t                        ep_rank   = 0;  ///< this rank's index among them
    int64_t                        n_rows    = 0;  ///< tokens of the step (rows of x and out)
    int64_t                        n_embd    = 0;  ///< hidden size
    int64_t                        n_ff      = 0;  ///< one expert's (whole) intermediate size
};

/// Floats of the ep_buffer the call needs: send [max_pairs, n_embd] + recv [ep, max_pairs, n_embd]
/// where max_pairs is the largest number of (token, expert) pairs one rank owns this step.
int64_t moe_ep_buffer_floats(const MoeEpCall & c);

/// out[t, :] = Σ over t's experts e in ascending id of w(t, e) · expert_e(x_t), bitwise equal to
/// Backend::moe_experts over all experts at tp = 1, on every rank.
/// Shapes  out [n_rows, n_embd] f32 (backend memory; overwritten); x [n_rows, n_embd] f32, the
///         same on every rank; work: Backend::moe_work_floats(plan.max_rows, n_embd, n_ff) floats;
///         buffer: moe_ep_buffer_floats(c) floats (backend memory: the ep_buffer region).
/// Errors  fd::Error{rank_failed} from the comm when a peer is gone or silent past its timeout.
void moe_experts_ep(kernels::Backend & be, comm::Comm & comm, const MoeEpCall & c, float * out, const float * x, float * work,
                    float * buffer);

/// The pairs [first[r], first[r + 1]) of `plan` (plan order) whose experts rank r of `ep` owns
/// (experts [r*E/ep, (r+1)*E/ep)). Shapes  [ep + 1].
std::vector<int64_t> moe_ep_rank_pairs(const kernels::MoePlan & plan, int32_t n_experts, int32_t ep);

}  // namespace fd::model
