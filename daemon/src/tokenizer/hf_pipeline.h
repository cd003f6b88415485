// hf_pipeline.h — the normalizer, pre-tokenizer, post-processor and decoder stages of a Hugging
// Face tokenizer.json, built from its JSON (private to daemon/src/tokenizer). Semantics follow
// HF tokenizers (Rust) and transformers.js, the reference the tests compare with:
//   normalizers     NFC NFD NFKC NFKD (utf8proc), Prepend, Replace, Lowercase, Sequence
//   pre-tokenizers  Split (regex via PCRE2 or string; removed / isolated / merged_with_previous /
//                   merged_with_next / contiguous; invert), ByteLevel (add_prefix_space, GPT-2
//                   regex when use_regex), Metaspace (replacement, prepend_scheme, split),
//                   Digits, WhitespaceSplit, Sequence
//   post-processors TemplateProcessing (single), ByteLevel (ids unchanged), Sequence
//   decoders        ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence
// Any other type is a start-up error naming the file and the field.
#pragma once

#include "regex.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fd::tokenizer {

class Normalizer {
public:
    virtual ~Normalizer() = default;
    /// Normalize `text` (valid UTF-8) in place.
    virtual void apply(std::string & text) const = 0;
};

class PreTokenizer {
public:
    virtual ~PreTokenizer() = default;
    /// Split each word of `words` further; `first_section` is true for the first text section
    /// of the input (Metaspace prepend_scheme "first").
    virtual void apply(std::vector<std::string> & words, bool first_section) const = 0;
};

/// The post-processor's contribution to encode(add_special_tokens=true): ids before and after
/// the sequence (TemplateProcessing "single").
struct PostProcessor {
    std::vector<int32_t> prefix_ids;
    std::vector<int32_t> suffix_ids;
};

class Decoder {
public:
    virtual ~Decoder() = default;
    /// Transform the token strings (HF decode_chain). `continuation`: the tokens do not start
    /// the text (Strip's start and Metaspace's leading space do not apply to the first token).
    virtual void apply(std::vector<std::string> & tokens, bool continuation) const = 0;
    /// Leading stages that change each token on its own, whatever its neighbours (Replace): the
    /// tokenizer runs them once per vocabulary entry at load time.
    virtual size_t n_token_local() const { return 0; }
    /// Apply stages [first, last) only (a Sequence's stages; a single stage is stage 0).
    virtual void apply_stages(size_t first, size_t last, std::vector<std::string> & tokens, bool continuation) const {
        if (first == 0 && last >= 1) { apply(tokens, continuation); }
    }
};

/// Builders; `j` is the stage's JSON (may be null → nullptr), `file` and `path` name it in errors.
/// `byte_level` is set when the pre-tokenizer contains a ByteLevel stage (words then stay raw
/// bytes; the BPE model maps them).
std::unique_ptr<Normalizer>   make_normalizer(const nlohmann::json & j, const std::string & file, const std::string & path);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json & j, const std::string & file,
                                                 const std::string & path, bool & byte_level);
PostProcessor            make_post_processor(const nlohmann::json & j, const std::string & file, const std::string & path);
/// `is_plain_byte_level` is set when the decoder is exactly one ByteLevel stage (the tokenizer
/// then decodes from per-id byte strings without building token strings).
std::unique_ptr<Decoder> make_decoder(const nlohmann::json & j, const std::string & file, const std::string & path,
                                      bool & is_plain_byte_level);

}  // namespace fd::tokenizer
