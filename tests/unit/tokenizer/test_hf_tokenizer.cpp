// HfTokenizer (daemon/src/tokenizer/hf_tokenizer.cpp, bpe_model.cpp, hf_pipeline.cpp) on small
// hand-built tokenizer.json files whose expected ids follow from the BPE rules by hand, and the
// start-up errors of malformed files. The real tokenizers are compared with @lenml/tokenizers in
// tests/reference/.
#include "../test_util.h"
#include "fd/status.h"
#include "fd/tokenizer/hf_tokenizer.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <fstream>

using fd::tokenizer::HfTokenizer;
using nlohmann::json;
using Ids = std::vector<int32_t>;

namespace {

struct Tok {
    fd::test::TempDir dir{"fd_hf_"};
    std::unique_ptr<HfTokenizer> t;
    explicit Tok(const json & j, const std::string & raw = "") {
        std::ofstream(dir.path / "tokenizer.json") << (raw.empty() ? j.dump() : raw);
        t = std::make_unique<HfTokenizer>(dir.path);
    }
    const HfTokenizer * operator->() const { return t.get(); }
};

json bpe(json vocab, json merges) {
    return {{"model", {{"type", "BPE"}, {"vocab", std::move(vocab)}, {"merges", std::move(merges)}}},
            {"decoder", {{"type", "Fuse"}}}};
}

std::string load_error(const json & j, const std::string & raw = "") {
    try {
        Tok t(j, raw);
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::invalid_checkpoint);
        return e.what();
    }
    FAIL("no error");
    return "";
}

const json kAbc = {{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"bc", 4}, {"abc", 5}};

}  // namespace

TEST_SUITE("tokenizer::hf") {

TEST_CASE("the lowest-ranked pair merges first, leftmost on ties; both merge spellings read alike") {
    for (const json & merges : {json{"a b", "b c", "ab c"}, json::array({json::array({"a", "b"}), json::array({"b", "c"}), json::array({"ab", "c"})})}) {
        Tok t(bpe(kAbc, merges));
        CHECK(t->encode("abc") == Ids{5});
        // b c a b c: (a,b) has rank 0 → b c ab c; then (b,c) rank 1 → bc ab c; then (ab,c) → bc abc
        CHECK(t->encode("bcabc") == Ids{4, 5});
        CHECK(t->encode("cba") == Ids{2, 1, 0});
        CHECK(t->decode(Ids{4, 5}) == "bcabc");
    }
}

TEST_CASE("long words (heap path) merge exactly like short ones") {
    Tok t(bpe(kAbc, json{"a b", "b c", "ab c"}));
    std::string text;
    Ids want;
    for (int i = 0; i < 20; ++i) { text += "abc"; want.push_back(5); }
    CHECK(t->encode(text) == want);                          // 60 symbols
    CHECK(t->encode(std::string(31, 'b') + "c") == [] { Ids v(30, 1); v.push_back(4); return v; }());
    std::string abab;
    for (int i = 0; i < 15; ++i) { abab += "ab"; }
    CHECK(t->encode(abab) == Ids(15, 3));
}

TEST_CASE("added tokens are matched before the model, never split; lstrip/rstrip eat whitespace; special ones skip") {
    json j = bpe(kAbc, json{"a b", "b c", "ab c"});
    j["added_tokens"] = json::array({{{"id", 6}, {"content", "<x>"}, {"special", true}, {"lstrip", true}},
                                     {{"id", 7}, {"content", "<y>"}, {"special", false}, {"rstrip", true}},
                                     {{"id", 8}, {"content", "<xx>"}, {"special", true}}});
    Tok t(j);
    CHECK(t->vocab_size() == 9);
    CHECK(t->encode("ab  <x>c") == Ids{3, 6, 2});
    CHECK(t->encode("<y>  c") == Ids{7, 2});
    CHECK(t->encode("a<xx>b<x") == Ids{0, 8, 1});           // longest match; "<x" alone has no id and is dropped
    CHECK(t->decode(Ids{3, 6, 2}) == "abc");
    CHECK(t->decode(Ids{3, 6, 2}, {.skip_special_tokens = false}) == "ab<x>c");
    CHECK(t->decode(Ids{7, 2}) == "<y>c");                    // added but not special: kept
    CHECK(t->is_special(6));
    CHECK_FALSE(t->is_special(7));
    CHECK(t->special_ids() == Ids{6, 8});
    CHECK(t->piece(6) == "<x>");
    CHECK(t->piece_to_id("<y>") == 7);
    CHECK(t->piece(99) == "");
    CHECK(t->decode(Ids{0, 99, -1, 1}) == "ab");              // unknown ids are skipped
}

TEST_CASE("Split behaviours cut words as HF tokenizers do") {
    const json vocab = {{"a", 0}, {"b", 1}, {"ab", 2}, {"ba", 3}, {"bb", 4}};
    const json merges = {"a b", "b a", "b b"};
    auto with = [&](const char * behavior, bool invert) {
        json j = bpe(vocab, merges);
        j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"String", "b"}}}, {"behavior", behavior}, {"invert", invert}};
        return std::make_unique<Tok>(j);
    };
    CHECK((*with("Isolated", false))->encode("abab") == Ids{0, 1, 0, 1});
    CHECK((*with("MergedWithPrevious", false))->encode("abab") == Ids{2, 2});
    CHECK((*with("MergedWithNext", false))->encode("abab") == Ids{0, 3, 1});
    CHECK((*with("Removed", false))->encode("abab") == Ids{0, 0});
    CHECK((*with("Removed", true))->encode("abab") == Ids{1, 1});
    CHECK((*with("Contiguous", false))->encode("abba") == Ids{0, 4, 0});
    CHECK((*with("Isolated", false))->encode("abba") == Ids{0, 1, 1, 0});
}

TEST_CASE("a regex Split uses Unicode classes and lookahead (PCRE2)") {
    const json vocab = {{"a", 0}, {" ", 1}, {"1", 2}, {"\xC3\xA9", 3}, {"  ", 4}, {" a", 5}};
    json j = bpe(vocab, json::array({json::array({" ", " "}), json::array({" ", "a"})}));   // pair form: a merge of spaces
    j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", R"( ?\p{L}+|\p{N}|\s+(?!\S)|\s+)"}}}, {"behavior", "Isolated"}};
    Tok t(j);
    // "   a": \s+(?!\S) takes two spaces (not the one before "a"), then " a" is one word.
    CHECK(t->encode("   a") == Ids{4, 5});
    CHECK(t->encode("\xC3\xA9" "11") == Ids{3, 2, 2});
}

TEST_CASE("the Llama-2 form: Prepend + Replace normalizers, byte fallback, ByteFallback/Fuse/Strip decoders") {
    const std::string sp = "\xE2\x96\x81";   // ▁
    json vocab = {{"<unk>", 0}, {"<s>", 1}, {sp, 2}, {"a", 3}, {sp + "a", 4}, {"<0xC3>", 5}, {"<0xA9>", 6}};
    json j = bpe(vocab, json{sp + " a"});
    j["model"]["byte_fallback"] = true;
    j["model"]["unk_token"] = "<unk>";
    j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "Prepend"}, {"prepend", sp}},
                                                              {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", sp}}}}};
    j["decoder"] = {{"type", "Sequence"}, {"decoders", {{{"type", "Replace"}, {"pattern", {{"String", sp}}}, {"content", " "}},
                                                        {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                                                        {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
    j["post_processor"] = {{"type", "TemplateProcessing"}, {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                                                      {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                           {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}};
    j["added_tokens"] = json::array({{{"id", 0}, {"content", "<unk>"}, {"special", true}},
                                     {{"id", 1}, {"content", "<s>"}, {"special", true}}});
    Tok t(j);
    CHECK(t->encode("a a") == Ids{1, 4, 4});
    CHECK(t->encode("a \xC3\xA9", false) == Ids{4, 2, 5, 6});
    CHECK(t->encode("a\xE4\xB8\x80", false) == Ids{4, 0});      // no byte pieces for U+4E00: <unk>
    CHECK(t->decode(Ids{1, 4, 2, 5, 6}) == "a \xC3\xA9");
    CHECK(t->decode(Ids{4, 5}) == "a\xEF\xBF\xBD");               // a lone lead byte is U+FFFD
    CHECK(t->decode(Ids{4}, {.continuation = true}) == " a");     // mid-sequence: the space stays
    CHECK(t->decode(Ids{4}) == "a");
}

TEST_CASE("Metaspace pre-tokenizer and decoder") {
    const std::string sp = "\xE2\x96\x81";
    json vocab = {{sp, 0}, {"a", 1}, {"b", 2}, {sp + "a", 3}, {sp + "b", 4}, {sp + "a" + sp + "b", 5}};
    json j = bpe(vocab, json{sp + " a", sp + " b", sp + "a " + sp + "b"});
    j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", sp}, {"prepend_scheme", "first"}, {"split", true}};
    j["decoder"] = {{"type", "Metaspace"}, {"replacement", sp}, {"prepend_scheme", "first"}};
    Tok split(j);
    CHECK(split->encode("a b") == Ids{3, 4});
    j["pre_tokenizer"]["split"] = false;
    Tok whole(j);
    CHECK(whole->encode("a b") == Ids{5});
    CHECK(whole->decode(Ids{3, 4}) == "a b");
    CHECK(whole->decode(Ids{3, 4}, {.continuation = true}) == " a b");
}

TEST_CASE("NFC normalizer composes combining sequences (utf8proc)") {
    json j = bpe(json{{"\xC3\xA9", 0}, {"e", 1}, {"\xCC\x81", 2}}, json::array());
    j["normalizer"] = {{"type", "NFC"}};
    Tok t(j);
    CHECK(t->encode("e\xCC\x81") == Ids{0});
    CHECK(t->encode("\xC3\xA9") == Ids{0});
    j["normalizer"] = nullptr;
    Tok raw(j);
    CHECK(raw->encode("e\xCC\x81") == Ids{1, 2});
}

TEST_CASE("ByteLevel: every byte has a token; decoding never yields broken UTF-8") {
    // GPT-2 byte characters for the bytes of "é" (C3 A9) are U+00C3 and U+00A9.
    json vocab = {{"h", 0}, {"i", 1}, {"hi", 2}, {"\xC4\xA0", 3}, {"\xC3\x83", 4}, {"\xC2\xA9", 5}, {"\xC4\xA0hi", 6}};
    json j = bpe(vocab, json{"h i", "\xC4\xA0 hi"});
    j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
    j["decoder"] = {{"type", "ByteLevel"}};
    Tok t(j);
    CHECK(t->encode("hi hi") == Ids{2, 6});
    CHECK(t->encode("\xC3\xA9") == Ids{4, 5});
    CHECK(t->decode(Ids{2, 6, 4, 5}) == "hi hi\xC3\xA9");
    CHECK(t->decode(Ids{4}) == "\xEF\xBF\xBD");
    CHECK(t->piece(6) == "\xC4\xA0hi");
    CHECK(t->token_text(6) == " hi");
}

TEST_CASE("malformed tokenizer.json: the error names the file and the position or field") {
    const json ok = bpe(kAbc, json{"a b"});
    std::string e = load_error(ok, ok.dump().substr(0, 40));
    CHECK(e.find("tokenizer.json") != std::string::npos);
    CHECK(e.find("not valid JSON (byte") != std::string::npos);
    json j = ok;
    j["model"]["merges"] = json{"a b", "a z"};
    CHECK(load_error(j).find("model.merges[1]: 'z' is not in model.vocab") != std::string::npos);
    j = ok;
    j["model"]["merges"] = json{"a b c"};
    CHECK(load_error(j).find("model.merges[0]") != std::string::npos);
    j = ok;
    j["model"]["type"] = "WordPiece";
    CHECK(load_error(j).find("model.type") != std::string::npos);
    j = ok;
    j["normalizer"] = {{"type", "Precompiled"}};
    CHECK(load_error(j).find("normalizer.type: normalizer 'Precompiled' is not supported") != std::string::npos);
    j = ok;
    j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
    CHECK(load_error(j).find("pre_tokenizer.pattern.Regex: regex error at offset") != std::string::npos);
    j = ok;
    j["model"]["vocab"]["x"] = 0;
    CHECK(load_error(j).find("used twice") != std::string::npos);
    j = ok;
    j.erase("model");
    CHECK(load_error(j).find("tokenizer.json: model: missing") != std::string::npos);
}

}  // TEST_SUITE
