// Pause modes (abort | wait | keep), the drain of a waiting pause, and aborting one request
// (SPEC §3; fd/engine/control.h documents the modes). Engine thread only.
//
// wait: the pause command starts a drain instead of answering: admission stops, the requests
//   already accepted keep running, and poll_drain() (every step) answers the command once none
//   is left (paused) or at the caller's deadline (504 timeout, admission reopened: a failed
//   command changes nothing, invariants 2 and 7). Commands that arrive meanwhile are held and
//   run in order after it, except abort_request, which may be what ends the drain.
// keep: the requests stay in the scheduler with their KV blocks; step() runs nothing while
//   paused. When the serving weights change under them (update_weights / commit_weights),
//   recompute_kept() drops their KV, so each is prefilled again (prompt + generated tokens)
//   with the new weights before it samples its next token: no KV of an older version is ever
//   attended to (invariant 1). Their choices report the version spans (VersionSpan).
#include "fd/engine/engine.h"
#include "fd/log.h"

#include "engine_sequence.h"

#include <algorithm>
#include <chrono>

namespace fd::engine {

void Engine::do_pause(PauseMode mode, ControlResult & r, std::chrono::steady_clock::time_point drain_deadline, bool flush_prefix) {
    if (mode == PauseMode::wait && state_.paused && state_.pause_mode == PauseMode::keep) {
        // A wait pause promises the requests in flight finish; the kept ones cannot while the
        // keep pause holds them (a probe: a 200 at once with them still frozen). Nothing changes.
        fail(Errc::wrong_state, "pause mode=wait: the engine is already paused with mode=keep ({} kept choice(s) frozen with their KV), "
                                "so nothing can finish; POST /v1/resume first (they continue, then pause?mode=wait drains them), or "
                                "pause?mode=abort to end them. Nothing was changed", n_live());
    }
    r.pause_mode = mode;
    accepting_.store(false);
    switch (mode) {
        case PauseMode::abort:
            state_.paused     = true;
            state_.pause_mode = PauseMode::abort;
            defer_events_     = true;  // held in the result (take_held): the control service releases them with its reply
            r.n_aborted       = abort_all();
            defer_events_     = false;
            break;
        case PauseMode::keep:
            state_.paused     = true;
            state_.pause_mode = PauseMode::keep;
            r.n_kept          = n_live();
            break;
        case PauseMode::wait: {
            if (state_.paused) {  // already paused with abort or wait (keep is refused above): nothing runs, the pause stays
                r.pause_mode = state_.pause_mode;
                return;
            }
            const int32_t n = n_live();
            if (n > 0) {  // answered by poll_drain()
                drain_ = Drain{.pc = nullptr, .deadline = drain_deadline, .t0 = {}, .n_at_start = n, .flush_prefix = flush_prefix};
                return;
            }
            state_.paused     = true;
            state_.pause_mode = PauseMode::wait;
            break;
        }
    }
    if (flush_prefix) { kv_.flush_prefix_cache(); }  // unreferenced cached blocks only: kept requests keep theirs
}

void Engine::poll_drain() {
    if (!drain_ || !drain_->pc) { return; }
    const int32_t n = n_live();
    if (n > 0 && std::chrono::steady_clock::now() < drain_->deadline) { return; }
    Drain d = std::move(*drain_);
    drain_.reset();
    ControlResult r;
    r.pause_mode = PauseMode::wait;
    if (d.rank_error) {  // its requests ended with the rank error, not at their end (they were counted "drained": a probe)
        r.error = Error(Errc::rank_failed, fmt::format("pause mode=wait: a rank failed while {} choice(s) drained; they ended with "
                                                       "rank_failed, not at their end: {}", d.n_at_start, d.rank_error->what()));
    } else if (n > 0) {
        r.error = Error(Errc::timeout,
                        fmt::format("pause mode=wait: {} of {} choice(s) still running at the caller's deadline ({:.1f} s after the pause "
                                    "began); admission reopened, nothing changed: retry with a longer deadline (X-Request-Timeout, "
                                    "fdctl --timeout) or with mode=abort", n, d.n_at_start,
                                    std::chrono::duration<double>(std::chrono::steady_clock::now() - d.t0).count()));
    } else {
        state_.paused     = true;
        state_.pause_mode = PauseMode::wait;
        r.n_aborted       = std::min(d.n_aborted, d.n_at_start);  // ended by an abort while it drained
        r.n_drained       = d.n_at_start - r.n_aborted;
        if (d.flush_prefix) { kv_.flush_prefix_cache(); }
    }
    answer(*d.pc, finish_control("pause", d.t0, std::move(r)));
    // The commands held behind it, in order (one of them may start another drain).
    while (!drain_ && !held_controls_.empty()) {
        auto pc = std::move(held_controls_.front());
        held_controls_.pop_front();
        dispatch_control(pc);
    }
}

void Engine::dispatch_control(const std::shared_ptr<PendingControl> & pc) {
    if (pc->cmd.gate && !pc->cmd.gate->start()) {  // its caller's deadline passed or it withdrew it
        log::get("control")->warn("dropped {}: its caller's deadline passed (or it gave up) before it could start; not run",
                                  to_string(pc->cmd.op));
        ControlResult r;
        r.error = Error(Errc::timeout, fmt::format("{} was not started before the caller's deadline: dropped, nothing changed",
                                                   to_string(pc->cmd.op)));
        answer(*pc, std::move(r));
        return;
    }
    const bool was_draining = drain_.has_value();
    ControlResult r = run_control(pc->cmd);
    if (!was_draining && drain_) {  // a pause mode=wait: poll_drain() answers it
        drain_->pc = pc;
        return;
    }
    r.held = take_held();
    answer(*pc, std::move(r));
}

void Engine::do_abort_request(const ControlCommand & cmd, ControlResult & r) {
    r.n_aborted = abort_matching(cmd.request_id, cmd.abort_all);
    if (r.n_aborted == 0 && !cmd.abort_all) {
        fail(Errc::not_found, "no queued, running or kept request has id '{}' (a finished one is forgotten); ids are the completion's "
                              "id (cmpl-…, chatcmpl-…) or the X-Request-Id header its client sent", cmd.request_id);
    }
}

void Engine::recompute_kept() {
    // Oldest first: the running ones in batch order, then the queue; all go back to the queue.
    std::vector<SchedSeq *> order(sched_.running().begin(), sched_.running().end());
    order.insert(order.end(), sched_.waiting().begin(), sched_.waiting().end());
    if (order.empty()) { return; }
    for (SchedSeq * s : order) {
        sched_.remove(s);
        kv_.release(s->id);
        auto & seq        = static_cast<Sequence &>(*s);
        seq.routes_final  = std::max(seq.routes_final, seq.n_computed);  // their rows stay those of the old weights
        s->n_computed     = 0;
        // Prompt logprobs taken before any token was generated would sit, under the new label,
        // beside rows the recompute scores with the new weights (a chunked prefill cut by the
        // update): they are scored again, all with the new weights. Once a token exists the
        // prompt was scored whole by the old weights, as the first version span says.
        if (seq.params.prompt_logprobs >= 0 && !seq.prompt_lps_sent && static_cast<int32_t>(seq.tokens.size()) <= seq.n_prompt) {
            seq.prompt_lps.clear();
            seq.n_prompt_scored = 0;
        }
    }
    for (SchedSeq * s : order) { sched_.add(s); }
    log::get("engine")->info("weights changed under {} kept choice(s): their KV is recomputed with weight_version {} on resume",
                             order.size(), state_.weight_version);
}

}  // namespace fd::engine
