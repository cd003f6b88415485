#include "fd/spec/spec_config.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <optional>

namespace fd::spec {

const char * to_string(SpecMethod m) {
    switch (m) {
        case SpecMethod::none: return "none";
        case SpecMethod::ngram: return "ngram";
        case SpecMethod::mtp: return "mtp";
    }
    return "none";
}

namespace {

/// An integer field (absent: nullopt). A non-integer value is a problem naming the field.
std::optional<int64_t> int_field(const nlohmann::json & j, const char * name, std::vector<std::string> & problems) {
    if (!j.contains(name) || j[name].is_null()) { return std::nullopt; }
    const auto & v = j[name];
    if (!v.is_number_integer()) {
        problems.push_back(fmt::format("--speculative-config: speculative_config.{} must be an integer, got {}", name, v.dump()));
        return std::nullopt;
    }
    return v.get<int64_t>();
}

}  // namespace

SpeculativeConfig parse_speculative_config(const std::string & text, int32_t model_mtp_layers, std::vector<std::string> & problems) {
    SpeculativeConfig c;
    if (text.find_first_not_of(" \t\r\n") == std::string::npos) { return c; }
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception & e) {
        problems.push_back(fmt::format("--speculative-config is not valid JSON ({}); expected e.g. "
                                       "'{{\"method\": \"ngram\", \"num_speculative_tokens\": 3}}'", e.what()));
        return c;
    }
    if (!j.is_object()) {
        problems.push_back("--speculative-config must be a JSON object, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'");
        return c;
    }
    if (j.empty()) { return c; }
    const size_t n_before = problems.size();
    static const char * const kKnown[] = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                                          "disable_by_batch_size"};
    for (const auto & [key, value] : j.items()) {
        if (std::find_if(std::begin(kKnown), std::end(kKnown), [&](const char * k) { return key == k; }) == std::end(kKnown)) {
            problems.push_back(fmt::format("--speculative-config: unknown field speculative_config.{} (known: method, num_speculative_tokens, "
                                           "prompt_lookup_min, prompt_lookup_max, disable_by_batch_size)", key));
        }
    }
    if (!j.contains("method") || !j["method"].is_string()) {
        problems.push_back("--speculative-config: speculative_config.method is required: \"ngram\" or \"mtp\"");
    } else {
        const auto m = j["method"].get<std::string>();
        if (m == "ngram") {
            c.method = SpecMethod::ngram;
        } else if (m == "mtp") {
            c.method = SpecMethod::mtp;
            if (model_mtp_layers <= 0) {
                problems.push_back("--speculative-config: speculative_config.method \"mtp\" needs a checkpoint with next-token-prediction "
                                   "layers (MiMoForCausalLM with config.json num_nextn_predict_layers >= 1); this model has none. Use \"ngram\"");
            }
        } else {
            problems.push_back(fmt::format("--speculative-config: unknown speculative_config.method \"{}\" (expected \"ngram\" or \"mtp\")", m));
        }
    }
    const auto k = int_field(j, "num_speculative_tokens", problems);
    if (!k && !j.contains("num_speculative_tokens")) {
        problems.push_back("--speculative-config: speculative_config.num_speculative_tokens is required (the draft tokens per step, "
                           "e.g. 3)");
    } else if (k && (*k < 1 || *k > kMaxSpeculativeTokens)) {
        problems.push_back(fmt::format("--speculative-config: speculative_config.num_speculative_tokens {} must be in [1, {}]", *k,
                                       kMaxSpeculativeTokens));
    }
    auto lo = int_field(j, "prompt_lookup_min", problems);
    auto hi = int_field(j, "prompt_lookup_max", problems);
    if (c.method != SpecMethod::ngram && (lo || hi)) {
        problems.push_back("--speculative-config: speculative_config.prompt_lookup_min/max apply to method \"ngram\" only");
    }
    if (c.method == SpecMethod::ngram) {
        bool ok = true;
        for (const auto & [v, name] : {std::pair{lo, "prompt_lookup_min"}, std::pair{hi, "prompt_lookup_max"}}) {
            if (v && (*v < 1 || *v > 1024)) {
                problems.push_back(fmt::format("--speculative-config: speculative_config.{} {} must be in [1, 1024]", name, *v));
                ok = false;
            }
        }
        if (!lo && !hi) { lo = hi = kDefaultPromptLookup; }
        if (!lo) { lo = hi; }
        if (!hi) { hi = lo; }
        if (ok && *lo > *hi) {
            problems.push_back(fmt::format("--speculative-config: speculative_config.prompt_lookup_min {} exceeds prompt_lookup_max {} "
                                           "(the bounds are reversed)", *lo, *hi));
        }
    }
    const auto b = int_field(j, "disable_by_batch_size", problems);
    if (b && *b < 0) {
        problems.push_back(fmt::format("--speculative-config: speculative_config.disable_by_batch_size {} must be >= 0 (0 = never off)", *b));
    }
    if (problems.size() != n_before) { return SpeculativeConfig{}; }
    c.num_speculative_tokens = static_cast<int32_t>(*k);
    if (c.method == SpecMethod::ngram) {
        c.prompt_lookup_min = static_cast<int32_t>(*lo);
        c.prompt_lookup_max = static_cast<int32_t>(*hi);
    }
    c.disable_by_batch_size = b ? static_cast<int32_t>(*b) : kDefaultDisableByBatchSize;
    return c;
}

}  // namespace fd::spec
