// Stacked expert tensors (fd/checkpoint/layout.h, split_stacked_experts): the layout newer
// exports write, `model.layers.L.<P>.experts.gate_up_proj [E, 2I, H]` and
// `...experts.down_proj [E, H, I]` (transformers v5's Qwen3MoeExperts: gate_up_proj[e] · x
// chunked into gate | up), turned into per-expert views of the same file bytes so that the one
// layout (plan_layout) and the one reader (fill_weights) serve both forms; and transformers v5's
// Mixtral names (the block called `mlp`) mapped onto the v4 ones (alias_v5_mixtral_names).
#include "fd/checkpoint/layout.h"
#include "fd/checkpoint/stored_names.h"

#include "fd/status.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <regex>
#include <vector>

namespace fd::model {

void split_stacked_experts(TensorIndex & idx) {
    static const std::regex kStacked(R"(^(model\.layers\.(\d+)\.([A-Za-z_]+))\.experts\.(gate_up_proj|down_proj)(\.weight)?$)");
    std::vector<std::string> stacked;
    for (const auto & [name, t] : idx.tensors) {
        if (name.find(".experts.") != std::string::npos && std::regex_match(name, kStacked)) { stacked.push_back(name); }
    }
    for (const std::string & name : stacked) {
        const TensorInfo whole = idx.tensors.at(name);
        std::smatch mt;
        std::regex_match(name, mt, kStacked);
        const std::string prefix = mt[1], layer = mt[2], block = mt[3], kind = mt[4];
        const bool mixtral = block == "block_sparse_moe";
        if (whole.shape.size() != 3) {
            fail(Errc::invalid_checkpoint, "{}: stacked expert tensor '{}' (layer {}) has shape [{}]; expected 3-D [experts, {}]",
                 whole.file.string(), name, layer, fmt::join(whole.shape, ", "), kind == "gate_up_proj" ? "2 * moe_intermediate, hidden"
                                                                                                       : "hidden, moe_intermediate");
        }
        const int64_t E = whole.shape[0], rows = whole.shape[1], cols = whole.shape[2], es = dtype_size(whole.dtype);
        // gate_up: two [I, H] views per expert (gate then up); down: one [H, I] view.
        std::vector<std::pair<std::string, int64_t>> pieces;  // leaf name, rows per view
        if (kind == "gate_up_proj") {
            if (rows % 2 != 0) {
                fail(Errc::invalid_checkpoint, "{}: stacked expert tensor '{}' (layer {}) has {} rows per expert; gate | up needs "
                     "an even number", whole.file.string(), name, layer, rows);
            }
            pieces = {{mixtral ? "w1" : "gate_proj", rows / 2}, {mixtral ? "w3" : "up_proj", rows / 2}};
        } else {
            pieces = {{mixtral ? "w2" : "down_proj", rows}};
        }
        idx.tensors.erase(name);
        for (int64_t e = 0; e < E; ++e) {
            int64_t row0 = 0;
            for (const auto & [leaf, n] : pieces) {
                TensorInfo v   = whole;
                v.name         = fmt::format("{}.experts.{}.{}.weight", prefix, e, leaf);
                v.shape        = {n, cols};
                v.offset_bytes = whole.offset_bytes + (e * rows + row0) * cols * es;
                v.size_bytes   = n * cols * es;
                row0 += n;
                if (idx.tensors.count(v.name)) {
                    fail(Errc::invalid_checkpoint, "{}: layer {} expert {} is given twice: as '{}' and inside the stacked '{}'",
                         whole.file.string(), layer, e, v.name, name);
                }
                idx.tensors.emplace(v.name, std::move(v));
            }
        }
    }
}

bool alias_v5_mixtral_names(const ModelConfig & cfg, TensorIndex & idx) {
    if (cfg.arch != Arch::mixtral) { return false; }
    static const std::regex kV5(R"(^model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight)$)");
    std::vector<std::string> v5;
    for (const auto & [name, t] : idx.tensors) {
        if (name.find(".mlp.") != std::string::npos && std::regex_match(name, kV5)) { v5.push_back(name); }
    }
    for (const std::string & name : v5) {
        std::smatch mt;
        std::regex_match(name, mt, kV5);
        const std::string layer = mt[1], leaf = mt[4];
        const std::string v4 = mt[3].matched
            ? fmt::format("model.layers.{}.block_sparse_moe.experts.{}.{}.weight", layer, std::string(mt[3]),
                          leaf == "gate_proj" ? "w1" : leaf == "up_proj" ? "w3" : "w2")
            : fmt::format("model.layers.{}.block_sparse_moe.gate.weight", layer);
        if (idx.tensors.count(v4)) {
            fail(Errc::invalid_checkpoint, "{}: layer {}{} is given twice: as '{}' and as transformers v5's '{}'",
                 idx.tensors.at(name).file.string(), layer, mt[3].matched ? " expert " + std::string(mt[3]) : std::string(" router"),
                 v4, name);
        }
        TensorInfo t = std::move(idx.tensors.at(name));
        idx.tensors.erase(name);
        t.name = v4;
        idx.tensors.emplace(v4, std::move(t));
    }
    return !v5.empty();
}

std::map<std::string, std::vector<std::string>> stacked_expert_views(const TensorIndex & stored) {
    std::map<std::string, std::vector<std::string>> out;
    for (const auto & [name, t] : stored.tensors) {
        if (name.find(".experts.") == std::string::npos) { continue; }
        TensorIndex one;  // the tensor alone, split as read_tensor_index splits it
        one.source = stored.source;
        one.tensors.emplace(name, t);
        split_stacked_experts(one);
        if (one.tensors.count(name)) { continue; }  // not a stacked expert tensor
        std::vector<const TensorInfo *> views;
        for (const auto & [vn, v] : one.tensors) { views.push_back(&v); }
        std::sort(views.begin(), views.end(), [](const TensorInfo * a, const TensorInfo * b) { return a->offset_bytes < b->offset_bytes; });
        auto & names = out[name];
        for (const TensorInfo * v : views) { names.push_back(v->name); }
    }
    return out;
}

const TensorIndex & with_v4_names(const ModelConfig & cfg, const TensorIndex & idx, TensorIndex & storage) {
    if (cfg.arch != Arch::mixtral) { return idx; }
    storage = idx;
    return alias_v5_mixtral_names(cfg, storage) ? storage : idx;
}

}  // namespace fd::model
