#include "output.h"

#include "fd/status.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <string_view>
#include <utility>

namespace fdctl {
namespace {

using nlohmann::json;

json parse(const Reply & r) {
    try {
        return json::parse(r.body);
    } catch (const json::exception &) {
        return json(r.body);  // plain text ("Dynamic Load Weight Disabled.")
    }
}

std::string mib(const json & v) { return fmt::format("{:.1f} MiB", v.get<double>() / 1048576.0); }

/// The daemon's hints name HTTP routes (its messages are the same on both transports); fdctl's
/// user types fdctl commands. Longest phrases first: a shorter one is a prefix of a longer one.
constexpr std::pair<std::string_view, std::string_view> kRouteToFdctl[] = {
    {"POST /v1/update_weights {\"version\": ..., \"commit\": false} first", "run `fdctl stage-weights --version V` first"},
    {"POST /v1/commit_weights or /v1/drop_staged_weights first", "run `fdctl commit-weights` or `fdctl drop-staged-weights` first"},
    {"POST /v1/wakeup or /v1/update_weights first", "run `fdctl wakeup` or `fdctl update-weights` first"},
    {"POST /v1/wakeup?tags=weight first", "run `fdctl wakeup --tags weight` first"},
    {"POST /v1/wakeup?tags=kv_cache", "`fdctl wakeup --tags kv_cache`"},
    {"retry after POST /v1/resume or /v1/wakeup", "retry after `fdctl resume` or `fdctl wakeup`"},
    {"POST /v1/pause first", "run `fdctl pause` first"},
    {"POST /v1/wakeup first", "run `fdctl wakeup` first"},
    {"POST /v1/wakeup", "`fdctl wakeup`"},
    {"GET /health names it", "`fdctl status` names it"},
    {"pass {\"version\": \"...\"}", "pass --version"},
    {"or pass \"version\")", "or pass --version)"},
};

std::string speak_fdctl(std::string msg) {
    for (const auto & [route, cmd] : kRouteToFdctl) {
        for (size_t at = msg.find(route); at != std::string::npos; at = msg.find(route, at + cmd.size())) {
            msg.replace(at, route.size(), cmd);
        }
    }
    return msg;
}

}  // namespace

int exit_code_for(const Reply & r) {
    const json j = parse(r);
    if (j.is_object() && j.contains("error") && j["error"].is_object()) {
        return fd::errc_info(fd::errc_from_name(j["error"].value("type", ""))).exit_code;
    }
    if (r.http_status == 200) { return 0; }
    const std::string msg = j.is_object() ? j.value("msg", "") : j.is_string() ? j.get<std::string>() : "";
    if (r.http_status == 404) {
        return fd::errc_info(msg.find("timeout") != std::string::npos ? fd::Errc::timeout : fd::Errc::not_found).exit_code;
    }
    if (r.http_status == 400 || r.http_status == 403 || r.http_status == 409) { return fd::errc_info(fd::Errc::wrong_state).exit_code; }
    return fd::errc_info(fd::Errc::internal).exit_code;
}

std::string error_message(const Reply & r) {
    const json j = parse(r);
    if (j.is_object() && j.contains("error") && j["error"].is_object()) {
        return fmt::format("{} ({}): {}", j["error"].value("type", "error"), r.http_status, speak_fdctl(j["error"].value("message", "")));
    }
    if (j.is_object() && j.contains("msg")) {
        std::string m = fmt::format("{} ({})", j["msg"].get<std::string>(), r.http_status);
        if (j.contains("error") && j["error"].is_string()) { m += ": " + j["error"].get<std::string>(); }
        return m;
    }
    return fmt::format("HTTP {}: {}", r.http_status, r.body);
}

std::string human_summary(const std::string & op, const Reply & r, const std::string & mode) {
    const json j = parse(r);
    if (op == "is_paused") { return j.value("is_paused", false) ? "true" : "false"; }
    if (op == "wait") { return fmt::format("state={}", j.value("state", "?")); }
    if (op == "status") {
        const auto & tags = j.contains("sleeping_tags") && j["sleeping_tags"].is_array() ? j["sleeping_tags"] : json::array();
        std::vector<std::string> sleeping;
        for (const auto & t : tags) { sleeping.push_back(t.is_string() ? t.get<std::string>() : t.dump()); }
        return fmt::format("state={} paused={} sleeping={} weights_valid={} weight_version={} model_weights_status={} running={} waiting={}",
                           j.value("state", "?"), j.value("is_paused", false),
                           sleeping.empty() ? "-" : fmt::format("{}", fmt::join(sleeping, ",")),
                           j.value("weights_valid", false), j.value("weight_version", "?"), j.value("model_weights_status", 0),
                           j.value("num_requests_running", 0), j.value("num_requests_waiting", 0)) +
               (j.contains("staged_weight_version") && j["staged_weight_version"].is_string()
                    ? " staged_weight_version=" + j["staged_weight_version"].get<std::string>()
                    : std::string());
    }
    if (j.is_object() && j.contains("msg")) { return j["msg"].get<std::string>(); }  // legacy answers
    if (!j.is_object() || !j.contains("result")) { return r.body; }
    const json & res = j["result"];
    if (op == "pause") {
        const std::string mode = res.value("mode", "abort");
        if (mode == "keep") { return fmt::format("paused, mode keep ({} choice(s) frozen with their KV until resume)", res.value("kept", 0)); }
        if (mode == "wait") {
            const int aborted = res.value("aborted", 0);
            return fmt::format("paused, mode wait ({} choice(s) ran to their end first{})", res.value("drained", 0),
                               aborted > 0 ? fmt::format(", {} ended by an abort meanwhile", aborted) : "");
        }
        return fmt::format("paused (aborted {} choice(s))", res.value("aborted", 0));  // a request with n > 1 counts n
    }
    if (op == "resume") { return "resumed"; }
    if (op == "flush_cache" && mode == "device") { return "device prefix cache flushed (host KV tier kept)"; }
    if (op == "flush_cache") { return fmt::format("prefix cache flushed ({} host KV tier block(s) forgotten)", res.value("host_blocks_flushed", 0)); }
    if (op == "abort") { return fmt::format("aborted {} choice(s)", res.value("aborted", 0)); }
    if (op == "sleep" || (op == "clear_load_weight" && res.contains("freed_bytes"))) {
        std::string freed;
        for (const auto & [tag, bytes] : res["freed_bytes"].items()) { freed += fmt::format(" {}={}", tag, mib(bytes)); }
        return fmt::format("asleep: {}{}; freed{}; rss {} -> {}", fmt::join(res["tags"].get<std::vector<std::string>>(), ","),
                           res["skipped"].empty() ? "" : fmt::format(" (already asleep: {})", fmt::join(res["skipped"].get<std::vector<std::string>>(), ",")),
                           freed.empty() ? " nothing" : freed, mib(res["rss_before_bytes"]), mib(res["rss_after_bytes"]));
    }
    if (op == "wakeup" || op == "update_model_weight") {
        return fmt::format("awake: {}; weight_version {}; {}", res["tags"].empty() ? "-" : fmt::format("{}", fmt::join(res["tags"].get<std::vector<std::string>>(), ",")),
                           res.value("version", "?"), res.value("is_paused", true) ? "paused" : "serving");
    }
    if (op == "update_weights" && res.value("staged", false)) {
        return fmt::format("staged weight_version {} ({}; not serving: commit-weights --version {} applies it, drop-staged-weights discards it)",
                           res.value("version", "?"), mib(res["bytes"]), res.value("version", "?"));
    }
    if (op == "commit_weights") { return fmt::format("weight_version {} committed (still paused: resume when ready)", res.value("version", "?")); }
    if (op == "drop_staged_weights") {
        return res["dropped_version"].is_null() ? std::string("nothing was staged") : fmt::format("dropped staged {}", res["dropped_version"].get<std::string>());
    }
    if (op == "update_weights") {
        double total = 0;
        for (const auto & rk : res["ranks"]) { total = std::max(total, rk.value("total_cost", 0.0)); }
        return fmt::format("weight_version {} ({} in {:.3f} s; still paused: resume when ready)", res.value("version", "?"), mib(res["bytes"]), total);
    }
    return r.body;
}

}  // namespace fdctl
