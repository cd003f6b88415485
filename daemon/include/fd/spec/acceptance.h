// fd/spec/acceptance.h — how many draft tokens the target accepted, per weight version.
//
// vLLM's spec-decode counters: a "draft" is one sequence's proposal verified in one step
// (vllm:spec_decode_num_drafts), of num_draft_tokens tokens of which num_accepted_tokens were
// accepted; accepted_per_pos[i] counts drafts whose token i was accepted. Mean accepted length
// (vLLM's mean acceptance length) = 1 + accepted / drafts: tokens produced per target forward
// of a speculating sequence. Header-only value types; the engine keeps one per recent weight
// version and one over all versions.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fd::spec {

struct DraftCounters {
    int64_t              n_drafts          = 0;  ///< proposals verified (one per sequence per step)
    int64_t              n_draft_tokens    = 0;  ///< tokens proposed and verified
    int64_t              n_accepted_tokens = 0;  ///< of those, accepted by the target
    std::vector<int64_t> accepted_per_pos;       ///< [k] drafts whose token i was accepted

    /// One verified proposal of `n_proposed` tokens, the first `n_accepted` accepted.
    void record(int32_t n_proposed, int32_t n_accepted) {
        ++n_drafts;
        n_draft_tokens += n_proposed;
        n_accepted_tokens += n_accepted;
        if (accepted_per_pos.size() < static_cast<size_t>(n_accepted)) { accepted_per_pos.resize(static_cast<size_t>(n_accepted), 0); }
        for (int32_t i = 0; i < n_accepted; ++i) { ++accepted_per_pos[static_cast<size_t>(i)]; }
    }
    /// accepted / proposed tokens; 0 when nothing was proposed.
    double acceptance_rate() const { return n_draft_tokens > 0 ? static_cast<double>(n_accepted_tokens) / static_cast<double>(n_draft_tokens) : 0.0; }
    /// 1 + accepted / drafts (tokens per target forward of a speculating sequence); 0 when no draft.
    double mean_accepted_length() const { return n_drafts > 0 ? 1.0 + static_cast<double>(n_accepted_tokens) / static_cast<double>(n_drafts) : 0.0; }
};

/// Weight versions whose counters are kept: the ones drafts were verified under most recently
/// (the acceptance-collapse check compares the last two). An RL loop updates the weights every
/// step, so keeping every version would grow /metrics by four series per update without end.
inline constexpr size_t kVersionsKept = 4;

/// Drafts are verified under `version` now: move it to the back of `recent` (the keys of
/// `by_version`, least recently drafted under first) and drop the versions past the last `keep`
/// from both. A dropped version that comes back starts from zero.
inline void keep_recent_versions(std::map<std::string, DraftCounters> & by_version, std::vector<std::string> & recent,
                                 const std::string & version, size_t keep = kVersionsKept) {
    recent.erase(std::remove(recent.begin(), recent.end(), version), recent.end());
    recent.push_back(version);
    while (recent.size() > keep) {
        by_version.erase(recent.front());
        recent.erase(recent.begin());
    }
}

/// Draft tokens each version must have had verified before their acceptance rates are compared.
inline constexpr int64_t kCollapseWindowTokens = 64;

/// The acceptance-collapse check after a weight update (SPEC §11): true when both the previous
/// version and the current one have at least `window` verified draft tokens and the current
/// acceptance rate is below a third of the previous one (e.g. a draft layer left stale, or
/// updated apart from the target). Pure; the engine logs a warning and flags /health.
inline bool acceptance_collapsed(const DraftCounters & previous, const DraftCounters & current, int64_t window = kCollapseWindowTokens) {
    return previous.n_draft_tokens >= window && current.n_draft_tokens >= window &&
           current.acceptance_rate() * 3.0 < previous.acceptance_rate();
}

}  // namespace fd::spec
