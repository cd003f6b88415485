#include "fd/engine/sampler.h"

#include "fd/kernels/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace fd::engine {

double SeqRng::next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1.0p-53;
}

SeqRng SeqRng::from_seed(uint64_t seed, int32_t choice) {
    SeqRng r{seed};
    for (int32_t i = 0; i <= choice; ++i) { r.state ^= static_cast<uint64_t>(r.next() * 0x1.0p53) + static_cast<uint64_t>(i); }
    return r;
}

void apply_logits_processors(float * logits, int32_t vocab, const SamplingParams & p, std::span<const int32_t> prompt,
                             std::span<const int32_t> generated, std::span<const int32_t> eos_ids) {
    auto in_vocab = [vocab](int32_t id) { return id >= 0 && id < vocab; };
    if (static_cast<int64_t>(generated.size()) < p.min_tokens) {
        for (int32_t id : p.stop_token_ids) {
            if (in_vocab(id)) { logits[id] = -std::numeric_limits<float>::infinity(); }
        }
        for (int32_t id : eos_ids) {
            if (in_vocab(id)) { logits[id] = -std::numeric_limits<float>::infinity(); }
        }
    }
    for (const auto & [id, bias] : p.logit_bias) {
        if (in_vocab(id)) { logits[id] += bias; }
    }
    if (p.repetition_penalty != 1.0f) {
        std::vector<int32_t> seen(prompt.begin(), prompt.end());
        seen.insert(seen.end(), generated.begin(), generated.end());
        std::sort(seen.begin(), seen.end());
        seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
        const float r = p.repetition_penalty;
        for (int32_t id : seen) {
            if (!in_vocab(id)) { continue; }
            logits[id] = logits[id] > 0.0f ? logits[id] / r : logits[id] * r;
        }
    }
    if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
        std::vector<int32_t> out(generated.begin(), generated.end());
        std::sort(out.begin(), out.end());
        for (size_t i = 0; i < out.size();) {
            size_t j = i;
            while (j < out.size() && out[j] == out[i]) { ++j; }
            const int32_t id = out[i];
            if (in_vocab(id)) {
                logits[id] -= p.frequency_penalty * static_cast<float>(j - i);
                logits[id] -= p.presence_penalty;
            }
            i = j;
        }
    }
}

int32_t sample_token(const float * logits, int32_t vocab, const SamplingParams & p, SeqRng & rng) {
    if (p.temperature <= 0.0f) { return static_cast<int32_t>(kernels::argmax(logits, vocab)); }
    const double u        = rng.next();
    const bool   restrict = (p.top_k > 0 && p.top_k < vocab) || p.top_p < 1.0f || p.min_p > 0.0f;
    std::vector<int32_t> ids(static_cast<size_t>(vocab));
    std::iota(ids.begin(), ids.end(), 0);
    int32_t n = vocab;
    auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    if (restrict) {
        n = p.top_k > 0 ? std::min(p.top_k, vocab) : vocab;
        std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), by_logit);
    }
    const float mx = logits[kernels::argmax(logits, vocab)];
    std::vector<double> prob(static_cast<size_t>(n));
    double sum = 0.0;
    for (int32_t i = 0; i < n; ++i) {
        // prob[i] / prob of the argmax = exp((logit - max) / T): the ratio min_p compares with
        // (The argmax's own is exactly 1, also when a penalty or bias overflowed some logits to
        // +inf: inf - inf would be NaN and the draw would fall through to the last id; the +inf
        // logits share the mass, as greedy's argmax picks the first of them.)
        prob[i] = logits[ids[i]] == mx ? 1.0 : std::exp(static_cast<double>(logits[ids[i]] - mx) / p.temperature);
        if (p.min_p > 0.0f && prob[i] < static_cast<double>(p.min_p)) {  // sorted: every later one is below too
            n = i;
            break;
        }
        sum += prob[i];
    }
    if (p.top_p < 1.0f) {
        double cum = 0.0;
        int32_t keep = n;
        for (int32_t i = 0; i < n; ++i) {
            cum += prob[i] / sum;
            if (cum >= p.top_p) { keep = i + 1; break; }
        }
        n   = keep;
        sum = std::accumulate(prob.begin(), prob.begin() + n, 0.0);
    }
    const double target = u * sum;
    double cum = 0.0;
    for (int32_t i = 0; i < n; ++i) {
        cum += prob[i];
        if (target < cum) { return ids[i]; }
    }
    return ids[n - 1];
}

DraftVerdict verify_draft_token(const float * logits, int32_t vocab, const SamplingParams & p, SeqRng & rng, int32_t draft) {
    const int32_t t = sample_token(logits, vocab, p, rng);
    return {.token = t, .accepted = t == draft};
}

TokenLogprob token_logprobs(const float * logits, int32_t vocab, int32_t id, int32_t k, std::vector<float> & scratch) {
    scratch.resize(static_cast<size_t>(vocab));
    kernels::log_softmax(scratch.data(), logits, vocab);
    TokenLogprob out;
    out.id      = id;
    out.logprob = scratch[id];
    out.rank    = static_cast<int32_t>(std::count_if(scratch.begin(), scratch.end(), [&](float v) { return v >= out.logprob; }));
    if (k > 0) {
        std::vector<int32_t> ids(static_cast<size_t>(vocab));
        std::iota(ids.begin(), ids.end(), 0);
        const int32_t n = std::min(k, vocab);
        std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), [&](int32_t a, int32_t b) {
            return scratch[a] > scratch[b] || (scratch[a] == scratch[b] && a < b);
        });
        for (int32_t i = 0; i < n; ++i) { out.top.emplace_back(ids[i], scratch[ids[i]]); }
    }
    return out;
}

}  // namespace fd::engine
