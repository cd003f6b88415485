// fd/spec/proposer.h — draft proposers: guesses of the next tokens that the target verifies.
//
// A proposer only guesses; the engine scores [last token, d1..dk] with the target in one forward
// and keeps the longest prefix the target itself would have produced (fd/engine/sampler.h,
// verify_draft_token), so a wrong guess costs compute, never correctness. Two proposers answer
// the same call: n-gram (a lookup in the tokens) and MTP (the drafts the checkpoint's own MTP
// layer computed right after the previous step, fd/model/worker.h DraftBatch; the engine runs
// that layer when uses_draft_layers() and hands its output in as ProposeInput::layer_drafts).
#pragma once

#include "fd/spec/spec_config.h"

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace fd::spec {

/// What a proposer may look at for one sequence.
struct ProposeInput {
    std::span<const int32_t> tokens;        ///< [n_tokens] prompt + generated, the last not yet in the KV cache
    std::span<const int32_t> layer_drafts;  ///< [<= k] the draft layers' greedy tokens after the last step (MTP), -1 ends them early
};

class Proposer {
public:
    virtual ~Proposer() = default;
    /// Up to `k` draft tokens to follow `in.tokens`. Appends them to `out` (cleared first);
    /// none is a valid answer.  Shapes  out [<= k] token ids
    virtual void propose(const ProposeInput & in, int32_t k, std::vector<int32_t> & out) const = 0;
    /// True when the engine must run the draft layers after each step (MTP).
    virtual bool uses_draft_layers() const { return false; }
};

/// vLLM's n-gram (prompt-lookup) proposer: for n from prompt_lookup_max down to
/// prompt_lookup_min, the sequence's last n tokens are searched for earlier in the sequence
/// (prompt and output alike); the first (earliest) occurrence of the longest n that matches
/// gives the draft: the up to k tokens that followed it. No match: no draft.
/// Cost O(n_tokens * prompt_lookup_max) per call, no state.
class NgramProposer final : public Proposer {
public:
    NgramProposer(int32_t prompt_lookup_min, int32_t prompt_lookup_max) : min_n_(prompt_lookup_min), max_n_(prompt_lookup_max) {}
    void propose(const ProposeInput & in, int32_t k, std::vector<int32_t> & out) const override;

private:
    int32_t min_n_, max_n_;
};

/// vLLM's MTP proposer (method "mtp"): the drafts are the greedy tokens of the checkpoint's MTP
/// layer 0, run k times (vLLM reuses that one layer), which the engine computed after the last
/// step. This only hands out the first up to k of them (stopping at a -1).
class MtpProposer final : public Proposer {
public:
    void propose(const ProposeInput & in, int32_t k, std::vector<int32_t> & out) const override;
    bool uses_draft_layers() const override { return true; }
};

/// The proposer `cfg` names (nullptr for SpecMethod::none).
std::unique_ptr<Proposer> make_proposer(const SpeculativeConfig & cfg);

}  // namespace fd::spec
