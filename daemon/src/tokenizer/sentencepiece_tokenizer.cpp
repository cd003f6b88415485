#include "fd/tokenizer/sentencepiece_tokenizer.h"

#include "fd/status.h"
#include "fd/utf8.h"

#include <nlohmann/json.hpp>
#include <sentencepiece_processor.h>

#include <fstream>

namespace fd::tokenizer {

SentencePieceTokenizer::SentencePieceTokenizer(const std::filesystem::path & dir, int32_t bos_token_id)
    : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
    const auto model = dir / "tokenizer.model";
    if (!std::filesystem::exists(model)) {
        fail(Errc::invalid_checkpoint, "{}: missing (a SentencePiece tokenizer.model is required)", model.string());
    }
    const auto st = sp_->Load(model.string());
    if (!st.ok()) { fail(Errc::invalid_checkpoint, "{}: cannot load: {}", model.string(), st.ToString()); }
    bos_ = bos_token_id >= 0 ? bos_token_id : sp_->bos_id();
    const auto cfg_file = dir / "tokenizer_config.json";
    if (std::filesystem::exists(cfg_file)) {
        try {
            std::ifstream in(cfg_file);
            const auto    j = nlohmann::json::parse(in);
            add_bos_ = j.value("add_bos_token", true);
        } catch (const nlohmann::json::exception & e) {
            fail(Errc::invalid_checkpoint, "{}: not valid JSON: {}", cfg_file.string(), e.what());
        }
    }
    std::vector<int> a;
    sp_->Encode("a", &a);
    anchor_id_ = a.empty() ? 0 : a.back();
    sp_->Decode(std::vector<int>{anchor_id_}, &anchor_text_);
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::vector<int32_t> SentencePieceTokenizer::encode(std::string_view text, bool add_special_tokens) const {
    std::vector<int> ids;
    sp_->Encode(text, &ids);
    std::vector<int32_t> out;
    out.reserve(ids.size() + 1);
    if (add_special_tokens && add_bos_ && bos_ >= 0) { out.push_back(bos_); }
    out.insert(out.end(), ids.begin(), ids.end());
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
    const int        n = sp_->GetPieceSize();
    std::vector<int> run;
    run.reserve(ids.size());
    std::string out;
    bool        at_start = !opts.continuation, any = false;
    for (int32_t id : ids) {
        if (id < 0 || id >= n) { continue; }
        if (!is_special(id)) {
            run.push_back(id);
            continue;
        }
        if (opts.skip_special_tokens) { continue; }
        // HF slow tokenizers: ordinary runs and special tokens are sub-texts, joined by a space
        // when spaces_between_special_tokens.
        if (!run.empty()) {
            if (any && opts.spaces_between_special_tokens) { out += ' '; }
            out += decode_run(run, !at_start && !any);
            run.clear();
            any = true;
        }
        if (any && opts.spaces_between_special_tokens) { out += ' '; }
        out += sp_->IdToPiece(id);
        any = true;
    }
    if (!run.empty()) {
        if (any && opts.spaces_between_special_tokens) { out += ' '; }
        out += decode_run(run, !at_start && !any);
    }
    return out;
}

std::string SentencePieceTokenizer::piece(int32_t id) const {
    if (id < 0 || id >= sp_->GetPieceSize()) { return ""; }
    return sp_->IdToPiece(id);
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
    return sp_->IsControl(id) || sp_->IsUnknown(id);
}

std::vector<int32_t> SentencePieceTokenizer::special_ids() const {
    std::vector<int32_t> out;
    for (int32_t id = 0; id < sp_->GetPieceSize(); ++id) {
        if (is_special(id)) { out.push_back(id); }
    }
    return out;
}

}  // namespace fd::tokenizer
