// fd/stream/weight_stream.h — trainer → rollout weight streams without files (SPEC §12;
// docs/weight_streams.md is the wire reference).
//
// A trainer pushes its new weights, in training (Hugging Face) names, over a transport the
// daemon opens for it; nothing touches a file system the trainer can see. The calls are vLLM's
// weight-transfer routes (SGLang's map onto the same calls, src/api/stream_routes.cpp):
//
//   init   (/init_weight_transfer_engine)  open the transport: on CPU a TCP listener on --host,
//          port chosen by the kernel, with a one-time token; the trainer connects and sends the
//          token as its first frame. The transport lives until the next init, a failed
//          stream, or the trainer closing its connection.
//   start  (/start_weight_update)          open one update: accept the trainer's connection
//          (rendezvous, bounded), create its private staging dir.
//   bucket (/update_weights {update_info}) announce tensors {names, dtype_names, shapes}; the
//          call returns once every announced tensor arrived on the transport, in announced
//          order, and was validated (known name, dtype and shape equal to the model's, no
//          duplicate in the stream, every value finite) and written to the staging dir.
//   finish (/finish_weight_update)         every tensor of the model present: the staging dir
//          is sealed as a Hugging Face checkpoint; the caller (the HTTP layer) then stages and
//          commits it on every rank with update_weights {weight_dir} (all ranks or none), and
//          reports committed() or drop().
//
// Delta updates: start with a base_version (every rank must serve it; the route checks, here
// and again before commit) names the last committed stream as the base; a bucket's tensor may
// then be (indices, values) or full. They are kept in memory (checked) and seal() writes them to
// one delta file (fd/weights/weight_delta.h) instead of a checkpoint, plus each rank's share of
// it split once by that rank's layout plan (fd/weights/rank_delta.h: runs in the shard's
// coordinates); the commit writes each share in place into its rank's weights and the delta into
// the base's dir (all or nothing, the engine's update_weights {weight_delta}), so the work is
// proportional to the delta and the dir stays the serving weights' complete source, byte for
// byte what a full stream of the same weights gives.
//
// All-or-nothing: any failure (bad input, a dead or silent trainer, a failed commit) drops the
// open update: its staging dir is removed, the transport closed, and the serving weights are
// untouched. The error stays readable (last_error) so a later finish names what went wrong.
// Bounded: every wait has a deadline — the rendezvous and each bucket by the caller's deadline
// (at most the stream timeout), the gaps between calls of an open update by the stream timeout
// (a watchdog thread drops an update that got nothing for that long, and at once when the
// trainer's connection closes).
//
// Staging: a private dir (mode 0700, owned by the daemon's user) under the staging root
// (default /dev/shm: tmpfs, memory), one safetensors file per bucket plus
// model.safetensors.index.json. After a commit the dir stays as the serving weights' source
// (a wakeup after sleep reloads them from it) until the next stream commits; every dir of this
// daemon is removed when it stops, and dirs of dead daemons on the same port at start-up.
//
// Thread-safety: every member may be called from any thread (the HTTP control pool); one
// update at a time; a second bucket while one is being received is refused (409).
#pragma once

#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/status.h"

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fd::stream {

using Clock = std::chrono::steady_clock;

struct StreamConfig {
    std::filesystem::path model_dir;        ///< --model: the names, shapes and dtypes every stream must carry
    std::filesystem::path staging_root;     ///< where staging dirs go; "" = /dev/shm when present, else the temp dir
    std::string           host = "127.0.0.1";  ///< the TCP transport listens here (--host)
    int32_t               port = 8000;      ///< the daemon's port (names its staging dirs)
    double                timeout_s = 900;  ///< --control-timeout-s: default bound of every wait
    int32_t               cuda_device = 0;  ///< nccl: the device this process receives on
    /// The serving model's config and rank layout (the engine's): seal() splits a delta with
    /// plan_layout(model_cfg, --model's index, {rank, tp_size, ep_size}) for every rank.
    model::ModelConfig    model_cfg;
    int32_t               tp_size = 1;      ///< the engine's ranks (tensor-parallel size)
    int32_t               ep_size = 1;      ///< --enable-expert-parallel (1 = off)
    /// --nnodes: > 1 refuses every stream at init (409): the staging files are on this host,
    /// and the ranks of the other hosts could not read them.
    int32_t               nnodes = 1;
    /// Keep the dir a full commit replaces as the spare, whose tmpfs pages the next full update
    /// writes over (one host copy of the weights more between updates, fewer page allocations and
    /// one copy less per byte in the next one); false: removed at once. FD_STREAM_RECYCLE_STAGING=0.
    bool                  recycle_staging = true;
    /// Stage each full update's bucket on the ranks as soon as it arrived (Worker::stage_bucket;
    /// the engine runs it between steps), so the finish mostly commits. It pays where the ranks'
    /// copies have cores beside the trainer's send and the receive; on a 2-core host it slows the
    /// stream (docs/benchmarks.md, "Stop 45"). stage_ahead_choice() decides.
    bool                  stage_ahead = false;
};

/// FD_STREAM_STAGE_AHEAD: `env` 1 = on, 0 = off, -1 = auto: on when this process may use at
/// least tp_size + 2 CPUs (fd/cpus.h: affinity mask and cgroup quota; one per rank's copy, the
/// receiver, the trainer's sender).
bool stage_ahead_choice(int32_t env, int32_t tp_size);

/// One tensor as announced (and as it must arrive).
/// A full tensor's payload is its numel values; a delta's (n_indices >= 0) is `n_indices` flat
/// element indices into the HF tensor (index_bytes each: int64 or int32, little-endian, sorted,
/// unique, in [0, numel)) followed by `n_indices` values of `dtype`; it is applied to a copy of
/// the base version's tensor.
struct TensorSpec {
    std::string          name;              ///< training (HF) name
    fd::DType            dtype = fd::DType::f32;
    std::vector<int64_t> shape;             ///< the HF tensor's, outermost first (a delta's too)
    int64_t              nbytes = 0;        ///< payload bytes on the wire: numel × dtype size, or a delta's n_indices × (index_bytes + dtype size)
    int64_t              n_indices = -1;    ///< -1 = a full tensor; >= 0 = a delta of that many elements
    int32_t              index_bytes = 0;   ///< a delta's index width: 8 (int64) | 4 (int32)

    bool    is_delta() const { return n_indices >= 0; }
    int64_t numel() const;                  ///< product of shape
    int64_t full_nbytes() const;            ///< numel × dtype size (what the staged tensor holds)
};

/// Parse an index dtype name: I64 | int64 | I32 | int32 (torch's with "torch."). Returns 8 or 4.
/// Errors  fd::Error{invalid_argument} naming `what`.
int32_t parse_index_dtype_name(const std::string & s, const std::string & what);

/// Parse a dtype name as trainers send it: safetensors' F32 | F16 | BF16, or torch's float32 |
/// float16 | bfloat16 (also "torch.float32", "float", "half").
/// Errors  fd::Error{invalid_argument} naming `what` (the tensor) and the accepted names.
fd::DType parse_dtype_name(const std::string & s, const std::string & what);

struct InitRequest {
    std::string            backend = "tcp";   ///< "tcp" (CPU transport) | "nccl" (GPU; needs a CUDA build)
    std::optional<double>  timeout_s;         ///< bound of each wait, (0, fd::kMaxWaitS] (fd/deadline.h: larger is a 400); default StreamConfig::timeout_s
    // nccl: the trainer is rank 0 of a group of world_size; the daemon's receiver is rank_offset.
    std::string            nccl_unique_id;    ///< 256 hex digits (ncclUniqueId)
    int32_t                rank_offset = 1;
    int32_t                world_size  = 2;
};

/// Where the trainer sends (the answer of init).
struct Endpoint {
    std::string backend;                      ///< "tcp" | "nccl"
    std::string host;                         ///< tcp: connect here
    int32_t     port = 0;
    std::string token;                        ///< tcp: 32 hex digits, the first frame's "token"
    double      timeout_s = 0;                ///< the bound the daemon applies to each wait
};

/// A per-expert view of a stacked expert tensor (StreamManager::expert_views).
struct ExpertView {
    std::string stacked;  ///< the stacked tensor's name, e.g. model.layers.0.mlp.experts.gate_up_proj
    TensorSpec  spec;     ///< the view: e.g. model.layers.0.mlp.experts.3.up_proj.weight [I, H]
};

/// One received bucket.
struct BucketReport {
    int32_t n_tensors = 0;
    int64_t bytes = 0;
    int32_t n_received = 0;                   ///< tensors in the update so far (a stacked expert tensor: each expert's it holds)
    int32_t n_expected = 0;                   ///< tensors the model has (stacked experts counted per expert)
    double  seconds = 0;
    /// A full update's bucket file, complete and never written again (its tensors as safetensors,
    /// in the update's staging dir): the ranks may stage it ahead of the finish (ControlCommand::
    /// weight_bucket). Empty for a delta update's bucket.
    std::filesystem::path file;
};

/// A complete update, ready to load.
struct Sealed {
    std::filesystem::path      dir;           ///< an HF checkpoint dir (index + shards), 0700
    std::optional<std::string> version;       ///< as given to start (or finish)
    int64_t                    bytes = 0;
    int32_t                    n_tensors = 0;
    std::optional<std::string> base_version;  ///< a delta update's base
    int32_t                    n_delta = 0;   ///< tensors that came as deltas
    int32_t                    n_from_base = 0;  ///< tensors not sent: they keep the base's bytes
    /// A delta update: the file (fd/weights/weight_delta.h) holding every sent tensor (sparse or
    /// dense), to be written into `base_dir` (the committed stream's dir, the wakeup source), and
    /// next to it each rank's share (weights::rank_delta_file), written in place into the ranks;
    /// `dir` then holds only these files. Empty for a full update. `base_dir` empty with a
    /// base_version: the base was landed (no dir holds it), so the delta goes to the ranks alone
    /// (update_weights {weight_delta, weight_land}).
    std::filesystem::path      delta_file;
    std::filesystem::path      base_dir;
    /// A landed update (start's `land`): the ranks received the tensors themselves
    /// (fd/stream/landing.h); the caller commits with update_weights {weight_land}, which fails
    /// unless every rank's parts all arrived. `dir` is empty of tensors.
    bool                       landed = false;
};

/// What the ranks serve now, from the engine's state (engine::EngineState): the label, and the
/// count of changes of the serving bytes (weights_epoch).
struct ServingNow {
    std::string weight_version;
    uint64_t    weights_epoch = 0;
};

class StreamManager {
public:
    explicit StreamManager(StreamConfig cfg);
    ~StreamManager();  ///< drops any update, closes the transport, removes every staging dir
    StreamManager(const StreamManager &) = delete;
    StreamManager & operator=(const StreamManager &) = delete;

    /// Open a transport (closing any earlier one).
    /// Errors  wrong_state while an update is open (finish or abort it first);
    ///         invalid_argument for an unknown backend or bad nccl fields; not_found for nccl
    ///         without CUDA; invalid_checkpoint when --model's tensor index cannot be read.
    Endpoint init(const InitRequest & req);

    /// Open an update labelled `version` (nullopt: the label is decided at the commit). Accepts
    /// the trainer's connection if it has not been accepted yet, until `deadline`.
    /// `base_version` set: a delta update against that version. Its tensors may come as deltas
    /// (applied to a copy of the base's tensor) or in full; tensors not sent keep the base's
    /// bytes. The base bytes are those of the stream this manager committed last (base_dir()):
    /// the caller checks that every rank serves `base_version` (here and again before commit).
    /// Errors  wrong_state (no transport; an update already open; `base_version` is not the
    ///         version of the last committed stream — nothing is opened, the transport stays),
    ///         timeout (no trainer connected with the right token by the deadline: the
    ///         transport is closed).
    /// `land`: the trainer lands the tensors on the ranks itself (fd/stream/landing.h; the caller
    /// opens the ranks' landings): this update takes no bucket, and seal() returns it as landed.
    /// Errors  also invalid_argument for `land` with a base_version; wrong_state for `land`
    ///         on another transport than tcp.
    void start(std::optional<std::string> version, Clock::time_point deadline,
               std::optional<std::string> base_version = std::nullopt, bool land = false);

    /// Receive one bucket: `specs` in order, each as one frame (packed=false) or all as one
    /// frame (packed=true). Returns when all arrived and were written to the staging dir (a
    /// delta update: checked and kept in memory for the delta file).
    /// Errors  (the transport is closed on every one, and the update dropped unless sealed)
    ///         wrong_state: no update open, or one being received (which stops too) or sealed;
    ///         invalid_argument: an unknown name, a dtype or shape unlike the model's, a name
    ///           twice (in the bucket or the stream; also an expert sent both inside its stacked
    ///           tensor and under its per-expert name), a stacked expert tensor in a delta
    ///           update (its per-expert names, expert_views(), are what a delta takes), a
    ///           frame unlike its announcement, a delta
    ///           in an update without base_version, a delta's indices unsorted, duplicated or
    ///           out of range (tensor and position named);
    ///         invalid_checkpoint: a non-finite value (tensor and element named);
    ///         timeout: the bytes did not arrive by `deadline`; source_unavailable: the trainer
    ///           closed the connection.
    BucketReport receive_bucket(const std::vector<TensorSpec> & specs, bool packed, Clock::time_point deadline);

    /// Each of `specs` names a tensor of the model with its dtype and shape, checked without
    /// waiting for anything (SGLang's bucket opens the update, which waits for the trainer: a
    /// bucket naming no tensor of the model is refused first). Errors  wrong_state when no
    /// transport was initialized (naming both inits); invalid_checkpoint naming the tensor and the
    /// field ("names", "dtype_names", "shapes").
    void check_specs(const std::vector<TensorSpec> & specs) const;

    /// Check that every tensor of the model arrived (a stacked expert tensor stands for every
    /// per-expert tensor it holds; it is staged under its stacked name and the ranks' loader
    /// splits it, as it splits a checkpoint's) and seal the staging dir. `version` (if
    /// given) overrides start's. A delta update instead writes its tensors to the delta file
    /// (Sealed::delta_file; tensors not sent keep the base's bytes). The update then waits for
    /// committed() or drop().
    /// Errors  wrong_state (no update open: says why the last one was dropped, if it was);
    ///         invalid_argument naming the missing tensors (the update is dropped).
    Sealed seal(std::optional<std::string> version);

    /// The sealed update went live as `version` (the label the engine gave it): its dir becomes
    /// the serving weights' source and the base of later deltas; the previous stream's dir
    /// becomes the spare, whose bucket files the next full update writes over in place (their
    /// tmpfs pages recycled: BucketFile), and the spare before it is removed (off the finish's
    /// critical path). A delta update: the base's dir (updated in place by the engine) stays the
    /// source, the delta file's dir is removed. The update is closed; the transport stays.
    /// `weights_epoch`: the engine's count of serving-byte changes after the commit
    /// (serves_last_stream compares it).
    void committed(const std::string & version, uint64_t weights_epoch);

    /// Remove the spare dir (a weight sleep hands its memory back: Engine::set_weight_sleep_hook)
    /// and return the bytes its files held; the next full update allocates fresh pages. Any
    /// thread; a bucket in flight is not disturbed (files it took are its own).
    int64_t release_spare();

    /// The base_version of the open update (nullopt: none open, or a full update).
    std::optional<std::string> open_base_version() const;

    /// Drop the open update (if any) for `why`: its staging dir is removed, the transport
    /// closed (a bucket being received stops at once). No-op without an update.
    void drop(const Error & why);

    /// The trainer's abort (POST /abort_weight_update): drop the open update for `why`, unless it
    /// is finishing (sealed, its commit running on the ranks: the finish's answer decides).
    /// A start still waiting for the trainer to connect stops too. Returns false when nothing was
    /// open. Errors  wrong_state (409) when finishing, naming it.
    bool abort(const Error & why);

    /// A bucket refused before its bytes were read (its announcement, or the state it came in):
    /// the trainer is already writing them and the next bucket would read them as its own, so
    /// the transport closes (a new init is needed) and an open update not yet finishing drops; a
    /// bucket in flight stops with `why`. Any thread.
    void out_of_step(const Error & why);

    /// The reason the last update was dropped ("" = none since the last init/start).
    std::optional<Error> last_error() const;

    /// Whether the ranks still serve the bytes of the last stream this daemon committed: `now`
    /// (the engine's state) carries its label, and the serving bytes have not changed since its
    /// commit (the same weights_epoch). False after an update from elsewhere (a checkpoint dir,
    /// even the stream's own; ipc; a rank's recovery that lost landed bytes), even under the same
    /// label, and before any stream committed.
    bool serves_last_stream(const ServingNow & now) const;

    /// The last committed stream's label ("" = none since start-up).
    std::string last_stream_version() const;

    /// For /health and the routes: {state: "idle" | "open" | "receiving" | "finishing",
    /// transport, connected, update_open, version, base_version, n_received, n_expected,
    /// n_delta, bytes_received, recycled_bytes (of the open update's, written into recycled
    /// pages), deadline_in_s (the watchdog's: seconds until an open update that gets nothing more
    /// is dropped; null when none), serving_stream_version, serving_landed (that version was
    /// landed on the ranks: no dir holds it), landing (the open update lands on the ranks),
    /// spare_bytes (the spare dir's recyclable bytes), last_error}. With `now`, the serving
    /// fields name the last stream only while it serves (serves_last_stream): null / false after
    /// an update from elsewhere.
    std::string status_json(const std::optional<ServingNow> & now = std::nullopt) const;

    /// The model's tensors a full update carries, under --model's checkpoint's own names and
    /// shapes (read at the first init): a stacked expert tensor as stored (3-D [E, 2*I, H] /
    /// [E, H, I]), a v5 Mixtral under its v5 names. What init lists. Empty before the first init.
    std::map<std::string, TensorSpec> expected() const;

    /// The per-expert views of --model's stacked expert tensors (split_stacked_experts' names and
    /// [rows, cols] shapes), each with the stacked name that holds it: accepted too, in place of
    /// that stacked tensor (never both for one expert), and the names a delta update takes. In
    /// the stacked tensors' name order, each one's views in file order (a stacked [E, R, C]
    /// tensor read as [E*R, C] is its views' rows one after another). Empty when --model stores
    /// no stacked experts, or before the first init.
    std::vector<ExpertView> expert_views() const;

    /// StreamConfig::stage_ahead: the routes have the ranks stage each bucket as it arrives.
    bool stage_ahead() const;
    /// The address the transport listens on (StreamConfig::host; the ranks' landings listen there too).
    const std::string & host() const;
    /// The bound of each wait of the transport opened last (init's timeout_s, else StreamConfig's).
    double timeout_s() const;

    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace fd::stream
