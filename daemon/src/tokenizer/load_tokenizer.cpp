// load_tokenizer: pick the implementation from what a model directory holds.
#include "fd/status.h"
#include "fd/tokenizer/hf_tokenizer.h"
#include "fd/tokenizer/sentencepiece_tokenizer.h"

#include <fmt/ranges.h>

namespace fd::tokenizer {

namespace {

/// Strings both tokenizers of one model must encode alike (ASCII, leading/double spaces,
/// newlines, digits, accents, CJK, an emoji: byte fallback); BOS and EOS text are added.
const char * const kProbes[] = {"Hello world", " leading space and  two", "line one\nline two\n", "12345 67",
                                "na\xC3\xAFve caf\xC3\xA9", "\xE4\xBD\xA0\xE5\xA5\xBD", "\xF0\x9F\x99\x82!"};

}  // namespace

std::shared_ptr<const Tokenizer> load_tokenizer(const std::filesystem::path & dir, const LoadOptions & opts) {
    const auto json_path = dir / "tokenizer.json", model_path = dir / "tokenizer.model";
    const bool has_json = std::filesystem::exists(json_path), has_model = std::filesystem::exists(model_path);
    if (!has_json && !has_model) {
        fail(Errc::invalid_checkpoint, "{}: neither tokenizer.json nor tokenizer.model (SentencePiece) is present",
             dir.string());
    }
    if (!has_json) { return std::make_shared<const SentencePieceTokenizer>(dir, opts.bos_token_id); }
    auto hf = std::make_shared<const HfTokenizer>(dir);
    if (!has_model) { return hf; }
    const SentencePieceTokenizer sp(dir, opts.bos_token_id);
    std::vector<std::string>     probes(std::begin(kProbes), std::end(kProbes));
    // Special-token text must be one token in both (HF's added-token split). It ends the probe:
    // text after it may differ by design (a `legacy: false` tokenizer.model with Llama-2's legacy
    // tokenizer.json).
    for (const auto id : {sp.bos_id(), sp.eos_id()}) {
        if (id) { probes.push_back("Hello world" + sp.piece(*id)); }
    }
    for (const std::string & probe : probes) {
        for (bool special : {false, true}) {
            const auto a = hf->encode(probe, special), b = sp.encode(probe, special);
            if (a != b) {
                fail(Errc::invalid_checkpoint,
                     "{} and {} disagree on {:?} (add_special_tokens={}): [{}] vs [{}]; remove the one that does not "
                     "belong to this model",
                     json_path.string(), model_path.string(), probe, special, fmt::join(a, ", "),
                     fmt::join(b, ", "));
            }
        }
    }
    return hf;
}

}  // namespace fd::tokenizer
