// stories260K against llama2.c: greedy ids and per-step top-1 logits (reference_logits.json),
// prefill-vs-decode and batch invariance of the logits, at the Worker level (no HTTP, no engine).
#include "fd/kv/kv_cache.h"
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/tokenizer/sentencepiece_tokenizer.h"
#include "fd/model/worker.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <fstream>

namespace {

const std::string kModel = FD_SOURCE_DIR "/models/stories260K";

struct Fixture {
    fd::model::ModelConfig cfg = fd::model::load_model_config(kModel);
    fd::model::Worker      worker{cfg, fd::model::read_tensor_index(kModel),
                             {.rank = 0, .n_threads = 2, .block_size = 16, .n_blocks = 256, .max_model_len = 512}};
    fd::kv::KvCache        kv{{.n_blocks = 256, .block_size_tokens = 16, .enable_prefix_caching = false}};

    /// Run tokens[from, to) of sequence `seq` (whose KV holds [0, from)), logits of the last.
    void add(fd::model::StepBatch & b, fd::kv::SeqId seq, const std::vector<int32_t> & tokens, int32_t from, int32_t to) {
        REQUIRE(kv.allocate(seq, to));
        const auto & table = kv.block_table(seq);
        for (int32_t pos = from; pos < to; ++pos) {
            b.tokens.push_back(tokens[pos]);
            b.positions.push_back(pos);
            b.slots.push_back(int64_t(table[pos / 16]) * 16 + pos % 16);
            b.queries.push_back({table.data(), pos + 1});
        }
        b.logits_rows.push_back(static_cast<int32_t>(b.tokens.size()) - 1);
    }
};

nlohmann::json reference() {
    std::ifstream in(kModel + "/reference_logits.json");
    return nlohmann::json::parse(in);
}

}  // namespace

TEST_SUITE("model::stories260K") {
    TEST_CASE("greedy decoding reproduces llama2.c ids and top-1 logits within 1e-4") {
        Fixture f;
        const auto ref = reference();
        std::vector<int32_t> tokens = ref["prompt_token_ids"].get<std::vector<int32_t>>();
        const auto gen = ref["generated_token_ids"].get<std::vector<int32_t>>();
        const size_t n_prompt = tokens.size();
        std::vector<float> logits(f.cfg.vocab_size);
        double max_err = 0.0;
        for (const auto & step : ref["steps"]) {
            const int32_t pos = step["pos"];
            fd::model::StepBatch b;
            f.add(b, 1, tokens, pos, pos + 1);
            f.worker.forward(b, logits.data());
            const int32_t am = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
            CHECK(am == step["argmax"].get<int32_t>());
            const double err = std::fabs(logits[am] - step["top1_logit"].get<double>());
            max_err = std::max(max_err, err);
            CHECK(err < 1e-4);
            for (const auto & t5 : step["top5"]) {
                CHECK(std::fabs(logits[t5[0].get<int32_t>()] - t5[1].get<double>()) < 1e-4);
            }
            if (static_cast<size_t>(pos) + 1 >= tokens.size()) { tokens.push_back(am); }
        }
        MESSAGE("max |top-1 logit - llama2.c| = " << max_err);
        CHECK(std::vector<int32_t>(tokens.begin() + n_prompt, tokens.end()) == gen);
    }

    TEST_CASE("a prompt prefilled in one step gives bitwise the logits of token-by-token decoding") {
        Fixture f;
        fd::tokenizer::SentencePieceTokenizer tok(kModel, f.cfg.bos_token_id);
        const auto prompt = tok.encode("Lily and Tom were playing in the park. They liked to play");
        const int32_t n = static_cast<int32_t>(prompt.size());
        std::vector<float> a(f.cfg.vocab_size), b(f.cfg.vocab_size);
        fd::model::StepBatch one;
        f.add(one, 1, prompt, 0, n);
        f.worker.forward(one, a.data());
        for (int32_t pos = 0; pos < n; ++pos) {
            fd::model::StepBatch s;
            f.add(s, 2, prompt, pos, pos + 1);
            f.worker.forward(s, b.data());
        }
        CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    }

    TEST_CASE("a sequence's logits are bitwise the same alone and batched with others") {
        Fixture f;
        fd::tokenizer::SentencePieceTokenizer tok(kModel, f.cfg.bos_token_id);
        const auto target = tok.encode("Once upon a time, there was a little girl");
        const int32_t n = static_cast<int32_t>(target.size());
        std::vector<float> alone(f.cfg.vocab_size);
        {
            fd::model::StepBatch b;
            f.add(b, 1, target, 0, n);
            f.worker.forward(b, alone.data());
        }
        // Same sequence in the middle of a mixed batch: a decode of another sequence, a long prefill.
        const auto other1 = tok.encode("The little dog ran");
        const auto other2 = tok.encode("Tom had a red ball. He threw it high and it landed in a tree far away");
        {
            fd::model::StepBatch warm;
            f.add(warm, 10, other1, 0, static_cast<int32_t>(other1.size()) - 1);
            f.worker.forward(warm, std::vector<float>(f.cfg.vocab_size).data());
        }
        fd::model::StepBatch mixed;
        f.add(mixed, 10, other1, static_cast<int32_t>(other1.size()) - 1, static_cast<int32_t>(other1.size()));
        f.add(mixed, 11, target, 0, n);
        f.add(mixed, 12, other2, 0, static_cast<int32_t>(other2.size()));
        std::vector<float> logits(3 * f.cfg.vocab_size);
        f.worker.forward(mixed, logits.data());
        CHECK(std::memcmp(alone.data(), logits.data() + f.cfg.vocab_size, alone.size() * sizeof(float)) == 0);
    }
}
