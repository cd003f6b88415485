// fd/runtime/world.h — where the ranks are: all rank arithmetic in one value type, resolved once
// from the configuration (TensorRT-LLM's WorldConfig). Every place that asks which node a rank
// runs on, which device it uses, which of its node's ranks it is, or which slice of the heads,
// the MLP, the vocabulary or the experts it holds, asks a World; the `auto` --dist-backend rule
// lives here too (resolve_dist_backend), read by the configuration and the mp executor alike.
//
// Expert parallelism (--enable-expert-parallel, vLLM's flag): ep = tp; rank r holds experts
// [r*E/ep, (r+1)*E/ep) whole (expert_ff is the whole width), attention stays tp-sliced.
//
// Placement (vLLM's / torchrun's): tp ranks over nnodes hosts, tp/nnodes per host, node k
// running ranks [k*tp/nnodes, (k+1)*tp/nnodes); on cuda a rank uses device
// (its index on its node) mod the devices its host sees.
//
// Slices (Megatron / vLLM; the same rule as fd/checkpoint/layout.h's plan_layout, which the
// unit tests check them against): rank r of tp holds the half-open ranges
//   heads    [r*H/tp, (r+1)*H/tp) of the H attention heads, kv_heads likewise of the KV heads,
//   ff       [r*F/tp, (r+1)*F/tp) of the MLP's intermediate size F,
//   vocab    [r*V/tp, (r+1)*V/tp) of the vocabulary V,
//   experts  [e*E/ep, (e+1)*E/ep) of E experts for expert rank e = r mod ep.
#pragma once

#include "fd/checkpoint/layout.h"
#include "fd/checkpoint/model_config.h"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fd::runtime {

/// The ranks' collectives (--dist-backend). `automatic` is only ever a request: resolved, it is
/// one of the other three (resolve_dist_backend).
enum class DistBackend : uint8_t { automatic, gloo, shm, nccl };

/// How the ranks run (--distributed-executor-backend): uni = one rank in the daemon's process
/// (LocalExecutor), mp = one process per rank (MpExecutor).
enum class ExecutorKind : uint8_t { uni, mp };

/// "auto" | "gloo" | "shm" | "nccl";  "uni" | "mp".
const char * dist_backend_name(DistBackend b);
const char * executor_kind_name(ExecutorKind k);
/// The inverse of the names above; nullopt for any other word.
std::optional<DistBackend>  parse_dist_backend(std::string_view name);
std::optional<ExecutorKind> parse_executor_kind(std::string_view name);

/// A half-open range [begin, end) of some dimension that one rank holds.
struct Slice {
    int64_t begin = 0;
    int64_t end   = 0;
    int64_t size() const { return end - begin; }
    bool operator==(const Slice &) const = default;
};

struct World {
    int32_t tp        = 1;  ///< tensor-parallel ranks in the group (--tensor-parallel-size)
    int32_t ep        = 1;  ///< expert-parallel size (1: every rank holds every expert)
    int32_t nnodes    = 1;  ///< hosts (--nnodes); divides tp
    int32_t n_devices = 1;  ///< cuda: devices each host sees (>= 1); cpu: 1

    /// Check and build. Appends one message per problem to `problems` (tp >= 1, nnodes >= 1
    /// dividing tp, ep >= 1 dividing tp) and returns the World anyway (with tp, nnodes, ep
    /// clamped to >= 1) so callers can collect every problem before failing.
    static World make(int32_t tp, int32_t nnodes, int32_t n_devices, std::vector<std::string> & problems, int32_t ep = 1);
    /// As make(), but throws fd::Error{invalid_argument} listing the problems.
    static World make(int32_t tp, int32_t nnodes, int32_t n_devices, int32_t ep = 1);

    int32_t size() const { return tp; }                            ///< ranks in all
    int32_t per_node() const { return tp / nnodes; }               ///< ranks each host runs
    int32_t node_of(int32_t rank) const { return rank / per_node(); }
    int32_t local_index(int32_t rank) const { return rank % per_node(); }  ///< its index among its node's ranks
    int32_t first_rank(int32_t node) const { return node * per_node(); }   ///< node's ranks: [first_rank, first_rank + per_node)
    bool    is_remote(int32_t rank) const { return node_of(rank) != 0; }   ///< not on node 0 (the daemon's host)
    bool    multi_node() const { return nnodes > 1; }
    /// The device (of its host's n_devices) rank `rank` runs on: local_index mod n_devices.
    int32_t device_of(int32_t rank) const { return local_index(rank) % n_devices; }
    /// The most ranks of one host on one device (ceil(per_node / n_devices)); 1 = each its own.
    int32_t ranks_per_device() const { return (per_node() + n_devices - 1) / n_devices; }
    int32_t expert_rank(int32_t rank) const { return rank % ep; }

    Slice heads(const model::ModelConfig & cfg, int32_t rank) const { return split(cfg.n_heads, tp, rank); }
    Slice kv_heads(const model::ModelConfig & cfg, int32_t rank) const { return split(cfg.n_kv_heads, tp, rank); }
    /// The dense MLP's intermediate slice (intermediate_size; not an expert's width: see expert_ff).
    Slice ff(const model::ModelConfig & cfg, int32_t rank) const { return split(cfg.intermediate_size, tp, rank); }
    /// The slice of ONE expert's intermediate dimension rank `rank` holds (moe_intermediate_size;
    /// Mixtral: intermediate_size): split over tp under TP-MoE, whole under expert parallelism.
    Slice expert_ff(const model::ModelConfig & cfg, int32_t rank) const {
        return ep > 1 ? Slice{0, cfg.moe.intermediate} : split(cfg.moe.intermediate, tp, rank);
    }
    /// The experts' layout for plan_layout (fd/checkpoint/layout.h): {rank, tp, ep}.
    model::TpRank tp_rank(int32_t rank) const { return {rank, tp, ep}; }
    Slice vocab(const model::ModelConfig & cfg, int32_t rank) const { return split(cfg.vocab_size, tp, rank); }
    /// The experts (of n_experts) expert rank expert_rank(rank) holds.
    Slice experts(int64_t n_experts, int32_t rank) const { return split(n_experts, ep, expert_rank(rank)); }

    /// Part `index` of `n` equal parts of `total` (total divisible by n, as check_tp_divides
    /// guarantees for the model's dimensions).
    static Slice split(int64_t total, int32_t n, int32_t index) { return {total * index / n, total * (index + 1) / n}; }
};

/// --dist-backend `requested` for `w` on `cuda` (else cpu), resolved. automatic: nccl on cuda
/// when tp > 1, one node and every rank has a device of its own (ranks_per_device 1; tp = 1
/// never reduces, so it needs no NCCL communicator); else shm on one node, gloo across nodes.
/// Appends a message to `problems` for a request the world cannot run: shm or nccl with
/// nnodes > 1, nccl on cpu, nccl with two ranks on one device.
DistBackend resolve_dist_backend(DistBackend requested, const World & w, bool cuda, std::vector<std::string> & problems);

}  // namespace fd::runtime
