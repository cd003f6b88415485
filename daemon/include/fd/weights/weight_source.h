// fd/weights/weight_source.h — where wakeup and update_weights take new weights from.
//
// One implementation per --load-strategy. A source only locates and describes a checkpoint
// (its validated tensor index and version); the Worker stages, validates against the running
// model and applies it all-or-nothing. Called on the engine thread only.
#pragma once

#include "fd/checkpoint/safetensors.h"

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

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
    /// The rank's weights are CUDA device memory: the ipc source leaves CUDA IPC tensors on the
    /// device (TensorInfo::on_cuda_ipc) for fill_weights to copy device to device; false: they
    /// are copied to host memory here.
    bool                       device_destination = false;
};

struct FetchedCheckpoint {
    model::TensorIndex         index;             ///< headers read and bounds-checked
    std::optional<std::string> version;           ///< the version this checkpoint carries, if it says
    bool                       checksum_verified = false;
    double                     transfer_s = 0.0;  ///< time spent moving bytes to this host (rsync)
    /// Called once every byte was copied into staging and before it goes live; throws to drop
    /// the staged copy (ipc: the publisher rewrote the record during the copy).
    std::function<void()>      verify_copied;
    /// Keeps alive what `index` points into (rsync: the staged version dir, removed with it).
    std::shared_ptr<void>      hold;
};

class WeightSource {
public:
    virtual ~WeightSource() = default;
    virtual LoadStrategy strategy() const = 0;
    /// Locate the checkpoint for `req`.
    /// Errors  not_found (unknown version), source_unavailable (source unreachable),
    ///         invalid_checkpoint / checksum_mismatch (bad files).
    virtual FetchedCheckpoint fetch(const FetchRequest & req) = 0;
};

/// Everything a source may need; one struct for all strategies.
struct SourceConfig {
    LoadStrategy          strategy = LoadStrategy::normal;
    std::filesystem::path model_dir;     ///< --model
    int                   port = 8000;   ///< ipc: the shm records are /fdrollout.<port>.weights.tp<rank>
    std::string           rsync_config;  ///< --rsync-config JSON (rsync)
};

/// The source for `cfg.strategy`. Errors  fd::Error{invalid_argument} on a bad rsync config.
std::unique_ptr<WeightSource> make_weight_source(const SourceConfig & cfg);

/// `normal`: the --model checkpoint directory, re-read on every fetch; its version is
/// version.yaml `step` when present.
std::unique_ptr<WeightSource> make_normal_source(std::filesystem::path model_dir);
/// `ipc_snapshot`: model_state.tp{rank}.part{N}.safetensors (all N, ascending), else
/// model_state.tp{rank}.safetensors, else the full checkpoint, in --model (weight_sources.md).
std::unique_ptr<WeightSource> make_ipc_snapshot_source(std::filesystem::path model_dir);
/// `ipc`: the POSIX shm record a trainer published (weight_sources.md, fd/shm/ipc_weights.h).
std::unique_ptr<WeightSource> make_ipc_source(int port);
/// `rsync`: versions pulled with the rsync program from the store in `config_json`; `port` names
/// the default staging dir ($TMPDIR/fdrollout-staging-<port>; 0: the pid).
/// Errors  fd::Error{invalid_argument} naming the bad field.
std::unique_ptr<WeightSource> make_rsync_source(std::filesystem::path model_dir, const std::string & config_json, int port = 0);

}  // namespace fd::weights
