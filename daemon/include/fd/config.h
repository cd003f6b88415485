// fd/config.h — fdrollout's configuration: one aggregate of per-module structs.
//
// main() binds every field to a flag and an FD_* env var (CLI11), then resolve() fills the
// values that depend on the model (max_model_len, KV pool size, served name, weight version),
// and validate() reports every problem at once. Components receive only their sub-struct.
#pragma once

#include "fd/api/server.h"
#include "fd/control/service.h"
#include "fd/engine/engine.h"
#include "fd/kernels/backend.h"
#include "fd/checkpoint/model_config.h"
#include "fd/runtime/world.h"

#include <cstdint>
#include <string>
#include <vector>

namespace fd {

struct ModelOptions {
    std::string model_dir;                   ///< HF checkpoint dir; default = the embedded stories260K
    std::string weight_version = "0";        ///< used when the model dir has no version.yaml `step`
    std::string device         = "cpu";      ///< cpu | cuda (cuda needs a CUDA build and a visible device)
    double      gpu_memory_utilization = 0.0;  ///< cuda: fraction (0, 1] of the device's memory this instance may use (sizes the KV pool); 0 = unset
    bool        batch_invariant = true;      ///< false = --no-batch-invariant (cuda: may use heuristic GEMMs; cpu: same kernels)
    std::string compute_dtype  = "float32";  ///< --compute-dtype: the linears' arithmetic, float32 | bfloat16 (kernels::ComputeType)
    int32_t     tensor_parallel_size = 1;    ///< ranks; 1 until tensor parallelism lands
    int32_t     n_threads      = 0;          ///< kernel threads per rank, 0..kMaxThreads (1024); 0 = every usable CPU
};

struct KvOptions {
    int32_t     block_size_tokens     = 16;  ///< tokens per KV block, power of two in [1, 256]
    std::string kv_cache_bytes        = "0"; ///< bytes ("512MiB", "2G", "1073741824"), a fraction of free memory ("0.3"), or 0 = enough for max_num_seqs full-length sequences (at most 2 GiB)
    bool        enable_prefix_caching = false;
    double      swap_space_gib        = 0.0; ///< host KV swap pool per rank, GiB (--swap-space; FastDeploy's/vLLM's name); 0 = off
    std::string kv_cache_dtype        = "auto"; ///< --kv-cache-dtype (vLLM's flag): auto | float32 (4 bytes per K/V element) | bfloat16 (2, rounded to nearest even)
};

struct WeightsOptions {
    std::string load_strategy = "normal";   ///< normal | ipc_snapshot | ipc | rsync (SPEC §5)
    std::string rsync_config;               ///< rsync: JSON {"source", "staging_dir", "timeout_s", ...}
    std::string update_staging = "persistent";  ///< persistent (2nd weight copy kept resident: updates at memory speed) | transient
    bool        check_finite_weights = true;    ///< refuse NaN/Inf weights at load, wakeup, update (checked during the copy)
};

/// How the ranks run and find each other (torchrun's names for the rendezvous).
struct ParallelOptions {
    std::string distributed_executor_backend;  ///< uni (ranks in this process) | mp (one process per rank); empty = uni at tp=1, mp at tp>1
    int32_t     nnodes      = 1;               ///< hosts the ranks span; node k holds ranks [k*tp/nnodes, (k+1)*tp/nnodes)
    int32_t     node_rank   = 0;               ///< this host's index in [0, nnodes)
    std::string master_addr = "127.0.0.1";     ///< where node 0 hosts the rendezvous store
    int32_t     master_port = 0;               ///< its port; 0 = any free port (single node); nnodes > 1: where nodes join
    std::string node_addr;                     ///< node k > 0: the address its ranks bind (empty: the one that reaches the master)
    std::string dist_token_file;               ///< nnodes > 1: the shared join secret (0600, owned by the user), else FD_DIST_TOKEN
    bool        shutdown_comm_group_if_worker_idle = true;  ///< sleep(weight) closes the comm group, wakeup rebuilds it (resolved: off under expert parallelism unless given)
    bool        shutdown_comm_group_given = false;          ///< the flag (or its env var) was given: expert parallelism keeps it as given
    bool        enable_expert_parallel = false;             ///< --enable-expert-parallel: experts spread over the tp ranks (ep = tp)
    std::string dist_backend = "auto";         ///< the ranks' all-reduce: gloo | shm (one host) | nccl (cuda) | auto (resolve() picks)
    double      rank_heartbeat_s = 3.0;        ///< a rank that sends no heartbeat this long while worked on (stopped, frozen, unreachable) is failed
    double      rank_stuck_s = 30.0;           ///< a rank that beats but whose main loop makes no progress this long is failed as stuck
};

struct Config {
    api::ServerConfig    server;
    control::ControlConfig control;
    engine::EngineConfig engine;
    ModelOptions         model;
    KvOptions            kv;
    WeightsOptions       weights;
    ParallelOptions      parallel;
    std::string          log_level        = "info";
    std::string          log_format       = "text";  ///< text | json (fd/log.h)
    double               log_stats_interval_s = 10.0;///< throughput line period, seconds; 0 = off
    double               shutdown_grace_s = 30.0;  ///< SIGTERM: seconds in-flight requests may take to finish
    std::string          speculative_config;       ///< --speculative-config JSON (resolve() parses it into engine.speculative)
};

/// The resolved numbers main() builds the engine from.
struct Resolved {
    model::ModelConfig model;
    kernels::DeviceKind device = kernels::DeviceKind::cpu;  ///< --device, parsed
    kernels::ComputeType compute = kernels::ComputeType::f32;  ///< --compute-dtype, parsed
    int64_t            n_kv_blocks = 0;
    /// --kv-cache-bytes resolved (a fraction, 0 = auto and --gpu-memory-utilization turned into
    /// bytes), all ranks together: the target's KV pool and, with MTP drafts, the MTP cache.
    int64_t            kv_budget_bytes = 0;
    /// --speculative-config method "mtp": MTP cache blocks past the KV pool's, for draft chains
    /// that run past a sequence's blocks (max_num_seqs * (ceil(k / block_size) + 1)); 0 without.
    /// Their bytes come out of kv_budget_bytes too.
    int64_t            n_mtp_scratch_blocks = 0;
    int64_t            n_swap_blocks = 0;   ///< host swap pool blocks per rank (0 = no swap tier)
    int64_t            swap_pool_bytes = 0; ///< the host swap pools of every rank together, bytes
    kernels::WType     kv_dtype = kernels::WType::f32;  ///< --kv-cache-dtype, parsed (auto = f32)
    runtime::ExecutorKind executor_backend = runtime::ExecutorKind::uni;  ///< --distributed-executor-backend, resolved
    /// --dist-backend, resolved (runtime::resolve_dist_backend): auto is nccl on cuda when tp > 1,
    /// --nnodes is 1 and every rank has a device of its own, else shm (one node) or gloo; on cpu
    /// shm or gloo. Never DistBackend::automatic.
    runtime::DistBackend  dist_backend = runtime::DistBackend::shm;
    /// The ranks: tp, nnodes and (cuda) the devices this node sees, CUDA_VISIBLE_DEVICES respected
    /// (cpu: 1); rank r runs on device world.device_of(r).
    runtime::World        world;
    /// cuda: world.n_devices and world.ranks_per_device() (the most ranks of this node on one
    /// device); cpu: 1, 1.
    int32_t            n_devices = 1;
    int32_t            ranks_per_device = 1;
};

/// Fill model-dependent defaults in `cfg` (max_model_len, served name, weight version, threads)
/// and size the KV pool. Errors  fd::Error{invalid_argument} listing every bad setting, among
/// them a non-loopback --host without --api-key (unless --allow-unauthenticated).
Resolved resolve(Config & cfg);

/// --gpu-memory-utilization's KV budget on one device (vLLM's rule): utilization x total, less
/// what is in use already (total - free), less this rank's `weight_bytes` and `other_bytes`
/// (activations, workspaces); 0 when nothing is left. Bytes.
int64_t gpu_kv_budget_bytes(const kernels::MemInfo & mem, double utilization, int64_t weight_bytes, int64_t other_bytes);

/// True when `host` (a --host value) only accepts local connections: 127.0.0.0/8, ::1,
/// ::ffff:127.x.y.z or "localhost". 0.0.0.0, ::, other addresses and hostnames are not.
bool is_loopback_host(const std::string & host);

/// --kv-cache-dtype: "auto" and "float32" -> f32 (4 bytes per K/V element), "bfloat16" -> bf16
/// (2 bytes); anything else -> nullopt (resolve() refuses it naming the choices).
std::optional<kernels::WType> parse_kv_cache_dtype(const std::string & s);
/// The KV dtype's name as /health, /v1/models and the log show it: "float32" | "bfloat16".
std::string kv_cache_dtype_name(kernels::WType t);

/// Parse a byte size with optional K/M/G/T suffix ("512MiB", "2G", "1.5GiB": a decimal part only
/// with a K/M/G/T unit) → bytes; nullopt if not a size.
std::optional<int64_t> parse_bytes(const std::string & s);

/// --kv-cache-bytes' fraction: a bare decimal number with a '.' ("0.3", ".5", "1.0") → its value
/// (the range is the caller's); nullopt for anything else.
std::optional<double> parse_fraction(const std::string & s);

/// --threads' upper bound (per rank; 0 = every usable CPU).
inline constexpr int32_t kMaxThreads = 1024;

}  // namespace fd
