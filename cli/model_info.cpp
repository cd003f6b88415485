// fdctl model-info --model DIR [--tp N] [--ep] [--json]: RolloutModel's state dict per rank and
// the training (HF) names each inference tensor maps to (docs/weight_sources.md). --ep
// (--enable-expert-parallel): the daemon's expert-parallel layout, each rank only its experts.
//
// --json prints
//   {"model": DIR, "architecture": ..., "tp": N, "ep": N or 1,
//    "ranks": [{"rank": r, "experts": [begin, end) of each sparse layer (MoE models only),
//               "state_dict": [{"name", "shape", "dtype"}],
//               "name_mappings_to_training": {this rank's inference name: [HF names]},
//               "training_slices": [{"name", "slices": [{"hf_name", "dim", "begin", "end", "dst_row0"}]}]}],
//    "name_mappings_to_training": {inference name: [HF names, stacking order]}}
//    "kv_cache": {"dtype": "float32" | "bfloat16", "bytes_per_token": per rank, "bytes_per_token_all_ranks"}
// (--kv-cache-dtype, the daemon's flag: 2 (K, V) x layers x kv_dim / tp x 4 or 2 bytes).
//    "numerics": {"compute_dtype", "linear_weights_dtype", "linears", "other_ops"}}
// The human form prints one table per rank, the mapping and the numerics (--compute-dtype: what
// the daemon started with that flag computes with these weights; docs/sampling.md).
#include "offline.h"

#include "fd/publish/rollout_model.h"
#include "fd/status.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <iostream>

namespace fdctl {
namespace {

using nlohmann::json;

std::string shape_str(const std::vector<int64_t> & s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

std::string slice_str(const fd::publish::TrainingSlice & s) {
    return s.dim == 0 ? fmt::format("{}[{}:{}]", s.hf_name, s.begin, s.end) : fmt::format("{}[:, {}:{}]", s.hf_name, s.begin, s.end);
}

/// The numerics block: what --compute-dtype `cd` does with weights stored as `wdtype`.
json numerics_json(const std::string & cd, const std::string & wdtype) {
    const bool bf = cd == "bfloat16";
    std::string linears = bf ? "x rounded to bf16 (round to nearest even), bf16 weights" : "x in f32, weights widened to f32";
    if (bf && wdtype == "F32") { linears += " (these F32 weights rounded to bf16 as they are read)"; }
    linears += bf ? ", exact products summed in f32 (vdpbf16ps); outputs f32" : ", products and sums in f32";
    return {{"compute_dtype", cd}, {"linear_weights_dtype", wdtype}, {"linears", linears},
            {"other_ops", "f32: embeddings widened, RMSNorm, RoPE, attention, softmax, residual stream"}};
}

}  // namespace

int run_model_info(const ModelInfoOptions & o) {
    const fd::publish::RolloutModel m(o.model_dir, o.tp, o.ep);
    const bool moe = m.config().moe.enabled();
    const auto mapping = m.name_mappings_to_training();
    const bool    bf16_kv  = o.kv_cache_dtype == "bfloat16";
    const int64_t kv_token = 2LL * m.config().n_layers * m.config().kv_dim() * (bf16_kv ? 2 : 4);  // all ranks
    const json    kv_cache = {{"dtype", bf16_kv ? "bfloat16" : "float32"}, {"bytes_per_token", kv_token / o.tp},
                              {"bytes_per_token_all_ranks", kv_token}};
    // The linears' stored dtype: that of the 2-D weights of rank 0 other than the embedding.
    std::string wdtype = "F32";
    for (const auto & src : m.training_slices(0)) {
        if (src.tensor.shape.size() == 2 && src.tensor.name.find("embed_tokens") == std::string::npos) {
            wdtype = fd::model::dtype_name(src.tensor.dtype);
            break;
        }
    }
    const json numerics = numerics_json(o.compute_dtype, wdtype);
    if (o.json) {
        json j = {{"model", o.model_dir}, {"architecture", m.config().architecture}, {"tp", o.tp}, {"ep", m.ep_size()},
                  {"kv_cache", kv_cache}, {"ranks", json::array()}};
        for (int r = 0; r < o.tp; ++r) {
            json sd = json::array(), sl = json::array();
            for (const auto & src : m.training_slices(r)) {
                sd.push_back({{"name", src.tensor.name}, {"shape", src.tensor.shape}, {"dtype", fd::model::dtype_name(src.tensor.dtype)}});
                json slices = json::array();
                for (const auto & s : src.slices) {
                    slices.push_back({{"hf_name", s.hf_name}, {"dim", s.dim}, {"begin", s.begin}, {"end", s.end}, {"dst_row0", s.dst_row0}});
                }
                sl.push_back({{"name", src.tensor.name}, {"slices", std::move(slices)}});
            }
            json rank = {{"rank", r}, {"state_dict", std::move(sd)}, {"training_slices", std::move(sl)},
                         {"name_mappings_to_training", m.name_mappings_to_training(r)}};
            if (moe) {
                const auto [e0, e1] = m.rank_experts(r);
                rank["experts"] = {e0, e1};
            }
            j["ranks"].push_back(std::move(rank));
        }
        j["name_mappings_to_training"] = mapping;
        j["numerics"] = numerics;
        std::cout << j.dump() << "\n";
        return 0;
    }
    std::cout << fmt::format("model {} ({}), tensor parallel size {}{}\n", o.model_dir, m.config().architecture, o.tp,
                             m.ep_size() > 1 ? fmt::format(", expert parallel size {}", m.ep_size()) : std::string{});
    std::cout << fmt::format("KV cache: {}, {} bytes per token per rank ({} all ranks)\n", kv_cache["dtype"].get<std::string>(),
                             kv_token / o.tp, kv_token);
    for (int r = 0; r < o.tp; ++r) {
        const auto srcs = m.training_slices(r);
        int64_t bytes = 0;
        for (const auto & s : srcs) { bytes += s.tensor.nbytes(); }
        std::string experts;
        if (moe) {
            const auto [e0, e1] = m.rank_experts(r);
            experts = fmt::format(", experts {}..{} of {} per sparse layer{}", e0, e1 - 1, m.config().moe.n_experts,
                                  m.ep_size() > 1 ? " (whole)" : " (each sliced)");
        }
        std::cout << fmt::format("\nrank {}: {} tensors, {:.1f} MiB{}\n", r, srcs.size(), bytes / 1048576.0, experts);
        std::cout << fmt::format("  {:<46} {:<14} {:<5} {}\n", "name", "shape", "dtype", "training slices");
        for (const auto & s : srcs) {
            std::vector<std::string> parts;
            for (const auto & x : s.slices) { parts.push_back(slice_str(x)); }
            std::cout << fmt::format("  {:<46} {:<14} {:<5} {}\n", s.tensor.name, shape_str(s.tensor.shape),
                                     fd::model::dtype_name(s.tensor.dtype), fmt::join(parts, " | "));
        }
    }
    std::cout << "\nname_mappings_to_training:\n";
    for (const auto & [name, hf] : mapping) { std::cout << fmt::format("  {} <- {}\n", name, fmt::join(hf, ", ")); }
    std::cout << fmt::format("\nnumerics (--compute-dtype {}): linears: {}; {}\n", o.compute_dtype,
                             numerics["linears"].get<std::string>(), numerics["other_ops"].get<std::string>());
    return 0;
}

}  // namespace fdctl
