// load_tokenizer (daemon/src/tokenizer/load_tokenizer.cpp): which implementation a model
// directory gets, and the agreement probe when it holds both files. models/stories260K ships
// both a SentencePiece tokenizer.model and a tokenizer.json derived from it (LlamaConverter form
// plus Replace normalizers for SentencePiece's remove_extra_whitespaces; README there), so
// libsentencepiece itself is the reference for HfTokenizer's Metaspace/byte-fallback form.
#include "../test_util.h"
#include "fd/status.h"
#include "fd/tokenizer/hf_tokenizer.h"
#include "fd/tokenizer/sentencepiece_tokenizer.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <random>

namespace fs = std::filesystem;
using fd::tokenizer::load_tokenizer;
using nlohmann::json;

namespace {

const fs::path kStories = fs::path(FD_SOURCE_DIR) / "models" / "stories260K";

/// A model dir holding stories260K's tokenizer.model (optional) and `tokenizer_json` (optional).
struct Dir {
    fd::test::TempDir tmp{"fd_loadtok_"};
    Dir(bool with_model, const json & tokenizer_json) {
        if (with_model) { fs::copy_file(kStories / "tokenizer.model", tmp.path / "tokenizer.model"); }
        if (!tokenizer_json.is_null()) { std::ofstream(tmp.path / "tokenizer.json") << tokenizer_json.dump(); }
    }
};

const json & shipped() {
    static const json j = json::parse(std::ifstream(kStories / "tokenizer.json"));
    return j;
}

/// What transformers' LlamaConverter alone writes for this model: no normalizers for
/// remove_extra_whitespaces, so runs of spaces encode differently from SentencePiece.
json without_whitespace_rules() {
    json j = shipped();
    auto & n = j["normalizer"]["normalizers"];
    n = json::array({n[2], n[3]});   // Prepend "▁", Replace " " → "▁"
    return j;
}

std::string start_error(const fs::path & dir) {
    try {
        load_tokenizer(dir);
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::invalid_checkpoint);
        return e.what();
    }
    FAIL("no error");
    return "";
}

}  // namespace

TEST_SUITE("tokenizer::load") {

TEST_CASE("only tokenizer.model gives SentencePiece, only tokenizer.json gives the HF tokenizer") {
    Dir only_model(true, nullptr);
    CHECK(load_tokenizer(only_model.tmp.path, {.bos_token_id = 1})->kind() == "sentencepiece");
    Dir only_json(false, shipped());
    CHECK(load_tokenizer(only_json.tmp.path)->kind() == "tokenizer.json");
}

TEST_CASE("neither file: the error names both") {
    Dir none(false, nullptr);
    const std::string e = start_error(none.tmp.path);
    CHECK(e.find("tokenizer.json") != std::string::npos);
    CHECK(e.find("tokenizer.model") != std::string::npos);
}

TEST_CASE("both files that agree: tokenizer.json is used, and it encodes like libsentencepiece, special-token text included") {
    const auto tok = load_tokenizer(kStories, {.bos_token_id = 1});
    CHECK(tok->kind() == "tokenizer.json");
    const fd::tokenizer::SentencePieceTokenizer sp(kStories, 1);
    std::vector<std::string> corpus = {"Once upon a time", "Lily and Tom were playing in the park.", "  two  spaces ",
                                       "line\nbreak\n\n", "na\xC3\xAFve caf\xC3\xA9 \xF0\x9F\x99\x82", "12345 + 678 = 999",
                                       "\xE4\xBD\xA0\xE5\xA5\xBD\xE4\xB8\x96\xE7\x95\x8C", ""};
    std::mt19937 rng(11);
    // Special-token text among them: both tokenizers match it as one token (HF's added-token split).
    const char * alphabet[] = {"a", "e", "t", "o", " ", " ", "\n", "T", "!", ".", "\xC3\xA9", "\xC3\xAF", "\xE2\x82\xAC", "\xF0\x9F\x99\x82", "ing", "the",
                               "<s>", "</s>", "<unk>", "</"};
    for (int i = 0; i < 300; ++i) {
        std::string s;
        for (int k = int(rng() % 30); k > 0; --k) { s += alphabet[rng() % std::size(alphabet)]; }
        corpus.push_back(s);
    }
    int mismatches = 0;
    for (const auto & text : corpus) {
        const auto a = tok->encode(text), b = sp.encode(text);
        if (a != b && ++mismatches <= 3) { FAIL_CHECK("ids differ for '" << text << "'"); }
        CHECK(tok->decode(a) == sp.decode(b));
        CHECK(tok->decode(a, {.skip_special_tokens = false}) == sp.decode(b, {.skip_special_tokens = false}));
        CHECK(tok->encode(text, false) == sp.encode(text, false));
    }
    // Random ids, specials among them, decode alike (the converted fast tokenizer's decoder). Byte
    // pieces are left out: ill-formed byte runs get U+FFFD per maximal subpart on the
    // tokenizer.json path and per byte from libsentencepiece (hf_tokenizer.h).
    for (int i = 0; i < 300; ++i) {
        std::vector<int32_t> ids;
        for (int k = 1 + int(rng() % 8); k > 0; --k) { ids.push_back(int32_t(259 + rng() % 253)); }
        if (i % 3 == 0) { ids.insert(ids.begin() + std::ptrdiff_t(rng() % ids.size()), int32_t(rng() % 3)); }
        for (bool cont : {false, true}) {
            const fd::tokenizer::DecodeOptions o{.skip_special_tokens = false, .continuation = cont};
            if (tok->decode(ids, o) != sp.decode(ids, o) && ++mismatches <= 6) {
                FAIL_CHECK("decodes differ: '" << tok->decode(ids, o) << "' vs '" << sp.decode(ids, o) << "'");
            }
        }
    }
    CHECK(mismatches == 0);
}

TEST_CASE("both files that disagree: the start-up error names both") {
    Dir both(true, without_whitespace_rules());
    const std::string e = start_error(both.tmp.path);
    CHECK(e.find("tokenizer.json and ") != std::string::npos);
    CHECK(e.find("tokenizer.model disagree") != std::string::npos);
}

}  // TEST_SUITE
