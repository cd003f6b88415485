// The engine's thread and its steps: construction, submit (any thread; the one
// way in for generation, refused while draining, degraded or paused), the loop (a failed step
// fails its sequences, a lost rank degrades the engine, shutdown aborts everything left), and
// step(): queued commands, reaping, build_step (schedule, swaps and tier copies, the flat batch),
// run_step, emit_step (prompt logprobs, samples, drafts), the stats /metrics reads.
// engine_choices.cpp: admission, tokens and events of each choice.
#include "fd/engine/engine.h"

#include "engine_sequence.h"

#include "fd/engine/sampler.h"
#include "fd/log.h"
#include "fd/tokenizer/incremental_decoder.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace fd::engine {

Engine::Engine(const EngineConfig & cfg, std::unique_ptr<runtime::Executor> executor,
               std::shared_ptr<const tokenizer::Tokenizer> tok, const kv::KvCacheConfig & kv_cfg)
    : cfg_(cfg), model_cfg_(executor->model_config()), executor_(std::move(executor)), tok_(std::move(tok)), kv_cfg_(kv_cfg),
      kv_(kv_cfg), sched_(cfg.scheduler) {
    state_.weight_version   = cfg_.weight_version;
    if (!cfg_.weight_fingerprint.empty()) { known_labels_[cfg_.weight_version] = cfg_.weight_fingerprint; }
    state_.executor_backend = executor_->backend();
    state_.tensor_parallel_size = executor_->world_size();
    state_.comm_backend     = executor_->comm_backend();
    state_.expert_parallel_size     = cfg_.expert_parallel_size;
    state_.comm_group_kept_on_sleep = !cfg_.shutdown_comm_group_on_sleep;
    proposer_ = spec::make_proposer(cfg_.speculative);
    stats_.spec_method            = spec::to_string(cfg_.speculative.method);
    stats_.num_speculative_tokens = cfg_.speculative.num_speculative_tokens;
    publish_stats();
}

Engine::~Engine() { stop(); }

void Engine::start() { thread_ = std::thread([this] { loop(); }); }

void Engine::stop() {
    if (!thread_.joinable()) { return; }
    stop_.store(true);
    inbox_cv_.notify_all();
    thread_.join();
    remove_landed_snapshot();  // a sleeping daemon's landed weights: nothing reads them after this
}

void Engine::submit(GenerateRequest req) {
    if (draining_.load()) { fail(Errc::shutting_down, "the server is shutting down; retry on another replica"); }
    if (degraded_.load()) {
        fail(Errc::rank_failed, "a tensor-parallel rank failed (GET /health names it); POST /v1/wakeup respawns it, or restart the daemon");
    }
    if (!accepting_.load()) {
        if (stats().state.pause_draining) { fail(Errc::engine_paused, "{}", kPauseDrainingMessage); }
        fail(Errc::engine_paused, "{}", kPausedMessage);
    }
    req.t_arrival = std::chrono::steady_clock::now();
    {
        std::lock_guard lk(inbox_mu_);
        inbox_.push_back(std::move(req));
    }
    inbox_cv_.notify_one();
}

bool Engine::idle() const {
    std::lock_guard lk(inbox_mu_);
    std::lock_guard lk2(stats_mu_);
    return inbox_.empty() && stats_.n_running == 0 && stats_.n_waiting == 0;
}

EngineStats Engine::stats() const {
    std::lock_guard lk(stats_mu_);
    return stats_;
}

void Engine::loop() {
    auto lg = log::get("engine");
    while (!stop_.load()) {
        bool worked = false;
        try {
            worked = step();
            try {
                executor_->refresh_rank_devices(1.0);  // cuda: /health's device memory, at most ~1 s old
            } catch (const Error & e) {
                if (e.code() == Errc::rank_failed) { throw; }  // a lost rank: degraded, as for a step
                lg->warn("device memory refresh failed (the step's results stand): {}", e.what());
            }
        } catch (const Error & e) {
            lg->error("step failed: {}", e.what());
            if (e.code() == Errc::rank_failed) {
                enter_degraded(e);
            } else {
                fail_step(e);
            }
        } catch (const std::exception & e) {
            // A failing step fails the sequences in it, never the daemon.
            lg->error("step failed: {}", e.what());
            fail_step(Error(Errc::internal, e.what()));
        }
        if (!worked) {
            if (!state_.degraded && !executor_->failed_ranks().empty()) {
                enter_degraded(Error(Errc::rank_failed, "a rank process exited while idle; POST /v1/wakeup respawns it"));
            }
            std::unique_lock lk(inbox_mu_);
            inbox_cv_.wait_for(lk, std::chrono::milliseconds(50), [&] { return stop_.load() || !inbox_.empty(); });
        }
    }
    // Shutdown: every sequence still alive ends with "abort"; queued commands fail.
    abort_all();
    auto shutting_down = [](const std::shared_ptr<PendingControl> & pc) {
        ControlResult r;
        r.error = Error(Errc::shutting_down, "the server is shutting down");
        answer(*pc, std::move(r));
    };
    if (drain_ && drain_->pc) { shutting_down(drain_->pc); }
    drain_.reset();
    for (const auto & pc : held_controls_) { shutting_down(pc); }
    held_controls_.clear();
    std::lock_guard lk(inbox_mu_);
    for (auto & item : inbox_) {
        if (auto * req = std::get_if<GenerateRequest>(&item)) {
            for (int32_t c = 0; c < static_cast<int32_t>(req->prompts.size()) * req->n; ++c) {
                ChoiceEvent ev;
                ev.choice = c;
                ev.finish = FinishReason::abort;
                ev.weight_version = state_.weight_version;
                req->channel->push(std::move(ev));
            }
        } else {
            ControlResult r;
            r.error = Error(Errc::shutting_down, "the server is shutting down");
            answer(*std::get<std::shared_ptr<PendingControl>>(item), std::move(r));
        }
    }
    inbox_.clear();
}

bool Engine::step() {
    bool handled_control = false;
    {
        std::deque<std::variant<GenerateRequest, std::shared_ptr<PendingControl>>> incoming;
        {
            std::lock_guard lk(inbox_mu_);
            incoming.swap(inbox_);
            control_waiting_.store(false);
        }
        for (auto & item : incoming) {
            if (auto * req = std::get_if<GenerateRequest>(&item)) {
                admit(*req);
            } else {
                auto & pc = std::get<std::shared_ptr<PendingControl>>(item);
                handled_control = true;
                // Commands stay serialized behind a pause mode=wait that is draining (abort_request
                // does not: it may be what ends the drain).
                if (drain_ && pc->cmd.op != ControlOp::abort_request) {
                    held_controls_.push_back(std::move(pc));
                    continue;
                }
                dispatch_control(pc);
            }
        }
    }
    // Drop sequences whose client went away.
    for (auto & [id, s] : seqs_) {
        if (s->channel && s->channel->cancelled()) {  // a disconnect is an abort in /metrics (as vLLM counts it); a timeout an error
            count_finished(*s, s->channel->cancel_reason());
            s->channel.reset();
        }
    }
    auto reap = [&] {
        for (auto it = seqs_.begin(); it != seqs_.end();) {
            if (!it->second->channel) {
                sched_.remove(it->second.get());
                kv_.release(it->first);
                it = seqs_.erase(it);
            } else {
                ++it;
            }
        }
    };
    reap();
    poll_drain();

    if (state_.paused) {  // invariant: nothing is generated while paused or asleep
        publish_stats();
        return handled_control;
    }
    StepPlan plan;
    if (!build_step(plan)) {
        reap();
        publish_stats();
        return !plan.d.rejected.empty() || handled_control;
    }
    const float * step_logits = run_step();
    if (!step_logits) {
        return true;  // a control command arrived: nothing advanced; it runs first, then the step is redone
    }
    hold_finals_ = true;
    const auto release = [this](Engine *) { release_finals(); };
    const std::unique_ptr<Engine, decltype(release)> finals_guard(this, release);  // also when a rank call throws
    emit_step(plan, step_logits);
    if (proposer_ && proposer_->uses_draft_layers()) { run_draft_layers(plan); }
    reap();
    if (!finals_.empty()) { publish_stats(); }  // the finished choices' blocks are free before their answers go out
    release_finals();
    poll_drain();  // after the answers: a pause that waited for them replies last
    publish_stats();
    return true;
}

void Engine::release_finals() noexcept {
    hold_finals_ = false;
    if (finals_.empty()) { return; }
    HeldEvents held(std::move(finals_));  // pushes each on destruction
    finals_.clear();
}

int64_t Engine::finish_background_copies() {
    const int64_t n = kv_.n_background_in_flight();
    if (n == 0) { return 0; }
    executor_->swap_kv(nullptr, 0, nullptr, 0);  // returns once every rank's background copies landed
    kv_.background_done();
    return n;
}

bool Engine::build_step(StepPlan & plan) {
    const auto t0 = plan.t0 = std::chrono::steady_clock::now();
    // The last step's background copies (they ran while it computed) landed before any block
    // they read or write can be handed out again: step-aligned, never a torn block. (Idle, with
    // nothing to schedule, nothing is handed out: the next step or control command waits.)
    if (sched_.running().empty() && sched_.waiting().empty()) { return false; }
    finish_background_copies();
    kv_.set_transfers_paused(drain_.has_value());  // a pause (mode=wait draining) stops tier copies
    propose_drafts();
    ScheduleDecision & d = plan.d = sched_.schedule(kv_);
    for (SchedSeq * r : d.rejected) {
        auto & s = static_cast<Sequence &>(*r);
        ChoiceEvent ev;
        ev.error = Error(Errc::invalid_argument, fmt::format("prompt of {} tokens does not fit the KV cache ({} blocks of {} tokens); raise --kv-cache-bytes",
                                                            s.tokens.size(), kv_.n_blocks_total(), kv_.block_size()), "prompt");
        emit(s, FinishReason::error, std::move(ev));
    }
    if (d.n_preempted() > 0) {
        log::get("engine")->warn("preempted {} sequence(s) (KV blocks exhausted): {} swapped out to the host pool, {} to recompute",
                                 d.n_preempted(), d.swapped.size(), d.preempted.size());
        std::lock_guard lk(stats_mu_);
        stats_.n_preemptions_total += static_cast<int64_t>(d.n_preempted());
        stats_.n_swap_preemptions_total += static_cast<int64_t>(d.swapped.size());
        stats_.n_recompute_preemptions_total += static_cast<int64_t>(d.preempted.size());
    }
    // Before the forward (it may overwrite swapped-out or evicted blocks), in one call: every
    // device → host copy (preemption, then the tier's) runs before every host → device one.
    // The write-ahead offloads (tier_bg) start last and run in the background during the forward.
    const size_t n_tier_out = d.tier_out.size(), n_tier_in = d.tier_in.size(), n_tier_bg = d.tier_bg.size();
    d.swap_out.insert(d.swap_out.end(), d.tier_out.begin(), d.tier_out.end());
    d.swap_in.insert(d.swap_in.end(), d.tier_in.begin(), d.tier_in.end());
    if (!d.swap_out.empty() || !d.swap_in.empty() || n_tier_bg > 0) {
        executor_->swap_kv(d.swap_out.data(), static_cast<int64_t>(d.swap_out.size()), d.swap_in.data(),
                           static_cast<int64_t>(d.swap_in.size()), d.tier_bg.data(), static_cast<int64_t>(n_tier_bg));
        const int64_t block_bytes = model::Worker::swap_block_bytes(model_cfg_, kv_.block_size(), 1, cfg_.kv_cache_dtype,
                                                                    cfg_.speculative.method == spec::SpecMethod::mtp);  // all ranks together
        std::lock_guard lk(stats_mu_);
        stats_.swap_out_bytes_total += static_cast<int64_t>(d.swap_out.size() - n_tier_out) * block_bytes;
        stats_.swap_in_bytes_total += static_cast<int64_t>(d.swap_in.size() - n_tier_in) * block_bytes;
        stats_.host_tier_out_bytes_total += static_cast<int64_t>(n_tier_out + n_tier_bg) * block_bytes;
        stats_.host_tier_in_bytes_total += static_cast<int64_t>(n_tier_in) * block_bytes;
    }
    kv_.copies_done();  // the copies ran (step-aligned): the blocks they held may be handed out again
    if (d.run.empty()) { return false; }

    // Build the flat batch.
    batch_.clear();
    const int32_t bs = kv_.block_size();
    auto & rows = plan.rows;  // what each logits row is for (StepPlan::RowUse)
    for (const auto & [ss, n, n_draft] : d.run) {
        auto &        s     = static_cast<Sequence &>(*ss);
        const auto &  table = kv_.block_table(s.id);
        if (s.t_scheduled == std::chrono::steady_clock::time_point{}) {
            s.t_scheduled = t0;
            request_metrics_.queue_s.observe(std::chrono::duration<double>(t0 - s.t_arrival).count());
        }
        for (int32_t j = 0; j < n; ++j) {
            const int32_t pos = static_cast<int32_t>(s.n_computed) + j;
            batch_.tokens.push_back(s.tokens[pos]);
            batch_.positions.push_back(pos);
            batch_.slots.push_back(static_cast<int64_t>(table[pos / bs]) * bs + pos % bs);
            batch_.queries.push_back({table.data(), pos + 1});
            if (s.params.prompt_logprobs >= 0 && pos < s.n_prompt - 1 && pos >= s.n_prompt_scored) {
                batch_.logits_rows.push_back(static_cast<int32_t>(batch_.tokens.size()) - 1);
                rows.push_back({&s, pos});
            }
        }
        batch_.want_routes = batch_.want_routes || s.params.return_routed_experts;
        if (s.n_computed + n == static_cast<int64_t>(s.tokens.size())) {
            batch_.logits_rows.push_back(static_cast<int32_t>(batch_.tokens.size()) - 1);
            rows.push_back({&s, -1, n_draft});
        }
        // Draft rows (n == 1: the sample row above is the last token's): draft token j at the
        // position after it, its KV written into blocks the scheduler granted, its logits row
        // scoring draft j + 1 (or giving the bonus token after the last).
        for (int32_t j = 0; j < n_draft; ++j) {
            const int32_t pos = static_cast<int32_t>(s.tokens.size()) + j;
            batch_.tokens.push_back(s.draft[static_cast<size_t>(j)]);
            batch_.positions.push_back(pos);
            batch_.slots.push_back(static_cast<int64_t>(table[pos / bs]) * bs + pos % bs);
            batch_.queries.push_back({table.data(), pos + 1});
            batch_.logits_rows.push_back(static_cast<int32_t>(batch_.tokens.size()) - 1);
            rows.push_back({&s, -2});
        }
    }
    return true;
}

const float * Engine::run_step() {
    if (cfg_.debug_step_delay_ms > 0) { std::this_thread::sleep_for(std::chrono::milliseconds(cfg_.debug_step_delay_ms)); }
    // Rank 0's logits where they were written (mp: the shared region), valid until the next executor call.
    return executor_->forward_in_place(batch_, &control_waiting_);
}

void Engine::count_tokens(int64_t n_generated, int64_t n_prompt, int64_t n_cached, int64_t n_host_cached, int64_t n_forwards) {
    // Token counters go up before each row's event goes out: an event-driven reader may answer
    // the client before push() returns, and a client that has its answer finds it in /metrics.
    std::lock_guard lk(stats_mu_);
    stats_.n_tokens_generated_total += n_generated;
    stats_.n_tokens_prompt_total += n_prompt;
    stats_.n_tokens_cached_total += n_cached;
    stats_.n_tokens_host_cached_total += n_host_cached;
    stats_.n_host_tier_hits_total += n_host_cached / kv_.block_size();  // the same first admissions, in blocks
    stats_.n_target_forwards_total += n_forwards;
}

void Engine::keep_routes(const ScheduleDecision & d) {
    const int32_t * routes = executor_->step_routes();  // [batch tokens, cols], batch_ order
    const int64_t   cols   = model::route_cols(model_cfg_);
    FD_CHECK(routes != nullptr && cols > 0, "a step that asked for routed experts returned none");
    int64_t row = 0;
    for (const auto & [ss, n, n_draft] : d.run) {
        auto & s = static_cast<Sequence &>(*ss);
        // The batch holds n rows at positions n_computed.., then n_draft draft rows after the
        // last token (a rejected draft's row is overwritten when that position is computed again).
        const int64_t first = s.n_computed, n_rows = n + n_draft;
        if (s.params.return_routed_experts) {
            const auto need = static_cast<size_t>((first + n_rows) * cols);
            if (s.routes.size() < need) { s.routes.resize(need, -1); }
            // A kept choice's recompute after an update: the rows computed before it stay (a probe
            // saw them replaced by the new weights' routes, under the old version's span).
            const int64_t skip = std::clamp<int64_t>(s.routes_final - first, 0, n_rows);
            std::copy_n(routes + (row + skip) * cols, (n_rows - skip) * cols, s.routes.begin() + (first + skip) * cols);
        }
        row += n_rows;
    }
}

void Engine::emit_step(const StepPlan & plan, const float * step_logits) {
    const ScheduleDecision & d     = plan.d;
    const auto &             rows  = plan.rows;
    const auto               t0    = plan.t0;
    const int32_t            vocab = model_cfg_.vocab_size;
    t_step_done_ = std::chrono::steady_clock::now();
    if (batch_.want_routes) { keep_routes(d); }
    for (const auto & [ss, n, n_draft] : d.run) {
        auto & s = static_cast<Sequence &>(*ss);
        s.n_computed += n;
        kv_.commit_full_blocks(s.id, s.tokens, s.n_computed, s.prefix_salt, s.n_prompt);
    }
    for (size_t i = 0; i < rows.size(); ++i) {
        Sequence &    s      = *rows[i].s;
        const float * logits = step_logits + i * static_cast<size_t>(vocab);
        if (rows[i].pos == -2 || !s.channel) { continue; }  // draft rows: read with their sample row
        if (rows[i].n_draft > 0) {
            emit_draft_rows(rows[i], logits);
            continue;
        }
        if (rows[i].pos >= 0) {
            s.prompt_lps.push_back(token_logprobs(logits, vocab, s.tokens[rows[i].pos + 1], s.params.prompt_logprobs, scratch_));
            s.n_prompt_scored = rows[i].pos + 1;
            continue;
        }
        int64_t n_prompt = 0, n_cached = 0, n_host_cached = 0;
        if (static_cast<int32_t>(s.tokens.size()) == s.n_prompt) {  // first token of this choice
            n_prompt      = s.n_prompt;
            n_cached      = std::max(0, s.n_cached);
            n_host_cached = s.n_cached > 0 ? s.n_host_cached : 0;
            if (s.params.max_tokens == 0) {  // scoring only: the prompt's logprobs, nothing generated
                count_tokens(0, n_prompt, n_cached, n_host_cached);
                emit(s, FinishReason::length, ChoiceEvent{});
                continue;
            }
        }
        const float * to_sample = logits;
        if (s.params.processes_logits()) {
            processed_.assign(logits, logits + vocab);
            const std::span<const int32_t> all(s.tokens);
            apply_logits_processors(processed_.data(), vocab, s.params, all.first(s.n_prompt), all.subspan(s.n_prompt),
                                    model_cfg_.eos_token_ids);
            to_sample = processed_.data();
        }
        count_tokens(1, n_prompt, n_cached, n_host_cached, 1);
        ChoiceEvent ev;
        if (proposer_ && n_prompt == 0) { ++s.spec.n_verify; }  // a decode step that had no draft to verify
        ev.spec = s.spec;
        append_token(s, sample_token(to_sample, vocab, s.params, s.rng), logits, ev);
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
        std::lock_guard lk(stats_mu_);
        ++stats_.n_steps_total;
        size_t b = 0;
        while (b < kStepLatencyBuckets.size() && dt > kStepLatencyBuckets[b]) { ++b; }
        ++stats_.step_latency_counts[b];
        stats_.step_latency_sum_s += dt;
    }
}

int32_t Engine::tensor_parallel_size() const { return executor_->world_size(); }

void Engine::answer(PendingControl & pc, ControlResult r) {
    if (pc.cmd.on_done) { pc.cmd.on_done(r); }
    pc.done.set_value(std::move(r));
}

void Engine::publish_stats() {
    std::lock_guard lk(stats_mu_);
    state_.comm_group        = executor_->comm_state();
    state_.pause_draining    = drain_.has_value();
    state_.serving_dir       = serving_landed_ ? std::string() : serving_dir_;
    state_.n_kept = 0;
    if (state_.paused && state_.pause_mode == PauseMode::keep) {
        for (const auto & [id, s] : seqs_) { state_.n_kept += s->channel ? 1 : 0; }
    }
    stats_.state             = state_;
    stats_.n_running         = static_cast<int64_t>(sched_.running().size());
    stats_.n_waiting         = static_cast<int64_t>(sched_.waiting().size());
    stats_.n_kv_blocks_used  = kv_.n_blocks_used();
    stats_.n_kv_blocks_free  = kv_.n_blocks_free();
    stats_.n_kv_blocks_total = kv_.n_blocks_total();
    stats_.kv_cache_dtype    = cfg_.kv_cache_dtype == kernels::WType::bf16 ? "bfloat16" : "float32";
    stats_.kv_block_size     = kv_.block_size();
    stats_.kv_bytes_per_token = model::Worker::kv_block_bytes(model_cfg_, 1, 1, cfg_.kv_cache_dtype);
    stats_.kv_budget_bytes    = cfg_.kv_budget_bytes;
    stats_.n_swap_blocks_used  = kv_.n_host_blocks_used();
    stats_.n_swap_blocks_total = kv_.n_host_blocks_total();
    stats_.n_swapped           = kv_.n_seqs_swapped();
    const auto tc = kv_.tier_counters();
    stats_.host_tier_enabled             = kv_.tier_enabled();
    stats_.n_host_tier_blocks_cached     = kv_.n_host_blocks_cached();
    stats_.host_tier_block_bytes         = model::Worker::swap_block_bytes(model_cfg_, kv_.block_size(), 1, cfg_.kv_cache_dtype,
                                                                           cfg_.speculative.method == spec::SpecMethod::mtp);
    stats_.n_host_tier_offloads_total    = tier_counted_.offloaded + tc.offloaded;
    stats_.n_host_tier_loads_total       = tier_counted_.loaded + tc.loaded;
    stats_.n_host_tier_offloads_background_total = tier_counted_.offloaded_background + tc.offloaded_background;
    stats_.n_host_tier_in_flight         = kv_.n_background_in_flight();
    stats_.n_host_tier_evictions_total   = tier_counted_.evicted + tc.evicted;
    stats_.n_host_tier_invalidated_total = tier_counted_.invalidated + tc.invalidated;
    stats_.host_tier_transfers_paused    = state_.paused || drain_.has_value();
    stats_.host_tier_weight_version      = state_.weight_version;
    stats_.mtp_cache_bytes               = executor_->mtp_cache_bytes();
}

}  // namespace fd::engine
