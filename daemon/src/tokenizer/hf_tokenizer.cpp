#include "fd/tokenizer/hf_tokenizer.h"

#include "added_tokens.h"
#include "bpe_model.h"
#include "hf_pipeline.h"
#include "json_field.h"
#include "fd/utf8.h"

#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <fstream>

namespace fd::tokenizer {

using nlohmann::json;

namespace {

/// tokenizer_config.json token names: "<s>" or {"content": "<s>", ...}.
std::string token_name(const json & j) {
    if (j.is_string()) { return j.get<std::string>(); }
    if (j.is_object() && j.contains("content") && j["content"].is_string()) { return j["content"].get<std::string>(); }
    return {};
}

json read_json(const std::filesystem::path & p) {
    std::ifstream in(p);
    if (!in) { fail(Errc::invalid_checkpoint, "{}: cannot open", p.string()); }
    try {
        return json::parse(in);
    } catch (const json::parse_error & e) {
        fail(Errc::invalid_checkpoint, "{}: not valid JSON (byte {}): {}", p.string(), e.byte, e.what());
    }
}

}  // namespace

struct HfTokenizer::Impl {
    std::unique_ptr<BpeModel>     model;
    std::unique_ptr<Normalizer>   normalizer;
    std::unique_ptr<PreTokenizer> pre_tokenizer;
    PostProcessor                 post;
    std::unique_ptr<Decoder>      decoder;
    bool                          plain_byte_level = false;
    size_t                        n_local_stages   = 0;   ///< decoder stages folded into local_pieces
    std::vector<std::string>      local_pieces;           ///< id → piece after those stages
    std::vector<AddedToken>       added;
    TokenMap                      added_by_content;   ///< content → index into added
    std::vector<int32_t>          added_index;        ///< id → index into added, or -1
    AddedTrie                     trie;
    std::vector<char>             special;            ///< id → is special
    int32_t                       n_vocab = 0;
    std::optional<int32_t>        bos, eos;

    void encode_section(std::string_view text, bool first_section, std::vector<int32_t> & out) const {
        std::string s(text);
        if (normalizer) { normalizer->apply(s); }
        if (s.empty()) { return; }
        thread_local std::vector<std::string> words;
        words.clear();
        words.push_back(std::move(s));
        if (pre_tokenizer) { pre_tokenizer->apply(words, first_section); }
        for (const auto & w : words) { model->encode_word(w, out); }
    }
};

HfTokenizer::HfTokenizer(const std::filesystem::path & dir) : impl_(std::make_unique<Impl>()) {
    const auto path = dir / "tokenizer.json";
    const auto file = path.string();
    if (!std::filesystem::exists(path)) { fail(Errc::invalid_checkpoint, "{}: missing", file); }
    const json j = read_json(path);
    if (!j.is_object()) { bad_field(file, "(top level)", "must be an object"); }
    if (!j.contains("model") || !j["model"].is_object()) { bad_field(file, "model", "missing or not an object"); }
    Impl & m = *impl_;
    m.normalizer       = make_normalizer(j.value("normalizer", json()), file, "normalizer");
    bool byte_level    = false;
    m.pre_tokenizer    = make_pre_tokenizer(j.value("pre_tokenizer", json()), file, "pre_tokenizer", byte_level);
    m.model            = std::make_unique<BpeModel>(j["model"], file, byte_level);
    m.post             = make_post_processor(j.value("post_processor", json()), file, "post_processor");
    m.decoder          = make_decoder(j.value("decoder", json()), file, "decoder", m.plain_byte_level);
    m.plain_byte_level = m.plain_byte_level && byte_level;

    m.n_vocab = m.model->size();
    if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
        if (!j["added_tokens"].is_array()) { bad_field(file, "added_tokens", "must be a list"); }
        const auto & list = j["added_tokens"];
        for (size_t i = 0; i < list.size(); ++i) {
            const auto p = fmt::format("added_tokens[{}]", i);
            AddedToken t;
            t.id      = field<int32_t>(list[i], "id", file, p);
            t.content = field<std::string>(list[i], "content", file, p);
            t.special = field_or<bool>(list[i], "special", false, file, p);
            t.lstrip  = field_or<bool>(list[i], "lstrip", false, file, p);
            t.rstrip  = field_or<bool>(list[i], "rstrip", false, file, p);
            if (t.id < 0) { bad_field(file, p + ".id", "must be >= 0"); }
            if (t.content.empty() || !utf8::valid(t.content)) { bad_field(file, p + ".content", "must be non-empty UTF-8"); }
            m.n_vocab = std::max(m.n_vocab, t.id + 1);
            m.added_by_content[t.content] = int32_t(m.added.size());
            m.added.push_back(std::move(t));
        }
    }
    m.added_index.assign(size_t(m.n_vocab), -1);
    m.special.assign(size_t(m.n_vocab), 0);
    for (size_t i = 0; i < m.added.size(); ++i) {
        m.added_index[m.added[i].id] = int32_t(i);
        m.special[m.added[i].id]     = m.added[i].special;
        m.trie.insert(m.added[i].content, int32_t(i));
    }
    if (m.decoder && !m.plain_byte_level && (m.n_local_stages = m.decoder->n_token_local()) > 0) {
        m.local_pieces.resize(size_t(m.n_vocab));
        std::vector<std::string> one;
        for (int32_t id = 0; id < m.n_vocab; ++id) {
            one.assign(1, piece(id));
            m.decoder->apply_stages(0, m.n_local_stages, one, false);
            m.local_pieces[id] = one.empty() ? std::string() : one[0];
        }
    }
    for (int32_t id : m.post.prefix_ids) {
        if (id < 0 || id >= m.n_vocab) { bad_field(file, "post_processor", fmt::format("special token id {} is outside the vocabulary", id)); }
    }

    const auto cfg_path = dir / "tokenizer_config.json";
    if (std::filesystem::exists(cfg_path)) {
        const json cfg = read_json(cfg_path);
        auto id_of = [&](const char * key) -> std::optional<int32_t> {
            if (!cfg.contains(key)) { return std::nullopt; }
            const std::string name = token_name(cfg[key]);
            return name.empty() ? std::nullopt : piece_to_id(name);
        };
        m.bos = id_of("bos_token");
        m.eos = id_of("eos_token");
        if (cfg.contains("additional_special_tokens") && cfg["additional_special_tokens"].is_array()) {
            for (const auto & t : cfg["additional_special_tokens"]) {
                if (auto id = piece_to_id(token_name(t))) { m.special[*id] = 1; }
            }
        }
    }
}

HfTokenizer::~HfTokenizer() = default;

std::vector<int32_t> HfTokenizer::encode(std::string_view raw, bool add_special_tokens) const {
    const Impl & m = *impl_;
    std::string  sanitized;
    std::string_view text = raw;
    if (!utf8::valid(raw)) {
        sanitized = utf8::lossy(raw);
        text      = sanitized;
    }
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 4);
    if (add_special_tokens) { out.insert(out.end(), m.post.prefix_ids.begin(), m.post.prefix_ids.end()); }
    split_on_added(
        text, m.added, m.trie, [&](std::string_view s, bool first) { m.encode_section(s, first, out); },
        [&](int32_t idx) { out.push_back(m.added[size_t(idx)].id); });
    if (add_special_tokens) { out.insert(out.end(), m.post.suffix_ids.begin(), m.post.suffix_ids.end()); }
    return out;
}

std::string HfTokenizer::decode(std::span<const int32_t> ids, const DecodeOptions & opts) const {
    const Impl & m = *impl_;
    if (m.plain_byte_level) {
        std::string out, bytes;
        for (int32_t id : ids) {
            if (id < 0 || id >= m.n_vocab) { continue; }
            if (opts.skip_special_tokens && m.special[id]) { continue; }
            if (m.added_index[id] >= 0) {
                utf8::append_lossy(out, bytes);
                bytes.clear();
                out += m.added[m.added_index[id]].content;
                continue;
            }
            const std::string & b = m.model->token_bytes(id);
            bytes += b.empty() ? m.model->token(id) : b;
        }
        utf8::append_lossy(out, bytes);
        return out;
    }
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
        if (id < 0 || id >= m.n_vocab) { continue; }
        if (opts.skip_special_tokens && m.special[id]) { continue; }
        if (m.n_local_stages > 0) {
            tokens.push_back(m.local_pieces[id]);
        } else if (std::string p = piece(id); !p.empty()) {
            tokens.push_back(std::move(p));
        }
    }
    if (!m.decoder) {
        std::string out;
        for (size_t i = 0; i < tokens.size(); ++i) { out += (i ? " " : "") + tokens[i]; }
        return out;
    }
    m.decoder->apply_stages(m.n_local_stages, SIZE_MAX, tokens, opts.continuation);
    std::string out;
    if (tokens.size() == 1) {
        out = std::move(tokens[0]);
    } else {
        for (const auto & t : tokens) { out += t; }
    }
    return utf8::valid(out) ? out : utf8::lossy(out);
}

std::string HfTokenizer::piece(int32_t id) const {
    const Impl & m = *impl_;
    if (id < 0 || id >= m.n_vocab) { return ""; }
    if (m.added_index[id] >= 0) { return m.added[m.added_index[id]].content; }
    return m.model->token(id);
}

std::optional<int32_t> HfTokenizer::piece_to_id(std::string_view p) const {
    const Impl & m = *impl_;
    if (auto it = m.added_by_content.find(p); it != m.added_by_content.end()) { return m.added[it->second].id; }
    return m.model->find(p);
}

int32_t HfTokenizer::vocab_size() const { return impl_->n_vocab; }
std::optional<int32_t> HfTokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> HfTokenizer::eos_id() const { return impl_->eos; }

bool HfTokenizer::is_special(int32_t id) const {
    return id >= 0 && id < impl_->n_vocab && impl_->special[id];
}

std::vector<int32_t> HfTokenizer::special_ids() const {
    std::vector<int32_t> out;
    for (int32_t id = 0; id < impl_->n_vocab; ++id) {
        if (impl_->special[id]) { out.push_back(id); }
    }
    return out;
}

}  // namespace fd::tokenizer
