// SentencePieceTokenizer and the IncrementalDecoder (daemon/src/tokenizer/) on models/stories260K,
// checked against the reference ids and texts of models/stories260K/README.md.
#include "../test_util.h"
#include "fd/status.h"
#include "fd/tokenizer/incremental_decoder.h"
#include "fd/tokenizer/sentencepiece_tokenizer.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using fd::tokenizer::IncrementalDecoder;
using Tokenizer = fd::tokenizer::SentencePieceTokenizer;

namespace {

const fs::path kStories = fs::path(FD_SOURCE_DIR) / "models" / "stories260K";

const Tokenizer & tok() {
    static const Tokenizer t(kStories, 1);
    return t;
}

const std::vector<int32_t> kOncePrompt = {1, 403, 407, 261, 378};
const std::vector<int32_t> kOnceGen = {432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267,
                                       337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432,
                                       358, 394, 261, 370, 432, 352, 266, 268, 388, 426, 338, 391, 266, 267, 337,
                                       335, 312, 432, 398, 312, 286, 267, 414, 270, 333, 415, 426, 13,  438, 310};
const std::string kOnceText =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a "
    "big, red ball. She wanted to play with it, but it was too high.\nLily";

const std::vector<int32_t> kLilyPrompt = {1, 317, 269, 274, 287};
const std::vector<int32_t> kLilyGen = {382, 276, 337, 299, 322, 265, 282, 295, 433, 426, 342, 397, 355, 267, 337,
                                       335, 265, 315, 267, 422, 419, 269, 352, 379, 261, 420, 277, 264, 265, 282,
                                       295, 433, 426, 342, 394, 261, 370, 268, 414, 444, 335, 261, 370, 268, 414,
                                       444, 426, 342, 391, 266, 267, 337, 335, 265, 268, 414, 444, 426, 13,  436};
const std::string kLilyText =
    "Lily and Tom were playing in the park. They liked to play with their toys and run around the park. They saw a "
    "big box with a big box. They wanted to play with the box.\n\"";

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t> & b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

/// True when `s` is well-formed UTF-8 made of complete sequences.
bool valid_utf8(const std::string & s) {
    size_t i = 0;
    while (i < s.size()) {
        const auto c = static_cast<unsigned char>(s[i]);
        const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
        if (n == 0 || i + n > s.size()) { return false; }
        for (size_t k = 1; k < n; ++k) {
            if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) { return false; }
        }
        i += n;
    }
    return true;
}

struct Streamed {
    std::vector<std::string> pieces;  ///< push() outputs, in order
    std::string              flushed;
    std::string text() const {
        std::string t;
        for (const auto & p : pieces) { t += p; }
        return t + flushed;
    }
};

Streamed stream(const std::vector<int32_t> & prompt, const std::vector<int32_t> & gen) {
    IncrementalDecoder dec(tok(), prompt);
    Streamed s;
    for (int32_t id : gen) { s.pieces.push_back(dec.push(id)); }
    s.flushed = dec.flush();
    return s;
}

}  // namespace

TEST_SUITE("tokenizer::sentencepiece") {

TEST_CASE("the stories260K tokenizer has 512 pieces and adds BOS") {
    CHECK(tok().vocab_size() == 512);
    CHECK(tok().add_bos());
    CHECK(tok().bos_id() == 1);
    CHECK(tok().eos_id() == 2);
    CHECK(tok().is_special(1));
    CHECK(tok().is_special(2));
    CHECK_FALSE(tok().is_special(13));
    CHECK(tok().piece_to_id("<0x0A>") == 13);
    CHECK_FALSE(tok().piece_to_id("no such piece").has_value());
    CHECK(tok().piece(1) == "<s>");
    CHECK(tok().piece(2) == "</s>");
    CHECK(tok().piece(13) == "<0x0A>");
    CHECK(tok().piece(512) == "");
    CHECK(tok().piece(-1) == "");
}

TEST_CASE("encode matches the reference prompt ids") {
    CHECK(tok().encode("Once upon a time") == kOncePrompt);
    CHECK(tok().encode("Lily and Tom") == kLilyPrompt);
    CHECK(tok().encode("") == std::vector<int32_t>{1});
    CHECK(tok().encode("Once upon a time", false) == std::vector<int32_t>(kOncePrompt.begin() + 1, kOncePrompt.end()));
}

TEST_CASE("decode of the reference ids equals the reference texts") {
    CHECK(tok().decode(kOncePrompt) == "Once upon a time");
    CHECK(tok().decode(concat(kOncePrompt, kOnceGen)) == kOnceText);
    CHECK(tok().decode(concat(kLilyPrompt, kLilyGen)) == kLilyText);
    // Out-of-range ids are dropped rather than crashing.
    CHECK(tok().decode(std::vector<int32_t>{1, 403, 9999, -3, 407}) == "Once upon");
}

TEST_CASE("special tokens are written out when not skipped, with no space around them (the converted fast tokenizer)") {
    const std::vector<int32_t> ids = {1, 403, 407, 2};
    CHECK(tok().decode(ids) == "Once upon");
    // transformers' LlamaConverter decoder (Replace, ByteFallback, Fuse, Strip(left=1)), which vLLM
    // loads for a tokenizer.model-only directory; spaces_between_special_tokens is ignored.
    CHECK(tok().decode(ids, {.skip_special_tokens = false}) == "<s> Once upon</s>");
    CHECK(tok().decode(ids, {.skip_special_tokens = false, .spaces_between_special_tokens = false}) == "<s> Once upon</s>");
    // The probe's case: "</s>", a lone continuation byte, " time", "é", "@", "<unk>".
    CHECK(tok().decode(std::vector<int32_t>{2, 133, 378, 485, 67, 0}, {.skip_special_tokens = false}) ==
          "</s>\xEF\xBF\xBD time\xC3\xA9@<unk>");
    // Mid-sequence the leading space of the first piece stays.
    CHECK(tok().decode(std::vector<int32_t>{407}, {.continuation = true}) == " upon");
    CHECK(tok().decode(std::vector<int32_t>{407}) == "upon");
    CHECK(tok().token_text(407) == " upon");
}

TEST_CASE("special-token text is one token, each section between them encoded on its own (HF legacy)") {
    const auto ids = [](std::string_view t) { return tok().encode(t, false); };
    std::vector<int32_t> want = ids("hi");
    want.push_back(2);
    want = concat(want, ids("there"));
    want.push_back(1);
    CHECK(ids("hi </s> there <s>") == want);
    CHECK(ids("hi</s>there<s>") == want);   // legacy: every section gets the dummy prefix
    CHECK(ids("<unk>") == std::vector<int32_t>{0});
    CHECK(tok().encode("</s>") == std::vector<int32_t>{1, 2});
    const auto partial = ids("<s");         // a partial token is plain text
    CHECK(std::find(partial.begin(), partial.end(), 1) == partial.end());
    // Round trip with the specials kept.
    CHECK(tok().decode(ids("hi </s> there"), {.skip_special_tokens = false}) == "hi</s> there");
}

TEST_CASE("legacy false: no dummy prefix after a special token; added_tokens_decoder lstrip/rstrip") {
    fd::test::TempDir dir("fd_sp_");
    fs::copy_file(kStories / "tokenizer.model", dir.path / "tokenizer.model");
    auto write_config = [&](const std::string & text) {
        std::ofstream(dir.path / "tokenizer_config.json") << text;
    };
    write_config(R"({"legacy": false})");
    const Tokenizer modern(dir.path, 1);
    const auto      there = tok().encode("there", false);          // "▁there"
    const auto      got   = modern.encode("hi</s>there", false);
    REQUIRE(got.size() > tok().encode("hi", false).size() + 1);
    const std::vector<int32_t> tail(got.begin() + std::ptrdiff_t(tok().encode("hi", false).size() + 1), got.end());
    CHECK(tail != there);
    CHECK(modern.decode(tail, {.continuation = true}) == "there");   // no leading space
    CHECK(modern.encode("hi</s> there", false) == tok().encode("hi </s> there", false));
    CHECK(modern.encode("hi there", false) == tok().encode("hi there", false));

    write_config(R"({"added_tokens_decoder": {"2": {"content": "</s>", "lstrip": true, "rstrip": true, "special": true}}})");
    const Tokenizer strip(dir.path, 1);
    CHECK(strip.encode("hi\n</s>\nthere", false) == tok().encode("hi</s>there", false));
    CHECK(tok().encode("hi\n</s>\nthere", false) != tok().encode("hi</s>there", false));   // newline pieces
}

TEST_CASE("encode then decode round-trips plain text") {
    for (const std::string text : {"Once upon a time", "The cat sat.\nThe dog ran!", "Tom said: \"Hello, Lily.\""}) {
        CHECK(tok().decode(tok().encode(text)) == text);
    }
}

TEST_CASE("incremental decoding of the generated ids equals decode(prompt + gen) minus decode(prompt)") {
    for (const auto & [prompt, gen] : {std::pair{kOncePrompt, kOnceGen}, std::pair{kLilyPrompt, kLilyGen}}) {
        const std::string full = tok().decode(concat(prompt, gen));
        const std::string head = tok().decode(prompt);
        REQUIRE(full.compare(0, head.size(), head) == 0);
        const Streamed s = stream(prompt, gen);
        CHECK(s.text() == full.substr(head.size()));
        // Plain ASCII pieces come out immediately: nothing is held back for flush().
        CHECK(s.flushed.empty());
        int non_empty = 0;
        for (const auto & p : s.pieces) { non_empty += !p.empty(); }
        CHECK(non_empty == int(gen.size()));
    }
    const Streamed once = stream(kOncePrompt, kOnceGen);
    CHECK(once.pieces[0] == ",");
    CHECK(once.pieces[1] == " there");
    CHECK(once.pieces[57] == "\n");
}

TEST_CASE("multi-byte characters from byte-fallback pieces stream out whole") {
    for (const std::string word : {"ï", "🙂", "naïve café 🙂!"}) {
        CAPTURE(word);
        const auto ids = tok().encode(word);
        int n_byte_pieces = 0;
        for (int32_t id : ids) { n_byte_pieces += id >= 3 && id <= 258; }
        REQUIRE(n_byte_pieces >= 2);                  // the vocabulary has no piece for ï or 🙂
        CHECK(tok().decode(ids) == word);
        const std::vector<int32_t> gen(ids.begin() + 1, ids.end());  // drop BOS
        const Streamed s = stream(kOncePrompt, gen);
        const std::string full = tok().decode(concat(kOncePrompt, gen));
        const std::string head = tok().decode(kOncePrompt);
        CHECK(s.text() == full.substr(head.size()));
        int held = 0;
        for (const auto & p : s.pieces) {
            CAPTURE(p);
            CHECK(valid_utf8(p));
            CHECK(p.find("\xEF\xBF\xBD") == std::string::npos);   // never a replacement character
            held += p.empty();
        }
        CHECK(held >= 1);                              // partial sequences were held back
        CHECK(valid_utf8(s.flushed));
    }
    // The 4 bytes of U+1F642 arrive in one push.
    const auto ids = tok().encode("🙂");
    const std::vector<int32_t> gen(ids.begin() + 1, ids.end());
    const Streamed s = stream(kOncePrompt, gen);
    int with_emoji = 0;
    for (const auto & p : s.pieces) { with_emoji += p.find("🙂") != std::string::npos; }
    CHECK(with_emoji == 1);
}

TEST_CASE("an incomplete UTF-8 sequence at the end is held back until flush") {
    // "ï" (C3 AF) has no piece of its own in this vocabulary ("é" does): it is two byte pieces.
    const auto ids = tok().encode("ï");
    // The first byte piece (0xC3) alone.
    std::vector<int32_t> first_byte;
    for (int32_t id : ids) {
        if (id == 3 + 0xC3) { first_byte.push_back(id); }
    }
    REQUIRE(first_byte.size() == 1);
    IncrementalDecoder dec(tok(), kOncePrompt);
    CHECK(dec.push(first_byte[0]).empty());
    const std::string rest = dec.flush();
    CHECK_FALSE(rest.empty());
    CHECK(valid_utf8(rest));
    CHECK(dec.flush().empty());   // nothing left the second time
}

TEST_CASE("é has its own piece and decodes back") {
    CHECK(tok().encode("é") == std::vector<int32_t>{1, 410, 485});
    const Streamed s = stream(kOncePrompt, {410, 485});
    CHECK(s.text() == " é");
}

TEST_CASE("incremental decoding agrees with decode on random piece sequences without bare-space pieces") {
    std::vector<int32_t> pool;  // BPE pieces that are not only U+2581 (those trigger the bug below)
    for (int32_t id = 259; id < tok().vocab_size(); ++id) {
        std::string p = tok().piece(id);
        while (p.rfind("\xE2\x96\x81", 0) == 0) { p.erase(0, 3); }
        if (!p.empty()) { pool.push_back(id); }
    }
    REQUIRE(pool.size() > 200);
    uint32_t st = 77;
    auto rnd = [&](uint32_t n) { st = st * 1664525u + 1013904223u; return (st >> 8) % n; };
    int mismatches = 0;
    for (int trial = 0; trial < 300; ++trial) {
        std::vector<int32_t> prompt = {1};
        for (uint32_t i = rnd(8); i > 0; --i) { prompt.push_back(pool[rnd(uint32_t(pool.size()))]); }
        std::vector<int32_t> gen;
        for (uint32_t i = 1 + rnd(20); i > 0; --i) { gen.push_back(pool[rnd(uint32_t(pool.size()))]); }
        if (rnd(2)) {  // splice in the 4 byte pieces of U+1F642
            const std::vector<int32_t> emoji = {3 + 0xF0, 3 + 0x9F, 3 + 0x99, 3 + 0x82};
            gen.insert(gen.begin() + rnd(uint32_t(gen.size())), emoji.begin(), emoji.end());
        }
        const std::string full = tok().decode(concat(prompt, gen));
        const std::string head = tok().decode(prompt);
        const Streamed s = stream(prompt, gen);
        bool ok = s.text() == full.substr(head.size());
        for (const auto & p : s.pieces) { ok = ok && valid_utf8(p); }
        mismatches += !ok;
    }
    CHECK(mismatches == 0);
}

TEST_CASE("a bare-space piece followed by a space-prefixed piece keeps both spaces when streamed") {
    const std::vector<int32_t> gen = {432, 410, 381};   // ",", "▁", "▁had"
    const std::string full = tok().decode(concat(kOncePrompt, gen));
    REQUIRE(full == "Once upon a time,  had");
    const Streamed s = stream(kOncePrompt, gen);
    CHECK(s.text() == ",  had");
}

TEST_CASE("a missing tokenizer.model is an invalid_checkpoint error naming the file") {
    const fs::path dir = fs::path(FD_SOURCE_DIR) / "docs";
    try {
        Tokenizer t(dir, 1);
        FAIL("no error");
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::invalid_checkpoint);
        CHECK(std::string(e.what()).find("tokenizer.model") != std::string::npos);
    }
}

}  // TEST_SUITE
