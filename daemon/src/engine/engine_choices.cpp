// The engine's choices from admission to their finishing event (engine thread): admit (one
// Sequence per choice of each prompt: seed, stop-string holdback, prompt scoring), push_token
// (a sampled token: logprobs, version spans, detokenization, vLLM's stop checks), emit (the
// event: held-back text, versions, routed experts, request metrics, deferred or held finals),
// ending choices early (a failed step, abort_all, abort_matching), n_live, and take_held (the
// events a pause held back). engine.cpp runs the steps.
#include "fd/engine/engine.h"

#include "engine_sequence.h"

#include "fd/engine/sampler.h"

#include <algorithm>
#include <chrono>
#include <random>

namespace fd::engine {
namespace {

int64_t count_code_points(std::string_view s) {
    return std::count_if(s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
}

/// Logits rows of one scoring sequence per step: at most 64 MiB of them.
int32_t scoring_chunk(int32_t vocab) { return std::max(16, static_cast<int32_t>((int64_t{64} << 20) / (4 * int64_t{std::max(vocab, 1)}))); }

}  // namespace

void Engine::fail_step(const Error & e) {
    for (auto & [id, s] : seqs_) {
        if (!s->channel) { continue; }  // already finished this step
        ChoiceEvent ev;
        ev.error = e;
        emit(*s, FinishReason::error, std::move(ev));
    }
}

void Engine::admit(GenerateRequest & req) {
    if (state_.paused && state_.pause_mode != PauseMode::keep) {
        // Submitted after a pause (abort or wait) or a sleep was asked for, before the engine
        // thread ran it (the request is behind the command in the inbox): the 503 that
        // Engine::submit gives once admission is stopped, not a 200 "abort" with no tokens (a
        // probe saw empty rollouts while weight streams committed). Nothing is ever generated
        // from paused or asleep weights. (A keep pause queues it frozen, like the requests it kept.)
        for (int32_t c = 0; c < static_cast<int32_t>(req.prompts.size()) * req.n; ++c) {
            ChoiceEvent ev;
            ev.choice          = c;
            ev.finish          = FinishReason::error;
            ev.error           = Error(Errc::engine_paused, kPausedMessage);
            ev.n_prompt_tokens = static_cast<int32_t>(req.prompts[c / req.n].size());
            ev.weight_version  = state_.weight_version;
            req.channel->push(std::move(ev));
        }
        return;
    }
    int32_t choice = 0;
    const uint64_t seed = req.params.seed ? *req.params.seed : std::random_device{}() * 0x100000001ULL + std::random_device{}();
    size_t holdback = 0;
    for (const auto & st : req.params.stop) { holdback = std::max(holdback, st.size()); }
    const auto ids = std::make_shared<const std::vector<std::string>>(std::move(req.request_ids));
    for (const auto & prompt : req.prompts) {
        for (int32_t i = 0; i < req.n; ++i, ++choice) {
            auto s           = std::make_unique<Sequence>(*tok_, prompt, req.params);
            s->id            = next_seq_id_++;
            s->tokens        = prompt;
            s->n_prompt      = static_cast<int32_t>(prompt.size());
            s->choice        = choice;
            s->channel       = req.channel;
            s->params        = req.params;
            // Seeded: sample i of every prompt draws from stream i, so a prompt's samples are
            // those of a request holding it alone, wherever it sits in a list (vLLM runs each
            // prompt of a list as its own request, children seeded by index). Unseeded: every
            // choice its own stream (two equal prompts in a list must not sample alike).
            s->rng           = SeqRng::from_seed(seed, req.params.seed ? i : choice);
            s->stop_holdback = holdback > 0 && !req.params.include_stop_str_in_output ? holdback - 1 : 0;
            if (req.params.prompt_logprobs >= 0) {  // every prompt row's logits are wanted: no prefix-cache skip
                s->no_prefix_cache = true;
                s->max_chunk       = scoring_chunk(model_cfg_.vocab_size);
            }
            // R3: a cached prefix's routes were never computed for this request; recompute them
            // (a request never gets routes another request's forward produced).
            if (req.params.return_routed_experts) { s->no_prefix_cache = true; }
            s->t_arrival     = req.t_arrival;
            s->prefix_salt   = req.prefix_salt;
            s->request_ids   = ids;
            sched_.add(s.get());
            seqs_.emplace(s->id, std::move(s));
        }
    }
    std::lock_guard lk(stats_mu_);
    ++stats_.n_requests_total;
}

void Engine::emit(Sequence & s, FinishReason why, ChoiceEvent ev) {
    // Text that could still turn out to start a stop string is held back until the end.
    const size_t hold = why == FinishReason::none ? s.stop_holdback : 0;
    size_t sendable   = s.text.size() > hold ? s.text.size() - hold : 0;
    // The held-back bytes count from the end: the cut moves back to a character's first byte, so a
    // delta never ends inside a UTF-8 sequence (a probe saw ' ت\ufffd' streamed for ' تن').
    while (sendable > s.n_text_sent && sendable < s.text.size() && (static_cast<unsigned char>(s.text[sendable]) & 0xC0) == 0x80) {
        --sendable;
    }
    if (sendable > s.n_text_sent) {
        ev.text += s.text.substr(s.n_text_sent, sendable - s.n_text_sent);
        s.n_text_sent = sendable;
    }
    if (s.params.prompt_logprobs >= 0 && !s.prompt_lps_sent) {
        ev.prompt_logprobs = std::move(s.prompt_lps);
        s.prompt_lps_sent  = true;
    }
    ev.choice          = s.choice;
    ev.finish          = why;
    ev.n_prompt_tokens = s.n_prompt;
    ev.n_cached_tokens = std::max(0, s.n_cached);
    ev.n_host_cached_tokens = kv_.tier_enabled() ? s.n_host_cached : -1;
    // The version its tokens came from: a kept choice that ends (abort, pause, sleep, shutdown)
    // after an update without a token under the new weights still names the old one.
    ev.weight_version  = s.spans.empty() ? state_.weight_version : s.spans.back().version;
    if (why != FinishReason::none && s.spans.size() > 1) { ev.weight_versions = s.spans; }
    if (why != FinishReason::none && s.params.return_routed_experts) {
        // The rows of every position this choice's forwards computed: prompt, then generated but the last.
        engine::RoutedExperts re;
        re.top_k    = model_cfg_.moe.top_k;
        re.n_layers = re.top_k > 0 ? model::route_cols(model_cfg_) / re.top_k : 0;
        const int64_t cols = model::route_cols(model_cfg_);
        const int64_t rows = cols > 0 ? std::min<int64_t>(s.n_computed, static_cast<int64_t>(s.routes.size()) / cols) : 0;
        re.ids.assign(s.routes.begin(), s.routes.begin() + rows * cols);
        ev.routed_experts = std::move(re);
    }
    // Metrics first: an event-driven reader may answer the client before push() returns, and
    // a client that has its answer must find it counted in /metrics.
    if (why != FinishReason::none) { count_finished(s, why); }
    if (defer_events_) {
        deferred_.emplace_back(s.channel, std::move(ev));
    } else if (hold_finals_ && why != FinishReason::none) {
        finals_.emplace_back(s.channel, std::move(ev));
    } else {
        s.channel->push(std::move(ev));
    }
    if (why != FinishReason::none) { s.channel.reset(); }  // finished; released at the end of the step
}

void Engine::count_finished(const Sequence & s, FinishReason why) {
    request_metrics_.e2e_s.observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - s.t_arrival).count());
    request_metrics_.n_finished[static_cast<size_t>(why) - 1].fetch_add(1, std::memory_order_relaxed);
    request_metrics_.prompt_tokens.observe(s.n_prompt);
    request_metrics_.generation_tokens.observe(static_cast<double>(s.tokens.size()) - s.n_prompt);
}

void Engine::append_token(Sequence & s, int32_t tok, const float * logits, ChoiceEvent & ev) {
    const FinishReason why = push_token(s, tok, logits, ev);
    emit(s, why, std::move(ev));
}

FinishReason Engine::push_token(Sequence & s, int32_t tok, const float * logits, ChoiceEvent & ev) {
    const SamplingParams & p = s.params;
    const bool first = s.t_last_token == std::chrono::steady_clock::time_point{};
    (first ? request_metrics_.ttft_s : request_metrics_.itl_s)
        .observe(std::chrono::duration<double>(t_step_done_ - (first ? s.t_arrival : s.t_last_token)).count());
    s.t_last_token = t_step_done_;
    s.tokens.push_back(tok);
    ev.token_ids.push_back(tok);
    ev.text_offsets.push_back(static_cast<int32_t>(s.n_chars));
    if (p.logprobs >= 0) { ev.logprobs.push_back(token_logprobs(logits, model_cfg_.vocab_size, tok, p.logprobs, scratch_)); }
    const int32_t n_generated = static_cast<int32_t>(s.tokens.size()) - s.n_prompt;
    if (s.spans.empty() || s.spans.back().version != state_.weight_version) {
        s.spans.push_back({.version = state_.weight_version, .first_token = n_generated - 1, .last_token = n_generated - 1});
    } else {
        s.spans.back().last_token = n_generated - 1;
    }
    // detokenize false (vLLM's): no text at all, and no decoding work (stop strings are refused then).
    auto add_text = [&](const std::string & t) {
        s.text += t;
        s.n_chars += count_code_points(t);
    };
    auto decode = [&](bool flush) {
        if (!p.detokenize) { return; }
        std::string t = s.detok.push(tok);
        if (flush) { t += s.detok.flush(); }
        add_text(t);
    };

    // vLLM's stop checks: nothing but the length stops a choice before min_tokens tokens; EOS
    // first (no stop_reason for the tokenizer's EOS), then stop_token_ids (stop_reason = id),
    // then stop strings once more than min_tokens tokens exist (stop_reason = the string).
    FinishReason why = FinishReason::none;
    const auto & eos_ids    = model_cfg_.eos_token_ids;
    const bool   is_eos     = std::find(eos_ids.begin(), eos_ids.end(), tok) != eos_ids.end();
    const bool   is_stop_id = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), tok) != p.stop_token_ids.end();
    const int32_t primary_eos = tok_->eos_id() ? *tok_->eos_id() : (eos_ids.empty() ? -1 : eos_ids[0]);
    if (n_generated >= p.min_tokens && ((is_eos && !p.ignore_eos) || is_stop_id)) {
        why = FinishReason::stop;
        if (p.ignore_eos || tok != primary_eos) { ev.stop_reason.token_id = tok; }
        if (p.include_stop_str_in_output) { decode(/*flush=*/true); }
    } else {
        const size_t before = s.text.size();
        decode(/*flush=*/false);
        if (n_generated > p.min_tokens && p.detokenize) {
            for (const auto & st : p.stop) {
                const size_t from = before >= st.size() ? before - st.size() + 1 : 0;
                const size_t at   = s.text.find(st, from);
                if (at == std::string::npos) { continue; }
                s.text.resize(p.include_stop_str_in_output ? at + st.size() : at);
                s.n_chars     = count_code_points(s.text);
                s.n_text_sent = std::min(s.n_text_sent, s.text.size());
                ev.stop_reason.str = st;
                why = FinishReason::stop;
                break;
            }
        }
        if (why == FinishReason::none && (n_generated >= p.max_tokens || static_cast<int32_t>(s.tokens.size()) >= cfg_.max_model_len)) {
            why = FinishReason::length;
            if (p.detokenize) { add_text(s.detok.flush()); }
        }
    }
    return why;
}

int32_t Engine::abort_all() {
    int32_t n = 0;
    for (auto & [id, s] : seqs_) {
        if (s->channel) {
            emit(*s, FinishReason::abort, ChoiceEvent{});
            ++n;
        }
    }
    for (auto & [id, s] : seqs_) {
        sched_.remove(s.get());
        kv_.release(id);
    }
    seqs_.clear();
    return n;
}

int32_t Engine::n_live() const {
    int32_t n = 0;
    for (const auto & [id, s] : seqs_) { n += s->channel ? 1 : 0; }
    return n;
}

int32_t Engine::abort_matching(const std::string & id, bool all) {
    std::vector<kv::SeqId> hit;
    for (auto & [sid, s] : seqs_) {
        if (!s->channel) { continue; }
        if (all || (s->request_ids && std::find(s->request_ids->begin(), s->request_ids->end(), id) != s->request_ids->end())) {
            emit(*s, FinishReason::abort, ChoiceEvent{});
            hit.push_back(sid);
        }
    }
    for (const kv::SeqId sid : hit) {
        sched_.remove(seqs_.at(sid).get());
        kv_.release(sid);
        seqs_.erase(sid);
    }
    if (drain_) { drain_->n_aborted += static_cast<int32_t>(hit.size()); }  // a pause's drain reports them aborted, not drained
    return static_cast<int32_t>(hit.size());
}

std::shared_ptr<HeldEvents> Engine::take_held() {
    if (deferred_.empty()) { return nullptr; }
    auto held = std::make_shared<HeldEvents>(std::move(deferred_));
    deferred_.clear();
    return held;
}

}  // namespace fd::engine
