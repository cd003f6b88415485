// fd/weights/weight_source.h — where wakeup and update_weights take new weights from.
//
// One implementation per --load-strategy. A source only locates and describes a checkpoint
// (its validated tensor index and version); the Worker stages, validates against the running
// model and applies it all-or-nothing. Called on the engine thread only.
#pragma once

#include "fd/checkpoint/safetensors.h"
#include "fd/status.h"

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fd::weights {

enum class LoadStrategy { normal, ipc_snapshot, ipc, rsync };

/// "normal" | "ipc_snapshot" | "ipc" | "rsync".
std::string_view to_string(LoadStrategy s);
/// Inverse of to_string. Errors  fd::Error{invalid_argument} on an unknown name.
LoadStrategy parse_load_strategy(std::string_view s);

struct FetchRequest {
    std::optional<std::string> version;           ///< asked-for version (already syntax-checked)
    bool                       verify_checksum = false;
    int32_t                    rank = 0;
    bool                       wakeup = false;    ///< reload after sleep (not an update)
    std::string                serving_version;   ///< the weight_version now served (or last served)
    /// wakeup: the source's own version of the serving bytes when known ("" = serving_version):
    /// an rsync wakeup pulls it again even when the label is a fingerprint label.
    std::string                serving_source_version;
    /// The rank's weights are CUDA device memory: the ipc source leaves CUDA IPC tensors on the
    /// device (TensorInfo::on_cuda_ipc) for fill_weights to copy device to device; false: they
    /// are copied to host memory here.
    bool                       device_destination = false;
    /// Not "": load the complete HF checkpoint in this directory instead of the source's
    /// (prime-rl's /update_weights weight_dir, /reload_weights: --model); see fetch_checkpoint_dir.
    std::string                weight_dir;
    bool                       weight_dir_owned = true;  ///< weight_dir must be the daemon user's (false: --model)
};

struct FetchedCheckpoint {
    model::TensorIndex         index;             ///< headers read and bounds-checked
    /// The checkpoint directory whose config.json describes these weights (the rank refuses one
    /// of other math than it serves); empty for sources without one (ipc records in /dev/shm,
    /// which other users may write to: nothing is read beside them).
    std::filesystem::path      config_dir;
    std::optional<std::string> version;           ///< the version this checkpoint carries, if it says
    bool                       checksum_verified = false;
    /// What the bytes are (fd/weights/fingerprint.h): the engine changes the label of a wakeup
    /// whose bytes differ from those the label was set on. "" = the source cannot say (ipc).
    std::string                fingerprint;
    double                     transfer_s = 0.0;  ///< time spent moving bytes to this host (rsync)
    /// Called once every byte was copied into staging and before it goes live; throws to drop
    /// the staged copy (ipc: the publisher rewrote the record during the copy).
    std::function<void()>      verify_copied;
    /// Keeps alive what `index` points into (rsync: the staged version dir, removed with it).
    std::shared_ptr<void>      hold;
};

/// A store version that is a delta on another (rsync; docs/weight_sources.md, "Delta versions"):
/// its weights.fddelta (fd/weights/weight_delta.h) changes `base_version`'s bytes.
struct StoreDelta {
    std::string           version;           ///< the delta version
    std::string           base_version;      ///< the version it changes
    std::string           base_fingerprint;  ///< manifest_fingerprint of the base (the bytes it must change)
    std::string           fingerprint;       ///< manifest_fingerprint of the delta version itself
    std::filesystem::path delta_file;        ///< the pulled weights.fddelta, checked against the manifest's SHA-256
    std::shared_ptr<void> hold;              ///< keeps the pulled dir; removed with the last reference
};

/// What a rank's rsync source says when asked to load a store version that is a delta (409
/// wrong_state; the engine then applies it in place, Engine::update_from_store_delta).
inline constexpr std::string_view kStoreDeltaRefusal = "in the store is a delta on";
/// True when `e` (also as a rank's error, prefixed with the rank) is that refusal.
inline bool is_store_delta_refusal(const Error & e) {
    return e.code() == Errc::wrong_state && std::string_view(e.what()).find(kStoreDeltaRefusal) != std::string_view::npos;
}

/// A private, writable copy of a full store version: a delta's base, to serve as the serving
/// dir (the wakeup source) that the deltas are then written into.
struct StoreCopy {
    std::filesystem::path dir;
    std::shared_ptr<void> hold;  ///< keeps the dir; removed with the last reference
};

class WeightSource {
public:
    virtual ~WeightSource() = default;
    virtual LoadStrategy strategy() const = 0;
    /// Locate the checkpoint for `req`.
    /// Errors  not_found (unknown version), source_unavailable (source unreachable),
    ///         invalid_checkpoint / checksum_mismatch (bad files).
    virtual FetchedCheckpoint fetch(const FetchRequest & req) = 0;
    /// The store version `version` (nullopt: the one fetch would take) when it is a delta, pulled
    /// whole (one rsync run: call it once a rank found a delta, is_store_delta_refusal); nullopt
    /// when it is a full version or the source holds no deltas (every strategy but rsync).
    /// Errors  as fetch (not_found, source_unavailable, invalid_checkpoint, checksum_mismatch).
    virtual std::optional<StoreDelta> fetch_delta(const std::optional<std::string> & version) {
        (void)version;
        return std::nullopt;
    }
    /// A private copy of the full store version `version` whose manifest_fingerprint must be
    /// `fingerprint`; checked against its manifest (every SHA-256 with `verify_checksum`).
    /// Errors  wrong_state (a delta, or other bytes than `fingerprint`), the fetch errors;
    ///         wrong_state from every strategy but rsync.
    virtual StoreCopy copy_version(const std::string & version, const std::string & fingerprint, bool verify_checksum);
};

/// Everything a source may need; one struct for all strategies.
struct SourceConfig {
    LoadStrategy          strategy = LoadStrategy::normal;
    std::filesystem::path model_dir;     ///< --model
    int                   port = 8000;   ///< ipc: the shm records are /fdrollout.<port>.weights.tp<rank>
    std::string           rsync_config;  ///< --rsync-config JSON (rsync)
    int                   tp = 1;        ///< ipc: the rollout's tensor parallel size (a record published for another is 422)
};

/// The source for `cfg.strategy`. Errors  fd::Error{invalid_argument} on a bad rsync config.
std::unique_ptr<WeightSource> make_weight_source(const SourceConfig & cfg);

/// `normal`: the --model checkpoint directory, re-read on every fetch; its version is
/// version.yaml `step` when present.
std::unique_ptr<WeightSource> make_normal_source(std::filesystem::path model_dir);
/// `ipc_snapshot`: model_state.tp{rank}.part{N}.safetensors (all N, ascending), else
/// model_state.tp{rank}.safetensors, else the full checkpoint, in --model (weight_sources.md).
std::unique_ptr<WeightSource> make_ipc_snapshot_source(std::filesystem::path model_dir);
/// `dir`/model_state.tp{rank}.safetensors: rank `rank`'s one-file snapshot, as the ipc_snapshot
/// source reads it (and the snapshot rank op writes a landed rank's weights, fd/runtime/rank_call.h).
std::filesystem::path ipc_snapshot_file(const std::filesystem::path & dir, int32_t rank);
/// The complete Hugging Face checkpoint in `dir` (any layout `normal` reads), its version.yaml
/// `step` and fingerprint. `owned`: `dir` and every file read must belong to the daemon's user
/// and not be writable by others (as ipc_snapshot files; --model itself is read with owned=false).
/// Errors  source_unavailable (no such dir), forbidden (owned and not), invalid_checkpoint.
FetchedCheckpoint fetch_checkpoint_dir(const std::filesystem::path & dir, bool owned);
/// The index of exactly `files` (safetensors, all in `dir`), each and `dir` checked to be the
/// daemon user's and not writable by others, as fetch_checkpoint_dir(dir, owned=true) checks
/// them: a weight stream's bucket file (RankOp::stage_bucket).
/// Errors  forbidden (not owned, or writable by others), not_found, invalid_checkpoint.
model::TensorIndex read_owned_files(const std::filesystem::path & dir, const std::vector<std::filesystem::path> & files);
/// `ipc`: the POSIX shm record a trainer published (weight_sources.md, fd/shm/ipc_weights.h) for
/// a rollout of `tp` ranks (a record whose tp_size differs is 422 invalid_checkpoint).
std::unique_ptr<WeightSource> make_ipc_source(int port, int tp = 1);
/// `rsync`: versions pulled with the rsync program from the store in `config_json`; `port` names
/// the default staging dir ($TMPDIR/fdrollout-staging-<port>; 0: the pid).
/// Errors  fd::Error{invalid_argument} naming the bad field.
std::unique_ptr<WeightSource> make_rsync_source(std::filesystem::path model_dir, const std::string & config_json, int port = 0);

}  // namespace fd::weights
