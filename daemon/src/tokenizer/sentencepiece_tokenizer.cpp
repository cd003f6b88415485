#include "fd/tokenizer/sentencepiece_tokenizer.h"

#include "added_tokens.h"
#include "fd/status.h"
#include "fd/utf8.h"

#include <nlohmann/json.hpp>
#include <sentencepiece_processor.h>

#include <fstream>

namespace fd::tokenizer {

struct SentencePieceTokenizer::Added {
    std::vector<AddedToken> tokens;   ///< matched in the text before SentencePiece sees it
    AddedTrie               trie;
    std::vector<int32_t>    index;    ///< id → index into tokens, or -1
    std::vector<char>       special;  ///< id → is special
};

SentencePieceTokenizer::SentencePieceTokenizer(const std::filesystem::path & dir, int32_t bos_token_id)
    : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()), added_(std::make_unique<Added>()) {
    const auto model = dir / "tokenizer.model";
    if (!std::filesystem::exists(model)) {
        fail(Errc::invalid_checkpoint, "{}: missing (a SentencePiece tokenizer.model is required)", model.string());
    }
    const auto st = sp_->Load(model.string());
    if (!st.ok()) { fail(Errc::invalid_checkpoint, "{}: cannot load: {}", model.string(), st.ToString()); }
    bos_ = bos_token_id >= 0 ? bos_token_id : sp_->bos_id();
    const int n = sp_->GetPieceSize();
    Added &   a = *added_;
    a.index.assign(size_t(n), -1);
    a.special.assign(size_t(n), 0);
    auto add = [&](int32_t id, std::string content, bool special, bool lstrip, bool rstrip) {
        if (content.empty()) { return; }
        if (a.index[id] < 0) {
            a.index[id] = int32_t(a.tokens.size());
            a.tokens.emplace_back();
        }
        a.tokens[a.index[id]] = {.content = std::move(content), .id = id, .special = special, .lstrip = lstrip, .rstrip = rstrip};
        a.special[id]         = special;
    };
    // The converted fast tokenizer's added tokens: the control and unknown pieces (<unk>, <s>, </s>) ...
    for (int32_t id = 0; id < n; ++id) {
        if (sp_->IsControl(id) || sp_->IsUnknown(id)) { add(id, sp_->IdToPiece(id), true, false, false); }
    }
    const auto cfg_file = dir / "tokenizer_config.json";
    if (std::filesystem::exists(cfg_file)) {
        try {
            std::ifstream in(cfg_file);
            const auto    j = nlohmann::json::parse(in);
            add_bos_ = j.value("add_bos_token", true);
            legacy_  = !j.contains("legacy") || j["legacy"].is_null() || j["legacy"].get<bool>();
            // ... and tokenizer_config.json's added_tokens_decoder, with its lstrip/rstrip (ids
            // past the SentencePiece vocabulary are not supported and are ignored).
            if (j.contains("added_tokens_decoder") && j["added_tokens_decoder"].is_object()) {
                for (const auto & [key, t] : j["added_tokens_decoder"].items()) {
                    const int32_t id = std::stoi(key);
                    if (id < 0 || id >= n || !t.is_object()) { continue; }
                    add(id, t.value("content", std::string()), t.value("special", a.special[id] != 0),
                        t.value("lstrip", false), t.value("rstrip", false));
                }
            }
        } catch (const nlohmann::json::parse_error & e) {
            fail(Errc::invalid_checkpoint, "{}: not valid JSON: {}", cfg_file.string(), e.what());
        } catch (const std::exception & e) {  // a field of the wrong type, a non-numeric added_tokens_decoder key
            fail(Errc::invalid_checkpoint, "{}: add_bos_token, legacy or added_tokens_decoder is malformed: {}", cfg_file.string(), e.what());
        }
    }
    for (size_t i = 0; i < a.tokens.size(); ++i) { a.trie.insert(a.tokens[i].content, int32_t(i)); }
    std::vector<int> ids;
    sp_->Encode("a", &ids);
    anchor_id_ = ids.empty() ? 0 : ids.back();
    sp_->Decode(std::vector<int>{anchor_id_}, &anchor_text_);
    if (sp_->unk_id() >= 0) {
        unk_text_ = sp_->IdToPiece(sp_->unk_id());
        sp_->Encode(unk_text_, &ids);
        unk_len_ = ids.size();
    }
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

void SentencePieceTokenizer::encode_section(std::string_view text, bool first, std::vector<int32_t> & out) const {
    std::vector<int> ids;
    if (legacy_ || first || unk_text_.empty()) {
        sp_->Encode(text, &ids);
        out.insert(out.end(), ids.begin(), ids.end());
        return;
    }
    // Non-legacy: no dummy prefix after an added token. transformers' LlamaTokenizer._tokenize
    // encodes behind the unk token's text and drops its pieces; its converted fast tokenizer gets
    // the same from Metaspace(prepend_scheme="first").
    sp_->Encode(unk_text_ + std::string(text), &ids);
    out.insert(out.end(), ids.begin() + std::ptrdiff_t(std::min(unk_len_, ids.size())), ids.end());
}

std::vector<int32_t> SentencePieceTokenizer::encode(std::string_view text, bool add_special_tokens) const {
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 2);
    if (add_special_tokens && add_bos_ && bos_ >= 0) { out.push_back(bos_); }
    const Added & a = *added_;
    split_on_added(
        text, a.tokens, a.trie, [&](std::string_view s, bool first) { encode_section(s, first, out); },
        [&](int32_t idx) { out.push_back(a.tokens[size_t(idx)].id); });
    return out;
}

std::string SentencePieceTokenizer::decode_run(const std::vector<int> & run, bool continuation) const {
    std::string text;
    if (run.empty()) { return text; }
    if (!continuation) {
        sp_->Decode(run, &text);
        return utf8::lossy(text);
    }
    // SentencePiece removes the leading whitespace of a decode, which must only happen at the
    // true start of a sequence: decode behind an anchor piece and cut the anchor's text off.
    std::vector<int> v{anchor_id_};
    v.insert(v.end(), run.begin(), run.end());
    sp_->Decode(v, &text);
    return utf8::lossy(std::string_view(text).substr(std::min(anchor_text_.size(), text.size())));
}

std::string SentencePieceTokenizer::decode(std::span<const int32_t> ids, const DecodeOptions & opts) const {
    // As the fast tokenizer transformers converts from this model (LlamaConverter, what vLLM
    // loads for a directory with only tokenizer.model): special tokens are their text with no
    // space around them (spaces_between_special_tokens is ignored), and only the very start of the
    // text loses the leading space of its first piece (decoder Strip(left=1) on the fused text).
    const int        n = sp_->GetPieceSize();
    std::vector<int> run;
    run.reserve(ids.size());
    std::string out;
    bool        any   = opts.continuation;   ///< something precedes the next run
    auto        flush = [&] {
        if (run.empty()) { return; }
        out += decode_run(run, any);
        run.clear();
        any = true;
    };
    for (int32_t id : ids) {
        if (id < 0 || id >= n) { continue; }
        if (!is_special(id)) {
            run.push_back(id);
            continue;
        }
        if (opts.skip_special_tokens) { continue; }
        flush();
        out += piece(id);
        any = true;
    }
    flush();
    return out;
}

std::string SentencePieceTokenizer::piece(int32_t id) const {
    if (id < 0 || id >= sp_->GetPieceSize()) { return ""; }
    const int32_t i = added_->index[id];
    return i >= 0 ? added_->tokens[size_t(i)].content : sp_->IdToPiece(id);
}

std::optional<int32_t> SentencePieceTokenizer::piece_to_id(std::string_view p) const {
    const int id = sp_->PieceToId(p);
    if (id < 0 || id >= sp_->GetPieceSize() || sp_->IdToPiece(id) != p) { return std::nullopt; }
    return id;
}

int32_t SentencePieceTokenizer::vocab_size() const { return sp_->GetPieceSize(); }

std::optional<int32_t> SentencePieceTokenizer::bos_id() const {
    return bos_ >= 0 ? std::optional<int32_t>(bos_) : std::nullopt;
}

std::optional<int32_t> SentencePieceTokenizer::eos_id() const {
    const int id = sp_->eos_id();
    return id >= 0 ? std::optional<int32_t>(id) : std::nullopt;
}

bool SentencePieceTokenizer::is_special(int32_t id) const {
    if (id < 0 || id >= sp_->GetPieceSize()) { return false; }
    return added_->special[id] != 0;
}

std::vector<int32_t> SentencePieceTokenizer::special_ids() const {
    std::vector<int32_t> out;
    for (int32_t id = 0; id < sp_->GetPieceSize(); ++id) {
        if (is_special(id)) { out.push_back(id); }
    }
    return out;
}

}  // namespace fd::tokenizer
