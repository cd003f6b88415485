// fd/weights/ipc_delta.h — a delta update over an ipc publish (docs/weight_streams.md, "Over ipc
// publishes"; the record's layout: fd/shm/ipc_weights.h IpcDeltaHeader).
//
// The trainer publishes full weights into the per-rank records (/dev/shm/fdrollout.<port>.
// weights.tp<rank>) once, then each step's changed elements, in HF names, into the port's one
// delta record (/dev/shm/fdrollout.<port>.weights.delta) with the version they make and the
// version they apply to. `update_weights {"version": V}` on an ipc daemon whose delta record
// names V applies it in place (Engine::update_from_ipc_delta); the engine reads the per-rank
// records' identities (ipc_record_ids) around every full load from them, so that a wakeup can
// tell whether the records still hold the bytes the deltas were applied to.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace fd::weights {

/// What one rank's weights record is: the shm object (device, inode) and its seqlock generation.
struct IpcRecordId {
    uint64_t dev = 0, ino = 0, generation = 0;
    bool operator==(const IpcRecordId &) const = default;
};

/// The identities of the `tp` weights records of `port`, rank order; nullopt when any is absent,
/// not a regular file, or not complete (generation 0 or odd). Reads 24 bytes per record; never
/// throws.
std::optional<std::vector<IpcRecordId>> ipc_record_ids(int port, int tp);

/// A delta record copied out of shared memory.
struct IpcDelta {
    std::string           version;       ///< the version the delta makes
    std::string           base_version;  ///< the version it applies to
    std::filesystem::path delta_file;    ///< `dir`/weights.fddelta: the payload (fd/weights/weight_delta.h), mode 0600
    int64_t               bytes = 0;     ///< its size
    IpcRecordId           record;        ///< the delta record copied (device, inode, generation)
};

/// The delta record of `port` if it exists and names `version`: its payload copied into
/// `dir`/weights.fddelta; then the generation and the object's identity are read again (a
/// publisher that wrote meanwhile: the copy is removed, 503). nullopt when there is no delta
/// record or it makes another version (the update is then a full one). The record must be the
/// daemon's user's with mode 0600 (fd/trust.h Trust::secret), like the weights records.
/// Errors  source_unavailable (a delta publish is in progress, or rewrote the record during the
///         copy: retry), forbidden (another user's or a group/other-accessible record),
///         invalid_checkpoint (bad magic, ABI, sizes or version strings; names the field).
std::optional<IpcDelta> fetch_ipc_delta(int port, const std::string & version, const std::filesystem::path & dir);

}  // namespace fd::weights
