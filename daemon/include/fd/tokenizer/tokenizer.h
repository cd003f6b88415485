// fd/tokenizer/tokenizer.h — the tokenizer interface the engine and the API use, and the
// factory that picks an implementation from what a model directory holds.
//
// Two implementations sit behind it: SentencePiece `tokenizer.model` (libsentencepiece,
// fd/tokenizer/sentencepiece_tokenizer.h) and Hugging Face `tokenizer.json`
// (fd/tokenizer/hf_tokenizer.h: BPE with ByteLevel or Metaspace/byte-fallback pipelines).
// Token ids are int32 in [0, vocab_size()). Text is UTF-8 in and out; every string a
// decode returns is valid UTF-8 (invalid byte runs become U+FFFD, one per maximal subpart as
// in the WHATWG/Unicode "substitution of maximal subparts" practice).
//
// Thread-safety: every method is const and may be called from any thread after construction.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fd::tokenizer {

/// How ids become text. Defaults are vLLM's request defaults.
struct DecodeOptions {
    bool skip_special_tokens = true;            ///< drop special tokens (BOS, EOS, <|im_end|>, ...)
    /// Put a space between an added/special token's text and the text next to it (HF slow
    /// tokenizers' option). Both implementations ignore it, as HF "fast" tokenizers do (vLLM
    /// loads a tokenizer.model-only directory as the fast tokenizer converted from it).
    bool spaces_between_special_tokens = true;
    /// The ids continue a sequence (they are not its start): start-of-text rules such as a
    /// decoder stripping the leading space of the first piece do not apply.
    bool continuation = false;
};

class Tokenizer {
public:
    virtual ~Tokenizer() = default;

    /// "sentencepiece" or "tokenizer.json" — which implementation, for logs and /version.
    virtual std::string_view kind() const = 0;

    /// Token ids of `text`. With `add_special_tokens` the model's template tokens are added
    /// (BOS for Llama-2/3.1, none for Qwen), as HF `encode(text, add_special_tokens=...)`.
    /// Special/added tokens written in `text` ("<|im_start|>") are matched first and never split.
    /// Shape  [n_tokens]. Errors: none (any UTF-8 input encodes; invalid UTF-8 bytes are
    /// encoded as their byte tokens or as unknown).
    virtual std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const = 0;

    /// Text of `ids`; ids outside [0, vocab_size()) are skipped.
    virtual std::string decode(std::span<const int32_t> ids, const DecodeOptions & opts = {}) const = 0;

    /// The vocabulary entry of one id, as the model's vocabulary spells it ("▁the", "Ġthe",
    /// "<0x0A>", "<|im_end|>") — what completions logprobs report. "" outside [0, vocab_size()).
    virtual std::string piece(int32_t id) const = 0;

    /// Id of a vocabulary entry or added token spelled exactly `piece`, if any.
    virtual std::optional<int32_t> piece_to_id(std::string_view piece) const = 0;

    /// Number of ids the tokenizer knows (largest id + 1, added tokens included).
    virtual int32_t vocab_size() const = 0;

    /// BOS / EOS ids as the tokenizer's own config names them (tokenizer_config.json
    /// `bos_token`/`eos_token`, SentencePiece's bos/eos pieces); nullopt when it names none.
    virtual std::optional<int32_t> bos_id() const = 0;
    virtual std::optional<int32_t> eos_id() const = 0;

    /// True for special tokens (the ones `skip_special_tokens` drops).
    virtual bool is_special(int32_t id) const = 0;
    /// All special ids, ascending.
    virtual std::vector<int32_t> special_ids() const = 0;

    /// The text one id reads as in the middle of a sequence (" the"); bytes that are not UTF-8
    /// on their own read as U+FFFD.
    std::string token_text(int32_t id) const {
        return decode(std::span<const int32_t>(&id, 1), {.skip_special_tokens = false, .continuation = true});
    }
};

struct LoadOptions {
    /// config.json's `bos_token_id`: the BOS a SentencePiece tokenizer adds (-1: its own).
    int32_t bos_token_id = -1;
};

/// Load the tokenizer of a Hugging Face model directory. `tokenizer.json` is used when present;
/// `tokenizer.model` (SentencePiece) otherwise. When both exist they must agree on a probe
/// (the same ids for a few strings, special tokens included), else the error names both files.
/// `tokenizer_config.json` (optional) supplies bos/eos names and SentencePiece's add_bos_token.
/// Errors  fd::Error{invalid_checkpoint} naming the file (and the field/position of a
///         malformed tokenizer.json); neither file present → the error names both.
std::shared_ptr<const Tokenizer> load_tokenizer(const std::filesystem::path & dir, const LoadOptions & opts = {});

}  // namespace fd::tokenizer
