// fdctl — drive fdrollout's weight control from the shell, over the shm control block or the V1
// HTTP API. Results on stdout (human, or --json: the HTTP API's body), diagnostics on stderr,
// one exit-code table (see --help).
#include "fleet.h"
#include "offline.h"
#include "output.h"
#include "progress_bar.h"
#include "transport.h"
#include "wait_state.h"

#include "fd/build_info.h"
#include "fd/deadline.h"

#include "fd/shm/names.h"
#include "fd/status.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

namespace {

constexpr const char * kExitCodes =
    "Exit codes (the same for both transports):\n"
    "   0  success\n"
    "   2  usage error: nothing was sent\n"
    "   3  not_found (e.g. dynamic load weight disabled; abort: no running request has that id)\n"
    "   4  wrong_state (not paused, a tag asleep, legacy clear/update in progress)\n"
    "   5  invalid_checkpoint\n"
    "   6  engine_paused\n"
    "   7  timeout (--timeout, or the daemon's); also a live daemon that is stopped or stalled. A command\n"
    "      not started by the deadline is withdrawn and never runs (the message says nothing changed)\n"
    "   8  daemon unreachable (none on that port, its pid died, it closed the connection mid-call, or what\n"
    "      answered is not fdrollout)\n"
    "   9  unauthorized (--api-key)\n"
    "  10  invalid_argument (an argument was rejected)\n"
    "  11  checksum_mismatch\n"
    "  12  source_unavailable\n"
    "  13  forbidden: a file the daemon must trust (ipc record, control block, snapshot or staging dir)\n"
    "      belongs to another user or is writable by others, or (fdctl) the control block is not yours or open to others\n"
    "  14  rank_failed (a tensor-parallel rank died, hung or never joined)\n"
    "  15  shutting_down (the daemon is draining or stopping: retry on another replica)\n"
    "  20  fleet (--fleet/--hosts): some hosts failed, the others succeeded (per-host results on stdout/stderr);\n"
    "      abort REQUEST_ID: a host failed (e.g. unreachable), so the id may still run there\n"
    "      update-weights: not every host staged, so the version was dropped where staged: all keep the old one\n"
    "  21  fleet update-weights inconsistent: committed on some hosts only, or versions differ afterwards\n"
    "      (a fleet where every host failed alike exits with that failure's code, e.g. 8 all unreachable)\n"
    "  70  internal error\n"
    "Environment: FD_ENABLE_V1_UPDATE_WEIGHTS=1 makes --transport default to v1 (else shm); FD_PORT;\n"
    "FD_CONTROL_API_KEY (the daemon's --control-api-key), else FD_API_KEY, is the --api-key default.";

struct Options {
    int         port      = 8000;
    std::string url;
    std::string transport;
    double      timeout_s = 600.0;
    bool        json      = false;
    bool        quiet     = false;
    std::string api_key;
    // subcommand arguments
    std::string tags;
    std::string version;
    bool        verify_checksum = false;
    std::string until;
    std::string fleet_file;
    std::string hosts;
    std::string mode;
    std::string request_id;
    bool        abort_all = false;
};

std::unique_ptr<fdctl::Transport> connect(const Options & o) {
    if (o.transport == "shm") { return fdctl::make_shm_transport(o.port, o.timeout_s); }
    return fdctl::make_v1_transport(o.url.empty() ? "http://127.0.0.1:" + std::to_string(o.port) : o.url, o.api_key, o.timeout_s);
}

/// Why the port of --url `v` (http://HOST[:PORT], HOST maybe [IPv6]) is not one, or "".
std::string url_port_problem(const std::string & v) {
    const std::string authority = v.substr(7);
    const size_t      bracket   = authority.rfind(']');
    const size_t      colon     = authority.rfind(':');
    if (colon == std::string::npos || (bracket != std::string::npos && colon < bracket)) { return {}; }  // no port: 80
    const std::string port = authority.substr(colon + 1);
    const bool digits = !port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos;
    if (!digits || std::stoi(port) < 1 || std::stoi(port) > 65535) {
        return "--url port must be a number in 1..65535, got '" + port + "' in '" + v + "'";
    }
    return {};
}

/// The subcommand word of argv (the first argument that is neither a global option nor the
/// value of one), or "" when there is none.
std::string subcommand_word(int argc, char ** argv) {
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a.empty() || a[0] != '-') { return a; }
        const bool takes_value = a == "--port" || a == "--url" || a == "--transport" || a == "--timeout" || a == "--api-key" ||
                                 a == "--fleet" || a == "--hosts";
        if (takes_value) { ++i; }
    }
    return "";
}

/// An error fdctl finds itself (usage, unreachable, timeout, ...): on stderr, and with --json also
/// on stdout in the daemon's control-error shape ({"status": "error", "error": {type, message}})
/// plus the exit code, so a script reading --json output always gets one JSON object. Returns rc.
int report_error(bool json, const std::string & type, const std::string & message, int rc) {
    std::cerr << "fdctl: " << (type == "usage" ? "usage: " : type == "internal" ? "internal error: " : type + ": ") << message << "\n";
    if (json) {
        std::cout << nlohmann::json{{"status", "error"}, {"error", {{"type", type}, {"message", message}}}, {"exit_code", rc}}.dump(
                         -1, ' ', false, nlohmann::json::error_handler_t::replace)
                  << "\n";
    }
    return rc;
}

/// `wait --until`: poll `status` until the state holds; unreachable counts as "not yet".
int run_wait(const Options & o) {
    const fdctl::WaitOutcome w = fdctl::wait_until(
        [&](double left_s) {
            Options each = o;  // each status call gets what is left of --timeout, no more
            each.timeout_s = left_s;
            return connect(each)->call({.op = "status"});
        },
        o.until, o.timeout_s);
    if (w.exit_code == 0) {
        if (!o.quiet) { std::cout << (o.json ? w.body : "state=" + w.state) << "\n"; }
        return 0;
    }
    return report_error(o.json, std::string(fd::errc_name(w.code)), w.message, w.exit_code);
}

std::string base_url(const Options & o) { return o.url.empty() ? "http://127.0.0.1:" + std::to_string(o.port) : o.url; }

/// The tensor_parallel_size and expert_parallel_size of the daemon on o.port (its /health),
/// {0, 0} when none answers within a few seconds (publish --strategy ipc works without a daemon).
std::pair<int, int> rollout_sizes(const Options & o) {
    try {
        const fdctl::Reply r = fdctl::make_v1_transport(base_url(o), o.api_key, std::min(o.timeout_s, 5.0))->call({.op = "status"});
        if (r.http_status != 200) { return {0, 0}; }
        const auto j = nlohmann::json::parse(r.body, nullptr, false);
        if (!j.is_object()) { return {0, 0}; }
        return {j.value("tensor_parallel_size", 1), j.value("expert_parallel_size", 1)};
    } catch (const fd::Error &) {
        return {0, 0};
    }
}

int run_command(const Options & o, fd::shm::MailboxCommand cmd) {
    const bool long_op = cmd.op != "status" && cmd.op != "is_paused" && cmd.op != "pause" && cmd.op != "resume" && cmd.op != "abort";
    std::unique_ptr<fdctl::ProgressBar> bar;  // bytes done / total of the daemon's load, on a terminal
    if (long_op && !o.quiet && !o.json && isatty(STDERR_FILENO)) { bar = std::make_unique<fdctl::ProgressBar>(base_url(o), o.api_key, cmd.op); }
    const fdctl::Reply r = connect(o)->call(cmd);
    bar.reset();
    const int rc = fdctl::exit_code_for(r);
    if (rc != 0) {
        if (o.json) { std::cout << r.body << "\n"; }
        std::cerr << "fdctl: " << cmd.op << ": " << fdctl::error_message(r) << "\n";
        return rc;
    }
    if (!o.quiet) { std::cout << (o.json ? r.body : fdctl::human_summary(cmd.op, r, cmd.mode)) << "\n"; }
    return 0;
}

}  // namespace

int main(int argc, char ** argv) {
    CLI::App app{"fdctl — weight control for fdrollout (pause, resume, sleep/wakeup, update-weights, legacy clear/update)\n"
                 "over the shared-memory control block (--transport shm) or the V1 HTTP API (--transport v1)."};
    app.footer(kExitCodes);
    app.require_subcommand(1);
    app.fallthrough();  // global options may also follow the subcommand
    Options o;
    const char * v1 = std::getenv("FD_ENABLE_V1_UPDATE_WEIGHTS");
    o.transport = v1 && std::string(v1) == "1" ? "v1" : "shm";
    app.add_option("--port", o.port, "The daemon's port (names its control block and default URL)")
        ->envname("FD_PORT")->check(CLI::Range(0, 65535))->capture_default_str();  // 0: none (a --fleet call)
    // http://HOST[:PORT] with an optional trailing '/' (dropped): a path, a query or another
    // scheme is a usage error, not a "connection refused" from a URL the client could not use.
    auto * url_opt = app.add_option("--url", o.url, "V1 base URL (default http://127.0.0.1:PORT); implies --transport v1")
        ->transform(CLI::Validator([](std::string & v) -> std::string {
                        while (v.size() > 7 && v.back() == '/') { v.pop_back(); }
                        const bool http = v.rfind("http://", 0) == 0 && v.size() > 7;
                        if (!http || v.find_first_of("/?#@ ", 7) != std::string::npos) {
                            return "--url must be http://HOST[:PORT] (no path, query or other scheme), got '" + v + "'";
                        }
                        return url_port_problem(v);
                    }, "URL"));
    auto * transport_opt = app.add_option("--transport", o.transport, "shm (control block) or v1 (HTTP); default from FD_ENABLE_V1_UPDATE_WEIGHTS "
                                                                      "(v1 when --url is given)")
        ->check(CLI::IsMember({"shm", "v1"}))->capture_default_str();
    // Bounded by fd::kMaxWaitS (fd/deadline.h): past ~9e9 s the clocks' tick counts overflowed (an instant timeout, or a wait without end).
    app.add_option("--timeout", o.timeout_s, "Seconds to wait for the daemon (and for `wait`), > 0 and <= 1e7; the last one given wins")
        ->check(CLI::Validator([](std::string & v) -> std::string {
                    // strtod also reads hex (0x10), inf/nan and leading blanks: a decimal number only
                    const bool decimal = !v.empty() && v.find_first_not_of("0123456789.eE+-") == std::string::npos;
                    char * end = nullptr;
                    const double x = std::strtod(v.c_str(), &end);
                    if (!decimal || end != v.c_str() + v.size() || !(x > 0) || !(x <= fd::kMaxWaitS)) {
                        return "--timeout must be a number of seconds > 0 and <= 1e7, got '" + v + "'";
                    }
                    return {};
                }, "SECONDS"))
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)->capture_default_str();
    app.add_flag("--json", o.json, "Print the daemon's JSON answer (the V1 HTTP body) instead of a summary");
    app.add_flag("--quiet", o.quiet, "Print nothing on success; the exit code says it all");
    // The control routes take the daemon's --control-api-key when it has one, else its --api-key.
    for (const char * env : {"FD_CONTROL_API_KEY", "FD_API_KEY"}) {
        if (const char * k = std::getenv(env); k && *k && o.api_key.empty()) { o.api_key = k; }
    }
    app.add_option("--api-key", o.api_key, "Bearer key for --transport v1: the daemon's --control-api-key if set, else its --api-key "
                                           "(default FD_CONTROL_API_KEY, else FD_API_KEY)");

    auto * fleet_opt = app.add_option("--fleet", o.fleet_file, "Run the command on every daemon listed in FILE (host:port or http://host:port per line, "
                                            "# comments) in parallel over HTTP; update-weights is all-or-nothing across them");
    auto * hosts_opt = app.add_option("--hosts", o.hosts, "Like --fleet, the daemons given inline: h1:p1,h2:p2");

    fd::shm::MailboxCommand cmd;
    auto simple = [&](const char * name, const char * op, const char * help) {
        app.add_subcommand(name, help)->callback([&cmd, op] { cmd.op = op; });
    };
    auto * pause = app.add_subcommand("pause", "Stop generation; --mode abort (default): running and queued requests end with "
                                               "finish_reason abort; wait: they finish first; keep: they freeze with their KV until resume");
    pause->add_option("--mode", o.mode, "abort | wait | keep")->check(CLI::IsMember({"abort", "wait", "keep"}));
    pause->callback([&] { cmd.op = "pause"; cmd.mode = o.mode; });
    simple("resume", "resume", "Resume generation (refused while a tag is asleep)");
    auto * abort_sub = app.add_subcommand("abort", "End one running request (by its completion id or the client's X-Request-Id) or, "
                                               "with --all, every request: finish_reason abort, KV freed; never pauses");
    abort_sub->add_option("REQUEST_ID", o.request_id, "Completion id (cmpl-...) or X-Request-Id (1..128 printable ASCII, no spaces)");
    abort_sub->add_flag("--all", o.abort_all, "Abort every running and queued request (not with REQUEST_ID)");
    abort_sub->callback([&] { cmd.op = "abort"; cmd.request_id = o.request_id; cmd.abort_all = o.abort_all; });
    simple("is-paused", "is_paused", "Print true or false");
    simple("status", "status", "Print the daemon's state (GET /health)");
    simple("clear-load-weight", "clear_load_weight", "Legacy: free weights and KV (GET /clear_load_weight)");
    simple("update-model-weight", "update_model_weight", "Legacy: reload weights (GET /update_model_weight)");
    auto * sleep = app.add_subcommand("sleep", "Free memory by tag (implies pause)");
    sleep->add_option("--tags", o.tags, "One or more tags, comma-separated (default weight,kv_cache)")
        ->type_name("TAGS:{weight,kv_cache,cuda_graph}");  // the set scripts/fdctl.bash-completion offers
    sleep->callback([&] { cmd.op = "sleep"; });
    auto * wakeup = app.add_subcommand("wakeup", "Restore memory by tag (reloads weights from the source; resumes on success)");
    wakeup->add_option("--tags", o.tags, "One or more tags, comma-separated (default weight,kv_cache)")
        ->type_name("TAGS:{weight,kv_cache,cuda_graph}");  // the set scripts/fdctl.bash-completion offers
    wakeup->callback([&] { cmd.op = "wakeup"; });
    auto * update = app.add_subcommand("update-weights", "Refresh weights in place, all-or-nothing (needs pause; never resumes)");
    update->add_option("--version", o.version, "Weight version to load ([A-Za-z0-9._-]{1,128})");
    update->add_flag("--verify-checksum", o.verify_checksum, "Verify checksums when the source has them");
    update->callback([&] { cmd.op = "update_weights"; });
    // Two-phase update (SPEC §3): stage and validate without applying, then commit or drop.
    auto * stage = app.add_subcommand("stage-weights", "Two-phase update, phase 1: fetch and validate a version without applying it (needs pause)");
    stage->add_option("--version", o.version, "Weight version to stage ([A-Za-z0-9._-]{1,128})");
    stage->add_flag("--verify-checksum", o.verify_checksum, "Verify checksums when the source has them");
    stage->callback([&] { cmd.op = "update_weights"; cmd.commit = false; });
    auto * commit = app.add_subcommand("commit-weights", "Two-phase update, phase 2: the staged version goes live (a pointer swap; needs pause)");
    commit->add_option("--version", o.version, "Refuse unless this is the staged version (recommended)");
    commit->callback([&] { cmd.op = "commit_weights"; });
    simple("drop-staged-weights", "drop_staged_weights", "Discard a staged version (no-op when none)");
    auto * flush = app.add_subcommand("flush-cache", "Forget the prefix cache: the device pool's and the host KV tier's (--swap-space) "
                                                     "cached blocks; running requests keep theirs");
    bool keep_host_tier = false;
    flush->add_flag("--keep-host-tier", keep_host_tier, "Keep the host KV tier's blocks (flush the device prefix cache only)");
    flush->callback([&] { cmd.op = "flush_cache"; cmd.mode = keep_host_tier ? "device" : "all"; });
    auto * wait = app.add_subcommand("wait", "Wait until /health's state is serving, paused or sleeping (bounded by --timeout)");
    wait->add_option("--until", o.until, "serving | paused | sleeping (asleep: the old name of sleeping)")->required()
        ->transform(CLI::Transformer({{"asleep", "sleeping"}}))->check(CLI::IsMember({"serving", "paused", "sleeping"}));
    wait->callback([&] { cmd.op = "wait"; });

    fdctl::PublishOptions pub;
    auto * publish = app.add_subcommand("publish", "Trainer side: publish a checkpoint as a new version, atomically (no daemon needed)");
    publish->add_option("--strategy", pub.strategy, "rsync | ipc_snapshot | ipc | ipc_delta")->required()
        ->check(CLI::IsMember({"rsync", "ipc_snapshot", "ipc", "ipc_delta"}));
    publish->add_option("--from", pub.from, "Hugging Face checkpoint dir to publish")->required();
    publish->add_option("--store", pub.store, "rsync: the versioned store dir");
    publish->add_option("--base-from", pub.base_from, "ipc_delta: the Hugging Face checkpoint dir of --base-version (what changed is "
                                                      "--from's elements whose bytes differ from it)");
    publish->add_option("--base-version", pub.base_version, "ipc_delta: the version the delta applies to (the rollout must serve it)");
    publish->add_option("--model", pub.model_dir, "ipc_snapshot: the rollout's --model dir");
    publish->add_option("--version", pub.version, "rsync, ipc: version to publish ([A-Za-z0-9._-]{1,128}); ipc_snapshot: optional, written to version.yaml");
    auto * publish_tp = publish->add_option("--tp", pub.tp, "ipc_snapshot, ipc: the rollout's tensor parallel size (ipc: default the "
                                                             "running rollout's on --port, else 1)")->capture_default_str();
    auto * publish_ep = publish->add_flag("--ep,--enable-expert-parallel", pub.ep,
                                          "ipc_snapshot, ipc: for a rollout started with --enable-expert-parallel: each rank's "
                                          "record holds only its experts, whole (ipc: default the running rollout's on --port)");
    publish->callback([&] { cmd.op = "publish"; });
    fdctl::ModelInfoOptions info;
    auto * model_info = app.add_subcommand("model-info", "Print the rollout's state dict per rank and its training-name mapping");
    model_info->add_option("--model", info.model_dir, "Hugging Face checkpoint dir")->required();
    model_info->add_option("--tp", info.tp, "Tensor parallel size")->capture_default_str();
    model_info->add_flag("--ep,--enable-expert-parallel", info.ep, "The daemon's --enable-expert-parallel layout: each rank lists "
                         "only its experts, whole (experts [r*E/tp, (r+1)*E/tp))");
    model_info->add_option("--kv-cache-dtype", info.kv_cache_dtype,
                           "The daemon's --kv-cache-dtype the kv_cache figures are for: auto (= float32), float32, bfloat16")
        ->check(CLI::IsMember({"auto", "float32", "bfloat16"}))->capture_default_str();
    model_info->add_option("--compute-dtype", info.compute_dtype, "The rollout's --compute-dtype: the numerics block says what the "
                           "linears compute with this checkpoint's weights")->check(CLI::IsMember({"float32", "bfloat16"}))->capture_default_str();
    model_info->callback([&] { cmd.op = "model_info"; });

    app.set_version_flag("--version", fmt::format("fdctl {} (git {})", fd::kVersion, fd::kGitCommit));
    // --json read off argv: a usage error found while parsing (a global option's check fails
    // before CLI11 stores --json) must still print the JSON shape.
    const bool argv_json = std::any_of(argv + 1, argv + argc, [](const char * a) { return std::string(a) == "--json"; });
    if (const std::string word = subcommand_word(argc, argv); !word.empty()) {
        bool known = false;
        std::string names;
        for (const auto * sub : app.get_subcommands({})) {
            known = known || sub->get_name() == word;
            names += (names.empty() ? "" : ", ") + sub->get_name();
        }
        if (!known) {  // before parsing
            return report_error(argv_json, "usage", "unknown subcommand '" + word + "'; one of: " + names + " (fdctl --help)", fd::kExitUsage);
        }
    }
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError & e) {
        if ((o.json || argv_json) && e.get_exit_code() != 0) { return report_error(true, "usage", e.what(), fd::kExitUsage); }
        const int rc = app.exit(e);
        return rc == 0 ? 0 : fd::kExitUsage;
    }
    // Given counts, empty or not: `--hosts "$UNSET"` ran on the local daemon (a probe); it is "the fleet is empty".
    const bool fleet = fleet_opt->count() + hosts_opt->count() > 0;
    try {
        // Usage errors are caught here, before anything is sent.
        if (url_opt->count() > 0) {  // --url names a daemon over HTTP: never the local control block instead
            if (transport_opt->count() > 0 && o.transport == "shm") {
                throw fd::Error(fd::Errc::invalid_argument, "--url is a V1 HTTP address; it does not go with --transport shm");
            }
            o.transport = "v1";
        }
        if (fleet) {  // a fleet is reached over HTTP at the hosts it lists
            if (transport_opt->count() > 0 && o.transport == "shm") {
                throw fd::Error(fd::Errc::invalid_argument, "--fleet/--hosts reach each daemon over V1 HTTP; they do not go with --transport shm");
            }
            if (url_opt->count() > 0) {
                throw fd::Error(fd::Errc::invalid_argument, "--fleet/--hosts name the daemons; they do not go with --url (list it in --hosts)");
            }
        }
        if (cmd.op == "sleep" || cmd.op == "wakeup") {
            cmd.tags.clear();
            for (const auto & t : fd::shm::parse_tag_list(o.tags)) { cmd.tags += (cmd.tags.empty() ? "" : ",") + t; }
        }
        if ((cmd.op == "update_weights" || cmd.op == "commit_weights") &&
            update->count("--version") + stage->count("--version") + commit->count("--version") > 0) {
            if (!fd::shm::is_valid_version(o.version)) {
                throw fd::Error(fd::Errc::invalid_argument, "--version '" + o.version + "' must match [A-Za-z0-9._-]{1,128} and not start with '.'");
            }
            cmd.version = o.version;
        }
        cmd.verify_checksum = o.verify_checksum;
        if (cmd.op == "abort" && cmd.abort_all == !cmd.request_id.empty()) {
            throw fd::Error(fd::Errc::invalid_argument, "abort takes a REQUEST_ID or --all (not both, not neither)");
        }
        if (cmd.op == "abort" && !fd::shm::is_valid_request_id(cmd.request_id) && !cmd.abort_all) {
            throw fd::Error(fd::Errc::invalid_argument, "REQUEST_ID '" + cmd.request_id + "' must be 1..128 printable ASCII characters without spaces");
        }
        if (cmd.op == "update_weights" && !cmd.commit && !cmd.version) {
            throw fd::Error(fd::Errc::invalid_argument, "stage-weights needs --version (commit-weights names it)");
        }
    } catch (const fd::Error & e) {
        return report_error(o.json, "usage", e.what(), fd::kExitUsage);
    }
    try {
        if (cmd.op == "publish") {
            pub.port     = o.port;
            pub.json     = o.json;
            pub.quiet    = o.quiet;
            pub.tp_given = publish_tp->count() > 0;
            pub.ep_given = publish_ep->count() > 0;
            if (pub.strategy == "ipc") { std::tie(pub.rollout_tp, pub.rollout_ep) = rollout_sizes(o); }
            return fdctl::run_publish(pub);
        }
        if (cmd.op == "model_info") {
            info.json = o.json;
            return fdctl::run_model_info(info);
        }
        if (fleet) {
            static const std::set<std::string> kFleetOps = {"pause", "resume", "is_paused", "status", "sleep", "wakeup", "update_weights",
                                                            "commit_weights", "drop_staged_weights", "wait", "abort"};
            if (!kFleetOps.count(cmd.op)) {
                return report_error(o.json, "usage", "--fleet/--hosts run pause, resume, is-paused, status, sleep, wakeup, update-weights, "
                                                     "stage-weights, commit-weights, drop-staged-weights, wait, abort", fd::kExitUsage);
            }
            fdctl::FleetOptions f{.api_key = o.api_key, .timeout_s = o.timeout_s, .json = o.json, .quiet = o.quiet, .until = o.until};
            try {
                f.hosts = fdctl::fleet_hosts(o.fleet_file, o.hosts);
                // commit-weights too: without it each host committed what it had staged (a probe: 701 on one, 702 on another, exit 0)
                if ((cmd.op == "update_weights" || cmd.op == "commit_weights") && !cmd.version) {
                    throw fd::Error(fd::Errc::invalid_argument, fmt::format("a fleet {} needs --version (every host must load the same one)",
                                                                            cmd.op == "update_weights" ? "update-weights" : "commit-weights"));
                }
            } catch (const fd::Error & e) {
                return report_error(o.json, "usage", e.what(), fd::kExitUsage);
            }
            return fdctl::run_fleet(f, cmd);
        }
        return cmd.op == "wait" ? run_wait(o) : run_command(o, cmd);
    } catch (const fd::Error & e) {
        return report_error(o.json, std::string(fd::errc_name(e.code())), e.what(), fd::errc_info(e.code()).exit_code);
    } catch (const std::exception & e) {
        return report_error(o.json, "internal", e.what(), 70);
    }
}
