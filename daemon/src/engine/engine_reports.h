// engine_reports.h — the one place a control result's per-rank entries are built (private to
// daemon/src/engine; engine_control.cpp defines it, engine_land.cpp uses it too).
#pragma once

#include "fd/engine/control.h"

#include <optional>
#include <string>
#include <vector>

namespace fd::engine {

/// Fold one rank call's reports into r.ranks (one entry per rank, in order of first mention):
/// freed bytes and durations add up over the command's calls, the RSS is the last one reported,
/// `label` (when given) is the weight version the rank serves or staged after this call.
/// `in_place`: the call copied straight into the serving weights (a wakeup's reload), so its
/// stage_s is the applying cost (commit_s).
void accumulate_rank_reports(ControlResult & r, const std::vector<runtime::RankReport> & reps, const std::optional<std::string> & label,
                             bool in_place = false);

}  // namespace fd::engine
