// fd/model/tokenizer.h — SentencePiece tokenizer (libsentencepiece) plus incremental decoding.
//
// Encoding follows the checkpoint's tokenizer_config.json: BOS prepended when `add_bos_token`
// (default true, as LlamaTokenizer). Thread-safe after construction (SentencePieceProcessor
// encode/decode are const).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece { class SentencePieceProcessor; }

namespace fd::model {

class Tokenizer {
public:
    /// Load `dir`/tokenizer.model and `dir`/tokenizer_config.json.
    /// Errors  fd::Error{invalid_checkpoint} naming the file.
    explicit Tokenizer(const std::filesystem::path & dir, int32_t bos_token_id);
    ~Tokenizer();

    /// Token ids of `text`, with BOS first when the config says so.
    std::vector<int32_t> encode(std::string_view text) const;

    /// Text of `ids` (control tokens dropped, byte pieces merged, leading space of the first
    /// piece removed as SentencePiece does).
    std::string decode(const std::vector<int32_t> & ids) const;

    /// The piece string of one id ("▁the", "<0x0A>"), as used in logprobs output.
    std::string id_to_piece(int32_t id) const;

    int32_t vocab_size() const;
    /// A plain piece ("a") and its text, decoded in front of mid-sequence windows so that
    /// SentencePiece's leading-whitespace stripping applies only at the true start.
    int32_t anchor_id() const { return anchor_id_; }
    const std::string & anchor_text() const { return anchor_text_; }
    int32_t bos_token_id() const { return bos_; }
    bool    add_bos() const { return add_bos_; }

private:
    std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
    int32_t bos_     = 1;
    bool    add_bos_ = true;
    int32_t anchor_id_ = 0;
    std::string anchor_text_;
};

/// Incremental detokenizer for one sequence (the prefix/read-offset scheme of vLLM and HF TGI):
/// decodes a short window before the new tokens so SentencePiece's leading-space and byte-merge
/// rules apply, and holds text back while it ends in an incomplete UTF-8 sequence.
class IncrementalDecoder {
public:
    /// `prompt_ids` are the context the first generated token follows.
    IncrementalDecoder(const Tokenizer & tok, const std::vector<int32_t> & prompt_ids);

    /// Append one generated id; returns the newly completed text (may be empty).
    std::string push(int32_t id);

    /// Text still held back (incomplete UTF-8) at the end of the sequence.
    std::string flush();

private:
    std::string decode_from(size_t begin, size_t end) const;

    const Tokenizer *    tok_;
    std::vector<int32_t> ids_;
    size_t               prefix_offset_ = 0;
    size_t               read_offset_   = 0;
};

}  // namespace fd::model
