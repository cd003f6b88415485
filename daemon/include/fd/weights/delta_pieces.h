// fd/weights/delta_pieces.h — one rank's part of a delta in training (HF) names, planned and
// written straight from the delta file's bytes (SPEC §12, docs/weight_streams.md "Delta updates").
//
// A delta stream's commit writes ONE file, weights.fddelta (fd/weights/weight_delta.h: int32
// indices when they fit, values in the HF dtype); every rank reads it (read_weight_delta_into) and splits
// it itself with its own layout plan (fd/checkpoint/layout.h), as weights::split_delta would, but
// without materialising the split: a piece is a range of one HF tensor's indices (or of a dense
// tensor's elements) that lands on one inference tensor of this rank at a fixed shift (q|k|v and
// gate|up stacked by rows, embed / lm_head by vocab rows: one piece per part; o_proj and
// down_proj by columns: one piece per HF row). The rank writes each piece's values into its
// shard in place, keeping the old values in an undo buffer (write_piece / restore_piece), so a
// rank failing part way — or any other rank failing — puts every written piece back.
#pragma once

#include "fd/checkpoint/layout.h"
#include "fd/weights/weight_delta.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fd::weights {

/// A range of one delta tensor that lands on one inference tensor of the rank.
struct DeltaPiece {
    int32_t tensor = 0;   ///< index into layout.tensors
    int32_t src = 0;      ///< index into the mapped delta's tensors
    bool    dense = false;
    int64_t k0 = 0, k1 = 0;  ///< sparse: positions [k0, k1) of src's indices; dense: HF elements [k0, k1)
    int64_t lo = 0, hi = 0;  ///< the HF flat indices the piece may hold, [lo, hi) (checked before writing)
    int64_t shift = 0;    ///< the shard element of HF index i is i + shift
    int64_t old_at = 0;   ///< byte offset of the piece's old values in the undo buffer

    int64_t n() const { return k1 - k0; }   ///< elements written
};

/// Every piece of `d` on the rank `layout` is planned for, grouped by inference tensor in the
/// layout's order, and the undo buffer's size.
struct DeltaPlan {
    std::vector<DeltaPiece> pieces;
    int64_t                 old_bytes = 0;   ///< the undo buffer: each piece's n() × the shard's element size, 8-byte aligned
    int64_t                 n_values = 0;    ///< elements written, all pieces
};

/// Plan `layout`'s pieces of `d` (binary searches only: O(rows × log n) per tensor; nothing is
/// written). HF names the layout does not read (a tied lm_head, another rank's experts) give
/// nothing. Errors  fd::Error{invalid_checkpoint} naming the tensor when a delta tensor's shape
/// or dtype does not match the layout's part (F16 / BF16 → an f32 shard is the one widening
/// allowed, as the loader widens).
/// `storage`: a vector whose capacity the plan reuses (its elements are dropped; a caller that
/// plans every update passes the last plan's pieces back, so no fresh memory is touched).
DeltaPlan plan_delta_pieces(const MappedWeightDelta & d, const model::WeightLayout & layout, std::vector<DeltaPiece> && storage = {});

/// Prefetch (for writing) the shard lines of piece `p`'s first few elements (sparse pieces;
/// dense ones stream): a column part's pieces are a handful of elements each, too short for
/// write_piece's own look-ahead, so the caller asks for a piece a few pieces before writing it.
void prefetch_piece(const DeltaPiece & p, const MappedWeightDelta & d, const model::InferenceTensor & t, std::byte * shard);

/// Write piece `p` of `d` into `shard` (the inference tensor layout.tensors[p.tensor]'s bytes, its
/// memory dtype) and save the bytes it overwrites at `old + p.old_at`. Every index is checked
/// first (strictly increasing, inside [p.lo, p.hi)); nothing is written when one is not.
/// Errors  fd::Error{invalid_checkpoint} naming the tensor and the position.
void write_piece(const DeltaPiece & p, const MappedWeightDelta & d, const model::InferenceTensor & t, std::byte * shard,
                 std::byte * old);

/// Put back what write_piece(p, ...) overwrote (the saved bytes at `old + p.old_at`).
void restore_piece(const DeltaPiece & p, const MappedWeightDelta & d, const model::InferenceTensor & t, std::byte * shard,
                   const std::byte * old);

}  // namespace fd::weights
