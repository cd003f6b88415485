// The multi-process executor's wire fields (mp_wire.h): a rank's spawn configuration to and
// from JSON, and the control fields of a LinkMsg (fetch requests, rank calls, their reports and
// a CUDA rank's device memory) to and from the struct. The rank process itself: rank_process.cpp.
#include "mp_wire.h"

#include "fd/runtime/world.h"
#include "fd/status.h"

#include <algorithm>
#include <iterator>
#include <string>

namespace fd::runtime {

using json = nlohmann::json;

json rank_spawn_to_json(const RankSpawn & s) {
    const auto & c = s.cfg;
    const auto & w = c.worker;
    return {{"rank", s.rank},
            {"generation", s.generation},
            {"store_port", s.store_port},
            {"store_token", s.store_token},
            {"tensor_parallel_size", c.tensor_parallel_size},
            {"nnodes", c.nnodes},
            {"model_dir", c.model_dir},
            {"worker", {{"n_threads", w.n_threads}, {"block_size", w.block_size}, {"n_blocks", w.n_blocks},
                        {"max_model_len", w.max_model_len}, {"n_swap_blocks", w.n_swap_blocks}, {"keep_update_staging", w.keep_update_staging},
                        {"check_finite_weights", w.check_finite_weights}, {"io_timeout_s", w.io_timeout_s},
                        {"device", kernels::device_kind_name(w.device)}, {"batch_invariant", w.batch_invariant},
                        {"compute_dtype", kernels::compute_type_name(w.compute)},
                        {"reserve_tokens", w.reserve_tokens}, {"graph_max_batch", w.graph_max_batch},
                        {"test_device_paths", w.test_device_paths},
                        {"kv_dtype", w.kv_dtype == kernels::WType::bf16 ? "bfloat16" : "float32"}, {"ep_size", w.ep_size},
                        {"mtp_draft_tokens", w.mtp_draft_tokens}, {"mtp_scratch_blocks", w.mtp_scratch_blocks}}},
            {"source", {{"strategy", std::string(weights::to_string(c.source.strategy))}, {"model_dir", c.source.model_dir.string()},
                        {"port", c.source.port}, {"rsync_config", c.source.rsync_config}}},
            {"master_addr", c.master_addr},
            {"bind_addr", s.bind_addr},
            {"dist_backend", dist_backend_name(c.dist_backend)},
            {"timeout_s", c.timeout_s},
            {"heartbeat_s", c.heartbeat_s},
            {"stuck_s", c.stuck_s},
            {"log_level", c.log_level},
            {"log_format", c.log_format}};
}

RankSpawn rank_spawn_from_json(const json & j) {
    try {
        RankSpawn s;
        s.rank       = j.at("rank");
        s.generation = j.at("generation");
        s.store_port = j.at("store_port");
        s.store_token = j.value("store_token", std::string{});
        auto & c = s.cfg;
        c.tensor_parallel_size = j.at("tensor_parallel_size");
        c.nnodes               = j.value("nnodes", 1);
        c.model_dir            = j.at("model_dir");
        const auto & w = j.at("worker");
        c.worker.n_threads            = w.at("n_threads");
        c.worker.block_size           = w.at("block_size");
        c.worker.n_blocks             = w.at("n_blocks");
        c.worker.max_model_len        = w.at("max_model_len");
        c.worker.n_swap_blocks        = w.at("n_swap_blocks");
        c.worker.keep_update_staging  = w.at("keep_update_staging");
        c.worker.check_finite_weights = w.at("check_finite_weights");
        c.worker.io_timeout_s         = w.at("io_timeout_s");
        c.worker.rank                 = s.rank;
        c.worker.device          = w.value("device", std::string("cpu")) == "cuda" ? kernels::DeviceKind::cuda : kernels::DeviceKind::cpu;
        c.worker.batch_invariant = w.value("batch_invariant", true);
        c.worker.compute         = kernels::parse_compute_type(w.value("compute_dtype", std::string("float32")));
        c.worker.reserve_tokens  = w.value("reserve_tokens", int64_t{0});
        c.worker.graph_max_batch = w.value("graph_max_batch", int32_t{0});  // --use-cudagraph (tp = 1 only; tp > 1 runs eagerly)
        c.worker.test_device_paths = w.value("test_device_paths", false);
        c.worker.kv_dtype = w.value("kv_dtype", std::string("float32")) == "bfloat16" ? kernels::WType::bf16 : kernels::WType::f32;
        c.worker.ep_size           = w.value("ep_size", int32_t{1});
        c.worker.mtp_draft_tokens   = w.value("mtp_draft_tokens", int32_t{0});  // --speculative-config method "mtp"
        c.worker.mtp_scratch_blocks = w.value("mtp_scratch_blocks", int64_t{0});
        // The device: this rank's index on its node modulo the devices this host sees.
        c.worker.device_id       = rank_device_id(s.rank, c.tensor_parallel_size, c.nnodes, kernels::device_count(c.worker.device));
        const auto & src = j.at("source");
        c.source.strategy     = weights::parse_load_strategy(src.at("strategy").get<std::string>());
        c.source.model_dir    = src.at("model_dir").get<std::string>();
        c.source.port         = src.at("port");
        c.source.rsync_config = src.at("rsync_config");
        c.source.tp           = c.tensor_parallel_size;
        c.master_addr = j.at("master_addr");
        s.bind_addr   = j.value("bind_addr", std::string());
        const std::string backend = j.value("dist_backend", std::string("gloo"));
        const auto parsed = parse_dist_backend(backend);
        if (!parsed) { fail(Errc::invalid_argument, "rank configuration: dist_backend '{}'", backend); }  // auto here: gloo, as before
        c.dist_backend = *parsed;
        c.timeout_s   = j.at("timeout_s");
        c.heartbeat_s = j.value("heartbeat_s", 3.0);
        c.stuck_s     = j.value("stuck_s", 30.0);
        c.log_level   = j.at("log_level");
        c.log_format  = j.at("log_format");
        return s;
    } catch (const json::exception & e) {
        fail(Errc::invalid_argument, "rank configuration: {}", e.what());
    }
}

void fetch_request_to_msg(const weights::FetchRequest & req, LinkMsg & m) {
    m.has_version     = req.version.has_value();
    set_field(m.version, req.version.value_or(""));
    set_field(m.serving_version, req.serving_version);
    set_field(m.serving_source_version, req.serving_source_version);
    m.verify_checksum = req.verify_checksum;
    m.wakeup          = req.wakeup;
    set_field(m.weight_dir, req.weight_dir);
    m.weight_dir_owned = req.weight_dir_owned;
}

weights::FetchRequest fetch_request_from_msg(const LinkMsg & m) {
    weights::FetchRequest r;
    if (m.has_version) { r.version = std::string(m.version); }
    r.serving_version = m.serving_version;
    r.serving_source_version = m.serving_source_version;
    r.verify_checksum = m.verify_checksum != 0;
    r.wakeup          = m.wakeup != 0;
    r.weight_dir       = m.weight_dir;
    r.weight_dir_owned = m.weight_dir_owned != 0;
    return r;
}

void rank_request_to_msg(const RankRequest & req, LinkMsg & m) {
    m.op      = static_cast<uint32_t>(LinkOp::rank_call);
    m.rank_op = static_cast<uint32_t>(req.op);
    m.tag     = static_cast<uint8_t>(req.tag);
    m.timeout_s = req.timeout_s;
    fetch_request_to_msg(req.fetch, m);
}

RankRequest rank_request_from_msg(const LinkMsg & m) {
    if (m.rank_op >= kRankOpCount || m.tag >= memory::kNumTags) {
        fail(Errc::internal, "rank call: operation {} / tag {} outside the lists (daemon and rank binaries differ?)", m.rank_op, m.tag);
    }
    return {.op = static_cast<RankOp>(m.rank_op), .fetch = fetch_request_from_msg(m), .tag = static_cast<memory::Tag>(m.tag),
            .timeout_s = m.timeout_s};
}

void rank_report_to_msg(const RankReport & r, LinkMsg & m) {
    m.rank              = r.rank;
    m.has_reply_version = r.version.has_value();
    set_field(m.version, r.version.value_or(""));
    set_field(m.fingerprint, r.fingerprint);
    m.bytes             = r.bytes;
    m.checksum_verified = r.checksum_verified;
    m.fetch_s           = r.fetch_s;
    m.stage_s           = r.stage_s;
    m.commit_s          = r.commit_s;
    m.freed_bytes       = r.freed_bytes;
    m.rss_bytes         = r.rss_bytes;
    m.device_freed_bytes = r.device_freed_bytes;
}

void rank_device_to_msg(const RankDevice & d, LinkMsg & m) {
    m.device_id          = d.device;
    m.device_free_bytes  = d.free_bytes;
    m.device_total_bytes = d.total_bytes;
    std::copy(std::begin(d.held_bytes), std::end(d.held_bytes), std::begin(m.held_bytes));
    m.comm_connected     = d.comm_connected;
    m.nccl_comms_live    = d.nccl_comms_live;
    m.nccl_comms_created = d.nccl_comms_created;
}

RankDevice rank_device_from_msg(const LinkMsg & m) {
    RankDevice d{.rank = m.rank, .device = m.device_id, .free_bytes = m.device_free_bytes, .total_bytes = m.device_total_bytes};
    std::copy(std::begin(m.held_bytes), std::end(m.held_bytes), std::begin(d.held_bytes));
    d.comm_connected     = m.comm_connected != 0;
    d.nccl_comms_live    = m.nccl_comms_live;
    d.nccl_comms_created = m.nccl_comms_created;
    return d;
}

int32_t rank_device_id(int32_t rank, int32_t tp, int32_t nnodes, int32_t n_devices) {
    return World::make(tp, nnodes, n_devices).device_of(rank);
}

RankReport rank_report_from_msg(const LinkMsg & m) {
    RankReport r;
    r.rank = m.rank;
    if (m.has_reply_version) { r.version = std::string(m.version); }
    r.fingerprint = m.fingerprint;
    r.bytes             = m.bytes;
    r.checksum_verified = m.checksum_verified != 0;
    r.fetch_s           = m.fetch_s;
    r.stage_s           = m.stage_s;
    r.commit_s          = m.commit_s;
    r.freed_bytes       = m.freed_bytes;
    r.rss_bytes         = m.rss_bytes;
    r.device_freed_bytes = m.device_freed_bytes;
    return r;
}

}  // namespace fd::runtime
