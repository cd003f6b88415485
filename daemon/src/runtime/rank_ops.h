// rank_ops.h — the rank side of the rank-call table (fd/runtime/rank_call.h), internal to
// daemon/src/runtime: what one rank holds while it runs rank operations, and the one function
// that runs a row of FD_RANK_OPS on it. LocalExecutor owns a RankSite (in-process: the engine's
// rank; in a rank process: that process's rank, reached through LinkOp::rank_call).
#pragma once

#include "fd/model/worker.h"
#include "fd/runtime/rank_call.h"
#include "fd/weights/weight_source.h"

#include <cstdint>
#include <memory>

namespace fd::runtime {

/// One rank: its Worker, its weight source and the checkpoint it last fetched.
struct RankSite {
    std::unique_ptr<model::Worker>         worker;
    std::unique_ptr<weights::WeightSource> source;
    int32_t                                rank = 0;
    /// Keep the fetched checkpoint (FetchedCheckpoint::hold) after stage / reload until
    /// release_fetched or drop (make_local_executor's hold_fetched); false: it ends with the call.
    bool                                   hold_fetched = false;
    std::shared_ptr<void>                  fetch_hold;
};

/// Run `req` on `site`'s rank. The report carries site.rank and the process's RSS after the call.
/// Errors  whatever the op's Worker method or the weight source throws (fd::Error); nothing of
///         the op's is left applied where its Worker method says so (see fd/model/worker.h).
RankReport run_rank_op(RankSite & site, const RankRequest & req);

}  // namespace fd::runtime
