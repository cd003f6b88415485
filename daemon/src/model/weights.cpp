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

void validate_checkpoint(const ModelConfig & cfg, const TensorIndex & idx, const DTypeMap * dtypes) {
    std::set<std::string> known;
    for (const auto & x : expected_tensors(cfg)) {
        known.insert(x.name);
        auto it = idx.tensors.find(x.name);
        if (it == idx.tensors.end()) {
            if (x.optional) { continue; }
            fail(Errc::invalid_checkpoint, "{}: checkpoint is missing tensor '{}' (expected shape [{}])", idx.source.string(),
                 x.name, fmt::join(x.shape, ", "));
        }
        if (it->second.shape != x.shape) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' has shape [{}], expected [{}]", it->second.file.string(),
                 x.name, fmt::join(it->second.shape, ", "), fmt::join(x.shape, ", "));
        }
        if (dtypes) {
            auto d = dtypes->find(x.name);
            if (d != dtypes->end() && d->second != it->second.dtype) {
                fail(Errc::invalid_checkpoint, "{}: tensor '{}' has dtype {}, expected {} (as loaded)", it->second.file.string(),
                     x.name, dtype_name(it->second.dtype), dtype_name(d->second));
            }
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

void fill_weights(const ModelConfig & c, const TensorReader & read, Arena * arena, ModelWeights & w) {
    const int64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), ff = c.intermediate_size;
    const bool fresh = arena != nullptr;
    std::vector<float> tmp;
    using Parts = std::initializer_list<std::pair<std::string, int64_t>>;
    // One inference tensor: tensors `parts` (each rows x cols) stacked along dim 0, packed or not.
    auto slot = [&](const float *& dst, Parts parts, int64_t cols, bool packed) {
        int64_t rows = 0;
        for (const auto & p : parts) { rows += p.second; }
        tmp.resize(static_cast<size_t>(rows * cols));
        int64_t r = 0;
        for (const auto & [name, n] : parts) {
            read(name, tmp.data() + r * cols);
            r += n;
        }
        const int64_t n_floats = packed ? kernels::packed_linear_floats(rows, cols) : rows * cols;
        if (fresh) { dst = arena->alloc_floats(n_floats); }
        auto * out = const_cast<float *>(dst);  // our own arena memory
        if (packed) {
            kernels::pack_linear(out, tmp.data(), rows, cols);
        } else {
            std::memcpy(out, tmp.data(), sizeof(float) * rows * cols);
        }
    };
    if (fresh) { w.layers.assign(static_cast<size_t>(c.n_layers), LayerWeights{}); }
    slot(w.embed, {{"model.embed_tokens.weight", c.vocab_size}}, h, false);
    for (int il = 0; il < c.n_layers; ++il) {
        LayerWeights & L = w.layers[il];
        slot(L.attn_norm, {{layer_name(il, "input_layernorm.weight"), 1}}, h, false);
        slot(L.wqkv, {{layer_name(il, "self_attn.q_proj.weight"), q},
                      {layer_name(il, "self_attn.k_proj.weight"), kv},
                      {layer_name(il, "self_attn.v_proj.weight"), kv}}, h, true);
        if (c.qkv_bias) {
            slot(L.bqkv, {{layer_name(il, "self_attn.q_proj.bias"), q},
                          {layer_name(il, "self_attn.k_proj.bias"), kv},
                          {layer_name(il, "self_attn.v_proj.bias"), kv}}, 1, false);
        }
        slot(L.wo, {{layer_name(il, "self_attn.o_proj.weight"), h}}, q, true);
        slot(L.mlp_norm, {{layer_name(il, "post_attention_layernorm.weight"), 1}}, h, false);
        slot(L.w_gate_up, {{layer_name(il, "mlp.gate_proj.weight"), ff}, {layer_name(il, "mlp.up_proj.weight"), ff}}, h, true);
        slot(L.w_down, {{layer_name(il, "mlp.down_proj.weight"), h}}, ff, true);
    }
    slot(w.final_norm, {{"model.norm.weight", 1}}, h, false);
    slot(w.lm_head, {{c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight", c.vocab_size}}, h, true);
}

ModelWeights load_weights(const ModelConfig & c, const TensorIndex & idx, Arena & arena, const DTypeMap * dtypes) {
    validate_checkpoint(c, idx, dtypes);
    arena.reserve(weights_arena_bytes(c));
    try {
        ModelWeights w;
        fill_weights(c, [&](const std::string & name, float * dst) { read_tensor_f32(idx.tensors.at(name), dst); }, &arena, w);
        return w;
    } catch (...) {
        arena.release();
        throw;
    }
}

}  // namespace fd::model
