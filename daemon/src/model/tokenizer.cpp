#include "fd/model/tokenizer.h"

#include "fd/status.h"

#include <nlohmann/json.hpp>
#include <sentencepiece_processor.h>

#include <fstream>

namespace fd::model {

Tokenizer::Tokenizer(const std::filesystem::path & dir, int32_t bos_token_id)
    : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()), bos_(bos_token_id) {
    const auto model = dir / "tokenizer.model";
    if (!std::filesystem::exists(model)) {
        fail(Errc::invalid_checkpoint, "{}: missing (a SentencePiece tokenizer.model is required)", model.string());
    }
    const auto st = sp_->Load(model.string());
    if (!st.ok()) { fail(Errc::invalid_checkpoint, "{}: cannot load: {}", model.string(), st.ToString()); }
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

Tokenizer::~Tokenizer() = default;

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
    std::vector<int> ids;
    sp_->Encode(text, &ids);
    std::vector<int32_t> out;
    out.reserve(ids.size() + 1);
    if (add_bos_) { out.push_back(bos_); }
    out.insert(out.end(), ids.begin(), ids.end());
    return out;
}

std::string Tokenizer::decode(const std::vector<int32_t> & ids) const {
    std::vector<int> v;
    v.reserve(ids.size());
    const int n = sp_->GetPieceSize();
    for (int32_t id : ids) {
        if (id >= 0 && id < n) { v.push_back(id); }
    }
    std::string text;
    sp_->Decode(v, &text);
    return text;
}

std::string Tokenizer::id_to_piece(int32_t id) const {
    if (id < 0 || id >= sp_->GetPieceSize()) { return ""; }
    return sp_->IdToPiece(id);
}

int32_t Tokenizer::vocab_size() const { return sp_->GetPieceSize(); }

namespace {

/// True when `s` ends inside a multi-byte UTF-8 sequence or with U+FFFD from a partial byte run.
bool ends_incomplete(const std::string & s) {
    if (s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0) { return true; }
    int i = static_cast<int>(s.size()) - 1, n_cont = 0;
    while (i >= 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80 && n_cont < 3) { --i; ++n_cont; }
    if (i < 0) { return n_cont > 0; }
    const auto lead = static_cast<unsigned char>(s[i]);
    const int  need = lead >= 0xF0 ? 3 : lead >= 0xE0 ? 2 : lead >= 0xC0 ? 1 : 0;
    return n_cont < need;
}

}  // namespace

IncrementalDecoder::IncrementalDecoder(const Tokenizer & tok, const std::vector<int32_t> & prompt_ids)
    : tok_(&tok), ids_(prompt_ids) {
    read_offset_   = ids_.size();
    prefix_offset_ = ids_.size() > 5 ? ids_.size() - 5 : 0;
}

std::string IncrementalDecoder::decode_from(size_t begin, size_t end) const {
    // Past the start of the sequence, decode behind an anchor piece: SentencePiece strips all
    // leading whitespace of a decode, which must only happen at the true start.
    if (begin == 0) { return tok_->decode(std::vector<int32_t>(ids_.begin(), ids_.begin() + end)); }
    std::vector<int32_t> v{tok_->anchor_id()};
    v.insert(v.end(), ids_.begin() + begin, ids_.begin() + end);
    return tok_->decode(v).substr(tok_->anchor_text().size());
}

std::string IncrementalDecoder::push(int32_t id) {
    ids_.push_back(id);
    const std::string prefix_text = decode_from(prefix_offset_, read_offset_);
    const std::string new_text    = decode_from(prefix_offset_, ids_.size());
    if (new_text.size() <= prefix_text.size() || ends_incomplete(new_text)) { return {}; }
    std::string delta = new_text.substr(prefix_text.size());
    prefix_offset_    = read_offset_;
    read_offset_      = ids_.size();
    return delta;
}

std::string IncrementalDecoder::flush() {
    if (read_offset_ == ids_.size()) { return {}; }
    const std::string prefix_text = decode_from(prefix_offset_, read_offset_);
    const std::string new_text    = decode_from(prefix_offset_, ids_.size());
    read_offset_ = ids_.size();
    return new_text.size() > prefix_text.size() ? new_text.substr(prefix_text.size()) : std::string{};
}

}  // namespace fd::model
