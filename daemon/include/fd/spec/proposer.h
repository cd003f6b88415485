// fd/spec/proposer.h — draft proposers: guesses of the next tokens that the target verifies.
//
// A proposer only guesses; the engine scores [last token, d1..dk] with the target in one forward
// and keeps the longest prefix the target itself would have produced (fd/engine/sampler.h,
// verify_draft_token), so a wrong guess costs compute, never correctness. The seam MTP uses next:
// an MTP proposer answers the same call from the draft layers' hidden states.
#pragma once

#include "fd/spec/spec_config.h"

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace fd::spec {

class Proposer {
public:
    virtual ~Proposer() = default;
    /// Up to `k` draft tokens to follow `tokens` (prompt + generated so far, the last one not yet
    /// in the KV cache). Appends them to `out` (cleared first); none is a valid answer.
    /// Shapes  tokens [n_tokens] token ids;  out [<= k] token ids
    virtual void propose(std::span<const int32_t> tokens, int32_t k, std::vector<int32_t> & out) const = 0;
};

/// vLLM's n-gram (prompt-lookup) proposer: for n from prompt_lookup_max down to
/// prompt_lookup_min, the sequence's last n tokens are searched for earlier in the sequence
/// (prompt and output alike); the first (earliest) occurrence of the longest n that matches
/// gives the draft: the up to k tokens that followed it. No match: no draft.
/// Cost O(n_tokens * prompt_lookup_max) per call, no state.
class NgramProposer final : public Proposer {
public:
    NgramProposer(int32_t prompt_lookup_min, int32_t prompt_lookup_max) : min_n_(prompt_lookup_min), max_n_(prompt_lookup_max) {}
    void propose(std::span<const int32_t> tokens, int32_t k, std::vector<int32_t> & out) const override;

private:
    int32_t min_n_, max_n_;
};

/// The proposer `cfg` names (nullptr for SpecMethod::none). Errors  fd::Error{invalid_argument}
/// for a method this build cannot propose with (mtp).
std::unique_ptr<Proposer> make_proposer(const SpeculativeConfig & cfg);

}  // namespace fd::spec
