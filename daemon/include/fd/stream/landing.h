// fd/stream/landing.h — a full weight stream landed straight into one rank's staging region
// (issue 25, "land once"; docs/weight_streams.md "Landing").
//
// The daemon path copies each streamed byte four times (trainer → socket, socket → daemon,
// daemon → staging file, staging file → rank). Landing copies it twice, as loopback TCP does:
// the trainer opens one connection per rank and sends each rank its own shard, already in the
// rollout's layout; the rank's receiver thread reads it from the socket straight into the rank's
// staging region (the second copy of the weights that update_weights fills and commit swaps in).
// The finish then only waits for the last bytes and commits, all ranks or none.
//
// What a rank expects is its layout in byte terms: every WeightPart of every InferenceTensor is
// one contiguous range of the arena (a column slice's rows are consecutive in the shard), so the
// rank publishes its parts {hf_name, offset, nbytes, dtype, dim, src0, n} and the trainer, which
// needs no model knowledge, slices each training tensor and sends frames {offset, nbytes}.
//
// Wire (per rank connection): the hello frame of the daemon transport (b"FDW1", u32 LE length,
// {"token": "<32 hex>"}), answered by {"accepted": true}; then frames of a 16-byte header (u64 LE
// offset, u64 LE nbytes) and nbytes of payload. Each frame must be exactly one part not yet
// received, in the part's memory dtype (little-endian); parts may come in any order. The trainer
// shuts its side down when done: a rank missing parts at that point fails at once, naming one.
// Every value is checked finite as it arrives (256 KiB pieces, while in cache).
//
// A delta landing (LandMode::delta; docs/weight_streams.md "Landed deltas") carries sparse
// changes against the weights the rank serves: frames of a 16-byte header (u64 LE offset of the
// part | kDeltaFrame [| kDeltaIndices64], u64 LE n) then n indices (int32 LE, or int64 LE with
// kDeltaIndices64: flat element indices into the training tensor hf_shape, strictly increasing)
// then n values in the part's memory dtype. A row part (dim 0) takes the indices inside its rows;
// a column part (dim 1) takes every changed element of the training tensor and keeps those in its
// columns (the trainer needs no per-element split). At most one frame per part; parts without one
// keep their bytes. The end frame (offset kDeltaEnd, n = the delta frames the trainer sent this
// rank) completes it. The receiver checks and keeps the frames in a buffer; nothing touches the
// live weights until the owner applies them (Worker::land_close), between forward steps.
//
// Thread-safety: the receiver is one thread owned by the Landing; wait() and stop() are for the
// owner's thread (the rank's control path). Nothing here touches live weights.
#pragma once

#include "fd/checkpoint/layout.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fd::stream {

/// One contiguous range of a rank's weight region and where its bytes come from.
struct LandPart {
    std::string          hf_name;      ///< the training tensor
    int64_t              offset = 0;   ///< bytes into the region (the layout's arena offsets)
    int64_t              nbytes = 0;
    fd::DType            dtype = fd::DType::f32;  ///< in memory (the trainer sends these bytes)
    int                  dim = 0;      ///< 0: HF rows [src0, src0 + n) whole; 1: HF columns [src0, src0 + n) of every row
    int64_t              src0 = 0;
    int64_t              n = 0;
    std::vector<int64_t> hf_shape;     ///< the whole training tensor's shape
};

/// Every part of `layout` as a byte range (in arena order).
/// Errors  fd::Error{wrong_state} naming the tensor when a tensor's parts do not tile its bytes
///         (a layout this transport cannot fill; the daemon path still can).
std::vector<LandPart> land_parts(const model::WeightLayout & layout);

/// What a landing receives: every part in full (into a staging region), or sparse changes.
enum class LandMode { full, delta };

/// Delta frame header flags (the high bits of the offset field) and the end frame's offset.
inline constexpr uint64_t kDeltaFrame     = uint64_t{1} << 63;
inline constexpr uint64_t kDeltaIndices64 = uint64_t{1} << 62;
inline constexpr uint64_t kDeltaEnd       = ~uint64_t{0};

/// A delta landing's frames as received and checked: frame k changes part `part` at `n` elements,
/// indices [n] uint32 (elements into the part's range of the region) at bytes + idx_at, values [n]
/// (the part's dtype) at bytes + val_at. `bytes` is the buffer the Landing was given.
struct LandedDelta {
    struct Frame {
        int32_t part = 0;
        int64_t n = 0;
        int64_t idx_at = 0;
        int64_t val_at = 0;
    };
    std::vector<Frame> frames;
    std::byte *        bytes = nullptr;
    int64_t n_values() const;
};

/// The buffer bytes a delta landing of `parts` may need at most (every frame as large as its part
/// allows, int64 indices): the size to give the Landing.
int64_t delta_buffer_bytes(const std::vector<LandPart> & parts);

class Landing {
public:
    /// Listen on `host` (a port the kernel picks) with a fresh token and start the receiver,
    /// which writes the parts into `base` [region bytes] until each arrived once, an error, the
    /// deadline (now + `timeout_s`) or stop(). `check_finite`: refuse NaN/Inf (invalid_checkpoint).
    /// Errors  invalid_argument when `host` cannot be bound.
    Landing(std::vector<LandPart> parts, std::byte * base, const std::string & host, double timeout_s, bool check_finite);
    /// A delta landing (LandMode::delta, above): frames are checked (indices in the part's range
    /// and strictly increasing, values finite when `check_finite`) and kept in `buffer`
    /// [buffer_bytes] (delta_buffer_bytes(parts) is always enough) until the end frame.
    /// Errors  as the full landing's.
    Landing(LandMode mode, std::vector<LandPart> parts, std::byte * buffer, int64_t buffer_bytes, const std::string & host, double timeout_s,
            bool check_finite);
    ~Landing();  ///< stop()
    Landing(const Landing &) = delete;
    Landing & operator=(const Landing &) = delete;

    int32_t port() const;
    const std::string & token() const;
    const std::vector<LandPart> & parts() const;
    LandMode mode() const;
    /// A delta landing after wait() returned: its frames (pointing into the buffer it was given).
    LandedDelta delta() const;

    /// Wait until every part arrived (a delta landing: its end frame), or fail: the receiver's error (invalid_argument for a
    /// frame that is no expected part, invalid_checkpoint for a non-finite value, source_unavailable
    /// when the trainer closed with parts missing, naming the first), or timeout at `deadline`
    /// naming how many parts are missing. The receiver keeps running until stop().
    void wait(std::chrono::steady_clock::time_point deadline);

    /// Stop the receiver (closes the sockets, joins the thread). Idempotent; never throws.
    void stop() noexcept;

    struct State;

private:
    Landing(std::vector<LandPart> parts, std::byte * base, const std::string & host, double timeout_s, bool check_finite, LandMode mode,
            std::byte * buffer, int64_t buffer_bytes);
    std::unique_ptr<State> s_;
};

}  // namespace fd::stream
