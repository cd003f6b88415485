// fd/weights/weight_source.h — where wakeup and update_weights take new weights from.
//
// One implementation per --load-strategy. A source only locates and describes a checkpoint
// (its validated tensor index and version); the Worker stages, validates against the running
// model and applies it all-or-nothing. Called on the engine thread only.
#pragma once

#include "fd/model/safetensors.h"

#include <filesystem>
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
};

struct FetchedCheckpoint {
    model::TensorIndex         index;             ///< headers read and bounds-checked
    std::optional<std::string> version;           ///< the version this checkpoint carries, if it says
    bool                       checksum_verified = false;
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

/// `normal`: the --model checkpoint directory, re-read on every fetch; its version is
/// version.yaml `step` when present.
std::unique_ptr<WeightSource> make_normal_source(std::filesystem::path model_dir);

}  // namespace fd::weights
