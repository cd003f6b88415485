// The weight-stream routes (SPEC §12, docs/weight_streams.md): vLLM's weight-transfer calls and
// SGLang's update-group calls, both over fd::stream::StreamManager. The finish seals the stream
// into a staging dir and loads it through the one update path (update_weights {weight_dir}):
// staged on every rank, committed on all or none, the new label only after the commit.
// Errors use the control shape {"status":"error","error":{"type","message"}} (both peers' clients
// look at the HTTP status only).
#include "peer_aliases.h"

#include "fd/log.h"
#include "fd/shm/names.h"
#include "fd/stream/weight_stream.h"

#include <algorithm>
#include <map>

namespace fd::api {

namespace {

using nlohmann::json;
using stream::Clock;

void require_stream(ApiContext & ctx, const Request & req) {
    if (!ctx.control->config().dynamic_load_weight) {
        fail(Errc::not_found, "{} needs dynamic weight loading; start fdrollout with --dynamic-load-weight", req.path);
    }
    FD_CHECK(ctx.stream != nullptr, "the API context has a stream manager");
}

/// The caller's deadline (X-Request-Timeout / X-Request-Deadline), else the stream's own bound.
Clock::time_point deadline_of(const ControlInput & in) {
    if (in.req) {
        if (auto g = request_gate(*in.req)) { return g->deadline(); }
    }
    return Clock::time_point::max();
}

std::optional<std::string> checked_version(const json & body, const char * key) {
    auto v = version_field(body, key);
    if (v && !shm::is_valid_version(*v)) {
        throw Error(Errc::invalid_argument, fmt::format("'{}' must match [A-Za-z0-9._-]{{1,128}} (not starting with '.'), got '{}'", key, *v), key);
    }
    return v;
}

json endpoint_json(const stream::Endpoint & ep, const stream::StreamManager & sm) {
    json tensors = json::array();
    for (const auto & [name, t] : sm.expected()) { tensors.push_back({{"name", name}, {"dtype", model::dtype_name(t.dtype)}, {"shape", t.shape}}); }
    // The per-expert views of a stacked expert tensor: accepted in its place, and what a delta takes.
    json views = json::array();
    for (const auto & v : sm.expert_views()) {  // each stacked tensor's views in file order
        views.push_back({{"name", v.spec.name}, {"dtype", model::dtype_name(v.spec.dtype)}, {"shape", v.spec.shape}, {"in", v.stacked}});
    }
    return {{"backend", ep.backend}, {"host", ep.host}, {"port", ep.port}, {"token", ep.token}, {"timeout_s", ep.timeout_s},
            {"tensors", tensors}, {"expert_tensors", views}};
}

/// update_info.deltas[i]: null (a full tensor) or {"n_indices": k, "index_dtype": "I64"|"I32"}:
/// the frame then carries k indices then k values (docs/weight_streams.md, "Delta updates").
void read_delta(const json & deltas, size_t i, stream::TensorSpec & s) {
    if (!deltas.is_array() || deltas.size() <= i) {
        throw Error(Errc::invalid_argument, "'deltas' must be a list with one entry (null or {n_indices, index_dtype}) per name", "deltas");
    }
    const json & d = deltas[i];
    if (d.is_null()) { return; }
    if (!d.is_object() || !d.contains("n_indices") || !d["n_indices"].is_number_integer() || d["n_indices"].get<int64_t>() < 0) {
        throw Error(Errc::invalid_argument, fmt::format("{}: a delta is {{\"n_indices\": k >= 0, \"index_dtype\": \"I64\"|\"I32\"}}, got {}",
                                                        s.name, brief(d)), "deltas");
    }
    reject_unknown_fields(d, {"n_indices", "index_dtype"}, "deltas");
    s.n_indices   = d["n_indices"].get<int64_t>();
    s.index_bytes = stream::parse_index_dtype_name(d.value("index_dtype", "I64"), s.name);
    if (s.n_indices > s.numel()) {
        throw Error(Errc::invalid_argument, fmt::format("{}: a delta of {} elements into a tensor of {}", s.name, s.n_indices, s.numel()), "deltas");
    }
    s.nbytes = s.n_indices * (s.index_bytes + model::dtype_size(s.dtype));
}

/// {names, dtype_names|dtypes, shapes[, deltas]} → specs. Errors  invalid_argument naming the field.
std::vector<stream::TensorSpec> read_specs(const json & b, const char * dtypes_key) {
    for (const char * k : {"names", dtypes_key, "shapes"}) {
        if (!b.contains(k) || !b[k].is_array()) { throw Error(Errc::invalid_argument, fmt::format("'{}' must be a list", k), k); }
    }
    const auto & names = b["names"];
    if (b[dtypes_key].size() != names.size() || b["shapes"].size() != names.size()) {
        throw Error(Errc::invalid_argument, fmt::format("names, {} and shapes must have the same length ({}, {}, {})", dtypes_key, names.size(),
                                                        b[dtypes_key].size(), b["shapes"].size()), "names");
    }
    std::vector<stream::TensorSpec> out;
    for (size_t i = 0; i < names.size(); ++i) {
        if (!names[i].is_string()) { throw Error(Errc::invalid_argument, "every name must be a string", "names"); }
        stream::TensorSpec s;
        s.name = names[i].get<std::string>();
        if (!b[dtypes_key][i].is_string()) { throw Error(Errc::invalid_argument, fmt::format("{}: the dtype must be a string", s.name), dtypes_key); }
        s.dtype  = stream::parse_dtype_name(b[dtypes_key][i].get<std::string>(), s.name);
        int64_t n = 1;
        for (const auto & d : b["shapes"][i]) {
            if (!d.is_number_integer() || d.get<int64_t>() < 0 || d.get<int64_t>() > (int64_t(1) << 40)) {
                throw Error(Errc::invalid_argument, fmt::format("{}: shape {} is not a list of sizes", s.name, brief(b["shapes"][i])), "shapes");
            }
            s.shape.push_back(d.get<int64_t>());
            n *= d.get<int64_t>();
        }
        s.nbytes = n * model::dtype_size(s.dtype);
        if (b.contains("deltas")) { read_delta(b["deltas"], i, s); }
        out.push_back(std::move(s));
    }
    return out;
}

/// Every rank serves `base` (the engine's one serving label; a degraded engine, asleep or
/// invalid weights serve nothing). Errors  wrong_state naming what serves.
void require_serving(ApiContext & ctx, const ControlInput & in, const std::string & base) {
    const control::ControlOutcome o = peer::run(ctx, in, {.op = "status"});
    if (!o.ok() || !o.status) { throw o.error ? *o.error : Error(Errc::internal, "the status query failed"); }
    const auto & st = o.status->stats.state;
    if (st.weight_version != base || st.degraded || st.weight_asleep || !st.weights_valid) {
        throw Error(Errc::wrong_state,
                    fmt::format("base_version '{}' is not what every rank serves (weight_version '{}'{}{}{}); a delta applies only to the "
                                "exact base; stream the full weights or name the serving version", base, st.weight_version,
                                st.degraded ? ", degraded" : "", st.weight_asleep ? ", weights asleep" : "",
                                st.weights_valid ? "" : ", weights invalid"), "base_version");
    }
    if (ctx.stream->last_stream_version() == base && !ctx.stream->serves_last_stream({st.weight_version, st.weights_epoch})) {
        throw Error(Errc::wrong_state,
                    fmt::format("base_version '{}': the weight stream of that version no longer serves (the ranks were loaded from {} "
                                "since, under its label); a delta applies only to the stream's bytes; stream the full weights", base,
                                st.serving_dir.empty() ? std::string("the --load-strategy source") : st.serving_dir), "base_version");
    }
}

/// A full update's bucket, just received: the ranks stage it now, while the trainer sends the
/// next (Worker::stage_bucket), so the finish finds most of the update staged and only commits
/// (issue 25). Submitted to the engine before the bucket's answer goes out, so it precedes
/// the finish's update in the engine's inbox; not waited for (the engine runs it between
/// steps; a failure only means the finish stages in full).
void stage_ahead(ApiContext & ctx, const stream::BucketReport & r) {
    if (r.file.empty() || !ctx.engine || !ctx.stream->stage_ahead()) { return; }
    engine::ControlCommand cmd;
    cmd.op            = engine::ControlOp::update_weights;
    cmd.weight_bucket = r.file.string();
    (void)ctx.engine->control(std::move(cmd));
}

/// The longest a landed update's finish waits for the ranks' last bytes (seconds; less when the
/// stream timeout or --control-timeout-s says so). What is left when the trainer calls the finish
/// is what its sockets and the ranks' hold, a few MB taken in milliseconds; generation is paused
/// meanwhile, so a trainer that finishes without its last frames holds it this long at most.
constexpr double kLandTailS = 10.0;

/// Load the sealed stream on every rank and commit (or drop it). A serving engine is paused
/// (mode wait) around the update and resumed after, as for prime-rl's weight_dir update; a
/// paused one (TRL's pause mode=keep) stays paused. A delta update is committed only while
/// every rank still serves its base (checked again here: 409 and the update dropped otherwise).
json commit_sealed(ApiContext & ctx, const ControlInput & in, const stream::Sealed & s) {
    if (s.base_version) {
        try {
            require_serving(ctx, in, *s.base_version);
        } catch (const Error & e) {
            ctx.stream->drop(e);
            throw Error(e.code(), fmt::format("the delta update was not applied (every rank keeps the serving version): {}", e.what()),
                        "base_version");
        }
    }
    const auto t0 = Clock::now();
    auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
    const bool was_paused = peer::paused(peer::run(ctx, in, {.op = "is_paused"}));
    control::ControlOutcome u;
    if (!was_paused) { u = peer::run(ctx, in, {.op = "pause", .mode = "wait"}); }
    const double pause_s = since(t0);
    double update_s = 0;
    if (was_paused || u.ok()) {
        shm::MailboxCommand update{.op = "update_weights"};
        if (s.landed) {  // the ranks hold the bytes: they check that every part arrived, then commit (a delta: write it in place)
            update.weight_land    = true;
            update.land_delta     = s.base_version.has_value();
            update.weight_dir     = s.base_version ? s.base_dir.string() : std::string();  // a delta's base: the serving dir ("" = landed)
            // The trainer sent every byte before it called the finish: the ranks wait only for what is
            // still in their sockets, and well within the rank call's own bound (0.9 of
            // --control-timeout-s, past which a rank is taken for dead; a probe: a 60 s stream timeout
            // on a 20 s control timeout failed a healthy rank). Generation is paused meanwhile.
            update.land_timeout_s = std::min({ctx.stream->timeout_s(), kLandTailS, 0.8 * ctx.control->config().control_timeout_s});
        } else if (s.base_version && s.base_dir.empty()) {  // a delta on landed weights: the ranks alone
            update.weight_delta = s.delta_file.string();
            update.weight_land  = true;
        } else {
            update.weight_dir   = s.delta_file.empty() ? s.dir.string() : s.base_dir.string();
            update.weight_delta = s.delta_file.string();  // a delta: written in place (ranks and base_dir)
        }
        update.version    = s.version;
        const auto t1 = Clock::now();
        u = peer::run(ctx, in, update);
        update_s = since(t1);
        if (!was_paused) { ctx.control->handle(shm::MailboxCommand{.op = "resume"}); }
    }
    log::get("stream")->info("weight stream commit{}: pause {:.3f} s, update_weights {:.3f} s, resume {:.3f} s", s.base_version ? " (delta)" : "",
                             pause_s, update_s, since(t0) - pause_s - update_s);
    if (!u.ok()) {
        const Error e = u.error ? *u.error : Error(Errc::internal, control::error_message(u));
        ctx.stream->drop(e);
        throw Error(e.code(), fmt::format("the streamed weights were not applied (every rank keeps the serving version): {}", e.what()));
    }
    ctx.stream->committed(u.result.version, u.result.weights_epoch);
    int64_t bytes = s.bytes;
    if (s.landed) {  // the ranks received them, not the daemon: what each rank landed
        bytes = 0;
        for (const auto & rep : u.result.ranks) { bytes += rep.bytes; }
    }
    json body{{"weight_version", u.result.version}, {"bytes", bytes}, {"n_tensors", s.n_tensors}, {"ranks", control::rank_reports_json(u.result)}};
    if (s.base_version && s.landed) {  // the ranks received the frames: what they wrote (replicated tensors on each rank)
        body["base_version"] = *s.base_version;
        body["n_delta"]      = bytes;
        body["bytes"]        = nullptr;
    } else if (s.base_version) {
        body["base_version"] = *s.base_version;
        body["n_delta"]      = s.n_delta;
        body["n_from_base"]  = s.n_from_base;
    }
    return body;
}

/// The transport fields both inits share (vLLM's init_info, SGLang's body), each checked for its
/// JSON type first, so a wrong one is a 400 naming it (not a generic type error):
/// backend / master_address / group_name / nccl_unique_id strings, timeout_s a number,
/// master_port an integer in [0, 65535] (NCCL's rendezvous; the tcp transport picks its own),
/// rank_offset and world_size integers. `backend`: the body's, else `default_backend`.
stream::InitRequest init_fields(const json & o, const char * where, const char * default_backend) {
    auto expect = [&](const char * key, bool ok, const char * what) {
        if (o.contains(key) && !o[key].is_null() && !ok) {
            throw Error(Errc::invalid_argument, fmt::format("{}.{} must be {}, got {}; nothing was done", where, key, what, brief(o[key])), key);
        }
    };
    for (const char * key : {"backend", "master_address", "group_name", "nccl_unique_id"}) {
        expect(key, o.contains(key) && o[key].is_string(), "a string");
    }
    expect("timeout_s", o.contains("timeout_s") && o["timeout_s"].is_number(), "a number of seconds");
    // SGLang's pydantic int also takes the port as a string of digits (AReaL sends str(port)).
    const auto port_ok = [](const json & v) {
        if (v.is_number_integer()) { return v.get<int64_t>() >= 0 && v.get<int64_t>() <= 65535; }
        if (!v.is_string()) { return false; }
        const auto & t = v.get_ref<const std::string &>();
        return !t.empty() && t.size() <= 5 && std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; }) && std::stoi(t) <= 65535;
    };
    expect("master_port", o.contains("master_port") && port_ok(o["master_port"]), "an integer port in [0, 65535]");
    for (const char * key : {"rank_offset", "world_size"}) {
        expect(key, o.contains(key) && o[key].is_number_integer() && o[key].get<int64_t>() >= 0 && o[key].get<int64_t>() <= (1 << 20),
               "a non-negative integer");
    }
    stream::InitRequest r;
    r.backend = o.contains("backend") && o["backend"].is_string() ? o["backend"].get<std::string>() : default_backend;
    if (o.contains("timeout_s") && !o["timeout_s"].is_null()) { r.timeout_s = o["timeout_s"].get<double>(); }
    r.nccl_unique_id = o.contains("nccl_unique_id") && !o["nccl_unique_id"].is_null() ? o["nccl_unique_id"].get<std::string>() : "";
    if (o.contains("rank_offset") && !o["rank_offset"].is_null()) { r.rank_offset = o["rank_offset"].get<int32_t>(); }
    if (o.contains("world_size") && !o["world_size"].is_null()) { r.world_size = o["world_size"].get<int32_t>(); }
    return r;
}

// ---- vLLM ----

void vllm_init(ApiContext & ctx, const ControlInput & in, Response & res) {
    reject_unknown_fields(in.body, {"init_info"}, "init_weight_transfer_engine");
    if (!in.body.is_object() || !in.body.contains("init_info") || !in.body["init_info"].is_object()) {
        throw Error(Errc::invalid_argument, "missing 'init_info' (an object) in the request body", "init_info");
    }
    const json & ii = in.body["init_info"];
    reject_unknown_fields(ii, {"backend", "timeout_s", "master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id"},
                          "init_info");
    stream::InitRequest r = init_fields(ii, "init_info", ii.contains("master_address") || ii.contains("nccl_unique_id") ? "nccl" : "tcp");
    const auto ep = ctx.stream->init(r);
    json body = endpoint_json(ep, *ctx.stream);
    body["message"] = "Weight transfer initialized";
    peer::send_json(res, 200, body);
}

/// Every rank opens a landing for the update just started (fd/stream/landing.h) and says where
/// and what it expects: [{rank, host, port, token, timeout_s, parts}] in rank order. Any failure
/// drops the update (the ranks that opened stop listening).
json open_landings(ApiContext & ctx, const ControlInput & in, bool delta) {
    shm::MailboxCommand open{.op = "update_weights"};
    open.land_delta     = delta;
    open.land_host      = ctx.stream->host();
    open.land_timeout_s = ctx.stream->timeout_s();
    const control::ControlOutcome o = peer::run(ctx, in, open);
    if (!o.ok()) {
        const Error e = o.error ? *o.error : Error(Errc::internal, control::error_message(o));
        ctx.stream->drop(e);
        throw Error(e.code(), fmt::format("the ranks could not open their landings (nothing changed): {}", e.what()), "land");
    }
    json ranks = json::array();
    for (const auto & rep : o.result.ranks) { ranks.push_back(json::parse(rep.detail)); }
    return ranks;
}

void vllm_start(ApiContext & ctx, const ControlInput & in, Response & res) {
    reject_unknown_fields(in.body, {"is_checkpoint_format", "version", "weight_version", "base_version", "land"}, "start_weight_update");
    if (in.body.is_object() && in.body.contains("is_checkpoint_format") && !in.body.value("is_checkpoint_format", true)) {
        throw Error(Errc::invalid_argument, "only checkpoint-format (Hugging Face training) names are streamed: is_checkpoint_format must be true",
                    "is_checkpoint_format");
    }
    auto v = checked_version(in.body, "version");
    if (!v) { v = checked_version(in.body, "weight_version"); }
    const auto base = checked_version(in.body, "base_version");
    if (base) { require_serving(ctx, in, *base); }
    const json * land_field = in.body.is_object() && in.body.contains("land") ? &in.body["land"] : nullptr;
    if (land_field && !land_field->is_boolean()) { throw Error(Errc::invalid_argument, "'land' must be true or false", "land"); }
    const bool land = land_field && land_field->get<bool>();
    if (land && !v) {
        throw Error(Errc::invalid_argument, "a landed update must name its version ({\"version\": ..., \"land\": true}): no file holds its "
                                            "bytes to be named by", "version");
    }
    const std::string serving_at_start = ctx.engine->stats().state.weight_version;
    ctx.stream->start(v, deadline_of(in), base, land);
    json body{{"message", "Weight update started"}, {"weight_version", serving_at_start}};  // the client names a change meanwhile
    if (land) { body["land"] = open_landings(ctx, in, base.has_value()); }
    peer::send_json(res, 200, body);
}

void vllm_finish(ApiContext & ctx, const ControlInput & in, Response & res) {
    reject_unknown_fields(in.body, {"version", "weight_version"}, "finish_weight_update");
    auto v = checked_version(in.body, "version");
    if (!v) { v = checked_version(in.body, "weight_version"); }
    json body = commit_sealed(ctx, in, ctx.stream->seal(v));
    body["message"] = "Weight update finished";
    peer::send_json(res, 200, body);
}

void stream_abort(ApiContext & ctx, const ControlInput & in, Response & res) {
    reject_unknown_fields(in.body, {}, "abort_weight_update");
    const bool open = ctx.stream->abort(Error(Errc::wrong_state, "the trainer aborted the update (POST /abort_weight_update)"));
    peer::send_json(res, 200, json{{"message", open ? "Weight update aborted; serving weights unchanged"
                                                    : "No weight update was open; serving weights unchanged"}});
}

/// A bucket's announcement read and checked; any refusal closes the transport (out_of_step): the
/// trainer is already writing the bucket's bytes, which the next bucket would read as its own.
template <class Fn>
auto announced(ApiContext & ctx, Fn && fn) {
    try {
        return fn();
    } catch (const Error & e) {
        ctx.stream->out_of_step(e);
        throw;
    }
}

void vllm_bucket(ApiContext & ctx, const ControlInput & in, Response & res) {
    bool packed = false;
    const auto specs = announced(ctx, [&] {
        reject_unknown_fields(in.body, {"update_info"}, "update_weights");
        const json & ui = in.body["update_info"];
        if (!ui.is_object()) { throw Error(Errc::invalid_argument, "'update_info' must be an object {names, dtype_names, shapes}", "update_info"); }
        reject_unknown_fields(ui, {"names", "dtype_names", "shapes", "packed", "extras", "is_checkpoint_format", "deltas"}, "update_info");
        if (ui.contains("packed") && !ui["packed"].is_boolean()) { throw Error(Errc::invalid_argument, "'packed' must be true or false", "packed"); }
        packed = ui.value("packed", false);
        return read_specs(ui, "dtype_names");
    });
    const auto r = ctx.stream->receive_bucket(specs, packed, deadline_of(in));
    stage_ahead(ctx, r);
    peer::send_json(res, 200, json{{"message", "Weights updated"}, {"n_tensors", r.n_tensors}, {"bytes", r.bytes},
                                   {"n_received", r.n_received}, {"n_expected", r.n_expected}});
}

// ---- SGLang ----

void sglang_init_group(ApiContext & ctx, const ControlInput & in, Response & res) {
    reject_unknown_fields(in.body, {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s",
                                    "nccl_unique_id", "pp_rank"}, "init_weights_update_group");  // pp_rank: AReaL's, SGLang ignores it
    const json & b = in.body.is_object() ? in.body : json::object();
    stream::InitRequest r = init_fields(b, "init_weights_update_group", "tcp");
    r.backend = r.backend == "gloo" ? "tcp" : r.backend;  // SGLang's gloo group: the TCP transport
    const auto ep = ctx.stream->init(r);
    json body = endpoint_json(ep, *ctx.stream);
    body["success"] = true;
    body["message"] = "Succeeded to initialize custom process group.";
    peer::send_json(res, 200, body);
}

/// One SGLang bucket. The first opens the update (labelled weight_version); the one that
/// completes the model's tensors commits it.
void sglang_update_distributed(ApiContext & ctx, const ControlInput & in, Response & res) {
    const json & b = in.body.is_object() ? in.body : json::object();
    std::optional<std::string> v;
    const auto specs = announced(ctx, [&] {
        reject_unknown_fields(in.body, {"names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version", "load_format",
                                        "abort_all_requests", "torch_empty_cache"}, "update_weights_from_distributed");
        // SGLang's UpdateWeightsFromDistributedReqInput: abort_all_requests ends every request in
        // flight first (AReaL sends it after pause_generation); torch_empty_cache frees a CUDA caching
        // allocator fdrollout has not (accepted, no work).
        for (const char * key : {"abort_all_requests", "torch_empty_cache"}) {
            if (b.contains(key) && !b[key].is_null() && !b[key].is_boolean()) {
                throw Error(Errc::invalid_argument, fmt::format("'{}' must be a boolean", key), key);
            }
        }
        v = checked_version(b, "weight_version");
        auto out = read_specs(b, "dtypes");
        if (b.value("abort_all_requests", false)) {
            const auto o = peer::run(ctx, in, {.op = "abort", .abort_all = true});
            if (o.error) { throw *o.error; }
        }
        return out;
    });
    const json st = json::parse(ctx.stream->status_json());
    if (!st.value("update_open", false)) {
        announced(ctx, [&] { ctx.stream->check_specs(specs); });  // before the start waits for the trainer: a bad bucket never opens an update
        ctx.stream->start(v, deadline_of(in));
    }
    const auto r = ctx.stream->receive_bucket(specs, false, deadline_of(in));
    stage_ahead(ctx, r);
    if (r.n_received < r.n_expected) {
        return peer::send_json(res, 200, json{{"success", true}, {"n_received", r.n_received}, {"n_expected", r.n_expected},
                                              {"message", fmt::format("received {} of {} tensors; the update commits when every tensor arrived",
                                                                      r.n_received, r.n_expected)}});
    }
    stream::Sealed sealed;
    try {
        sealed = ctx.stream->seal(v);
    } catch (const Error & e) {  // SGLang's flow has no separate finish to retry: the update goes (a last bucket relabelling it, ...)
        ctx.stream->drop(e);
        throw;
    }
    json body = commit_sealed(ctx, in, std::move(sealed));
    body["success"] = true;
    body["message"] = "Succeeded to update parameter online.";
    peer::send_json(res, 200, body);
}

using StreamFn = void (*)(ApiContext &, const ControlInput &, Response &);
const std::map<std::string, StreamFn> kStreamRoutes = {
    {"/init_weight_transfer_engine", vllm_init},
    {"/start_weight_update", vllm_start},
    {"/finish_weight_update", vllm_finish},
    {"/abort_weight_update", stream_abort},
    {"/init_weights_update_group", sglang_init_group},
    {"/update_weights_from_distributed", sglang_update_distributed},
};

}  // namespace

void stream_route(ApiContext & ctx, const Request & req, Response & res) {
    require_stream(ctx, req);
    kStreamRoutes.at(req.path)(ctx, read_control_input(req), res);
}

void update_weights_route(ApiContext & ctx, const Request & req, Response & res) {
    const ControlInput in = read_control_input(req);
    if (in.body.is_object() && in.body.contains("update_info")) {  // vLLM's bucket; else prime-rl's {"weight_dir"}
        require_stream(ctx, req);
        return vllm_bucket(ctx, in, res);
    }
    peer_alias_route(ctx, req, res);
}

}  // namespace fd::api
