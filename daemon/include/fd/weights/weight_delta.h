// fd/weights/weight_delta.h — a sparse weight update applied in place (a delta weight stream's
// commit; SPEC §12, docs/weight_streams.md "Delta updates").
//
// A delta names training (Hugging Face) tensors and, for each, the flat element indices into
// the HF tensor that change and their new values (or every element: a dense tensor sent in full
// inside a delta update). The stream route writes it to one file (write_weight_delta) and splits
// it per rank (fd/weights/rank_delta.h: runs in each shard's coordinates); every rank writes its
// share into its own shard in place (Worker::apply_rank_delta), keeping the old values as an undo
// log; the engine keeps this file and later writes the same values into the serving checkpoint
// dir (the wakeup source and the next delta's base, apply_delta_to_dir). Any failure undoes every
// rank and the dir: all-or-nothing, and the result is bit for bit what a full update of the same
// weights serves.
#pragma once

#include "fd/checkpoint/safetensors.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <sys/types.h>
#include <vector>

namespace fd {
class Arena;
}

namespace fd::weights {

/// One tensor's change.
struct DeltaTensor {
    std::string           name;       ///< training (HF) name
    fd::DType             dtype = fd::DType::f32;  ///< of the values (= the checkpoint's)
    std::vector<int64_t>  shape;      ///< the HF tensor's, outermost first
    bool                  dense = false;  ///< true: `values` holds every element, `indices` is empty
    std::vector<int64_t>  indices;    ///< [n] flat element indices into the HF tensor, sorted, unique, in [0, numel)
    std::vector<std::byte> values;    ///< [n] (dense: [numel]) values of `dtype`, little-endian

    int64_t numel() const;            ///< product of shape
    int64_t n_values() const;         ///< values.size() / dtype size
};

struct WeightDelta {
    std::vector<DeltaTensor> tensors;
    int64_t payload_bytes() const;    ///< indices (8 B each) + values
};

/// Write `d` to `file` (created, mode 0600): "FDDELTA1", u64 LE header length, a JSON header
/// {"tensors": [{name, dtype, shape, dense, n, index_bytes}]}, then each tensor's indices (absent
/// when dense; int32 LE when the tensor has < 2^31 elements: index_bytes 4, else int64 LE) and
/// values, in order.
/// Errors  fd::Error{invalid_argument} when the file cannot be written.
void write_weight_delta(const std::filesystem::path & file, const WeightDelta & d);

namespace detail {
struct Framed;  // delta_framing.h: an opened framed file
}  // namespace detail

/// A weights.fddelta file (write_weight_delta's format) mapped read-only (map_weight_delta) or
/// read into a kept buffer (read_weight_delta_into): each tensor's indices and values point into
/// it. Every rank of a delta stream's commit reads the same file and splits it with its own
/// layout (fd/weights/delta_pieces.h).
struct DeltaView {
    std::string          name;                 ///< training (HF) name
    fd::DType            dtype = fd::DType::f32;  ///< of the values
    std::vector<int64_t> shape;                ///< the HF tensor's, outermost first
    bool                 dense = false;        ///< true: `values` holds every element, no indices
    int64_t              n = 0;                ///< values (dense: numel)
    int32_t              index_bytes = 4;      ///< 4 (int32 LE) or 8 (int64 LE)
    const std::byte *    indices = nullptr;    ///< [n] flat HF indices (any alignment; read with index())
    const std::byte *    values = nullptr;     ///< [n] values of `dtype` (any alignment)

    int64_t numel() const;                     ///< product of shape
    /// Index k (0 <= k < n) of a sparse tensor, widened.
    int64_t index(int64_t k) const {
        if (index_bytes == 4) {
            int32_t v;
            std::memcpy(&v, indices + 4 * k, 4);
            return v;
        }
        int64_t v;
        std::memcpy(&v, indices + 8 * k, 8);
        return v;
    }
};

class MappedWeightDelta {
public:
    MappedWeightDelta() = default;
    ~MappedWeightDelta();
    MappedWeightDelta(const MappedWeightDelta &) = delete;
    MappedWeightDelta & operator=(const MappedWeightDelta &) = delete;
    std::vector<DeltaView> tensors;            ///< in the file's order
    /// The tensor named `name`, or nullptr.
    const DeltaView * find(const std::string & name) const;

private:
    friend std::shared_ptr<const MappedWeightDelta> map_framed(const detail::Framed & f, const std::filesystem::path & file);
    void * map_ = nullptr;
    size_t map_bytes_ = 0;
};

/// Map `file` (a regular file; read-only, shared: its page-cache pages, nothing copied) and
/// check its framing: every tensor's dtype, n <= numel (dense: n == numel) and bytes inside the
/// file. The indices' order is NOT checked here (O(1) per tensor): whoever writes through them
/// checks each against the range it may hold (delta_pieces.h write_piece).
/// Errors  fd::Error{invalid_checkpoint} naming the file and the tensor.
std::shared_ptr<const MappedWeightDelta> map_weight_delta(const std::filesystem::path & file);

/// map_weight_delta's views over a copy of `file` read (pread) into `buffer`, which is grown
/// (Arena::reserve: a fresh mapping, 2 MiB pages from 2 MiB on) when it is smaller than the
/// file and otherwise reused. Why not map: a rank reads every index and value of its share once,
/// and on a shadow-paged guest (the PVM CI machine) each first touch of a 4 KiB page of a fresh
/// file mapping costs ~2 µs (a 41 MB delta: 10 k pages, 20 ms), where the kernel's copy reads the
/// page cache through its own mapping and the kept buffer stays faulted in (docs/benchmarks.md
/// "Stop 48"). The result points into `buffer`: drop it before `buffer` is read into again or
/// released. Same checks and errors as map_weight_delta, plus invalid_checkpoint when the read
/// comes up short, and internal when the buffer cannot be mapped (out of memory).
/// A file over `max_copy_bytes` (dense tensors in it, near a full update: not kept twice) is
/// mapped as map_weight_delta does instead, and `buffer` released — one open and one fstat
/// either way.
std::shared_ptr<const MappedWeightDelta> read_weight_delta_into(const std::filesystem::path & file, Arena & buffer,
                                                                int64_t max_copy_bytes = INT64_MAX);

/// Read a file written by write_weight_delta and check it (sizes, indices sorted, unique and in
/// range). Errors  fd::Error{invalid_checkpoint} naming the file and the tensor.
WeightDelta read_weight_delta(const std::filesystem::path & file);

/// `older` then `newer` as one delta: every tensor of either; for a tensor in both, the union of
/// their indices with newer's value where both name an element (a dense side makes the result
/// dense: newer dense replaces, older dense takes newer's values at its indices). Applying the
/// result equals applying older then newer. Cost: O(elements of both). Errors
/// fd::Error{invalid_checkpoint} naming a tensor whose dtype or shape differ between the two.
WeightDelta merge_weight_deltas(const WeightDelta & older, const WeightDelta & newer);

/// The old bytes of a checkpoint dir a delta overwrote, to put back (restore_dir).
struct DirUndo {
    struct File {
        std::filesystem::path path;
        struct timespec       mtime{};            ///< before the write (restored with the bytes)
        std::vector<int64_t>  offsets;            ///< byte offsets written
        std::vector<int64_t>  sizes;              ///< bytes at each
        std::vector<std::byte> old;               ///< their old bytes, back to back
    };
    std::vector<File> files;
};

/// Write `d`'s values into the safetensors files of the checkpoint dir `dir` in place (each
/// file mapped shared; its mtime is then set to now so that a fingerprint of the dir
/// (fingerprint.h) tells the new bytes from the old). Every tensor of `d` must be in the dir
/// with the same dtype and shape (checked before anything is written). `undo` (optional)
/// receives the old bytes. Errors  fd::Error{invalid_checkpoint} naming the tensor (nothing
/// written), source_unavailable when a file cannot be mapped (what was written is put back).
void apply_delta_to_dir(const std::filesystem::path & dir, const WeightDelta & d, DirUndo * undo);

/// Put back what apply_delta_to_dir wrote (bytes and mtimes). Never throws (logs a failure).
void restore_dir(const DirUndo & undo) noexcept;

}  // namespace fd::weights
