// /v1/completions' echo text of each prompt (echo_prompt_texts): token-id prompts are decoded
// only when echo asks for them, and echo returns the same text as before (the prompt's own text,
// the decode of what ran after truncation, the decode of a token-id prompt).
#include "../../../daemon/src/api/generation.h"

#include <doctest/doctest.h>

#include <stdexcept>

using namespace fd;

namespace {

/// A tokenizer of letters: id i is the letter 'a' + i; decode counts its calls and throws when
/// `throw_on_decode` is set (a request without echo must never reach it).
class LetterTokenizer : public tokenizer::Tokenizer {
public:
    bool        throw_on_decode = false;
    mutable int decodes         = 0;

    std::string_view     kind() const override { return "letters"; }
    std::vector<int32_t> encode(std::string_view text, bool) const override {
        std::vector<int32_t> ids;
        for (char c : text) { ids.push_back(c - 'a'); }
        return ids;
    }
    std::string decode(std::span<const int32_t> ids, const tokenizer::DecodeOptions &) const override {
        ++decodes;
        if (throw_on_decode) { throw std::logic_error("decode called"); }
        std::string s;
        for (int32_t id : ids) { s.push_back(static_cast<char>('a' + id)); }
        return s;
    }
    std::string            piece(int32_t id) const override { return std::string(1, static_cast<char>('a' + id)); }
    std::optional<int32_t> piece_to_id(std::string_view) const override { return std::nullopt; }
    int32_t                vocab_size() const override { return 26; }
    std::optional<int32_t> bos_id() const override { return std::nullopt; }
    std::optional<int32_t> eos_id() const override { return std::nullopt; }
    bool                   is_special(int32_t) const override { return false; }
    std::vector<int32_t>   special_ids() const override { return {}; }
};

}  // namespace

TEST_CASE("without echo, token-id prompts are never decoded") {
    LetterTokenizer tok;
    tok.throw_on_decode = true;
    const std::vector<std::vector<int32_t>> prompts = {{7, 4, 11, 11, 14}, {22, 14, 17, 11, 3}};
    std::vector<std::string>                texts;
    CHECK_NOTHROW(texts = api::echo_prompt_texts(tok, prompts, {}, false, false));
    CHECK(texts.empty());
    CHECK_NOTHROW(texts = api::echo_prompt_texts(tok, prompts, {}, true, false));  // truncated, no echo
    CHECK(texts.empty());
    CHECK(tok.decodes == 0);
}

TEST_CASE("echo of token-id prompts is their decode, one call each") {
    LetterTokenizer tok;
    const auto texts = api::echo_prompt_texts(tok, {{7, 4, 11, 11, 14}, {22, 14, 17, 11, 3}}, {}, false, true);
    CHECK(texts == std::vector<std::string>{"hello", "world"});
    CHECK(tok.decodes == 2);
}

TEST_CASE("echo of text prompts is the text as given, decoded only after truncation") {
    LetterTokenizer tok;
    const std::vector<std::vector<int32_t>> ran = {{11, 11, 14}};  // "hello" cut to its last 3 tokens
    CHECK(api::echo_prompt_texts(tok, {{7, 4, 11, 11, 14}}, {"hello"}, false, true) == std::vector<std::string>{"hello"});
    CHECK(tok.decodes == 0);
    CHECK(api::echo_prompt_texts(tok, ran, {"hello"}, true, true) == std::vector<std::string>{"llo"});
    CHECK(tok.decodes == 1);
}
