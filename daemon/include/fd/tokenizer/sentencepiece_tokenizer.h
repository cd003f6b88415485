// fd/tokenizer/sentencepiece_tokenizer.h — SentencePiece `tokenizer.model` (libsentencepiece)
// behind the fd::tokenizer::Tokenizer interface.
//
// It behaves as the fast tokenizer transformers converts from it (LlamaConverter), which is what
// vLLM loads for a model directory with only tokenizer.model:
// - Added tokens are matched in the text first and never split (HF's added-token split): the
//   control and unknown pieces (<unk>, <s>, </s>) and tokenizer_config.json's
//   `added_tokens_decoder` entries (with their lstrip/rstrip; ids past the SentencePiece
//   vocabulary are ignored). The text between them is encoded section by section: with
//   `legacy` (tokenizer_config.json, default true as in LlamaTokenizer) each section gets
//   SentencePiece's dummy prefix, as the converted Prepend("▁") normalizer does; with
//   `legacy: false` only the section that starts the text does (Metaspace prepend_scheme "first").
// - BOS is prepended when `add_bos_token` (default true) and add_special_tokens.
// - Decoding writes special tokens as their text with no space around them
//   (spaces_between_special_tokens is ignored, as by HF fast tokenizers), and only the very start
//   of the text loses its first piece's leading space (the converted decoder's Strip(left=1)).
// Thread-safe after construction (SentencePieceProcessor's encode and decode are const).
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
    struct Added;

    /// Ids of one section of text between added tokens; `first`: it starts the text.
    void encode_section(std::string_view text, bool first, std::vector<int32_t> & out) const;

    /// SentencePiece decode of a run of ordinary pieces; with `continuation` the run is decoded
    /// behind a plain anchor piece so SentencePiece's leading-whitespace removal does not apply.
    std::string decode_run(const std::vector<int> & run, bool continuation) const;

    std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
    std::unique_ptr<Added>                                 added_;
    bool        legacy_    = true;   ///< tokenizer_config.json `legacy`
    std::string unk_text_;           ///< the unknown piece's text, encoded in front of a non-legacy section
    size_t      unk_len_   = 0;      ///< number of pieces unk_text_ encodes to
    int32_t     bos_       = 1;
    bool        add_bos_   = true;
    int32_t     anchor_id_ = 0;    ///< a plain piece ("a") used by decode_run
    std::string anchor_text_;
};

}  // namespace fd::tokenizer
