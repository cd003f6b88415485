// fd/tokenizer/sentencepiece_tokenizer.h — SentencePiece `tokenizer.model` (libsentencepiece)
// behind the fd::tokenizer::Tokenizer interface, as HF's slow LlamaTokenizer uses it.
//
// Encoding follows tokenizer_config.json: BOS prepended when `add_bos_token` (default true, as
// LlamaTokenizer) and add_special_tokens. Special tokens are SentencePiece's control and unknown
// pieces (<s>, </s>, <unk>). Decoding with skip_special_tokens=false writes them as their piece
// text, separated from the neighbouring text by a space when spaces_between_special_tokens (HF
// slow-tokenizer `_decode`). Thread-safe after construction (SentencePieceProcessor's encode and
// decode are const).
#pragma once

#include "fd/tokenizer/tokenizer.h"

#include <filesystem>
#include <memory>

namespace sentencepiece { class SentencePieceProcessor; }

namespace fd::tokenizer {

class SentencePieceTokenizer final : public Tokenizer {
public:
    /// Load `dir`/tokenizer.model and (if present) `dir`/tokenizer_config.json. `bos_token_id`
    /// is config.json's BOS (-1: the model's own bos piece).
    /// Errors  fd::Error{invalid_checkpoint} naming the file.
    SentencePieceTokenizer(const std::filesystem::path & dir, int32_t bos_token_id);
    ~SentencePieceTokenizer() override;

    std::string_view         kind() const override { return "sentencepiece"; }
    std::vector<int32_t>     encode(std::string_view text, bool add_special_tokens = true) const override;
    std::string              decode(std::span<const int32_t> ids, const DecodeOptions & opts = {}) const override;
    std::string              piece(int32_t id) const override;
    std::optional<int32_t>   piece_to_id(std::string_view piece) const override;
    int32_t                  vocab_size() const override;
    std::optional<int32_t>   bos_id() const override;
    std::optional<int32_t>   eos_id() const override;
    bool                     is_special(int32_t id) const override;
    std::vector<int32_t>     special_ids() const override;

    bool add_bos() const { return add_bos_; }

private:
    /// SentencePiece decode of a run of ordinary pieces; with `continuation` the run is decoded
    /// behind a plain anchor piece so SentencePiece's leading-whitespace removal does not apply.
    std::string decode_run(const std::vector<int> & run, bool continuation) const;

    std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
    int32_t     bos_       = 1;
    bool        add_bos_   = true;
    int32_t     anchor_id_ = 0;    ///< a plain piece ("a") used by decode_run
    std::string anchor_text_;
};

}  // namespace fd::tokenizer
