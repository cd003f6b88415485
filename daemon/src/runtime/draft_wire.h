// draft_wire.h — an MTP draft batch (model::DraftBatch, fd/model/worker.h) on the multi-process
// executor's link: LinkOp::draft_mtp (fd/runtime/rank_link.h), internal to daemon/src/runtime.
//
// The daemon writes the batch into the shared region (the one a step uses; a draft call comes
// after the step's logits were read) and rank 0 writes the drafts back after it; a rank on another
// node gets the bytes up to the drafts inline, like a step's arrays (LinkMsg::bytes).
// Region layout (offsets in bytes, each array 64-byte aligned, computed by draft_layout()):
//   DraftHeader
//   hidden_rows  [n_rows]   i32   the last forward's row feeding each catch-up row
//   tokens       [n_rows]   i32
//   positions    [n_rows]   i32
//   slots        [n_rows]   i64
//   q_table      [n_rows]   i32   offset of the row's block table in `tables`
//   q_ctx        [n_rows]   i32
//   chain_row    [n_chains] i32
//   chain_k      [n_chains] i32
//   chain_table  [n_chains] i32   offset of the chain's block table in `tables`
//   chain_blocks [n_chains] i32   its length (DraftBatch::Chain::n_table_blocks)
//   tables       [n_tables] i32   block ids, one run per distinct table (queries and chains of one
//                                 sequence share it; as long as its longest use)
//   drafts       [n_drafts] i32   sum of the chains' k: written by rank 0 (-1 ends a chain early)
#pragma once

#include "fd/model/worker.h"

#include <cstdint>
#include <vector>

namespace fd::runtime {

struct DraftHeader {
    int32_t n_rows = 0, n_chains = 0, n_tables = 0, n_drafts = 0;
};

/// Byte offsets of one draft batch's arrays in the region.
struct DraftLayout {
    int64_t hidden_rows = 0, tokens = 0, positions = 0, slots = 0, q_table = 0, q_ctx = 0;
    int64_t chain_row = 0, chain_k = 0, chain_table = 0, chain_blocks = 0, tables = 0, drafts = 0;
    int64_t total_bytes = 0;
};
DraftLayout draft_layout(int64_t n_rows, int64_t n_chains, int64_t n_tables, int64_t n_drafts);

/// One distinct block table of a draft batch (draft_encode's scratch).
struct DraftRun {
    const int32_t * table  = nullptr;
    int32_t         blocks = 0;  ///< its longest use: a row's ceil(n_ctx / block_size), a chain's n_table_blocks
    int32_t         offset = 0;  ///< where it starts in `tables`
};

/// Write `db` into `region` (of `region_bytes`); returns the bytes it needs. Writes nothing and
/// returns more than region_bytes when it does not fit (grow the region and call again). The
/// drafts array is filled with -1. `runs` is the caller's scratch (reused: no allocation once warm).
/// Errors  fd::Error{internal} on arrays of different lengths, a chain with k < 1 or a row outside the batch.
int64_t draft_encode(void * region, int64_t region_bytes, const model::DraftBatch & db, int32_t block_size,
                     std::vector<DraftRun> & runs);

/// Rebuild the batch from `region` into `db` (its vectors reused; block tables point into the
/// region). Errors  fd::Error{invalid_argument} on a table offset or length outside `tables`.
void draft_decode(const void * region, model::DraftBatch & db, int32_t block_size);

/// The drafts array rank 0 writes. Shapes  [n_drafts] i32.
int32_t * draft_out(void * region);

/// Check that `n` bytes of a draft batch received inline hold what their header says: non-negative
/// counts whose arrays (up to the drafts, which never travel) fit in `n`.
/// Errors  fd::Error{invalid_argument} naming the counts and `n`.
void check_inline_draft(const void * data, int64_t n);

}  // namespace fd::runtime
