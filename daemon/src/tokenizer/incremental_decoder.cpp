#include "fd/tokenizer/incremental_decoder.h"

#include "fd/utf8.h"

namespace fd::tokenizer {

namespace {

constexpr size_t kWindowTokens = 5;   ///< ids decoded in front of the new ones (vLLM uses 5 too)

bool ends_with_replacement(const std::string & s) {
    return s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0;
}

}  // namespace

bool is_valid_utf8(std::string_view s) { return utf8::valid(s); }

IncrementalDecoder::IncrementalDecoder(const Tokenizer & tok, std::vector<int32_t> prompt_ids, DecodeOptions opts)
    : tok_(&tok), opts_(opts), ids_(std::move(prompt_ids)) {
    read_offset_   = ids_.size();
    prefix_offset_ = ids_.size() > kWindowTokens ? ids_.size() - kWindowTokens : 0;
}

std::string IncrementalDecoder::decode_range(size_t begin, size_t end) const {
    DecodeOptions o  = opts_;
    o.continuation   = begin > 0;
    return tok_->decode(std::span<const int32_t>(ids_.data() + begin, end - begin), o);
}

std::string IncrementalDecoder::push(int32_t id) {
    ids_.push_back(id);
    const std::string prefix_text = decode_range(prefix_offset_, read_offset_);
    const std::string new_text    = decode_range(prefix_offset_, ids_.size());
    if (new_text.size() <= prefix_text.size() || ends_with_replacement(new_text)) { return {}; }
    // Both decodes are valid UTF-8; start the delta on a character boundary so that even a
    // window whose text is not a byte prefix of the longer one never yields a broken chunk.
    size_t cut = prefix_text.size();
    while (cut < new_text.size() && utf8::is_continuation(static_cast<unsigned char>(new_text[cut]))) { ++cut; }
    prefix_offset_ = read_offset_;
    read_offset_   = ids_.size();
    return new_text.substr(cut);
}

std::string IncrementalDecoder::flush() {
    if (read_offset_ == ids_.size()) { return {}; }
    const std::string prefix_text = decode_range(prefix_offset_, read_offset_);
    const std::string new_text    = decode_range(prefix_offset_, ids_.size());
    read_offset_ = ids_.size();
    if (new_text.size() <= prefix_text.size()) { return {}; }
    size_t cut = prefix_text.size();
    while (cut < new_text.size() && utf8::is_continuation(static_cast<unsigned char>(new_text[cut]))) { ++cut; }
    return new_text.substr(cut);
}

}  // namespace fd::tokenizer
