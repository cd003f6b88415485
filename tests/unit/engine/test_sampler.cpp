// Sampler (daemon/src/engine/sampler.cpp): greedy, seeded reproducibility, top-k/top-p,
// min_p, sampling frequencies, logprobs and ranks, and vLLM's logits processors (min_tokens, logit_bias,
// repetition/frequency/presence penalties) on hand-computed rows.
#include "fd/engine/sampler.h"
#include "fd/kernels/ops.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

using fd::engine::SamplingParams;
using fd::engine::apply_logits_processors;
using fd::engine::SeqRng;
using fd::engine::sample_token;
using fd::engine::token_logprobs;

namespace {

std::vector<float> random_logits(uint32_t seed, int n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 2.0f);
    std::vector<float> v(static_cast<size_t>(n));
    for (auto & x : v) { x = d(rng); }
    return v;
}

SamplingParams params(float temperature, int32_t top_k = 0, float top_p = 1.0f) {
    SamplingParams p;
    p.temperature = temperature;
    p.top_k       = top_k;
    p.top_p       = top_p;
    return p;
}

std::vector<int32_t> draw(const std::vector<float> & logits, const SamplingParams & p, SeqRng rng, int n) {
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) { out.push_back(sample_token(logits.data(), int32_t(logits.size()), p, rng)); }
    return out;
}

}  // namespace

TEST_SUITE("engine::sampler") {

TEST_CASE("SeqRng yields uniform doubles in [0, 1) with a sane mean") {
    SeqRng r = SeqRng::from_seed(123, 0);
    double sum = 0.0, lo = 1.0, hi = 0.0;
    for (int i = 0; i < 10000; ++i) {
        const double u = r.next();
        REQUIRE(u >= 0.0);
        REQUIRE(u < 1.0);
        sum += u;
        lo = std::min(lo, u);
        hi = std::max(hi, u);
    }
    CHECK(sum / 10000 == doctest::Approx(0.5).epsilon(0.02));
    CHECK(lo < 0.01);
    CHECK(hi > 0.99);
}

TEST_CASE("temperature 0 is greedy argmax with the lowest id on ties and consumes no randomness") {
    const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.9f};
    SeqRng rng = SeqRng::from_seed(1, 0);
    const uint64_t before = rng.state;
    for (int i = 0; i < 5; ++i) { CHECK(sample_token(logits.data(), 5, params(0.0f), rng) == 1); }
    CHECK(rng.state == before);
    for (uint32_t s = 0; s < 20; ++s) {
        const auto l = random_logits(s, 300);
        SeqRng r{s};
        CHECK(sample_token(l.data(), 300, params(0.0f), r) == fd::kernels::argmax(l.data(), 300));
    }
}

TEST_CASE("the same seed and logits give the same token sequence") {
    const auto logits = random_logits(9, 64);
    const auto p = params(1.0f);
    const auto a = draw(logits, p, SeqRng::from_seed(42, 0), 200);
    const auto b = draw(logits, p, SeqRng::from_seed(42, 0), 200);
    CHECK(a == b);
    const auto c = draw(logits, p, SeqRng::from_seed(43, 0), 200);
    CHECK(a != c);
    // The draws really are random: more than a handful of distinct tokens.
    std::vector<int32_t> sorted = a;
    std::sort(sorted.begin(), sorted.end());
    CHECK(std::unique(sorted.begin(), sorted.end()) - sorted.begin() > 10);
}

TEST_CASE("different choice indices of one seed give different streams") {
    const auto logits = random_logits(10, 64);
    const auto p = params(1.0f);
    std::vector<std::vector<int32_t>> streams;
    for (int32_t choice = 0; choice < 4; ++choice) {
        streams.push_back(draw(logits, p, SeqRng::from_seed(7, choice), 100));
        CHECK(SeqRng::from_seed(7, choice).state == SeqRng::from_seed(7, choice).state);
    }
    for (size_t i = 0; i < streams.size(); ++i) {
        for (size_t j = i + 1; j < streams.size(); ++j) {
            CAPTURE(i); CAPTURE(j);
            CHECK(streams[i] != streams[j]);
            CHECK(SeqRng::from_seed(7, int32_t(i)).state != SeqRng::from_seed(7, int32_t(j)).state);
        }
    }
}

TEST_CASE("top_k 1 equals greedy at any temperature") {
    for (uint32_t s = 0; s < 10; ++s) {
        const auto logits = random_logits(100 + s, 128);
        const int32_t greedy = int32_t(fd::kernels::argmax(logits.data(), 128));
        for (float t : {0.1f, 1.0f, 5.0f, 100.0f}) {
            SeqRng rng = SeqRng::from_seed(s, 0);
            for (int i = 0; i < 20; ++i) { CHECK(sample_token(logits.data(), 128, params(t, 1), rng) == greedy); }
        }
    }
}

TEST_CASE("a tiny top_p equals greedy") {
    for (uint32_t s = 0; s < 10; ++s) {
        const auto logits = random_logits(200 + s, 128);
        const int32_t greedy = int32_t(fd::kernels::argmax(logits.data(), 128));
        SeqRng rng = SeqRng::from_seed(s, 3);
        for (int i = 0; i < 50; ++i) { CHECK(sample_token(logits.data(), 128, params(2.0f, 0, 1e-6f), rng) == greedy); }
    }
}

TEST_CASE("top_k restricts draws to the k highest logits") {
    const std::vector<float> logits = {0.0f, 5.0f, 1.0f, 4.0f, 3.0f, -2.0f};
    SeqRng rng = SeqRng::from_seed(5, 0);
    std::array<int, 6> count{};
    for (int i = 0; i < 3000; ++i) { ++count[size_t(sample_token(logits.data(), 6, params(10.0f, 3), rng))]; }
    CHECK(count[0] + count[2] + count[5] == 0);
    CHECK(count[1] > 0);
    CHECK(count[3] > 0);
    CHECK(count[4] > 0);
}

TEST_CASE("top_p keeps the smallest prefix of candidates reaching p") {
    // softmax of log([0.5, 0.3, 0.15, 0.05]): top_p 0.75 keeps ids {0, 1} (0.5 < 0.75 <= 0.8).
    const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
    SeqRng rng = SeqRng::from_seed(11, 0);
    std::array<int, 4> count{};
    const int n = 20000;
    for (int i = 0; i < n; ++i) { ++count[size_t(sample_token(logits.data(), 4, params(1.0f, 0, 0.75f), rng))]; }
    CHECK(count[2] + count[3] == 0);
    CHECK(double(count[0]) / n == doctest::Approx(0.5 / 0.8).epsilon(0.03));
}

TEST_CASE("min_p drops tokens less likely than min_p x the most likely (vLLM's min_p), hand-computed") {
    // p = [0.5, 0.3, 0.15, 0.05]; min_p 0.35: threshold 0.35 * 0.5 = 0.175 keeps ids {0, 1},
    // drawn as 0.5 / 0.8 and 0.3 / 0.8.
    const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
    const int n = 20000;
    SamplingParams p = params(1.0f);
    p.min_p = 0.35f;
    SeqRng rng = SeqRng::from_seed(7, 0);
    std::array<int, 4> count{};
    for (int i = 0; i < n; ++i) { ++count[size_t(sample_token(logits.data(), 4, p, rng))]; }
    CHECK(count[2] + count[3] == 0);
    CHECK(double(count[0]) / n == doctest::Approx(0.625).epsilon(0.03));
    CHECK(double(count[1]) / n == doctest::Approx(0.375).epsilon(0.03));
    // min_p compares the tempered distribution: T = 2 gives p ~ sqrt(p) = [0.7071, 0.5477,
    // 0.3873, 0.2236], ratios to the max [1, 0.7746, 0.5477, 0.3162]; min_p 0.5 keeps {0, 1, 2},
    // drawn as [0.4306, 0.3335, 0.2359] (each sqrt over their sum 1.6421).
    p.temperature = 2.0f;
    p.min_p       = 0.5f;
    count         = {};
    for (int i = 0; i < n; ++i) { ++count[size_t(sample_token(logits.data(), 4, p, rng))]; }
    CHECK(count[3] == 0);
    const std::array<double, 3> want = {0.4306, 0.3335, 0.2359};
    for (size_t i = 0; i < 3; ++i) {
        CAPTURE(i);
        CHECK(std::fabs(double(count[i]) / n - want[i]) < 0.02);
    }
}

TEST_CASE("min_p applies before top_p: top_p sums over the tokens min_p kept") {
    // p = [0.5, 0.3, 0.15, 0.05], min_p 0.2 (threshold 0.1) keeps {0, 1, 2} renormalised to
    // [0.5263, 0.3158, 0.1579]; top_p 0.84 then keeps {0, 1} (0.5263 + 0.3158 = 0.8421 >= 0.84).
    // top_p first would keep {0, 1, 2} (0.5 + 0.3 < 0.84), and min_p would keep id 2 (0.15 >= 0.1).
    const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
    SamplingParams p = params(1.0f, 0, 0.84f);
    p.min_p = 0.2f;
    SeqRng rng = SeqRng::from_seed(13, 0);
    std::array<int, 4> count{};
    const int n = 20000;
    for (int i = 0; i < n; ++i) { ++count[size_t(sample_token(logits.data(), 4, p, rng))]; }
    CHECK(count[2] + count[3] == 0);
    CHECK(double(count[0]) / n == doctest::Approx(0.625).epsilon(0.03));
}

TEST_CASE("min_p 1 is greedy, min_p 0 changes no draw") {
    const auto logits = random_logits(17, 300);
    SamplingParams p = params(1.5f);
    const auto plain = draw(logits, p, SeqRng::from_seed(3, 0), 200);
    p.min_p = 0.0f;
    CHECK(draw(logits, p, SeqRng::from_seed(3, 0), 200) == plain);
    p.min_p = 1.0f;
    const auto greedy_id = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    for (int32_t t : draw(logits, p, SeqRng::from_seed(3, 0), 200)) { REQUIRE(t == greedy_id); }
}

TEST_CASE("empirical frequencies at temperature 1 match the softmax within 0.02") {
    const std::vector<float> logits = {1.0f, 2.0f, 0.0f, 1.5f};
    std::vector<float> lp(4);
    fd::kernels::log_softmax(lp.data(), logits.data(), 4);
    SeqRng rng = SeqRng::from_seed(2024, 0);
    std::array<int, 4> count{};
    const int n = 20000;
    for (int i = 0; i < n; ++i) { ++count[size_t(sample_token(logits.data(), 4, params(1.0f), rng))]; }
    for (int i = 0; i < 4; ++i) {
        CAPTURE(i);
        CHECK(std::fabs(double(count[size_t(i)]) / n - std::exp(double(lp[size_t(i)]))) < 0.02);
    }
    // Temperature 0.5 sharpens the same distribution: softmax(2 * logits).
    const std::vector<float> doubled = {2.0f, 4.0f, 0.0f, 3.0f};
    fd::kernels::log_softmax(lp.data(), doubled.data(), 4);
    count = {};
    for (int i = 0; i < n; ++i) { ++count[size_t(sample_token(logits.data(), 4, params(0.5f), rng))]; }
    for (int i = 0; i < 4; ++i) { CHECK(std::fabs(double(count[size_t(i)]) / n - std::exp(double(lp[size_t(i)]))) < 0.02); }
}

TEST_CASE("token_logprobs returns the chosen token's log_softmax and a best-first top list") {
    const std::vector<float> logits = {0.1f, 3.0f, -1.0f, 3.0f, 2.5f, 0.0f, -7.0f};
    std::vector<float> lp(logits.size());
    fd::kernels::log_softmax(lp.data(), logits.data(), int64_t(logits.size()));
    std::vector<float> scratch;
    const auto r = token_logprobs(logits.data(), int32_t(logits.size()), 4, 3, scratch);
    CHECK(r.id == 4);
    CHECK(r.logprob == lp[4]);
    REQUIRE(r.top.size() == 3);
    CHECK(r.top[0].first == 1);   // tie between ids 1 and 3: lower id first
    CHECK(r.top[1].first == 3);
    CHECK(r.top[2].first == 4);
    for (const auto & [id, v] : r.top) { CHECK(v == lp[size_t(id)]); }
    CHECK(r.top[0].second >= r.top[1].second);
    CHECK(r.top[1].second >= r.top[2].second);

    const auto none = token_logprobs(logits.data(), int32_t(logits.size()), 6, 0, scratch);
    CHECK(none.top.empty());
    CHECK(none.logprob == lp[6]);
    const auto all = token_logprobs(logits.data(), int32_t(logits.size()), 0, 100, scratch);
    CHECK(all.top.size() == logits.size());
    CHECK(all.top.back().first == 6);
}

TEST_CASE("token_logprobs ranks like vLLM: the count of tokens whose logprob is >= the token's") {
    const std::vector<float> logits = {0.1f, 3.0f, -1.0f, 3.0f, 2.5f, 0.0f, -7.0f};
    std::vector<float> scratch;
    CHECK(token_logprobs(logits.data(), 7, 4, 0, scratch).rank == 3);
    CHECK(token_logprobs(logits.data(), 7, 1, 0, scratch).rank == 2);  // tied with id 3: both count
    CHECK(token_logprobs(logits.data(), 7, 3, 0, scratch).rank == 2);
    CHECK(token_logprobs(logits.data(), 7, 6, 0, scratch).rank == 7);
    CHECK(token_logprobs(logits.data(), 7, 0, 0, scratch).rank == 4);
}

TEST_CASE("logits processors: nothing active leaves the row bit-identical") {
    std::vector<float> row = random_logits(5, 64);
    const std::vector<float> before = row;
    SamplingParams p;
    CHECK_FALSE(p.processes_logits());
    const std::vector<int32_t> prompt = {1, 2, 3}, gen = {4, 4, 5};
    apply_logits_processors(row.data(), 64, p, prompt, gen, std::vector<int32_t>{2});
    CHECK(row == before);
}

TEST_CASE("min_tokens masks stop ids and every EOS id until enough tokens exist") {
    SamplingParams p;
    p.min_tokens     = 2;
    p.stop_token_ids = {5};
    p.ignore_eos     = true;  // vLLM masks EOS during min_tokens even with ignore_eos
    CHECK(p.processes_logits());
    const std::vector<int32_t> eos = {1, 2};
    std::vector<float> row = {0.5f, 4.0f, 3.0f, -1.0f, 0.25f, 9.0f, 1.0f};
    std::vector<int32_t> gen = {3};
    apply_logits_processors(row.data(), 7, p, std::vector<int32_t>{0}, gen, eos);
    const float inf = std::numeric_limits<float>::infinity();
    CHECK(row == std::vector<float>{0.5f, -inf, -inf, -1.0f, 0.25f, -inf, 1.0f});
    SeqRng rng = SeqRng::from_seed(1, 0);
    CHECK(sample_token(row.data(), 7, params(0.0f), rng) == 6);
    // With 2 tokens generated the mask is off.
    std::vector<float> row2 = {0.5f, 4.0f, 3.0f, -1.0f, 0.25f, 9.0f, 1.0f};
    gen = {3, 3};
    apply_logits_processors(row2.data(), 7, p, std::vector<int32_t>{0}, gen, eos);
    CHECK(row2 == std::vector<float>{0.5f, 4.0f, 3.0f, -1.0f, 0.25f, 9.0f, 1.0f});
}

TEST_CASE("logit_bias, then repetition, frequency and presence penalties, in vLLM's order") {
    SamplingParams p;
    p.logit_bias         = {{0, 1.0f}, {3, -2.5f}};
    p.repetition_penalty = 2.0f;
    p.frequency_penalty  = 0.5f;
    p.presence_penalty   = 0.25f;
    // prompt {1, 3}, generated {2, 2, 4}: penalised by repetition = {1, 2, 3, 4}
    const std::vector<int32_t> prompt = {1, 3}, gen = {2, 2, 4};
    std::vector<float> row = {1.0f, 3.0f, -1.0f, 2.0f, 0.0f, 5.0f};
    apply_logits_processors(row.data(), 6, p, prompt, gen, std::vector<int32_t>{});
    // id 0: 1 + 1 = 2 (not seen: no penalty)
    // id 1: 3 / 2 = 1.5 (prompt only: repetition only)
    // id 2: -1 * 2 = -2, - 0.5 * 2 = -3, - 0.25 = -3.25
    // id 3: 2 - 2.5 = -0.5 (bias first), * 2 = -1 (now non-positive: multiplied)
    // id 4: 0 * 2 = 0, - 0.5 - 0.25 = -0.75
    // id 5: untouched
    CHECK(row == std::vector<float>{2.0f, 1.5f, -3.25f, -1.0f, -0.75f, 5.0f});
}

TEST_CASE("negative penalties reward repeats; greedy follows the processed row") {
    SamplingParams p    = params(0.0f);
    p.frequency_penalty = -2.0f;
    const std::vector<int32_t> gen = {1, 1, 1};
    std::vector<float> row = {5.0f, 0.0f, 4.0f};
    apply_logits_processors(row.data(), 3, p, std::vector<int32_t>{}, gen, std::vector<int32_t>{});
    CHECK(row == std::vector<float>{5.0f, 6.0f, 4.0f});
    SeqRng rng = SeqRng::from_seed(1, 0);
    CHECK(sample_token(row.data(), 3, p, rng) == 1);
}

}  // TEST_SUITE

TEST_CASE("logits a tiny repetition_penalty overflowed to +inf take all the mass, as greedy's argmax does (a probe: the draw fell through to the last id)") {
    // vocab 6; prompt tokens 1 and 3 have positive logits, divided by 1e-38 they overflow to +inf.
    std::vector<float> logits = {0.5f, 30.0f, -1.0f, 20.0f, 0.1f, -4.0f};
    const std::vector<int32_t> prompt = {1, 3};
    SamplingParams p;
    p.temperature        = 1.0f;
    p.repetition_penalty = 1e-38f;
    apply_logits_processors(logits.data(), 6, p, prompt, {}, {});
    REQUIRE(std::isinf(logits[1]));
    REQUIRE(std::isinf(logits[3]));
    int hits[6] = {};
    for (uint64_t seed = 0; seed < 400; ++seed) {
        SeqRng rng = SeqRng::from_seed(seed, 0);
        ++hits[sample_token(logits.data(), 6, p, rng)];
    }
    CHECK(hits[1] + hits[3] == 400);  // only the +inf tokens, never token 5
    CHECK(hits[1] > 120);             // shared evenly between the two
    CHECK(hits[3] > 120);
    p.temperature = 0.0f;
    SeqRng rng = SeqRng::from_seed(1, 0);
    CHECK(sample_token(logits.data(), 6, p, rng) == 1);
}
