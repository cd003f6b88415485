// --speculative-config (daemon/src/spec/spec_config.cpp) and the n-gram proposer
// (daemon/src/spec/ngram_proposer.cpp) on hand-worked sequences; fd/spec/acceptance.h's checks.
#include "fd/spec/proposer.h"
#include "fd/spec/spec_config.h"
#include "fd/spec/acceptance.h"  // after: it uses size_t without <cstddef> (left as is: every engine file includes it)

#include <doctest/doctest.h>

#include <map>
#include <string>
#include <vector>

using fd::spec::NgramProposer;
using fd::spec::parse_speculative_config;
using fd::spec::SpecMethod;

namespace {

/// The problems parsing `json` reports (model without MTP layers unless `mtp_layers`).
std::vector<std::string> problems_of(const std::string & json, int32_t mtp_layers = 0) {
    std::vector<std::string> p;
    parse_speculative_config(json, mtp_layers, p);
    return p;
}

bool one_names(const std::vector<std::string> & p, const std::string & what) {
    return p.size() == 1 && p[0].find(what) != std::string::npos;
}

std::vector<int32_t> propose(const NgramProposer & pr, const std::vector<int32_t> & toks, int32_t k) {
    std::vector<int32_t> out = {99};  // cleared by propose
    pr.propose({.tokens = toks, .layer_drafts = {}}, k, out);
    return out;
}

}  // namespace

TEST_CASE("speculative-config: absent or empty is no speculation") {
    for (const char * s : {"", "  ", "{}"}) {
        std::vector<std::string> p;
        const auto c = parse_speculative_config(s, 0, p);
        CHECK(p.empty());
        CHECK(c.method == SpecMethod::none);
        CHECK_FALSE(c.enabled());
    }
}

TEST_CASE("speculative-config: ngram with vLLM's fields and defaults") {
    std::vector<std::string> p;
    auto c = parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4})", 0, p);
    REQUIRE(p.empty());
    CHECK(c.method == SpecMethod::ngram);
    CHECK(c.num_speculative_tokens == 3);
    CHECK(c.prompt_lookup_min == 2);
    CHECK(c.prompt_lookup_max == 4);
    CHECK(c.disable_by_batch_size == 8);  // absent: fdrollout's measured default (vLLM: never off)
    c = parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 2})", 0, p);
    REQUIRE(p.empty());
    CHECK(c.prompt_lookup_min == 5);  // neither bound: both 5, as vLLM
    CHECK(c.prompt_lookup_max == 5);
    c = parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})", 0, p);
    REQUIRE(p.empty());
    CHECK(c.prompt_lookup_min == 3);  // one bound: the other takes its value
    CHECK(c.prompt_lookup_max == 3);
    c = parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 2, "disable_by_batch_size": 32})", 0, p);
    REQUIRE(p.empty());
    CHECK(c.prompt_lookup_max == 2);
    CHECK(c.disable_by_batch_size == 32);
    c = parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 1, "disable_by_batch_size": 0})", 0, p);
    REQUIRE(p.empty());
    CHECK(c.disable_by_batch_size == 0);  // never off
}

TEST_CASE("speculative-config: bad input is one problem naming the field") {
    CHECK(one_names(problems_of(R"({"method": "medusa", "num_speculative_tokens": 2})"), "speculative_config.method \"medusa\""));
    CHECK(one_names(problems_of(R"({"num_speculative_tokens": 2})"), "speculative_config.method is required"));
    CHECK(one_names(problems_of(R"({"method": "ngram", "num_speculative_tokens": 0})"), "speculative_config.num_speculative_tokens 0"));
    CHECK(one_names(problems_of(R"({"method": "ngram", "num_speculative_tokens": -1})"), "speculative_config.num_speculative_tokens -1"));
    CHECK(one_names(problems_of(R"({"method": "ngram", "num_speculative_tokens": 1000})"), "speculative_config.num_speculative_tokens 1000"));
    CHECK(one_names(problems_of(R"({"method": "ngram", "num_speculative_tokens": 2.5})"), "speculative_config.num_speculative_tokens must be an integer"));
    CHECK(one_names(problems_of(R"({"method": "ngram"})"), "speculative_config.num_speculative_tokens is required"));
    CHECK(one_names(problems_of(R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2})"),
                    "prompt_lookup_min 4 exceeds prompt_lookup_max 2"));
    CHECK(one_names(problems_of(R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0})"),
                    "speculative_config.prompt_lookup_min 0"));
    CHECK(one_names(problems_of(R"({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -3})"),
                    "speculative_config.disable_by_batch_size -3"));
    CHECK(one_names(problems_of(R"({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"})"),
                    "unknown field speculative_config.draft_model"));
    CHECK(one_names(problems_of(R"({"method": "ngram", "num_speculative_tokens": 2)"), "not valid JSON"));
    CHECK(one_names(problems_of(R"(["ngram"])"), "must be a JSON object"));
    // mtp: a model without MTP layers is told so; one with them is accepted.
    CHECK(one_names(problems_of(R"({"method": "mtp", "num_speculative_tokens": 1})"), "num_nextn_predict_layers"));
    CHECK(problems_of(R"({"method": "mtp", "num_speculative_tokens": 2})", 1).empty());
    // Every problem at once, and nothing half-parsed.
    std::vector<std::string> p;
    const auto c = parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_min": 3, "prompt_lookup_max": 1})", 0, p);
    CHECK(p.size() == 2);
    CHECK(c.method == SpecMethod::none);
}

TEST_CASE("ngram proposer: the longest suffix n-gram's earliest occurrence gives the draft") {
    const NgramProposer p13(1, 3);
    // [1 2 3] recurs at 0: the two tokens after it.
    CHECK(propose(p13, {1, 2, 3, 4, 1, 2, 3}, 2) == std::vector<int32_t>{4, 1});
    // the 3-gram [1 2 3] (at 3, then 8) wins over the 2-gram [2 3] (at 0, then 7).
    CHECK(propose(p13, {2, 3, 7, 1, 2, 3, 8, 1, 2, 3}, 2) == std::vector<int32_t>{8, 1});
    // only a 2-gram matches: [5 6] first at 0, then 7 5.
    CHECK(propose(p13, {5, 6, 7, 5, 6, 8, 5, 6}, 2) == std::vector<int32_t>{7, 5});
    // the continuation stops at the end of the sequence (fewer than k).
    CHECK(propose(p13, {1, 2, 1, 2}, 5) == std::vector<int32_t>{1, 2});
    // no earlier occurrence: no draft; k = 0: no draft.
    CHECK(propose(p13, {1, 2, 3, 4}, 3).empty());
    CHECK(propose(p13, {1, 2, 3, 1, 2, 3}, 0).empty());
    // a 1-gram repeats but prompt_lookup_min 2 asks for at least 2.
    const NgramProposer p23(2, 3);
    CHECK(propose(p23, {4, 9, 5, 4}, 2).empty());
    CHECK(propose(p13, {4, 9, 5, 4}, 2) == std::vector<int32_t>{9, 5});
    // a sequence shorter than the n-gram: nothing, no out-of-range read.
    CHECK(propose(p23, {4}, 2).empty());
    CHECK(propose(p23, {}, 2).empty());
}

TEST_CASE("mtp proposer: the draft layer's tokens, at most k, up to a -1; make_proposer picks it") {
    const fd::spec::MtpProposer p;
    std::vector<int32_t>       out = {99};
    const std::vector<int32_t> toks = {1, 2, 3}, layer = {7, 8, 9};
    p.propose({.tokens = toks, .layer_drafts = layer}, 2, out);
    CHECK(out == std::vector<int32_t>{7, 8});
    p.propose({.tokens = toks, .layer_drafts = layer}, 5, out);
    CHECK(out == std::vector<int32_t>{7, 8, 9});
    const std::vector<int32_t> cut = {7, -1, 9};  // a chain that stopped early
    p.propose({.tokens = toks, .layer_drafts = cut}, 3, out);
    CHECK(out == std::vector<int32_t>{7});
    p.propose({.tokens = toks, .layer_drafts = {}}, 3, out);
    CHECK(out.empty());
    fd::spec::SpeculativeConfig c;
    c.method = SpecMethod::mtp;
    CHECK(fd::spec::make_proposer(c)->uses_draft_layers());
    c.method = SpecMethod::ngram;
    c.prompt_lookup_min = c.prompt_lookup_max = 2;
    CHECK_FALSE(fd::spec::make_proposer(c)->uses_draft_layers());
}

TEST_CASE("acceptance collapse: below a third of the previous version's rate, once both saw the window") {
    using fd::spec::acceptance_collapsed;
    using fd::spec::DraftCounters;
    auto counters = [](int64_t proposed, int64_t accepted) {
        DraftCounters c;
        c.n_drafts = proposed, c.n_draft_tokens = proposed, c.n_accepted_tokens = accepted;
        return c;
    };
    CHECK(acceptance_collapsed(counters(100, 60), counters(100, 19), 64));         // 0.19 < 0.6 / 3
    CHECK_FALSE(acceptance_collapsed(counters(100, 60), counters(100, 20), 64));   // 0.2 is exactly a third
    CHECK_FALSE(acceptance_collapsed(counters(100, 60), counters(63, 0), 64));     // the new version's window not full
    CHECK_FALSE(acceptance_collapsed(counters(63, 60), counters(100, 0), 64));     // the old one's not either
    CHECK_FALSE(acceptance_collapsed(counters(100, 0), counters(100, 0), 64));     // nothing to fall from
}

TEST_CASE("per-version counters: only the versions drafted under most recently stay") {
    using fd::spec::DraftCounters;
    std::map<std::string, DraftCounters> by;
    std::vector<std::string>             recent;
    auto draft = [&](const std::string & v) {  // as the engine: record, then note a version change
        by[v].record(2, 1);
        fd::spec::keep_recent_versions(by, recent, v, 3);
    };
    for (const char * v : {"1", "2", "3"}) { draft(v); }
    CHECK(recent == std::vector<std::string>{"1", "2", "3"});
    draft("4");  // "1" leaves
    CHECK(recent == std::vector<std::string>{"2", "3", "4"});
    CHECK(by.size() == 3);
    CHECK(by.count("1") == 0);
    draft("2");  // back again: the most recent now, its counts kept
    CHECK(recent == std::vector<std::string>{"3", "4", "2"});
    CHECK(by["2"].n_drafts == 2);
    draft("5");  // "3" was the least recent
    CHECK(recent == std::vector<std::string>{"4", "2", "5"});
    CHECK(by.count("3") == 0);
    for (int i = 6; i < 200; ++i) { draft(std::to_string(i)); }  // bounded however many updates
    CHECK(by.size() == 3);
    CHECK(recent == std::vector<std::string>{"197", "198", "199"});
    CHECK(fd::spec::kVersionsKept >= 2);  // the collapse check compares the previous version with the current one
}
