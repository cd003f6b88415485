#include "fd/config.h"

#include "fd/arena.h"
#include "fd/cpus.h"
#include "fd/deadline.h"
#include "fd/model/worker.h"
#include "fd/shm/names.h"
#include "fd/status.h"
#include "fd/spec/spec_config.h"
#include "fd/weights/weight_source.h"

#include <nlohmann/json.hpp>

#include <fmt/ranges.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

namespace fd {

std::optional<int64_t> parse_bytes(const std::string & s) {
    // A decimal part only with a K/M/G/T unit ("1.5GiB"): a bare "0.5" is --kv-cache-bytes' fraction.
    static const std::regex kRe(R"(^\s*(\d+)(\.\d+)?\s*([KkMmGgTt]?)(i?[Bb])?\s*$)");
    std::smatch m;
    if (!std::regex_match(s, m, kRe)) { return std::nullopt; }
    const char u = m[3].str().empty() ? ' ' : static_cast<char>(std::toupper(m[3].str()[0]));
    const int shift = u == 'K' ? 10 : u == 'M' ? 20 : u == 'G' ? 30 : u == 'T' ? 40 : 0;
    if (m[2].matched) {
        if (shift == 0) { return std::nullopt; }
        const double v = std::strtod((m[1].str() + m[2].str()).c_str(), nullptr) * static_cast<double>(int64_t{1} << shift);
        if (!(v < 9.2e18)) { return std::nullopt; }
        return static_cast<int64_t>(v);
    }
    int64_t v = 0;
    const std::string digits = m[1].str();
    if (std::from_chars(digits.data(), digits.data() + digits.size(), v).ec != std::errc{}) { return std::nullopt; }
    if (v > (INT64_MAX >> shift)) { return std::nullopt; }
    return v << shift;
}

std::optional<double> parse_fraction(const std::string & s) {
    static const std::regex kRe(R"(^\s*(\d+\.\d*|\.\d+)\s*$)");
    if (!std::regex_match(s, kRe)) { return std::nullopt; }
    return std::strtod(s.c_str(), nullptr);
}

bool is_loopback_host(const std::string & host) {
    if (host == "localhost") { return true; }
    in_addr a4{};
    if (::inet_pton(AF_INET, host.c_str(), &a4) == 1) { return (ntohl(a4.s_addr) >> 24) == 127; }
    in6_addr a6{};
    if (::inet_pton(AF_INET6, host.c_str(), &a6) == 1) {
        if (IN6_IS_ADDR_LOOPBACK(&a6)) { return true; }
        return IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127;
    }
    return false;  // a hostname or any other address: assume reachable
}

std::optional<kernels::WType> parse_kv_cache_dtype(const std::string & s) {
    if (s == "auto" || s == "float32") { return kernels::WType::f32; }
    if (s == "bfloat16") { return kernels::WType::bf16; }
    return std::nullopt;
}

std::string kv_cache_dtype_name(kernels::WType t) { return t == kernels::WType::bf16 ? "bfloat16" : "float32"; }

namespace {

/// --dist-backend, and where the ranks of this node run on cuda (Resolved::world, n_devices,
/// ranks_per_device). Several ranks may share a device (tests on one GPU): allowed, with a
/// warning at start-up, over a host-staged shm/gloo group (NCCL refuses two ranks on one device).
void resolve_dist_backend(const Config & cfg, Resolved & r, std::vector<std::string> & problems) {
    const bool cuda    = r.device == kernels::DeviceKind::cuda;
    r.n_devices        = r.world.n_devices;
    r.ranks_per_device = cuda ? r.world.ranks_per_device() : 1;
    const auto requested = runtime::parse_dist_backend(cfg.parallel.dist_backend);
    if (!requested) {
        problems.push_back(fmt::format("--dist-backend '{}': expected gloo, shm, nccl or auto", cfg.parallel.dist_backend));
        return;
    }
    r.dist_backend = runtime::resolve_dist_backend(*requested, r.world, cuda, problems);
}

/// --tensor-parallel-size, --distributed-executor-backend and the rendezvous flags.
void resolve_parallel(Config & cfg, Resolved & r, std::vector<std::string> & problems) {
    const int32_t tp = cfg.model.tensor_parallel_size;
    const auto & p = cfg.parallel;
    const bool cuda = r.device == kernels::DeviceKind::cuda;
    // tp >= 1, nnodes >= 1 dividing tp: World::make reports those.
    // --enable-expert-parallel (vLLM's flag): the experts over all tp ranks (ep = tp), each whole.
    const int32_t ep = p.enable_expert_parallel ? std::max(1, tp) : 1;
    r.world = runtime::World::make(tp, p.nnodes, cuda ? kernels::device_count(kernels::DeviceKind::cuda) : 1, problems, ep);
    if (p.enable_expert_parallel && !r.model.moe.enabled()) {
        problems.push_back(fmt::format("--enable-expert-parallel needs a mixture-of-experts model; {} ({}) is dense (no num_experts)",
                                       cfg.model.model_dir, r.model.architecture));
    } else if (p.enable_expert_parallel && r.model.moe.n_experts % std::max(1, tp) != 0) {
        problems.push_back(fmt::format("--enable-expert-parallel: num_experts = {} is not divisible by --tensor-parallel-size {} (each "
                                       "rank holds num_experts / tp experts); pick a size that divides the experts",
                                       r.model.moe.n_experts, tp));
    }
    // Under expert parallelism the comm group stays up across a weight sleep unless asked
    // (FastDeploy's DeepEP rule: the buffers are rebuilt on the same group).
    if (ep > 1 && !p.shutdown_comm_group_given) { cfg.parallel.shutdown_comm_group_if_worker_idle = false; }
    // A MoE model whose every layer is sparse never splits intermediate_size (Mixtral's experts
    // are that wide); under expert parallelism no expert is split.
    const bool dense_ff = r.model.has_dense_layer() || (r.model.arch == model::Arch::mixtral && ep == 1);
    if (tp >= 1 && (r.model.n_kv_heads % tp != 0 || r.model.n_heads % tp != 0 || (dense_ff && r.model.intermediate_size % tp != 0) ||
                    r.model.vocab_size % tp != 0)) {
        problems.push_back(fmt::format("--tensor-parallel-size {} must divide the model's {} KV heads, {} attention heads, "
                                       "intermediate size {} and vocab size {}", tp, r.model.n_kv_heads, r.model.n_heads,
                                       r.model.intermediate_size, r.model.vocab_size));
    } else if (tp >= 1 && r.model.moe.enabled() && (ep == 1 || r.model.moe.n_experts % ep == 0)) {
        try {  // the experts' widths (moe_intermediate_size, shared_expert_intermediate_size)
            model::check_tp_divides(r.model, tp, ep);
        } catch (const Error & e) {
            problems.push_back(fmt::format("--tensor-parallel-size {}: {}", tp, e.what()));
        }
    }
    const auto kind = p.distributed_executor_backend.empty()
                          ? std::optional(tp > 1 || p.nnodes > 1 ? runtime::ExecutorKind::mp : runtime::ExecutorKind::uni)
                          : runtime::parse_executor_kind(p.distributed_executor_backend);
    if (!kind) {
        problems.push_back(fmt::format("--distributed-executor-backend '{}': expected uni or mp", p.distributed_executor_backend));
    } else {
        r.executor_backend = *kind;
        if (*kind == runtime::ExecutorKind::uni && tp > 1) {
            problems.push_back(fmt::format("--distributed-executor-backend uni runs one rank in this process; --tensor-parallel-size {} needs mp", tp));
        }
    }
    if (p.nnodes > 1) {
        if (p.master_port == 0) { problems.push_back(fmt::format("--nnodes {} needs --master-port: the port node 0 listens on for the other nodes", p.nnodes)); }
        if (kind == runtime::ExecutorKind::uni) { problems.push_back("--nnodes > 1 needs --distributed-executor-backend mp"); }
    }
    resolve_dist_backend(cfg, r, problems);
    in_addr n4{};
    if (!p.node_addr.empty() && ::inet_pton(AF_INET, p.node_addr.c_str(), &n4) != 1) {
        problems.push_back(fmt::format("--node-addr '{}' must be an IPv4 address", p.node_addr));
    }
    if (p.node_rank < 0 || p.node_rank >= p.nnodes) { problems.push_back(fmt::format("--node-rank {} must be in [0, --nnodes {})", p.node_rank, p.nnodes)); }
    if (p.master_port < 0 || p.master_port > 65535) { problems.push_back(fmt::format("--master-port {} must be in [0, 65535]", p.master_port)); }
    in_addr a4{};
    if (::inet_pton(AF_INET, p.master_addr.c_str(), &a4) != 1) {
        problems.push_back(fmt::format("--master-addr '{}' must be an IPv4 address", p.master_addr));
    }
}

/// --swap-space: the host swap pool, per rank, in blocks of this rank's share of the KV.
void resolve_swap_space(const Config & cfg, Resolved & r, std::vector<std::string> & problems) {
    const double gib = cfg.kv.swap_space_gib;
    if (!(gib >= 0.0) || gib > 1e6) {
        problems.push_back(fmt::format("--swap-space {} must be a number of GiB >= 0 (0 = off)", gib));
        return;
    }
    if (gib == 0.0) { return; }
    const int32_t tp          = std::max(1, cfg.model.tensor_parallel_size);
    // With MTP drafts a host block holds the block's MTP KV too (Worker::swap_block_bytes).
    const int64_t block_bytes = model::Worker::swap_block_bytes(r.model, cfg.kv.block_size_tokens, tp, r.kv_dtype,
                                                                cfg.engine.speculative.method == spec::SpecMethod::mtp);
    const auto    bytes       = static_cast<int64_t>(gib * static_cast<double>(int64_t{1} << 30));
    r.n_swap_blocks = bytes / block_bytes;
    if (r.n_swap_blocks == 0) {
        problems.push_back(fmt::format("--swap-space {} GiB ({} bytes) holds no KV block of {} bytes (per rank); raise it or pass 0", gib,
                                       bytes, block_bytes));
        return;
    }
    r.swap_pool_bytes = r.n_swap_blocks * block_bytes * tp;
}

/// The host pools are pre-faulted: refuse what this machine cannot hold now (MemAvailable), the
/// KV pool (on cpu) and the swap pools of every rank together, instead of an OOM kill or a failed
/// mmap part-way through start-up. `kv_pool_bytes` is the KV pool all ranks together.
void check_host_memory(const Config & cfg, const Resolved & r, int64_t kv_pool_bytes, std::vector<std::string> & problems) {
    const int64_t avail = mem_available_bytes();
    const int64_t kv    = r.device == kernels::DeviceKind::cpu ? kv_pool_bytes : 0;
    if (avail <= 0 || kv + r.swap_pool_bytes <= avail) { return; }
    const auto gib = [](int64_t b) { return static_cast<double>(b) / static_cast<double>(int64_t{1} << 30); };
    std::string what;
    if (kv > 0) { what = fmt::format("--kv-cache-bytes {} (a KV pool of {:.2f} GiB)", cfg.kv.kv_cache_bytes, gib(kv)); }
    if (r.swap_pool_bytes > 0) {
        what += fmt::format("{}--swap-space {} GiB per rank x {} rank(s)", what.empty() ? "" : " plus ", cfg.kv.swap_space_gib,
                            std::max(1, cfg.model.tensor_parallel_size));
    }
    problems.push_back(fmt::format("{} exceeds the memory available now ({:.2f} GiB, MemAvailable); the pools are pre-faulted: "
                                   "pass smaller sizes", what, gib(avail)));
}

/// --device, --gpu-memory-utilization (its range; the sizing is gpu_kv_pool_bytes').
void resolve_device(const Config & cfg, Resolved & r, std::vector<std::string> & problems) {
    const auto & m = cfg.model;
    if (m.device == "cpu") {
        r.device = kernels::DeviceKind::cpu;
    } else if (m.device == "cuda") {
        r.device = kernels::DeviceKind::cuda;
        std::string why;
        if (!kernels::device_available(kernels::DeviceKind::cuda, 0, &why)) { problems.push_back("--device cuda: " + why); }
    } else {
        problems.push_back(fmt::format("--device '{}': expected cpu or cuda", m.device));
        return;
    }
    const bool cuda = r.device == kernels::DeviceKind::cuda;
    try {
        r.compute = kernels::parse_compute_type(m.compute_dtype);
        if (cuda && r.compute != kernels::ComputeType::f32) {
            problems.push_back(fmt::format("--compute-dtype {} runs on the cpu backend only; --device cuda computes in float32", m.compute_dtype));
        }
    } catch (const Error & e) {
        problems.push_back(e.what());
    }
    if (m.gpu_memory_utilization != 0.0) {
        if (!cuda) {
            problems.push_back("--gpu-memory-utilization needs --device cuda; on the CPU backend size the KV pool with --kv-cache-bytes "
                               "(bytes, or a fraction of available memory such as 0.3)");
        } else if (!(m.gpu_memory_utilization > 0.0 && m.gpu_memory_utilization <= 1.0)) {
            problems.push_back(fmt::format("--gpu-memory-utilization {} must be in (0, 1]", m.gpu_memory_utilization));
        } else if (cfg.kv.kv_cache_bytes != "0") {
            problems.push_back("--gpu-memory-utilization and --kv-cache-bytes both size the KV pool: pass one of them");
        }
    }
}

}  // namespace

int64_t gpu_kv_budget_bytes(const kernels::MemInfo & mem, double utilization, int64_t weight_bytes, int64_t other_bytes) {
    // vLLM's rule: this instance may hold utilization x total; what other processes (and the
    // context) hold already, total - free, counts against it.
    const double  budget = utilization * static_cast<double>(mem.total_bytes) - static_cast<double>(mem.total_bytes - mem.free_bytes);
    return std::max<int64_t>(0, static_cast<int64_t>(budget) - weight_bytes - other_bytes);
}

namespace {

/// --gpu-memory-utilization: the KV pool's bytes (whole model, as --kv-cache-bytes counts them)
/// from device 0's memory now, less this rank's weights (twice with persistent update staging),
/// its activation buffers for --max-num-batched-tokens and 512 MiB for the CUDA context and
/// kernels' workspaces. Each rank holds 1/tp of every block on its own device.
int64_t gpu_kv_pool_bytes(const Config & cfg, const Resolved & r) {
    const int32_t tp      = std::max(1, cfg.model.tensor_parallel_size);
    model::TensorIndex renamed;
    const auto    layout  = model::plan_layout(r.model, model::with_v4_names(r.model, model::read_tensor_index(cfg.model.model_dir), renamed),
                                               r.world.tp_rank(0));
    const int64_t weights = layout.arena_bytes * (cfg.weights.update_staging == "persistent" ? 2 : 1);
    const auto &  m       = r.model;
    const int64_t n       = cfg.engine.scheduler.max_num_batched_tokens;
    const int64_t per_tok = (4LL * m.hidden_size + 3LL * m.n_heads * m.head_dim + 4LL * m.kv_dim() + 3LL * m.intermediate_size) / tp +
                            m.hidden_size;
    const int64_t acts    = 4 * (n * per_tok + 2LL * cfg.engine.scheduler.max_num_seqs * m.vocab_size);
    // Ranks sharing a device (ranks_per_device > 1) split its budget, each with its own weights,
    // activations and context.
    const int64_t rpd     = std::max(1, r.ranks_per_device);
    const int64_t per_dev = gpu_kv_budget_bytes(kernels::device_mem_info(r.device, 0), cfg.model.gpu_memory_utilization, rpd * weights,
                                                rpd * (acts + (512LL << 20)));
    return per_dev / rpd * tp;
}

}  // namespace

Resolved resolve(Config & cfg) {
    std::vector<std::string> problems;
    Resolved r;
    const std::filesystem::path dir(cfg.model.model_dir);
    if (!std::filesystem::is_directory(dir)) {
        fail(Errc::invalid_argument, "--model {}: {}; give a local Hugging Face checkpoint directory (fdrollout never downloads models)",
             cfg.model.model_dir, std::filesystem::exists(dir) ? "is not a directory" : "no such directory");
    }
    r.model = model::load_model_config(dir);  // throws invalid_checkpoint

    resolve_device(cfg, r, problems);
    try {
        const auto st = weights::parse_load_strategy(cfg.weights.load_strategy);
        if (st == weights::LoadStrategy::rsync && cfg.weights.rsync_config.empty()) {
            problems.push_back("--load-strategy rsync needs --rsync-config '{\"source\": ..., \"staging_dir\": ...}'");
        }
    } catch (const Error & e) {
        problems.push_back(e.what());
    }
    resolve_parallel(cfg, r, problems);
    // Each rank starts --threads kernel threads: past a few thousand thread creation fails part-way
    // (std::terminate); more threads than CPUs only contend.
    if (cfg.model.n_threads < 0 || cfg.model.n_threads > kMaxThreads) {
        problems.push_back(fmt::format("--threads {} must be in [0, {}] (0 = every CPU this process may use)", cfg.model.n_threads, kMaxThreads));
    }
    if (cfg.model.n_threads <= 0) { cfg.model.n_threads = usable_cpus(); }  // the affinity mask, capped by a cgroup CPU quota

    auto & e = cfg.engine;
    if (e.max_model_len <= 0) {
        // Sliding-window attention is not implemented: by default serve only what fits the
        // window (vLLM caps max_model_len the same way when sliding windows are disabled).
        e.max_model_len = r.model.max_position_embeddings;
        if (r.model.sliding_window > 0) { e.max_model_len = std::min(e.max_model_len, r.model.sliding_window); }
    }
    if (auto why = model::check_max_model_len(r.model, e.max_model_len)) { problems.push_back(*why); }
    if (e.max_model_len < 2) { problems.push_back("--max-model-len must be >= 2"); }
    if (e.max_model_len > r.model.max_position_embeddings) {
        problems.push_back(fmt::format("--max-model-len {} exceeds the model's max_position_embeddings {}", e.max_model_len,
                                       r.model.max_position_embeddings));
    }
    if (e.scheduler.max_num_seqs < 1) { problems.push_back("--max-num-seqs must be >= 1"); }
    if (e.scheduler.max_num_batched_tokens < 1) { problems.push_back("--max-num-batched-tokens must be >= 1"); }
    const int32_t bs = cfg.kv.block_size_tokens;
    if (bs < 1 || bs > 256 || (bs & (bs - 1)) != 0) { problems.push_back(fmt::format("--block-size {} must be a power of two in [1, 256]", bs)); }

    if (auto step = model::read_version_step(cfg.model.model_dir)) { e.weight_version = *step; }
    else { e.weight_version = cfg.model.weight_version; }
    if (!shm::is_valid_version(e.weight_version)) {
        problems.push_back(fmt::format("--weight-version '{}' must match [A-Za-z0-9._-]{{1,128}} and not start with '.'", e.weight_version));
    }

    e.speculative = spec::parse_speculative_config(cfg.speculative_config, r.model.n_mtp_layers, problems);

    auto & s = cfg.server;
    s.model_dir = cfg.model.model_dir;
    if (s.served_model_names.empty() && !s.served_model_name.empty()) { s.served_model_names = {s.served_model_name}; }
    if (s.served_model_names.empty()) {
        auto p = std::filesystem::path(cfg.model.model_dir).lexically_normal();
        if (p.filename().empty()) { p = p.parent_path(); }
        s.served_model_names = {p.filename().string()};
    }
    for (const auto & name : s.served_model_names) {
        if (name.empty()) { problems.push_back("--served-model-name: a name must not be empty"); }
    }
    s.served_model_name = s.served_model_names.front();  // vLLM: responses report the first
    if (!is_loopback_host(s.host) && s.api_key.empty() && !s.allow_unauthenticated) {
        problems.push_back(fmt::format("--host {} is reachable from other machines and --api-key is not set: anyone who can reach it could "
                                       "generate and drive the weight-control routes. Set --api-key (and --control-api-key for the control "
                                       "routes), or pass --allow-unauthenticated if this network is trusted", s.host));
    }
    // vLLM's --generation-config: auto (the model's generation_config.json), vllm (none) or a folder.
    if (s.generation_config == "auto") {
        s.sampling_defaults = model::read_generation_defaults(cfg.model.model_dir);  // throws invalid_checkpoint naming the field
    } else if (s.generation_config != "vllm") {
        if (!std::filesystem::is_regular_file(std::filesystem::path(s.generation_config) / "generation_config.json")) {
            problems.push_back(fmt::format("--generation-config '{}': expected auto, vllm or a folder holding a generation_config.json",
                                           s.generation_config));
        } else {
            s.sampling_defaults = model::read_generation_defaults(s.generation_config);
        }
    }
    if (!s.override_generation_config.empty()) {  // vLLM: merged over --generation-config's (auto: the model's; vllm: none)
        try {
            std::vector<std::string> ignored;
            s.sampling_defaults = model::override_generation_defaults(s.sampling_defaults, s.override_generation_config, &ignored);
            if (!ignored.empty()) {
                problems.push_back(fmt::format("--override-generation-config: {} not a sampling field (temperature, top_p, top_k, min_p, "
                                               "repetition_penalty, max_new_tokens); vLLM would ignore {}: leave {} out",
                                               fmt::join(ignored, ", "), ignored.size() == 1 ? "it" : "them",
                                               ignored.size() == 1 ? "it" : "them"));
            }
        } catch (const Error & e) {
            problems.push_back(e.what());
        }
    }
    cfg.control.served_model_name = s.served_model_name;
    cfg.control.rsync_config      = cfg.weights.rsync_config;
    if (!(cfg.control.control_timeout_s > 0 && cfg.control.control_timeout_s <= kMaxWaitS) ||  // fd/deadline.h
        !(cfg.control.legacy_timeout_s > 0 && cfg.control.legacy_timeout_s <= kMaxWaitS)) {
        problems.push_back("--control-timeout-s must be > 0 and <= 1e7 seconds");
    }
    if (s.port < 0 || s.port > 65535) { problems.push_back(fmt::format("--port {} must be in [0, 65535]", s.port)); }

    if (const auto d = parse_kv_cache_dtype(cfg.kv.kv_cache_dtype)) {
        r.kv_dtype = *d;
    } else {
        problems.push_back(fmt::format("--kv-cache-dtype '{}': expected one of auto, float32, bfloat16", cfg.kv.kv_cache_dtype));
    }
    int64_t kv_pool_bytes = 0;  // what the KV pool (and its MTP cache) will take, all ranks together
    if (problems.empty()) {
        const int64_t block_bytes = model::Worker::kv_block_bytes(r.model, bs, 1, r.kv_dtype);
        // MTP drafts: the MTP cache (one layer's K and V, f32, over the pool's blocks and the
        // chains' scratch blocks) is paid from the same budget: each block costs its target KV
        // and its MTP KV, and the scratch blocks come off the top. Both all ranks together: each
        // rank holds its kv_dim / tp share of a block (tp x the per-rank bytes).
        const int32_t tp        = std::max(1, cfg.model.tensor_parallel_size);
        const bool    mtp       = e.speculative.method == spec::SpecMethod::mtp;
        const int64_t mtp_bytes = mtp ? tp * model::Worker::mtp_block_bytes(r.model, bs, tp) : 0;
        r.n_mtp_scratch_blocks  = mtp ? static_cast<int64_t>(e.scheduler.max_num_seqs) *
                                            ((e.speculative.num_speculative_tokens + bs - 1) / bs + 1) : 0;
        const int64_t per_block = block_bytes + mtp_bytes;
        const std::string & kvs = cfg.kv.kv_cache_bytes;
        int64_t bytes = 0;
        if (const auto frac = parse_fraction(kvs)) {
            if (!(*frac > 0.0 && *frac <= 1.0)) {
                problems.push_back(fmt::format("--kv-cache-bytes '{}': a number without a unit is a fraction of available memory, in (0, 1]; "
                                               "bytes take a unit (e.g. 1.5GiB, 512MiB)", kvs));
            }
            const int64_t avail = r.device == kernels::DeviceKind::cuda ? kernels::device_mem_info(r.device, 0).free_bytes : mem_available_bytes();
            bytes = static_cast<int64_t>(*frac * static_cast<double>(avail));
        } else if (auto b = parse_bytes(kvs)) {
            bytes = *b;
            if (bytes == 0 && cfg.model.gpu_memory_utilization > 0.0) {
                bytes = gpu_kv_pool_bytes(cfg, r);
            } else if (bytes == 0) {
                const int64_t want_tokens = static_cast<int64_t>(e.scheduler.max_num_seqs) * e.max_model_len;
                // auto: max_num_seqs sequences of max_model_len (and their MTP cache), at most 2 GiB
                bytes = std::min<int64_t>((want_tokens + bs - 1) / bs * per_block + r.n_mtp_scratch_blocks * mtp_bytes, 2LL << 30);
            }
        } else {
            problems.push_back(fmt::format("--kv-cache-bytes '{}': expected bytes (e.g. 512MiB, 1.5GiB, 1073741824), a fraction of available "
                                           "memory (e.g. 0.3) or 0 (automatic)", kvs));
        }
        r.kv_budget_bytes       = bytes;
        r.n_kv_blocks = std::max<int64_t>(0, bytes - r.n_mtp_scratch_blocks * mtp_bytes) / per_block;
        kv_pool_bytes = r.n_kv_blocks * per_block + r.n_mtp_scratch_blocks * mtp_bytes;
        const int64_t min_blocks = (e.max_model_len + bs - 1) / bs;
        if (problems.empty() && r.n_kv_blocks < min_blocks) {
            const int64_t need = min_blocks * per_block + r.n_mtp_scratch_blocks * mtp_bytes;
            problems.push_back(fmt::format("--kv-cache-bytes {} holds {} KV blocks of {} bytes{}; one --max-model-len {} sequence needs {} blocks "
                                           "= {} bytes at least (or pass 0 to size the pool automatically)",
                                           kvs, r.n_kv_blocks, per_block,
                                           mtp ? fmt::format(" ({} of them the MTP cache's, which also takes {} scratch blocks = {} bytes; "
                                                             "fewer --max-num-seqs need fewer)", mtp_bytes, r.n_mtp_scratch_blocks,
                                                             r.n_mtp_scratch_blocks * mtp_bytes) : std::string(),
                                           e.max_model_len, min_blocks, need));
        }
    }
    if (problems.empty()) { resolve_swap_space(cfg, r, problems); }
    if (problems.empty()) { check_host_memory(cfg, r, kv_pool_bytes, problems); }
    if (!problems.empty()) { throw Error(Errc::invalid_argument, fmt::format("invalid configuration:\n  {}", fmt::join(problems, "\n  "))); }
    return r;
}

}  // namespace fd
