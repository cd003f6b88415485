// fd/checkpoint/stored_names.h — a checkpoint's tensors under the names it stores them by.
// read_tensor_index hands every reader per-expert views of the stacked expert tensors newer MoE
// exports write (split_stacked_experts, fd/checkpoint/layout.h); a weight stream instead accepts
// the checkpoint's own names, stacked tensors included (docs/weight_streams.md), and needs both
// views: these two functions give them. Library fd_checkpoint.
#pragma once

#include "fd/checkpoint/safetensors.h"

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace fd::model {

/// The tensor index of the checkpoint in `dir` as stored: read_tensor_index without
/// split_stacked_experts (a stacked `model.layers.L.<P>.experts.gate_up_proj` [E, 2*I, H] /
/// `...experts.down_proj` [E, H, I] stays one 3-D tensor under its own name; no v5 renaming).
/// Errors  as read_tensor_index.
TensorIndex read_tensor_index_as_stored(const std::filesystem::path & dir);

/// For each stacked expert tensor of `stored` (a read_tensor_index_as_stored index): the names
/// split_stacked_experts gives its per-expert views, in file order (gate_up_proj: expert 0's
/// gate then up, expert 1's gate then up, ...; down_proj: expert 0's down, ...). Tensors that are
/// not stacked experts have no entry (an index without any: empty map).
/// Errors  as split_stacked_experts (a stacked tensor that is not 3-D, or 2*I odd).
std::map<std::string, std::vector<std::string>> stacked_expert_views(const TensorIndex & stored);

}  // namespace fd::model
