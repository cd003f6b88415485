// Stacked expert tensors (fd/checkpoint/layout.h, split_stacked_experts): the layout newer
// exports write, `model.layers.L.<P>.experts.gate_up_proj [E, 2I, H]` and
// `...experts.down_proj [E, H, I]` (transformers v5's Qwen3MoeExperts: gate_up_proj[e] · x
// chunked into gate | up), turned into per-expert views of the same file bytes so that the one
// layout (plan_layout) and the one reader (fill_weights) serve both forms.
#include "fd/checkpoint/layout.h"

#include "fd/status.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

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

}  // namespace fd::model
