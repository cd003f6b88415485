#include "hf_pipeline.h"

#include "bpe_model.h"
#include "json_field.h"
#include "fd/utf8.h"

#include <utf8proc.h>

#include <cstdlib>

namespace fd::tokenizer {

namespace {

using nlohmann::json;

const char * const kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string escape_regex(const std::string & s) {
    std::string out = "\\Q";
    for (size_t i = 0; i < s.size(); ++i) {
        if (s.compare(i, 2, "\\E") == 0) { out += "\\E\\\\E\\Q"; ++i; } else { out += s[i]; }
    }
    return out + "\\E";
}

/// A Replace stage's pattern: a literal string stays a string (plain search), a regex compiles.
void set_replace_pattern(struct ReplaceNormalizer & r, const json & j, const std::string & file, const std::string & path);

/// A tokenizer.json "pattern": {"String": s} or {"Regex": r}, as a compiled regex.
std::unique_ptr<Regex> make_pattern(const json & j, const std::string & file, const std::string & path) {
    if (j.is_object() && j.contains("String") && j["String"].is_string()) {
        return std::make_unique<Regex>(escape_regex(j["String"].get<std::string>()), file + ": " + path + ".String");
    }
    if (j.is_object() && j.contains("Regex") && j["Regex"].is_string()) {
        return std::make_unique<Regex>(j["Regex"].get<std::string>(), file + ": " + path + ".Regex");
    }
    bad_field(file, path, "must be {\"String\": ...} or {\"Regex\": ...}");
}

std::vector<const json *> list_of(const json & j, const char * key, const std::string & file, const std::string & path) {
    if (!j.contains(key) || !j[key].is_array()) { bad_field(file, path + "." + key, "missing or not a list"); }
    std::vector<const json *> out;
    for (const auto & e : j[key]) { out.push_back(&e); }
    return out;
}

// ---- normalizers ----------------------------------------------------------------------------

struct UnicodeNormalizer final : Normalizer {
    utf8proc_option_t opts;
    explicit UnicodeNormalizer(utf8proc_option_t o) : opts(o) {}
    void apply(std::string & text) const override {
        bool ascii = true;
        for (unsigned char c : text) { if (c >= 0x80) { ascii = false; break; } }
        if (ascii) { return; }
        utf8proc_uint8_t * out = nullptr;
        const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t *>(text.data()), utf8proc_ssize_t(text.size()),
                                    &out, opts);
        FD_CHECK(n >= 0, "utf8proc_map failed on valid UTF-8: {}", utf8proc_errmsg(n));
        text.assign(reinterpret_cast<char *>(out), size_t(n));
        std::free(out);
    }
};

struct PrependNormalizer final : Normalizer {
    std::string prepend;
    void apply(std::string & text) const override {
        if (!text.empty()) { text.insert(0, prepend); }
    }
};

struct ReplaceNormalizer final : Normalizer {
    std::unique_ptr<Regex> pattern;   ///< {"Regex": ...}
    std::string            literal;   ///< {"String": ...} (used when pattern is null)
    std::string            content;
    void apply(std::string & text) const override {
        if (!pattern) {
            if (literal.empty() || text.find(literal) == std::string::npos) { return; }
            std::string out;
            out.reserve(text.size() + text.size() / 4);
            size_t at = 0;
            for (size_t k; (k = text.find(literal, at)) != std::string::npos; at = k + literal.size()) {
                out.append(text, at, k - at);
                out += content;
            }
            out.append(text, at, std::string::npos);
            text = std::move(out);
            return;
        }
        thread_local std::vector<std::pair<size_t, size_t>> m;
        m.clear();
        pattern->find_all(text, m);
        if (m.empty()) { return; }
        std::string out;
        size_t      at = 0;
        for (auto [b, e] : m) {
            out.append(text, at, b - at);
            out += content;
            at = e;
        }
        out.append(text, at, std::string::npos);
        text = std::move(out);
    }
};

void set_replace_pattern(ReplaceNormalizer & r, const json & j, const std::string & file, const std::string & path) {
    if (j.is_object() && j.contains("String") && j["String"].is_string()) {
        r.literal = j["String"].get<std::string>();
        if (r.literal.empty()) { bad_field(file, path + ".String", "must not be empty"); }
        return;
    }
    r.pattern = make_pattern(j, file, path);
}

struct LowercaseNormalizer final : Normalizer {
    void apply(std::string & text) const override {
        std::string out;
        out.reserve(text.size());
        for (size_t i = 0; i < text.size();) { utf8::append(out, uint32_t(utf8proc_tolower(utf8::next(text, i)))); }
        text = std::move(out);
    }
};

struct NormalizerSequence final : Normalizer {
    std::vector<std::unique_ptr<Normalizer>> steps;
    void apply(std::string & text) const override {
        for (const auto & s : steps) { s->apply(text); }
    }
};

// ---- pre-tokenizers -------------------------------------------------------------------------

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

Behavior parse_behavior(const std::string & b, const std::string & file, const std::string & path) {
    if (b == "Removed") { return Behavior::removed; }
    if (b == "Isolated") { return Behavior::isolated; }
    if (b == "MergedWithPrevious") { return Behavior::merged_with_previous; }
    if (b == "MergedWithNext") { return Behavior::merged_with_next; }
    if (b == "Contiguous") { return Behavior::contiguous; }
    bad_field(file, path, "unknown split behavior '" + b + "'");
}

/// Split `word` at the matches of `re` as HF tokenizers' NormalizedString::split does.
void split_word(const std::string & word, const Regex & re, Behavior behavior, bool invert, std::vector<std::string> & out) {
    thread_local std::vector<std::pair<size_t, size_t>> m;
    m.clear();
    re.find_all(word, m);
    struct Part { size_t b, e; bool is_match; };
    thread_local std::vector<Part> parts;
    parts.clear();
    size_t at = 0;
    for (auto [b, e] : m) {
        if (e == b) { continue; }
        if (b > at) { parts.push_back({at, b, invert}); }
        parts.push_back({b, e, !invert});
        at = e;
    }
    if (at < word.size()) { parts.push_back({at, word.size(), invert}); }
    thread_local std::vector<Part> merged;
    merged.clear();
    switch (behavior) {
    case Behavior::removed:
        for (const auto & p : parts) { if (!p.is_match) { merged.push_back(p); } }
        break;
    case Behavior::isolated: merged = parts; break;
    case Behavior::merged_with_previous: {
        bool prev_match = false;
        for (const auto & p : parts) {
            if (p.is_match && !prev_match && !merged.empty()) { merged.back().e = p.e; } else { merged.push_back(p); }
            prev_match = p.is_match;
        }
        break;
    }
    case Behavior::merged_with_next: {
        bool prev_match = false;
        for (size_t k = parts.size(); k-- > 0;) {
            const auto & p = parts[k];
            if (p.is_match && !prev_match && !merged.empty()) { merged.back().b = p.b; } else { merged.push_back(p); }
            prev_match = p.is_match;
        }
        std::reverse(merged.begin(), merged.end());
        break;
    }
    case Behavior::contiguous: {
        bool prev_match = false;
        for (const auto & p : parts) {
            if (p.is_match == prev_match && !merged.empty()) { merged.back().e = p.e; } else { merged.push_back(p); }
            prev_match = p.is_match;
        }
        break;
    }
    }
    for (const auto & p : merged) {
        if (p.e > p.b) { out.emplace_back(word, p.b, p.e - p.b); }
    }
}

struct SplitPreTokenizer final : PreTokenizer {
    std::unique_ptr<Regex> pattern;
    Behavior               behavior = Behavior::isolated;
    bool                   invert   = false;
    void apply(std::vector<std::string> & words, bool) const override {
        std::vector<std::string> out;
        out.reserve(words.size() * 4);
        for (const auto & w : words) { split_word(w, *pattern, behavior, invert, out); }
        words = std::move(out);
    }
};

/// ByteLevel: words stay raw bytes (the BPE model maps bytes to its byte characters).
struct ByteLevelPreTokenizer final : PreTokenizer {
    bool                   add_prefix_space = false;
    std::unique_ptr<Regex> gpt2;   ///< set when use_regex
    void apply(std::vector<std::string> & words, bool) const override {
        if (add_prefix_space) {
            for (auto & w : words) { if (w.empty() || w[0] != ' ') { w.insert(0, 1, ' '); } }
        }
        if (!gpt2) { return; }
        std::vector<std::string> out;
        out.reserve(words.size() * 4);
        for (const auto & w : words) { split_word(w, *gpt2, Behavior::isolated, false, out); }
        words = std::move(out);
    }
};

struct MetaspacePreTokenizer final : PreTokenizer {
    std::string            replacement = "\xE2\x96\x81";
    std::string            scheme      = "always";   ///< always | first | never
    std::unique_ptr<Regex> split;                    ///< set when "split": true
    void apply(std::vector<std::string> & words, bool first_section) const override {
        std::vector<std::string> out;
        for (size_t i = 0; i < words.size(); ++i) {
            std::string w;
            for (char c : words[i]) { if (c == ' ') { w += replacement; } else { w += c; } }
            const bool prepend = scheme == "always" || (scheme == "first" && first_section && i == 0);
            if (prepend && w.compare(0, replacement.size(), replacement) != 0) { w.insert(0, replacement); }
            if (split) { split_word(w, *split, Behavior::merged_with_next, false, out); } else { out.push_back(std::move(w)); }
        }
        words = std::move(out);
    }
};

struct RegexSplitPreTokenizer final : PreTokenizer {   // Digits, WhitespaceSplit
    std::unique_ptr<Regex> pattern;
    Behavior               behavior;
    void apply(std::vector<std::string> & words, bool) const override {
        std::vector<std::string> out;
        for (const auto & w : words) { split_word(w, *pattern, behavior, false, out); }
        words = std::move(out);
    }
};

struct PreTokenizerSequence final : PreTokenizer {
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    void apply(std::vector<std::string> & words, bool first_section) const override {
        for (const auto & s : steps) { s->apply(words, first_section); }
    }
};

// ---- decoders -------------------------------------------------------------------------------

struct ByteLevelDecoder final : Decoder {
    void apply(std::vector<std::string> & tokens, bool) const override {
        std::string bytes;
        for (const auto & t : tokens) {
            for (size_t i = 0; i < t.size();) {
                const size_t   start = i;
                const uint32_t cp    = utf8::next(t, i);
                const int32_t  b     = codepoint_to_byte(cp);
                if (b >= 0) { bytes += char(b); } else { bytes.append(t, start, i - start); }
            }
        }
        tokens.assign(1, utf8::lossy(bytes));
    }
};

struct ReplaceDecoder final : Decoder {
    ReplaceNormalizer r;
    size_t n_token_local() const override { return 1; }
    void apply(std::vector<std::string> & tokens, bool) const override {
        for (auto & t : tokens) { r.apply(t); }
    }
};

int hex_digit(char c) {
    if (c >= '0' && c <= '9') { return c - '0'; }
    if (c >= 'A' && c <= 'F') { return c - 'A' + 10; }
    if (c >= 'a' && c <= 'f') { return c - 'a' + 10; }
    return -1;
}

struct ByteFallbackDecoder final : Decoder {
    void apply(std::vector<std::string> & tokens, bool) const override {
        std::vector<std::string> out;
        out.reserve(tokens.size());
        std::string              bytes;
        auto flush = [&] {
            if (!bytes.empty()) { out.push_back(utf8::lossy(bytes)); bytes.clear(); }
        };
        for (auto & t : tokens) {
            const int hi = t.size() == 6 ? hex_digit(t[3]) : -1, lo = t.size() == 6 ? hex_digit(t[4]) : -1;
            if (hi >= 0 && lo >= 0 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
                bytes += char(hi * 16 + lo);
            } else {
                flush();
                out.push_back(std::move(t));
            }
        }
        flush();
        tokens = std::move(out);
    }
};

struct FuseDecoder final : Decoder {
    void apply(std::vector<std::string> & tokens, bool) const override {
        size_t n = 0;
        for (const auto & t : tokens) { n += t.size(); }
        std::string all;
        all.reserve(n);
        for (const auto & t : tokens) { all += t; }
        tokens.assign(1, std::move(all));
    }
};

struct StripDecoder final : Decoder {
    std::string content;   ///< one character
    size_t      start = 0, stop = 0;
    void apply(std::vector<std::string> & tokens, bool continuation) const override {
        for (size_t k = 0; k < tokens.size(); ++k) {
            std::string & t   = tokens[k];
            size_t        beg = 0, end = t.size();
            if (!(continuation && k == 0)) {
                for (size_t i = 0; i < start && t.compare(beg, content.size(), content) == 0; ++i) { beg += content.size(); }
            }
            for (size_t i = 0; i < stop && end >= beg + content.size() &&
                               t.compare(end - content.size(), content.size(), content) == 0; ++i) {
                end -= content.size();
            }
            t = t.substr(beg, end - beg);
        }
    }
};

struct MetaspaceDecoder final : Decoder {
    std::string replacement = "\xE2\x96\x81";
    bool        prepend     = true;   ///< prepend_scheme != never (or legacy add_prefix_space)
    void apply(std::vector<std::string> & tokens, bool continuation) const override {
        for (size_t k = 0; k < tokens.size(); ++k) {
            std::string out;
            const std::string & t = tokens[k];
            for (size_t i = 0; i < t.size();) {
                if (t.compare(i, replacement.size(), replacement) == 0) { out += ' '; i += replacement.size(); } else { out += t[i++]; }
            }
            if (k == 0 && prepend && !continuation && !out.empty() && out[0] == ' ') { out.erase(0, 1); }
            tokens[k] = std::move(out);
        }
    }
};

struct DecoderSequence final : Decoder {
    std::vector<std::unique_ptr<Decoder>> steps;
    void apply(std::vector<std::string> & tokens, bool continuation) const override {
        for (const auto & s : steps) { s->apply(tokens, continuation); }
    }
    size_t n_token_local() const override {
        size_t n = 0;
        while (n < steps.size() && steps[n]->n_token_local() == 1) { ++n; }
        return n;
    }
    void apply_stages(size_t first, size_t last, std::vector<std::string> & tokens, bool continuation) const override {
        for (size_t i = first; i < steps.size() && i < last; ++i) { steps[i]->apply(tokens, continuation); }
    }
};

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const json & j, const std::string & file, const std::string & path) {
    if (j.is_null()) { return nullptr; }
    const std::string type = field<std::string>(j, "type", file, path);
    if (type == "NFC") { return std::make_unique<UnicodeNormalizer>(utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_COMPOSE)); }
    if (type == "NFD") { return std::make_unique<UnicodeNormalizer>(utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE)); }
    if (type == "NFKC") {
        return std::make_unique<UnicodeNormalizer>(utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT));
    }
    if (type == "NFKD") {
        return std::make_unique<UnicodeNormalizer>(utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT));
    }
    if (type == "Prepend") {
        auto n     = std::make_unique<PrependNormalizer>();
        n->prepend = field<std::string>(j, "prepend", file, path);
        return n;
    }
    if (type == "Replace") {
        auto n     = std::make_unique<ReplaceNormalizer>();
        set_replace_pattern(*n, j.value("pattern", json()), file, path + ".pattern");
        n->content = field<std::string>(j, "content", file, path);
        return n;
    }
    if (type == "Lowercase") { return std::make_unique<LowercaseNormalizer>(); }
    if (type == "Sequence") {
        auto seq  = std::make_unique<NormalizerSequence>();
        auto list = list_of(j, "normalizers", file, path);
        for (size_t i = 0; i < list.size(); ++i) {
            if (auto n = make_normalizer(*list[i], file, fmt::format("{}.normalizers[{}]", path, i))) { seq->steps.push_back(std::move(n)); }
        }
        return seq;
    }
    bad_field(file, path + ".type", "normalizer '" + type + "' is not supported");
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json & j, const std::string & file, const std::string & path,
                                                 bool & byte_level) {
    if (j.is_null()) { return nullptr; }
    const std::string type = field<std::string>(j, "type", file, path);
    if (byte_level) { bad_field(file, path, "a ByteLevel pre-tokenizer must be the last one"); }
    if (type == "Split") {
        auto p      = std::make_unique<SplitPreTokenizer>();
        p->pattern  = make_pattern(j.value("pattern", json()), file, path + ".pattern");
        p->behavior = parse_behavior(field<std::string>(j, "behavior", file, path), file, path + ".behavior");
        p->invert   = field_or<bool>(j, "invert", false, file, path);
        return p;
    }
    if (type == "ByteLevel") {
        auto p              = std::make_unique<ByteLevelPreTokenizer>();
        p->add_prefix_space = field_or<bool>(j, "add_prefix_space", true, file, path);
        if (field_or<bool>(j, "use_regex", true, file, path)) { p->gpt2 = std::make_unique<Regex>(kGpt2Pattern, "GPT-2 pattern"); }
        byte_level = true;
        return p;
    }
    if (type == "Metaspace") {
        auto p         = std::make_unique<MetaspacePreTokenizer>();
        p->replacement = field_or<std::string>(j, "replacement", p->replacement, file, path);
        if (j.contains("prepend_scheme")) {
            p->scheme = field<std::string>(j, "prepend_scheme", file, path);
            if (p->scheme != "always" && p->scheme != "first" && p->scheme != "never") {
                bad_field(file, path + ".prepend_scheme", "must be always, first or never");
            }
        } else {
            p->scheme = field_or<bool>(j, "add_prefix_space", true, file, path) ? "always" : "never";
        }
        if (field_or<bool>(j, "split", true, file, path)) { p->split = std::make_unique<Regex>(escape_regex(p->replacement), "Metaspace"); }
        return p;
    }
    if (type == "Digits") {
        auto p      = std::make_unique<RegexSplitPreTokenizer>();
        const bool individual = field_or<bool>(j, "individual_digits", false, file, path);
        p->pattern  = std::make_unique<Regex>(individual ? "\\p{N}" : "\\p{N}+", "Digits");
        p->behavior = Behavior::isolated;
        return p;
    }
    if (type == "WhitespaceSplit") {
        auto p      = std::make_unique<RegexSplitPreTokenizer>();
        p->pattern  = std::make_unique<Regex>("\\s+", "WhitespaceSplit");
        p->behavior = Behavior::removed;
        return p;
    }
    if (type == "Sequence") {
        auto seq  = std::make_unique<PreTokenizerSequence>();
        auto list = list_of(j, "pretokenizers", file, path);
        for (size_t i = 0; i < list.size(); ++i) {
            if (auto p = make_pre_tokenizer(*list[i], file, fmt::format("{}.pretokenizers[{}]", path, i), byte_level)) {
                seq->steps.push_back(std::move(p));
            }
        }
        return seq;
    }
    bad_field(file, path + ".type", "pre-tokenizer '" + type + "' is not supported");
}

PostProcessor make_post_processor(const json & j, const std::string & file, const std::string & path) {
    PostProcessor pp;
    if (j.is_null()) { return pp; }
    const std::string type = field<std::string>(j, "type", file, path);
    if (type == "ByteLevel") { return pp; }   // changes offsets only
    if (type == "Sequence") {
        auto list = list_of(j, "processors", file, path);
        for (size_t i = 0; i < list.size(); ++i) {
            PostProcessor p = make_post_processor(*list[i], file, fmt::format("{}.processors[{}]", path, i));
            pp.prefix_ids.insert(pp.prefix_ids.end(), p.prefix_ids.begin(), p.prefix_ids.end());
            pp.suffix_ids.insert(pp.suffix_ids.begin(), p.suffix_ids.begin(), p.suffix_ids.end());
        }
        return pp;
    }
    if (type == "TemplateProcessing") {
        auto items   = list_of(j, "single", file, path);
        const json & specials = j.value("special_tokens", json::object());
        bool seen_a  = false;
        for (size_t i = 0; i < items.size(); ++i) {
            const json & it  = *items[i];
            const auto   ipath = fmt::format("{}.single[{}]", path, i);
            if (it.contains("Sequence")) {
                if (seen_a) { bad_field(file, ipath, "a second sequence in 'single'"); }
                seen_a = true;
            } else if (it.contains("SpecialToken") && it["SpecialToken"].contains("id")) {
                const std::string name = it["SpecialToken"]["id"].get<std::string>();
                if (!specials.contains(name) || !specials[name].contains("ids") || !specials[name]["ids"].is_array()) {
                    bad_field(file, path + ".special_tokens", "'" + name + "' (used in " + ipath + ") has no ids");
                }
                auto & dst = seen_a ? pp.suffix_ids : pp.prefix_ids;
                for (const auto & id : specials[name]["ids"]) { dst.push_back(id.get<int32_t>()); }
            } else {
                bad_field(file, ipath, "must be {\"SpecialToken\": ...} or {\"Sequence\": ...}");
            }
        }
        return pp;
    }
    bad_field(file, path + ".type", "post-processor '" + type + "' is not supported");
}

std::unique_ptr<Decoder> make_decoder(const json & j, const std::string & file, const std::string & path,
                                      bool & is_plain_byte_level) {
    if (j.is_null()) { return nullptr; }
    const std::string type = field<std::string>(j, "type", file, path);
    if (type == "ByteLevel") {
        is_plain_byte_level = true;
        return std::make_unique<ByteLevelDecoder>();
    }
    if (type == "Replace") {
        auto d       = std::make_unique<ReplaceDecoder>();
        set_replace_pattern(d->r, j.value("pattern", json()), file, path + ".pattern");
        d->r.content = field<std::string>(j, "content", file, path);
        return d;
    }
    if (type == "ByteFallback") { return std::make_unique<ByteFallbackDecoder>(); }
    if (type == "Fuse") { return std::make_unique<FuseDecoder>(); }
    if (type == "Strip") {
        auto d     = std::make_unique<StripDecoder>();
        d->content = field<std::string>(j, "content", file, path);
        d->start   = field_or<size_t>(j, "start", 0, file, path);
        d->stop    = field_or<size_t>(j, "stop", 0, file, path);
        return d;
    }
    if (type == "Metaspace") {
        auto d         = std::make_unique<MetaspaceDecoder>();
        d->replacement = field_or<std::string>(j, "replacement", d->replacement, file, path);
        d->prepend     = j.contains("prepend_scheme") ? field<std::string>(j, "prepend_scheme", file, path) != "never"
                                                      : field_or<bool>(j, "add_prefix_space", true, file, path);
        return d;
    }
    if (type == "Sequence") {
        auto seq  = std::make_unique<DecoderSequence>();
        auto list = list_of(j, "decoders", file, path);
        bool dummy = false;
        for (size_t i = 0; i < list.size(); ++i) {
            if (auto d = make_decoder(*list[i], file, fmt::format("{}.decoders[{}]", path, i), dummy)) { seq->steps.push_back(std::move(d)); }
        }
        return seq;
    }
    bad_field(file, path + ".type", "decoder '" + type + "' is not supported");
}

}  // namespace fd::tokenizer
