// fd/tokenizer/hf_tokenizer.h — Hugging Face `tokenizer.json` behind fd::tokenizer::Tokenizer.
//
// Pipeline (HF tokenizers' encode, the order transformers.js follows too):
//   1. added tokens (tokenizer.json "added_tokens") are matched in the raw text first, longest
//      match at the leftmost position, and never split; lstrip/rstrip eat the whitespace next
//      to them;
//   2. each text section between them: normalizer (NFC, Prepend, Replace, ...) → pre-tokenizer
//      (Split regexes on PCRE2, ByteLevel, Metaspace, ...) → BPE model (merges, byte fallback,
//      ignore_merges);
//   3. with add_special_tokens, the post-processor's template ids (Llama-2/3.1's BOS).
// Decoding maps ids to vocabulary strings and runs the decoder chain (ByteLevel, or Llama-2's
// Replace → ByteFallback → Fuse → Strip); added tokens decode to their literal text.
// Supported stages: fd/tokenizer/../../src/tokenizer/hf_pipeline.h. Deliberate choices:
// `spaces_between_special_tokens` is ignored (HF fast tokenizers do), decode never applies
// `clean_up_tokenization_spaces` (vLLM's streaming detokenizer does not either), added tokens
// are matched on the raw text whatever their `normalized` flag (transformers.js does the same),
// `single_word` is not honoured (transformers.js does not either). Split regexes run on PCRE2 with
// UCP, whose \s is Unicode White_Space like HF's Oniguruma: U+0085 is whitespace and U+FEFF is
// not, where JavaScript (so @lenml/tokenizers) has it the other way round for these two.
// Thread-safe after construction.
#pragma once

#include "fd/tokenizer/tokenizer.h"

#include <filesystem>
#include <memory>
#include <string>

namespace fd::tokenizer {

class HfTokenizer final : public Tokenizer {
public:
    /// Load `dir`/tokenizer.json and (if present) `dir`/tokenizer_config.json (bos_token,
    /// eos_token, additional_special_tokens).
    /// Errors  fd::Error{invalid_checkpoint} naming the file and, for malformed JSON, the
    ///         line/column, for a bad or unsupported field its path ("model.merges[17]").
    explicit HfTokenizer(const std::filesystem::path & dir);
    ~HfTokenizer() override;

    std::string_view       kind() const override { return "tokenizer.json"; }
    std::vector<int32_t>   encode(std::string_view text, bool add_special_tokens = true) const override;
    std::string            decode(std::span<const int32_t> ids, const DecodeOptions & opts = {}) const override;
    std::string            piece(int32_t id) const override;
    std::optional<int32_t> piece_to_id(std::string_view piece) const override;
    int32_t                vocab_size() const override;
    std::optional<int32_t> bos_id() const override;
    std::optional<int32_t> eos_id() const override;
    bool                   is_special(int32_t id) const override;
    std::vector<int32_t>   special_ids() const override;

    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace fd::tokenizer
