#include "fd/spec/proposer.h"

#include "fd/status.h"

#include <algorithm>

namespace fd::spec {

void NgramProposer::propose(const ProposeInput & in, int32_t k, std::vector<int32_t> & out) const {
    const std::span<const int32_t> tokens = in.tokens;
    out.clear();
    const auto n_tok = static_cast<int64_t>(tokens.size());
    if (k <= 0) { return; }
    for (int64_t n = std::min<int64_t>(max_n_, n_tok - 1); n >= min_n_; --n) {
        const int32_t * suffix = tokens.data() + (n_tok - n);
        // Earlier windows [i, i + n), i + n < n_tok: a token must follow the match.
        for (int64_t i = 0; i + n < n_tok; ++i) {
            if (!std::equal(suffix, suffix + n, tokens.data() + i)) { continue; }
            const int64_t from = i + n, to = std::min<int64_t>(n_tok, from + k);
            out.assign(tokens.begin() + from, tokens.begin() + to);
            return;
        }
    }
}

std::unique_ptr<Proposer> make_proposer(const SpeculativeConfig & cfg) {
    switch (cfg.method) {
        case SpecMethod::none: return nullptr;
        case SpecMethod::ngram: return std::make_unique<NgramProposer>(cfg.prompt_lookup_min, cfg.prompt_lookup_max);
        case SpecMethod::mtp: return std::make_unique<MtpProposer>();
    }
    return nullptr;
}

void MtpProposer::propose(const ProposeInput & in, int32_t k, std::vector<int32_t> & out) const {
    out.clear();
    for (const int32_t t : in.layer_drafts) {
        if (static_cast<int32_t>(out.size()) >= k || t < 0) { break; }
        out.push_back(t);
    }
}

}  // namespace fd::spec
