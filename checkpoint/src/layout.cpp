// The tensor-parallel sharding layout (fd/checkpoint/layout.h): planning it from a checkpoint and
// checking checkpoints against it. Linked by the daemon (fd_core) and the publishers (fd_publish).
#include "fd/checkpoint/layout.h"

#include "fd/status.h"

#include <fmt/format.h>

#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <set>
namespace fd::model {
namespace {

std::string layer_name(int il, const char * leaf) { return fmt::format("model.layers.{}.{}", il, leaf); }

}  // namespace

std::string expert_of(std::string_view name) {
    int layer = -1, expert = -1, used = 0;
    const size_t at = name.find(".experts.");
    if (name.rfind("model.layers.", 0) != 0 || at == std::string_view::npos) { return {}; }
    const std::string s(name);
    if (std::sscanf(s.c_str(), "model.layers.%d.%n", &layer, &used) != 1) { return {}; }
    if (std::sscanf(s.c_str() + at, ".experts.%d", &expert) != 1) { return fmt::format(" (layer {}, experts)", layer); }
    return fmt::format(" (layer {}, expert {})", layer, expert);
}

namespace {

/// The dtype of training part `hf` of inference tensor `name`: as the checkpoint stores it, or
/// (a checkpoint in inference names) as the whole inference tensor is stored.
using DtypeOf = std::function<fd::DType(const std::string & name, const std::string & hf)>;

/// Rank `tp.rank`'s inference layout of `c` (the sharding table of layout.h).
WeightLayout plan(const ModelConfig & c, const DtypeOf & dtype_of, TpRank tp);

}  // namespace

std::pair<int32_t, int32_t> rank_experts(int32_t n_experts, TpRank tp) {
    if (tp.ep <= 1) { return {0, n_experts}; }
    const int64_t e = tp.rank % tp.ep;
    return {static_cast<int32_t>(n_experts * e / tp.ep), static_cast<int32_t>(n_experts * (e + 1) / tp.ep)};
}

void check_tp_divides(const ModelConfig & c, int32_t tp_size, int32_t ep) {
    if (tp_size < 1) { fail(Errc::invalid_argument, "tensor parallel size must be >= 1, got {}", tp_size); }
    if (ep > 1 && !c.moe.enabled()) {
        fail(Errc::invalid_argument, "--enable-expert-parallel needs a mixture-of-experts model; {} is dense (no num_experts)",
             c.architecture);
    }
    if (ep > 1 && c.moe.n_experts % ep != 0) {
        fail(Errc::invalid_argument, "num_experts = {} is not divisible by the expert parallel size {} (--tensor-parallel-size with "
             "--enable-expert-parallel); pick a size that divides the experts", c.moe.n_experts, ep);
    }
    // Under TP-MoE every expert's intermediate dimension is split like the dense MLP's (vLLM
    // without expert parallelism); a dense width no layer uses is not split. Under expert
    // parallelism the experts (and Qwen2-MoE's shared expert) stay whole.
    const bool mixtral = c.arch == Arch::mixtral, tp_moe = ep <= 1;
    const std::pair<const char *, int64_t> dims[] = {
        {"num_attention_heads", c.n_heads},
        {"num_key_value_heads", c.n_kv_heads},
        {"intermediate_size", c.has_dense_layer() || (mixtral && tp_moe) ? c.intermediate_size : 0},
        {"moe_intermediate_size", mixtral || !tp_moe ? 0 : c.moe.intermediate},
        {"shared_expert_intermediate_size", tp_moe ? c.moe.shared_intermediate : 0},
        {"vocab_size", c.vocab_size}};
    for (const auto & [what, n] : dims) {
        if (n % tp_size != 0) {
            fail(Errc::invalid_argument, "{} = {} is not divisible by the tensor parallel size {}; pick a tp that divides it",
                 what, n, tp_size);
        }
    }
}

std::vector<ExpectedTensor> expected_tensors(const ModelConfig & c) {
    // Every training part of the inference layout, in layout order (dtypes do not matter here).
    std::vector<ExpectedTensor> e;
    for (const InferenceTensor & t : plan(c, [](const std::string &, const std::string &) { return fd::DType::f32; }, {}).tensors) {
        for (const WeightPart & p : t.parts) { e.push_back({p.hf_name, p.hf_shape}); }
    }
    if (c.tie_word_embeddings) { e.push_back({"lm_head.weight", {c.vocab_size, c.hidden_size}, true}); }
    return e;
}

void validate_checkpoint(const ModelConfig & cfg, const TensorIndex & idx) {
    std::set<std::string> known;
    for (const auto & x : expected_tensors(cfg)) {
        known.insert(x.name);
        auto it = idx.tensors.find(x.name);
        if (it == idx.tensors.end()) {
            if (x.optional) { continue; }
            fail(Errc::invalid_checkpoint, "{}: checkpoint is missing tensor '{}'{} (expected shape [{}])", idx.source.string(),
                 x.name, expert_of(x.name), fmt::join(x.shape, ", "));
        }
        if (it->second.shape != x.shape) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}'{} has shape [{}], expected [{}]", it->second.file.string(),
                 x.name, expert_of(x.name), fmt::join(it->second.shape, ", "), fmt::join(x.shape, ", "));
        }
    }
    for (const auto & [name, t] : idx.tensors) {
        if (known.count(name) == 0 && name.find("rotary_emb.inv_freq") == std::string::npos) {
            fail(Errc::invalid_checkpoint, "{}: unknown tensor '{}'{} for {}{}", t.file.string(), name, expert_of(name), cfg.architecture,
                 cfg.moe.enabled() && name.find(".experts.") != std::string::npos
                     ? fmt::format(" ({} experts, 0 to {})", cfg.moe.n_experts, cfg.moe.n_experts - 1) : std::string{});
        }
    }
}

const InferenceTensor * WeightLayout::find(std::string_view name) const {
    for (const auto & t : tensors) {
        if (t.name == name) { return &t; }
    }
    return nullptr;
}

WeightLayout plan_layout(const ModelConfig & c, const TensorIndex & idx, TpRank tp) {
    check_tp_divides(c, tp.size, tp.ep);
    if (tp.ep > 1 && tp.size % tp.ep != 0) {
        fail(Errc::invalid_argument, "expert parallel size {} does not divide the tensor parallel size {}", tp.ep, tp.size);
    }
    if (tp.rank < 0 || tp.rank >= tp.size) {
        fail(Errc::invalid_argument, "rank {} is outside [0, {}) (tp size {})", tp.rank, tp.size, tp.size);
    }
    return plan(c, [&](const std::string & name, const std::string & hf) {
        auto it = idx.tensors.find(hf);
        if (it == idx.tensors.end()) { it = idx.tensors.find(name); }
        if (it == idx.tensors.end()) {
            fail(Errc::invalid_checkpoint, "{}: checkpoint is missing tensor '{}'{}", idx.source.string(), hf,
                 name != hf ? fmt::format(" (or the fused '{}')", name) : std::string{});
        }
        return it->second.dtype;
    }, tp);
}

namespace {

WeightLayout plan(const ModelConfig & c, const DtypeOf & dtype_of, TpRank tp) {
    const int64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), ff = c.intermediate_size, T = tp.size, r = tp.rank;
    WeightLayout L;
    L.tied_lm_head = c.tie_word_embeddings;
    L.tp = tp;
    int64_t offset = 0;
    using Parts = std::initializer_list<std::pair<std::string, int64_t>>;
    // One inference tensor stacked from `parts` (HF name, HF rows), each HF part [rows, cols]
    // (cols 0 = 1-D), cut for rank r as `shard` says.
    auto add = [&](std::string name, Shard shard, Parts parts, int64_t cols) {
        InferenceTensor t;
        t.name  = std::move(name);
        t.shard = shard;
        int64_t rows = 0;
        for (const auto & [hf, n] : parts) {
            WeightPart p{hf, rows, n, dtype_of(t.name, hf), 0, 0, cols ? std::vector<int64_t>{n, cols} : std::vector<int64_t>{n}};
            if (shard == Shard::rows) {  // rows [r*n/T, (r+1)*n/T) of this part
                p.rows = n / T;
                p.src0 = r * p.rows;
            } else if (shard == Shard::cols) {  // columns [r*cols/T, (r+1)*cols/T) of every row
                p.dim  = 1;
                p.src0 = r * (cols / T);
            }
            rows += p.rows;
            t.parts.push_back(std::move(p));
        }
        const int64_t my_cols = shard == Shard::cols ? cols / T : cols;
        const fd::DType d0 = t.parts.front().dtype;
        bool same = true;
        for (const auto & p : t.parts) { same = same && p.dtype == d0; }
        t.dtype = same && d0 != fd::DType::f16 ? d0 : fd::DType::f32;
        t.shape = my_cols ? std::vector<int64_t>{rows, my_cols} : std::vector<int64_t>{rows};
        t.bytes = rows * std::max<int64_t>(my_cols, 1) * dtype_size(t.dtype);
        t.offset = offset;
        offset += (t.bytes + 63) / 64 * 64;
        L.tensors.push_back(std::move(t));
    };
    add("model.embed_tokens.weight", Shard::rows, {{"model.embed_tokens.weight", c.vocab_size}}, h);
    // A decoder block's attention half, through post_attention_layernorm, under `pre`
    // ("model.layers.N." or "model.mtp_layers.N."): the same for dense and MoE blocks.
    auto attention = [&](const std::string & pre) {
        auto n = [&](const char * leaf) { return pre + leaf; };
        add(n("input_layernorm.weight"), Shard::replicated, {{n("input_layernorm.weight"), h}}, 0);
        add(n("self_attn.qkv_proj.weight"), Shard::rows, {{n("self_attn.q_proj.weight"), q}, {n("self_attn.k_proj.weight"), kv},
                                                          {n("self_attn.v_proj.weight"), kv}}, h);
        if (c.qkv_bias) {
            add(n("self_attn.qkv_proj.bias"), Shard::rows, {{n("self_attn.q_proj.bias"), q}, {n("self_attn.k_proj.bias"), kv},
                                                            {n("self_attn.v_proj.bias"), kv}}, 0);
        }
        if (c.qk_norm) {
            add(n("self_attn.q_norm.weight"), Shard::replicated, {{n("self_attn.q_norm.weight"), c.head_dim}}, 0);
            add(n("self_attn.k_norm.weight"), Shard::replicated, {{n("self_attn.k_norm.weight"), c.head_dim}}, 0);
        }
        add(n("self_attn.o_proj.weight"), Shard::cols, {{n("self_attn.o_proj.weight"), h}}, q);
        add(n("post_attention_layernorm.weight"), Shard::replicated, {{n("post_attention_layernorm.weight"), h}}, 0);
    };
    // One dense decoder block under `pre`: attention, then the SwiGLU MLP.
    auto dense_block = [&](const std::string & pre) {
        auto n = [&](const char * leaf) { return pre + leaf; };
        attention(pre);
        add(n("mlp.gate_up_proj.weight"), Shard::rows, {{n("mlp.gate_proj.weight"), ff}, {n("mlp.up_proj.weight"), ff}}, h);
        add(n("mlp.down_proj.weight"), Shard::cols, {{n("mlp.down_proj.weight"), h}}, ff);
    };
    for (int il = 0; il < c.n_layers; ++il) {
        auto n = [&](const char * leaf) { return layer_name(il, leaf); };
        if (!c.is_moe_layer(il)) {
            dense_block(layer_name(il, ""));
            continue;
        }
        attention(layer_name(il, ""));
        // A sparse MoE block: the router whole, then every expert as a dense MLP sliced like
        // the dense one (TP-MoE), then Qwen2-MoE's shared expert and its gate. Expert parallel:
        // only this rank's experts, each whole, and the shared expert whole.
        const MoeConfig & m = c.moe;
        const int64_t     mf = m.intermediate;
        const std::string p  = n(m.prefix.c_str());
        const Shard       er = tp.ep > 1 ? Shard::replicated : Shard::rows, ec = tp.ep > 1 ? Shard::replicated : Shard::cols;
        const auto [e0, e1]  = rank_experts(m.n_experts, tp);
        add(p + ".gate.weight", Shard::replicated, {{p + ".gate.weight", m.n_experts}}, h);
        const std::string fused = c.arch == Arch::mixtral ? "w13" : "gate_up_proj";
        for (int e = e0; e < e1; ++e) {
            const std::string x = fmt::format("{}.experts.{}.", p, e);
            add(x + fused + ".weight", er, {{x + m.gate_name + ".weight", mf}, {x + m.up_name + ".weight", mf}}, h);
        }
        for (int e = e0; e < e1; ++e) {
            const std::string x = fmt::format("{}.experts.{}.", p, e);
            add(x + m.down_name + ".weight", ec, {{x + m.down_name + ".weight", h}}, mf);
        }
        if (m.shared_intermediate > 0) {
            const int64_t sf = m.shared_intermediate;
            add(p + ".shared_expert.gate_up_proj.weight", er,
                {{p + ".shared_expert.gate_proj.weight", sf}, {p + ".shared_expert.up_proj.weight", sf}}, h);
            add(p + ".shared_expert.down_proj.weight", ec, {{p + ".shared_expert.down_proj.weight", h}}, sf);
            add(p + ".shared_expert_gate.weight", Shard::replicated, {{p + ".shared_expert_gate.weight", 1}}, h);
        }
    }
    add("model.norm.weight", Shard::replicated, {{"model.norm.weight", h}}, 0);
    // MiMo's MTP layers (vLLM mimo_mtp.py): the two input norms, input_proj over
    // [hidden_layernorm(h), token_layernorm(embed)] (replicated: small, read whole by every rank),
    // a dense decoder block, final_layernorm. The embedding and the head are the target's.
    for (int m = 0; m < c.n_mtp_layers; ++m) {
        const std::string pre = fmt::format("model.mtp_layers.{}.", m);
        add(pre + "token_layernorm.weight", Shard::replicated, {{pre + "token_layernorm.weight", h}}, 0);
        add(pre + "hidden_layernorm.weight", Shard::replicated, {{pre + "hidden_layernorm.weight", h}}, 0);
        add(pre + "input_proj.weight", Shard::replicated, {{pre + "input_proj.weight", h}}, 2 * h);
        dense_block(pre);
        add(pre + "final_layernorm.weight", Shard::replicated, {{pre + "final_layernorm.weight", h}}, 0);
    }
    if (!c.tie_word_embeddings) { add("lm_head.weight", Shard::rows, {{"lm_head.weight", c.vocab_size}}, h); }
    L.arena_bytes = offset;
    return L;
}

bool is_fused(const InferenceTensor & it) { return it.parts.size() > 1 || it.parts.front().hf_name != it.name; }

}  // namespace

namespace {

/// A per-expert tensor name "model.layers.L.<P>.experts.E.<rest>": its sparse layer
/// ("model.layers.L.<P>") and global expert id E; nullopt for any other name.
std::optional<std::pair<std::string, int>> split_expert(const std::string & name) {
    const size_t at = name.find(".experts.");
    int expert = -1;
    if (at == std::string::npos || std::sscanf(name.c_str() + at, ".experts.%d", &expert) != 1 ||
        name.find('.', at + 9) == std::string::npos) {
        return std::nullopt;
    }
    return std::pair{name.substr(0, at), expert};
}

/// The tensor-parallel size other than `layout`'s whose shard of inference tensor `name` has
/// `shape`, or 0 when none does: a snapshot published for another --tp has that tp's shards.
int32_t tp_of_shard(const ModelConfig & cfg, const WeightLayout & layout, const std::string & name, const std::vector<int64_t> & shape) {
    const InferenceTensor * mine = layout.find(name);
    if (mine == nullptr || mine->shape.size() != shape.size()) { return 0; }
    for (int32_t t = 1; t <= 256; ++t) {
        if (t == layout.tp.size) { continue; }
        const TpRank other{0, t, layout.tp.ep > 1 ? t : 1};
        try {
            check_tp_divides(cfg, other.size, other.ep);
        } catch (const Error &) {
            continue;
        }
        const WeightLayout L = plan(cfg, [](const std::string &, const std::string &) { return fd::DType::f32; }, other);
        const InferenceTensor * theirs = L.find(name);
        if (theirs != nullptr && theirs->shape == shape) { return t; }
    }
    return 0;
}

}  // namespace

bool holds_inference_form(const InferenceTensor & it, const TensorIndex & idx) {
    auto w = idx.tensors.find(it.name);
    return w != idx.tensors.end() && (is_fused(it) || w->second.shape == it.shape);
}


void validate_against_layout(const WeightLayout & layout, const TensorIndex & idx, const ModelConfig * cfg) {
    std::set<std::string> used;
    // Expert parallel: this rank's experts per sparse layer. An expert another rank holds (its
    // layer has experts, its id is below this rank's share x ep: rank_experts' even split) is that
    // rank's to check; one no rank holds (an id past the model's experts, a layer without experts)
    // is unknown here too (a probe: an extra expert passed at EP=2).
    std::map<std::string, std::set<int>> own_by_layer;
    if (layout.tp.ep > 1) {
        for (const InferenceTensor & it : layout.tensors) {
            if (const auto e = split_expert(it.name)) { own_by_layer[e->first].insert(e->second); }
        }
    }
    auto another_ranks = [&](const std::pair<std::string, int> & e) {
        const auto lay = own_by_layer.find(e.first);
        return lay != own_by_layer.end() && !lay->second.count(e.second) && e.second >= 0 &&
               e.second < static_cast<int>(lay->second.size()) * layout.tp.ep;
    };
    auto check = [&](const std::string & name, const std::vector<int64_t> & shape, std::initializer_list<fd::DType> dtypes) {
        const TensorInfo & t = idx.tensors.at(name);
        if (t.shape != shape) {
            // A snapshot published for another tp (a probe: tp=1 files into a tp=2 daemon) gets
            // the ipc strategy's hint (ipc_source.cpp) instead of the bare shapes.
            if (const int32_t other = cfg != nullptr ? tp_of_shard(*cfg, layout, name, t.shape) : 0) {
                fail(Errc::invalid_checkpoint, "{}: tensor '{}' has shape [{}], expected [{}], the shape of a tp={} shard: published "
                     "for tp={}, the rollout runs tp={}: pass --tp {} to fdctl publish --strategy ipc_snapshot (or tp={} to "
                     "fdpublish.to_rollout_names); nothing applied", t.file.string(), name, fmt::join(t.shape, ", "),
                     fmt::join(shape, ", "), other, other, layout.tp.size, layout.tp.size, layout.tp.size);
            }
            fail(Errc::invalid_checkpoint, "{}: tensor '{}'{} has shape [{}], expected [{}]", t.file.string(), name,
                 expert_of(name), fmt::join(t.shape, ", "), fmt::join(shape, ", "));
        }
        if (std::find(dtypes.begin(), dtypes.end(), t.dtype) == dtypes.end()) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' has dtype {}, expected {} (as loaded)", t.file.string(), name,
                 dtype_name(t.dtype), dtype_name(*dtypes.begin()));
        }
        used.insert(name);
    };
    for (const InferenceTensor & it : layout.tensors) {
        const bool fused = is_fused(it);
        if (holds_inference_form(it, idx)) {  // a snapshot / ipc record (an unfused tensor's name is its HF name)
            if (fused) {
                check(it.name, it.shape, {it.dtype});
            } else {
                check(it.name, it.shape, {it.parts.front().dtype, it.dtype});
            }
            continue;
        }
        for (const WeightPart & p : it.parts) {  // the whole training tensors; the rank's slices are read
            if (!idx.tensors.count(p.hf_name)) {
                fail(Errc::invalid_checkpoint, "{}: checkpoint is missing tensor '{}'{}{}", idx.source.string(), p.hf_name,
                     expert_of(p.hf_name), fused ? fmt::format(" (or the fused '{}')", it.name) : std::string{});
            }
            check(p.hf_name, p.hf_shape, {p.dtype});
        }
    }
    for (const auto & [name, t] : idx.tensors) {
        if (used.count(name) || name.find("rotary_emb.inv_freq") != std::string::npos) { continue; }
        if (layout.tp.ep > 1) {  // another rank's expert: that rank checks (and loads) it
            if (const auto e = split_expert(name); e && another_ranks(*e)) { continue; }
        }
        if (layout.tied_lm_head && name == "lm_head.weight") { continue; }
        fail(Errc::invalid_checkpoint, "{}: unknown tensor '{}' (not in the rollout's state dict)", t.file.string(), name);
    }
}

}  // namespace fd::model
