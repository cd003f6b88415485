// fd/weights/rank_delta.h — a sparse weight update split by the tensor-parallel layout: one
// rank's share, in its shard's coordinates (SPEC §12, docs/weight_streams.md "Delta updates").
//
// A delta (fd/weights/weight_delta.h) names training (HF) tensors and flat element indices into
// them. The daemon splits it ONCE per rank with that rank's layout plan (fd/checkpoint/layout.h:
// q|k|v and gate|up stacked by rows, o_proj and down_proj by columns, embed / lm_head by vocab
// rows, norms whole; expert parallelism keeps whole experts on their rank): each rank gets only
// the runs of consecutive shard elements it holds, their values already in the shard's memory
// dtype (F16 widened to f32 as the loader widens it). A rank then writes each run with one copy
// and keeps the old bytes of the same runs as its undo log (Worker::apply_rank_delta); it never
// reads another rank's indices nor divides an index.
#pragma once

#include "fd/checkpoint/layout.h"
#include "fd/weights/weight_delta.h"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace fd::weights {

/// One inference tensor's share of a delta on one rank.
struct RankDeltaTensor {
    std::string            name;              ///< inference name (WeightLayout::find)
    fd::DType              dtype = fd::DType::f32;  ///< the shard's memory dtype (= the values')
    std::vector<int64_t>   shape;             ///< the rank's shard shape, outermost first (checked by the rank)
    std::vector<int64_t>   starts;            ///< [n_runs] first element of each run, flat into the shard; runs never overlap
    std::vector<int64_t>   lens;              ///< [n_runs] elements per run; EMPTY when every run is one element
    std::vector<std::byte> values;            ///< [sum of lens] values of `dtype`, the runs' back to back

    int64_t n_runs() const { return static_cast<int64_t>(starts.size()); }
    int64_t n_values() const;                 ///< values.size() / dtype size
    int64_t run_len(int64_t i) const { return lens.empty() ? 1 : lens[static_cast<size_t>(i)]; }
};

/// One rank's share of a delta: every inference tensor of its layout the delta touches.
struct RankDelta {
    int32_t                      rank = 0;   ///< the layout's TpRank the split was made for
    int32_t                      tp = 1;
    int32_t                      ep = 1;
    std::vector<RankDeltaTensor> tensors;
    int64_t n_values() const;                 ///< elements written, all tensors
    int64_t payload_bytes() const;            ///< run tables (8 B per start / len) + values
};

/// Split `d` for the rank `layout` is planned for (plan_layout of the model's first checkpoint,
/// as the rank's Worker plans it). HF names the layout does not read (a tied lm_head, another
/// rank's experts) give nothing. Per part of an inference tensor: a row range takes the indices
/// in [src0*cols, (src0+rows)*cols) shifted to row0 (one binary search each end); a column range
/// takes, per HF row, the indices in that row's column window (two binary searches per row).
/// Consecutive shard elements merge into one run; a dense tensor gives one run per part (row
/// range) or per row (column range). Cost: O(elements of the rank + rows × log n) per tensor.
/// Errors  fd::Error{invalid_checkpoint} naming the tensor when its shape or dtype does not match
///         the layout's part (F16 → f32 is the one widening allowed).
RankDelta split_delta(const WeightDelta & d, const model::WeightLayout & layout);

/// Every rank's layout plan as its Worker plans it: `model_dir`'s tensor index (v4 names), ranks
/// 0..tp-1 of tp x ep. Errors  fd::Error{invalid_checkpoint} when the index cannot be read.
std::vector<model::WeightLayout> plan_rank_layouts(const model::ModelConfig & cfg, const std::filesystem::path & model_dir,
                                                   int32_t tp, int32_t ep);

/// Split `d` for every layout (layouts[r] = rank r) and write each rank's share to
/// rank_delta_file(delta_file, r) (write_rank_share), a thread per rank; `alongside` (may be empty) runs on the
/// calling thread meanwhile (the stream writes the delta file itself there). Errors  the first
/// rank's (or alongside's) error, after every thread has finished; files already written stay
/// (they live in the caller's staging dir).
void write_rank_shares(const std::filesystem::path & delta_file, const WeightDelta & d,
                       const std::vector<model::WeightLayout> & layouts, const std::function<void()> & alongside = {});

/// True when a delta of HF tensor `name` can be applied in place by ranks planned as `layouts`:
/// some rank reads it under that name, or every rank may lack it (rotary inv_freq, a tied lm_head).
bool delta_name_applicable(const std::string & name, const std::vector<model::WeightLayout> & layouts);

/// The file rank `rank` reads for the delta file `delta_file`: "<delta_file>.rank<rank>".
std::filesystem::path rank_delta_file(const std::filesystem::path & delta_file, int32_t rank);

/// Write `d` to `file` (created, mode 0600): "FDRDLT01", u64 LE header length, a JSON header
/// {"rank", "tp", "ep", "tensors": [{name, dtype, shape, n_runs, n, start_bytes}]}, then per
/// tensor its starts (int32 LE when the shard has < 2^31 elements: start_bytes 4; else int64),
/// its lens (int64 LE, absent when n_runs == n: every run is one element) and its values. Errors  fd::Error{invalid_argument} when the file cannot be written.
void write_rank_delta(const std::filesystem::path & file, const RankDelta & d);

/// write_rank_delta(file, split_delta(d, layout)), byte for byte, without the intermediate
/// RankDelta for the tensors whose touched parts are all sparse: their starts (shifted HF
/// indices) and values are written straight from `d` into the file's pages (sized, then mapped
/// shared); a tensor with a dense part goes through split_tensor's runs as in split_delta.
/// Cost: the file's bytes once, plus O(rows × log n) binary searches. Errors  as split_delta;
/// fd::Error{invalid_argument} when the file cannot be created, sized or mapped.
void write_rank_share(const std::filesystem::path & file, const WeightDelta & d, const model::WeightLayout & layout);

/// Read a file written by write_rank_delta and check its framing (sizes fit the file, runs of
/// length >= 1 summing to n). Range checks against the shard are the rank's
/// (Worker::apply_rank_delta). Errors  fd::Error{invalid_checkpoint} naming the file and tensor.
RankDelta read_rank_delta(const std::filesystem::path & file);

}  // namespace fd::weights
