// fd/kernels/moe.h — mixture-of-experts routing and the grouped expert plan (host code; the
// expert GEMMs themselves run through Backend::moe_experts, fd/kernels/backend.h).
//
// Routing follows transformers' Qwen3MoeSparseMoeBlock / Qwen2MoeSparseMoeBlock /
// MixtralSparseMoeBlock, in f32, one token at a time (a token's route never depends on the
// rest of the batch):
//   p        = softmax(router_logits)              (max-subtracted, f32)
//   ids, w   = the top_k largest p, in descending order (ties: the lower expert id first,
//              a fixed rule where torch.topk leaves the order open)
//   w       /= sum(w)                               when renormalize (norm_topk_prob; Mixtral always)
#pragma once

#include <cstdint>
#include <vector>

namespace fd::kernels {

/// Route `n_rows` tokens.
/// Shapes  ids [n_rows, top_k] int32 written (expert ids in [0, n_experts));
///         weights [n_rows, top_k] f32 written;  logits [n_rows, n_experts] f32 (host memory).
/// Requires 1 <= top_k <= n_experts.
void moe_route(int32_t * ids, float * weights, const float * logits, int64_t n_rows, int64_t n_experts, int32_t top_k,
               bool renormalize);

/// The batch grouped by expert: for every expert e used by some token, the (token, slot)
/// pairs that chose it, tokens ascending. Experts appear in ascending id order, which is the
/// order each token's expert outputs are summed in (transformers' index_add_ loop), so a
/// token's sum never depends on the other tokens.
struct MoePlan {
    std::vector<int32_t> experts;   ///< [n_used] the experts used, ascending
    std::vector<int64_t> begin;     ///< [n_used + 1] expert experts[i]'s pairs are [begin[i], begin[i+1])
    std::vector<int32_t> rows;      ///< [n_rows * top_k] token row of each pair
    std::vector<float>   weights;   ///< [n_rows * top_k] routing weight of each pair
    int64_t              max_rows = 0;  ///< the largest group (sizes the expert op's work buffer)
};

/// Build the plan of `n_rows` routed tokens (ids / weights as moe_route writes them).
/// Errors  none (ids outside [0, n_experts) are a caller bug: FD_CHECK, Errc::internal).
MoePlan moe_plan(const int32_t * ids, const float * weights, int64_t n_rows, int32_t top_k, int64_t n_experts);

}  // namespace fd::kernels
