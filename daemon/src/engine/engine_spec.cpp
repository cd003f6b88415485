// Engine: speculative decoding's two halves of a step — proposing drafts before schedule(), and
// verifying them after the forward (docs/speculative.md).
//
// A speculating sequence's step computes [last token, d1..dg] in one forward; row j's logits are
// the target's at the position after token j, bitwise equal to the row a one-token decode of the
// same prefix gives (batch-invariant kernels). The rows are read in order: the token the target
// samples there (the plain sampler, same rng draw) is appended; while it equals the draft the
// next row is valid too (its KV was computed from accepted tokens), else the step ends there.
// So the tokens, logprobs, rng stream and finish of a choice equal a run without speculation.
#include "fd/engine/engine.h"

#include "engine_sequence.h"

#include "fd/log.h"

#include <algorithm>

namespace fd::engine {

void Engine::propose_drafts() {
    const auto & running = sched_.running();
    for (SchedSeq * r : running) { r->n_draft = 0; }
    if (!proposer_) { return; }
    const spec::SpeculativeConfig & sc = cfg_.speculative;
    if (sc.disable_by_batch_size > 0 && static_cast<int32_t>(running.size()) > sc.disable_by_batch_size) {
        std::lock_guard lk(stats_mu_);
        ++stats_.n_spec_steps_off_total;
        return;
    }
    for (SchedSeq * r : running) {
        auto & s = static_cast<Sequence &>(*r);
        s.draft.clear();
        const auto    n_tokens    = static_cast<int32_t>(s.tokens.size());
        const int32_t n_generated = n_tokens - s.n_prompt;
        if (!s.channel || s.n_remaining() != 1 || n_generated < 1) { continue; }  // decodes only
        // The step yields at most 1 + g tokens: never past max_tokens; draft j sits at position
        // n_tokens - 1 + j, below max_model_len.
        const int32_t k = std::min({sc.num_speculative_tokens, s.params.max_tokens - n_generated - 1, cfg_.max_model_len - n_tokens});
        if (k <= 0) { continue; }
        proposer_->propose({.tokens = s.tokens, .layer_drafts = s.layer_drafts}, k, s.draft);
        s.n_draft = static_cast<int32_t>(s.draft.size());
    }
}

void Engine::run_draft_layers(const StepPlan & plan) {
    model::DraftBatch & db = draft_batch_;
    db.clear();
    const spec::SpeculativeConfig & sc = cfg_.speculative;
    const int32_t bs       = kv_.block_size();
    const bool    chains   = sc.disable_by_batch_size == 0 || static_cast<int32_t>(sched_.running().size()) <= sc.disable_by_batch_size;
    std::vector<Sequence *> drafting;  // chain c's sequence
    size_t r0 = 0;  // the sequence's first row in batch_
    for (const auto & [ss, n, n_draft] : plan.d.run) {
        auto &       s     = static_cast<Sequence &>(*ss);
        const size_t n_rows = static_cast<size_t>(n + n_draft);
        const size_t first  = r0;
        r0 += n_rows;
        s.layer_drafts.clear();
        if (!s.channel) { continue; }  // finished this step
        const auto & table = kv_.block_table(s.id);
        const auto   n_tok = static_cast<int32_t>(s.tokens.size());
        int32_t      last  = -1;  // the catch-up row of the sequence's last kept position
        for (size_t i = first; i < first + n_rows; ++i) {
            const int32_t pos = batch_.positions[i];
            if (pos >= s.n_computed || pos + 1 >= n_tok) { break; }  // a rejected draft row, or no next token yet
            db.hidden_rows.push_back(static_cast<int32_t>(i));
            db.tokens.push_back(s.tokens[static_cast<size_t>(pos) + 1]);
            db.positions.push_back(pos);
            db.slots.push_back(static_cast<int64_t>(table[static_cast<size_t>(pos / bs)]) * bs + pos % bs);
            db.queries.push_back({table.data(), pos + 1});
            last = static_cast<int32_t>(db.tokens.size()) - 1;
        }
        const int32_t n_generated = n_tok - s.n_prompt;
        if (!chains || last < 0 || s.n_computed != n_tok - 1 || n_generated < 1) { continue; }  // not about to decode
        // As propose_drafts bounds them: never past max_tokens, no draft at or past max_model_len.
        const int32_t k = std::min({sc.num_speculative_tokens, s.params.max_tokens - n_generated - 1, cfg_.max_model_len - n_tok});
        if (k <= 0 || db.positions[static_cast<size_t>(last)] != n_tok - 2) { continue; }
        db.chains.push_back({.row = last, .k = k, .block_table = table.data(), .n_table_blocks = static_cast<int32_t>(table.size())});
        drafting.push_back(&s);
    }
    if (db.hidden_rows.empty()) { return; }
    executor_->draft_mtp(db, layer_drafts_);
    size_t at = 0;
    for (size_t c = 0; c < drafting.size(); ++c) {
        const auto k = static_cast<size_t>(db.chains[c].k);
        drafting[c]->layer_drafts.assign(layer_drafts_.begin() + static_cast<std::ptrdiff_t>(at),
                                         layer_drafts_.begin() + static_cast<std::ptrdiff_t>(at + k));
        at += k;
    }
}

void Engine::emit_draft_rows(const StepPlan::RowUse & row, const float * logits) {
    Sequence &    s     = *row.s;
    const int32_t vocab = model_cfg_.vocab_size;
    const int32_t g     = row.n_draft;
    ChoiceEvent   ev;
    FinishReason  why        = FinishReason::none;
    int32_t       n_accepted = 0;
    for (int32_t j = 0; j <= g && why == FinishReason::none; ++j) {
        const float * raw       = logits + static_cast<size_t>(j) * vocab;
        const float * to_sample = raw;
        if (s.params.processes_logits()) {  // over the tokens accepted so far, as a plain step sees them
            processed_.assign(raw, raw + vocab);
            const std::span<const int32_t> all(s.tokens);
            apply_logits_processors(processed_.data(), vocab, s.params, all.first(s.n_prompt), all.subspan(s.n_prompt),
                                    model_cfg_.eos_token_ids);
            to_sample = processed_.data();
        }
        DraftVerdict v;
        if (j < g) {
            v = verify_draft_token(to_sample, vocab, s.params, s.rng, s.draft[static_cast<size_t>(j)]);
        } else {
            v.token = sample_token(to_sample, vocab, s.params, s.rng);  // every draft accepted: the bonus token
        }
        count_tokens(1, 0, 0, 0, j == 0 ? 1 : 0);
        why = push_token(s, v.token, raw, ev);
        if (!v.accepted) { break; }
        ++n_accepted;
    }
    // The choice's own counters (SGLang's per-request spec_*): one decode step, its drafts, and
    // the tokens it gave past its first (SGLang's accepted count: a draft that ended the choice
    // as its stop token is the step's own token there).
    s.spec.n_verify += 1;
    s.spec.n_draft_tokens += g;
    s.spec.n_accepted += static_cast<int32_t>(ev.token_ids.size()) - 1;
    ev.spec = s.spec;
    {
        std::lock_guard lk(stats_mu_);
        const std::string & v = state_.weight_version;
        stats_.spec_by_version[v].record(g, n_accepted);
        stats_.spec_total.record(g, n_accepted);
        if (v != spec_version_) {  // the first draft under a new version
            spec_prev_version_ = spec_version_;
            spec_version_      = v;
            spec::keep_recent_versions(stats_.spec_by_version, spec_versions_, v);
            stats_.spec_collapse_version.clear();
            stats_.spec_collapse_previous.clear();
        }
        if (!spec_prev_version_.empty() && collapse_warned_ != v &&
            spec::acceptance_collapsed(stats_.spec_by_version[spec_prev_version_], stats_.spec_by_version[v])) {
            collapse_warned_ = v;
            stats_.spec_collapse_version  = v;
            stats_.spec_collapse_previous = spec_prev_version_;
            log::get("engine")->warn("speculative decoding: acceptance collapsed after the weight update from version '{}' to '{}': "
                                     "{:.3f} of draft tokens accepted now, {:.3f} before (a stale or mismatched draft?); outputs are "
                                     "unchanged, only slower", spec_prev_version_, v, stats_.spec_by_version[v].acceptance_rate(),
                                     stats_.spec_by_version[spec_prev_version_].acceptance_rate());
        }
    }
    // The accepted drafts' KV (computed by this forward from accepted tokens) is kept; the
    // rejected ones' slots are not. Finished: the positions this forward computed count too
    // (routed_experts has a row for each, as without speculation: every token but the last; a
    // probe saw the accepted drafts' rows dropped), up to the last token, which no forward took
    // as input. Either way the full blocks go to the prefix cache as a plain step's do (a probe
    // saw the block a finishing verify step completed left out), and nothing past n_computed.
    s.n_computed = why == FinishReason::none ? s.n_computed + n_accepted
                                             : std::min<int64_t>(s.n_computed + n_accepted, static_cast<int64_t>(s.tokens.size()) - 1);
    kv_.commit_full_blocks(s.id, s.tokens, s.n_computed, s.prefix_salt, s.n_prompt);
    if (why == FinishReason::none) { kv_.trim(s.id, static_cast<int64_t>(s.tokens.size())); }  // the rejected drafts' blocks go back
    s.draft.clear();
    emit(s, why, std::move(ev));
}

}  // namespace fd::engine
