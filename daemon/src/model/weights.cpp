#include "fd/model/weights.h"

#include "fd/kernels/ops.h"
#include "fd/status.h"

#include <fmt/ranges.h>

#include <cstring>
#include <set>

namespace fd::model {
namespace {

std::string layer_name(int il, const char * leaf) { return fmt::format("model.layers.{}.{}", il, leaf); }

}  // namespace

std::vector<ExpectedTensor> expected_tensors(const ModelConfig & c) {
    const int64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), ff = c.intermediate_size;
    std::vector<ExpectedTensor> e;
    e.push_back({"model.embed_tokens.weight", {c.vocab_size, h}});
    for (int il = 0; il < c.n_layers; ++il) {
        e.push_back({layer_name(il, "input_layernorm.weight"), {h}});
        e.push_back({layer_name(il, "self_attn.q_proj.weight"), {q, h}});
        e.push_back({layer_name(il, "self_attn.k_proj.weight"), {kv, h}});
        e.push_back({layer_name(il, "self_attn.v_proj.weight"), {kv, h}});
        if (c.qkv_bias) {
            e.push_back({layer_name(il, "self_attn.q_proj.bias"), {q}});
            e.push_back({layer_name(il, "self_attn.k_proj.bias"), {kv}});
            e.push_back({layer_name(il, "self_attn.v_proj.bias"), {kv}});
        }
        e.push_back({layer_name(il, "self_attn.o_proj.weight"), {h, q}});
        e.push_back({layer_name(il, "post_attention_layernorm.weight"), {h}});
        e.push_back({layer_name(il, "mlp.gate_proj.weight"), {ff, h}});
        e.push_back({layer_name(il, "mlp.up_proj.weight"), {ff, h}});
        e.push_back({layer_name(il, "mlp.down_proj.weight"), {h, ff}});
    }
    e.push_back({"model.norm.weight", {h}});
    e.push_back({"lm_head.weight", {c.vocab_size, h}, c.tie_word_embeddings});
    return e;
}

void validate_checkpoint(const ModelConfig & cfg, const TensorIndex & idx) {
    std::set<std::string> known;
    for (const auto & x : expected_tensors(cfg)) {
        known.insert(x.name);
        auto it = idx.tensors.find(x.name);
        if (it == idx.tensors.end()) {
            if (x.optional) { continue; }
            fail(Errc::invalid_checkpoint, "checkpoint is missing tensor '{}' (expected shape [{}])", x.name,
                 fmt::join(x.shape, ", "));
        }
        if (it->second.shape != x.shape) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' has shape [{}], expected [{}]", it->second.file.string(),
                 x.name, fmt::join(it->second.shape, ", "), fmt::join(x.shape, ", "));
        }
    }
    for (const auto & [name, t] : idx.tensors) {
        if (known.count(name) == 0 && name.find("rotary_emb.inv_freq") == std::string::npos) {
            fail(Errc::invalid_checkpoint, "{}: unknown tensor '{}' for {}", t.file.string(), name, cfg.architecture);
        }
    }
}

int64_t weights_arena_bytes(const ModelConfig & c) {
    const int64_t h = c.hidden_size, qkv = c.q_dim() + 2 * c.kv_dim(), ff = c.intermediate_size;
    auto packed = [](int64_t n_out, int64_t n_in) { return Arena::footprint_floats(kernels::packed_linear_floats(n_out, n_in)); };
    int64_t per_layer = 2 * Arena::footprint_floats(h) + packed(qkv, h) + packed(h, c.q_dim()) +
                        packed(2 * ff, h) + packed(h, ff) + (c.qkv_bias ? Arena::footprint_floats(qkv) : 0);
    return Arena::footprint_floats(int64_t(c.vocab_size) * h) + c.n_layers * per_layer +
           Arena::footprint_floats(h) + packed(c.vocab_size, h);
}

ModelWeights load_weights(const ModelConfig & c, const TensorIndex & idx, Arena & arena) {
    validate_checkpoint(c, idx);
    const int64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), ff = c.intermediate_size;
    std::vector<float> tmp;
    // Read tensors `names` (stacked along dim 0, each `rows` x `cols`) into tmp.
    auto read_stacked = [&](std::initializer_list<std::pair<std::string, int64_t>> parts, int64_t cols) {
        int64_t rows = 0;
        for (const auto & p : parts) { rows += p.second; }
        tmp.resize(static_cast<size_t>(rows * cols));
        int64_t r = 0;
        for (const auto & [name, n] : parts) {
            read_tensor_f32(idx.tensors.at(name), tmp.data() + r * cols);
            r += n;
        }
        return rows;
    };
    auto packed = [&](std::initializer_list<std::pair<std::string, int64_t>> parts, int64_t cols) {
        const int64_t rows = read_stacked(parts, cols);
        float * dst = arena.alloc_floats(kernels::packed_linear_floats(rows, cols));
        kernels::pack_linear(dst, tmp.data(), rows, cols);
        return static_cast<const float *>(dst);
    };
    auto plain = [&](std::initializer_list<std::pair<std::string, int64_t>> parts, int64_t cols) {
        const int64_t rows = read_stacked(parts, cols);
        float * dst = arena.alloc_floats(rows * cols);
        std::memcpy(dst, tmp.data(), sizeof(float) * rows * cols);
        return static_cast<const float *>(dst);
    };
    arena.reserve(weights_arena_bytes(c));
    try {
        ModelWeights w;
        w.embed = plain({{"model.embed_tokens.weight", c.vocab_size}}, h);
        for (int il = 0; il < c.n_layers; ++il) {
            LayerWeights L;
            L.attn_norm = plain({{layer_name(il, "input_layernorm.weight"), 1}}, h);
            L.wqkv = packed({{layer_name(il, "self_attn.q_proj.weight"), q},
                             {layer_name(il, "self_attn.k_proj.weight"), kv},
                             {layer_name(il, "self_attn.v_proj.weight"), kv}}, h);
            if (c.qkv_bias) {
                L.bqkv = plain({{layer_name(il, "self_attn.q_proj.bias"), q},
                                {layer_name(il, "self_attn.k_proj.bias"), kv},
                                {layer_name(il, "self_attn.v_proj.bias"), kv}}, 1);
            }
            L.wo        = packed({{layer_name(il, "self_attn.o_proj.weight"), h}}, q);
            L.mlp_norm  = plain({{layer_name(il, "post_attention_layernorm.weight"), 1}}, h);
            L.w_gate_up = packed({{layer_name(il, "mlp.gate_proj.weight"), ff}, {layer_name(il, "mlp.up_proj.weight"), ff}}, h);
            L.w_down    = packed({{layer_name(il, "mlp.down_proj.weight"), h}}, ff);
            w.layers.push_back(L);
        }
        w.final_norm = plain({{"model.norm.weight", 1}}, h);
        const bool stored_head = !c.tie_word_embeddings;
        w.lm_head = packed({{stored_head ? "lm_head.weight" : "model.embed_tokens.weight", c.vocab_size}}, h);
        return w;
    } catch (...) {
        arena.release();
        throw;
    }
}

}  // namespace fd::model
