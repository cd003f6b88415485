// fd/tokenizer/incremental_decoder.h — streaming detokenization of one sequence.
//
// The prefix/read-offset scheme of vLLM and HF TGI (and tokenizers' DecodeStream): each push
// decodes a short window of ids before the new one, twice (without and with it), and emits the
// difference. Text is held back while the window ends in an incomplete UTF-8 sequence (the
// decode ends in U+FFFD), so no chunk ever carries a broken or partial UTF-8 sequence, and the
// chunks concatenate to decode(prompt + generated) minus decode(prompt). Works with any
// fd::tokenizer::Tokenizer; windows past the start of a sequence decode with
// DecodeOptions::continuation so start-of-text rules apply only at the true start.
// Not thread-safe: one decoder per sequence, used by the engine thread.
#pragma once

#include "fd/tokenizer/tokenizer.h"

#include <cstdint>
#include <string>
#include <vector>

namespace fd::tokenizer {

class IncrementalDecoder {
public:
    /// `prompt_ids` are the context the first generated id follows; `opts.continuation` is
    /// ignored (the decoder sets it per window).
    IncrementalDecoder(const Tokenizer & tok, std::vector<int32_t> prompt_ids, DecodeOptions opts = {});

    /// Append one generated id; returns the newly completed text (may be empty). Valid UTF-8.
    std::string push(int32_t id);

    /// Text still held back (an incomplete UTF-8 sequence) at the end of the sequence.
    std::string flush();

private:
    std::string decode_range(size_t begin, size_t end) const;

    const Tokenizer *    tok_;
    DecodeOptions        opts_;
    std::vector<int32_t> ids_;
    size_t               prefix_offset_ = 0;
    size_t               read_offset_   = 0;
};

/// True when `s` is well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
bool is_valid_utf8(std::string_view s);

}  // namespace fd::tokenizer
