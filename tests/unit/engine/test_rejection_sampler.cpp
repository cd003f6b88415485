// verify_draft_token (daemon/src/engine/sampler.cpp): the rejection sampler for a deterministic
// draft keeps the target distribution exactly. Many seeds, chi-square of the emitted tokens
// against the target's probabilities computed here independently (softmax over the top-k
// filter in double); the draft is accepted with probability p(draft); a rejection never emits
// the draft; and the coupling with sample_token (same rng state, same token) that makes seeded
// requests equal with and without speculation.
#include "fd/engine/sampler.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

using fd::engine::SamplingParams;
using fd::engine::SeqRng;
using fd::engine::sample_token;
using fd::engine::verify_draft_token;

namespace {

/// The target's probabilities: softmax(logits / T) over the top_k highest logits, 0 elsewhere.
std::vector<double> target_probs(const std::vector<float> & logits, float temperature, int32_t top_k) {
    std::vector<int32_t> ids(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    std::vector<double> p(logits.size(), 0.0);
    double sum = 0.0;
    for (int32_t i = 0; i < top_k; ++i) { sum += p[ids[i]] = std::exp(static_cast<double>(logits[ids[i]]) / temperature); }
    for (double & x : p) { x /= sum; }
    return p;
}

}  // namespace

TEST_CASE("verify_draft_token: emitted tokens follow the target distribution (chi-square), p(draft) accepted") {
    const std::vector<float> logits = {1.2f, -0.4f, 0.9f, 0.3f, 2.0f, -1.5f, 0.1f};
    SamplingParams p;
    p.temperature = 0.9f;
    p.top_k       = 5;
    const auto    want  = target_probs(logits, p.temperature, p.top_k);
    const int32_t vocab = static_cast<int32_t>(logits.size());
    for (const int32_t draft : {2, 4, 5}) {  // a middling token, the most likely, one top-k filters out
        CAPTURE(draft);
        const int n = 40000;
        std::vector<int64_t> seen(logits.size(), 0);
        int64_t n_accepted = 0, n_draft_on_reject = 0;
        for (int i = 0; i < n; ++i) {
            SeqRng rng = SeqRng::from_seed(0x5eed0000ULL + static_cast<uint64_t>(i), 0);
            const auto v = verify_draft_token(logits.data(), vocab, p, rng, draft);
            ++seen[static_cast<size_t>(v.token)];
            n_accepted += v.accepted ? 1 : 0;
            n_draft_on_reject += !v.accepted && v.token == draft ? 1 : 0;
            CHECK(v.accepted == (v.token == draft));
        }
        CHECK(n_draft_on_reject == 0);
        double chi2 = 0.0;
        int    df   = -1;
        for (size_t t = 0; t < seen.size(); ++t) {
            if (want[t] == 0.0) {
                CHECK(seen[t] == 0);  // filtered out: never emitted, never accepted
                continue;
            }
            const double e = want[t] * n;
            chi2 += (static_cast<double>(seen[t]) - e) * (static_cast<double>(seen[t]) - e) / e;
            ++df;
        }
        CHECK(df == 4);
        CHECK(chi2 < 18.47);  // chi-square, 4 degrees of freedom, p = 0.001
        // Acceptance rate = p(draft): within 4.5 standard deviations.
        const double pd = want[static_cast<size_t>(draft)];
        CHECK(std::abs(static_cast<double>(n_accepted) / n - pd) <= 4.5 * std::sqrt(pd * (1 - pd) / n) + 1e-12);
    }
}

TEST_CASE("verify_draft_token: the same rng state gives sample_token's token (greedy and sampled)") {
    const std::vector<float> logits = {0.5f, 1.5f, -0.2f, 1.49f, 0.0f};
    for (const float temperature : {0.0f, 0.7f, 1.3f}) {
        SamplingParams p;
        p.temperature = temperature;
        p.top_p       = 0.9f;
        for (uint64_t seed = 1; seed < 200; ++seed) {
            for (int32_t draft = 0; draft < 5; ++draft) {
                SeqRng a = SeqRng::from_seed(seed, 3), b = a;
                const int32_t t = sample_token(logits.data(), 5, p, a);
                const auto    v = verify_draft_token(logits.data(), 5, p, b, draft);
                CHECK(v.token == t);
                CHECK(v.accepted == (t == draft));
                CHECK(a.state == b.state);  // the stream advances the same: the rest of the choice matches too
            }
        }
    }
    SamplingParams greedy;
    greedy.temperature = 0.0f;
    SeqRng r{7};
    CHECK(verify_draft_token(logits.data(), 5, greedy, r, 1).accepted);       // the argmax
    CHECK_FALSE(verify_draft_token(logits.data(), 5, greedy, r, 3).accepted); // a near miss is a miss
    CHECK(verify_draft_token(logits.data(), 5, greedy, r, 3).token == 1);
}
