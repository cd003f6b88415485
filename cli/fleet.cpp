// fdctl --fleet / --hosts: one control command on every daemon in parallel; update-weights is
// two-phase across the fleet (cli/fleet.h).
#include "fleet.h"

#include "output.h"
#include "transport.h"
#include "wait_state.h"

#include "fd/status.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cctype>
#include <fstream>
#include <functional>
#include <iostream>
#include <set>
#include <thread>

namespace fdctl {
namespace {

using nlohmann::json;

/// One host's answer to one command.
struct HostResult {
    std::string host;
    int         exit_code = 0;   ///< fdctl's table: 0 ok
    int         http_status = 0; ///< 0 = no answer
    std::string body;            ///< the daemon's body, or the error text when there was no answer
    std::string op;
    std::string mode;            ///< the command's mode (flush_cache "device": host tier kept)
    bool        never_reached = false;  ///< no connection: the command was never sent

    bool ok() const { return exit_code == 0; }
    std::string message() const {
        if (http_status == 0) { return body; }
        return ok() ? human_summary(op, {http_status, body}, mode) : error_message({http_status, body});
    }
    json to_json() const {
        json b = http_status == 0 ? json(nullptr) : json::parse(body, nullptr, false);
        if (b.is_discarded()) { b = body; }
        json j = {{"host", host}, {"ok", ok()}, {"exit_code", exit_code}, {"http_status", http_status}, {"body", b}};
        if (http_status == 0) { j["error"] = body; }
        return j;
    }
};

/// `wait --until` on one host: its /health polled until the state holds or --timeout passes.
HostResult wait_one(const FleetOptions & o, const std::string & host) {
    HostResult r{.host = host, .op = "wait"};
    try {
        const WaitOutcome w = wait_until([&](double left_s) { return make_v1_transport(host, o.api_key, left_s)->call({.op = "status"}); },
                                         o.until, o.timeout_s);
        r.exit_code   = w.exit_code;
        r.http_status = w.exit_code == 0 ? 200 : 0;
        r.body        = w.exit_code == 0 ? w.body : std::string(fd::errc_name(w.code)) + ": " + w.message;
    } catch (const fd::Error & e) {
        r.exit_code = fd::errc_info(e.code()).exit_code;
        r.body      = fmt::format("{}: {}", fd::errc_name(e.code()), e.what());
    }
    return r;
}

HostResult call_one(const FleetOptions & o, const std::string & host, const fd::shm::MailboxCommand & cmd) {
    if (cmd.op == "wait") { return wait_one(o, host); }
    HostResult r{.host = host, .op = cmd.op, .mode = cmd.mode};
    try {
        const Reply rep = make_v1_transport(host, o.api_key, o.timeout_s)->call(cmd);
        r.http_status   = rep.http_status;
        r.body          = rep.body;
        r.exit_code     = exit_code_for(rep);
    } catch (const fd::Error & e) {
        r.exit_code     = fd::errc_info(e.code()).exit_code;
        r.body          = fmt::format("{}: {}", fd::errc_name(e.code()), e.what());
        r.never_reached = e.code() == fd::Errc::unreachable && std::string(e.what()).rfind(kNeverReached, 0) == 0;
    } catch (const std::exception & e) {
        r.exit_code = 70;
        r.body      = e.what();
    }
    return r;
}

/// `cmd` on every host at once; results in host order.
std::vector<HostResult> fan_out(const FleetOptions & o, const std::vector<std::string> & hosts, const fd::shm::MailboxCommand & cmd) {
    std::vector<HostResult> out(hosts.size());
    std::vector<std::thread> threads;
    threads.reserve(hosts.size());
    for (size_t i = 0; i < hosts.size(); ++i) {
        threads.emplace_back([&, i] { out[i] = call_one(o, hosts[i], cmd); });
    }
    for (auto & t : threads) { t.join(); }
    return out;
}

bool all_ok(const std::vector<HostResult> & rs) {
    for (const auto & r : rs) {
        if (!r.ok()) { return false; }
    }
    return true;
}

/// 0 when all succeeded; the shared code when all failed alike; else kExitFleetPartial.
int combined_exit(const std::vector<HostResult> & rs) {
    std::set<int> failed;
    size_t n_failed = 0;
    for (const auto & r : rs) {
        if (!r.ok()) { failed.insert(r.exit_code); ++n_failed; }
    }
    if (n_failed == 0) { return 0; }
    if (n_failed == rs.size() && failed.size() == 1) { return *failed.begin(); }
    return kExitFleetPartial;
}

void print_phase(const FleetOptions & o, const std::string & phase, const std::vector<HostResult> & rs) {
    if (o.json) { return; }
    for (const auto & r : rs) {
        if (r.ok()) {
            if (!o.quiet) { std::cout << fmt::format("{}  {}: ok  {}\n", r.host, phase, r.message()); }
        } else {
            std::cerr << fmt::format("fdctl: {}  {}: FAILED (exit {})  {}\n", r.host, phase, r.exit_code, r.message());
        }
    }
}

json phase_json(const std::vector<HostResult> & rs) {
    json a = json::array();
    for (const auto & r : rs) { a.push_back(r.to_json()); }
    return a;
}

/// Every host's weight_version now (from /health): "unreachable" / "no answer" where none came.
json serving_versions(const FleetOptions & o, const std::vector<std::string> & hosts) {
    const auto status = fan_out(o, hosts, {.op = "status"});
    json seen = json::object();
    for (const auto & s : status) {
        const json j = s.ok() ? json::parse(s.body, nullptr, false) : json();
        seen[s.host] = j.is_object() ? j.value("weight_version", "?")
                       : s.exit_code == fd::errc_info(fd::Errc::unreachable).exit_code ? "unreachable"
                                                                                         : "no answer";
    }
    return seen;
}

/// "h1 (exit 8), h3 (exit 7)": the hosts of `rs` that failed.
std::string failed_hosts(const std::vector<HostResult> & rs) {
    std::string out;
    for (const auto & r : rs) {
        if (!r.ok()) { out += fmt::format("{}{} (exit {})", out.empty() ? "" : ", ", r.host, r.exit_code); }
    }
    return out;
}

/// Whether this update's stage may have left its copy staged on r's host: it staged, or its outcome
/// is unknown (no answer, or 504: the daemon stopped waiting for its ranks). Not where it was
/// refused (any other error answer: the daemon drops what a failed stage staged, and its 409 may
/// mean another version, e.g. a trainer's, is staged there: a probe saw the rollback drop that),
/// nor where the call never reached the daemon.
bool may_have_staged(const HostResult & r) {
    return r.ok() || (r.http_status == 0 && !r.never_reached) || r.http_status == 504;
}

/// The versions the hosts that answered serve ("unreachable" / "no answer" / "?" left out).
std::set<std::string> known_versions(const json & seen) {
    std::set<std::string> out;
    for (const auto & [host, v] : seen.items()) {
        if (v != "unreachable" && v != "no answer" && v != "?") { out.insert(v.get<std::string>()); }
    }
    return out;
}

/// "serving V: h1; not serving it: h2 (old)".
std::string who_serves(const std::vector<std::string> & hosts, const json & seen, const std::string & version) {
    std::string serve_new, serve_other;
    for (const auto & h : hosts) {
        const std::string v = seen.value(h, std::string("?"));
        std::string & list  = v == version ? serve_new : serve_other;
        list += fmt::format("{}{}{}", list.empty() ? "" : ", ", h, v == version ? std::string{} : " (" + v + ")");
    }
    return fmt::format("serving {}: {}; not serving it: {}", version, serve_new.empty() ? "none confirmed" : serve_new,
                       serve_other.empty() ? "none" : serve_other);
}

/// The all-or-nothing update: stage everywhere → commit everywhere, or drop where staged → verify.
/// Exit codes (cli/fleet.h, README's table): nothing committed anywhere and every host that
/// answered serves one version → the shared code when every host failed alike, else 20, whether
/// or not every staged copy could be dropped (a staged copy is never served); 21 when some host
/// may serve the new version and another does not, or the versions differ afterwards (a fleet
/// already split before the update: a probe saw 20 "every host keeps its old version" there).
int fleet_update(const FleetOptions & o, const std::vector<std::string> & hosts, fd::shm::MailboxCommand cmd) {
    json report = {{"op", "update_weights"}, {"version", *cmd.version}, {"hosts", hosts}};
    auto finish = [&](int rc, const std::string & outcome) {
        report["outcome"] = outcome;
        report["ok"]      = rc == 0;
        report["exit_code"] = rc;
        if (o.json) { std::cout << report.dump() << "\n"; }
        if (rc == 0 && !o.quiet && !o.json) { std::cout << "fleet: " << outcome << "\n"; }
        if (rc != 0) { std::cerr << "fdctl: fleet: " << outcome << "\n"; }
        return rc;
    };
    // Nothing was committed anywhere: drop what this update may have staged (`drop_on`: a host
    // that gave no answer may still finish its stage), and say who serves what. A drop that fails
    // leaves a staged copy that is never served: that alone does not split the fleet (20, not 21).
    auto roll_back = [&](const std::vector<HostResult> & failed_phase, const char * phase, const std::vector<std::string> & drop_on) {
        const auto dropped = fan_out(o, drop_on, {.op = "drop_staged_weights"});
        report["drop"] = phase_json(dropped);
        print_phase(o, "drop", dropped);
        const std::string not_dropped = failed_hosts(dropped);
        const json seen = serving_versions(o, hosts);
        report["weight_versions"] = seen;
        const std::string left = not_dropped.empty() ? std::string{}
                                                     : fmt::format(". The staged copy (never served) could not be dropped on {}: run "
                                                                   "drop-staged-weights there once it answers", not_dropped);
        if (known_versions(seen).size() > 1) {
            return finish(kExitFleetInconsistent,
                          fmt::format("INCONSISTENT: version {} did not {} on every host (failed: {}); this update committed nothing, "
                                      "but the hosts serve different versions: {}; weight_version per host: {}{}", *cmd.version, phase,
                                      failed_hosts(failed_phase), who_serves(hosts, seen, *cmd.version), seen.dump(), left));
        }
        return finish(combined_exit(failed_phase),
                      fmt::format("version {} did not {} on every host (failed: {}); nothing was committed anywhere: every host keeps "
                                  "its old version; weight_version per host: {}{}", *cmd.version, phase, failed_hosts(failed_phase),
                                  seen.dump(), left));
    };
    cmd.commit = false;
    const auto staged = fan_out(o, hosts, cmd);
    report["stage"] = phase_json(staged);
    print_phase(o, "stage", staged);
    if (!all_ok(staged)) {
        std::vector<std::string> drop_on;
        for (const auto & r : staged) {
            if (may_have_staged(r)) { drop_on.push_back(r.host); }
        }
        return roll_back(staged, "stage", drop_on);
    }
    const auto committed = fan_out(o, hosts, {.op = "commit_weights", .version = cmd.version});
    report["commit"] = phase_json(committed);
    print_phase(o, "commit", committed);
    const json seen = serving_versions(o, hosts);
    report["weight_versions"] = seen;
    bool all_new = true, any_new = false, any_unsure = false;
    for (size_t i = 0; i < hosts.size(); ++i) {
        const std::string v = seen.value(hosts[i], std::string("?"));
        all_new    = all_new && v == *cmd.version;
        any_new    = any_new || v == *cmd.version || committed[i].ok();
        any_unsure = any_unsure || committed[i].http_status == 0 || (v != *cmd.version && (v == "unreachable" || v == "no answer"));
    }
    if (all_ok(committed) && all_new) {
        return finish(0, fmt::format("every host ({}) serves weight_version {} once resumed", hosts.size(), *cmd.version));
    }
    if (!any_new && !any_unsure) { return roll_back(committed, "commit", hosts); }  // every commit refused, none serves it
    return finish(kExitFleetInconsistent,
                  fmt::format("INCONSISTENT: version {} committed on some hosts only (commit failed: {}); {}; weight_version per host: {}",
                              *cmd.version, failed_hosts(committed).empty() ? "none" : failed_hosts(committed),
                              who_serves(hosts, seen, *cmd.version), seen.dump()));
}

/// `abort REQUEST_ID` on a fleet: the request runs on one host (or a few, for an X-Request-Id
/// reused across hosts), so "not found" from the others is the normal answer, not a failure.
/// 0: aborted somewhere and every other host answered; 3 (not_found): no host had it; 20: some
/// host did not answer (the id may still run there); all failed alike: that code.
int fleet_abort(const FleetOptions & o, const fd::shm::MailboxCommand & cmd) {
    const auto rs = fan_out(o, o.hosts, cmd);
    const int  kNotFound = fd::errc_info(fd::Errc::not_found).exit_code;
    size_t n_found = 0, n_absent = 0;
    int    aborted = 0;
    std::vector<HostResult> failed;
    for (const auto & r : rs) {
        if (r.ok()) {
            ++n_found;
            const json j = json::parse(r.body, nullptr, false);
            aborted += j.is_object() && j.contains("result") ? j["result"].value("aborted", 0) : 0;
        } else if (r.exit_code == kNotFound && r.http_status == 404) {
            ++n_absent;
        } else {
            failed.push_back(r);
        }
    }
    int rc = 0;
    if (failed.empty()) {
        rc = n_found > 0 ? 0 : kNotFound;
    } else {
        rc = n_found + n_absent == 0 ? combined_exit(failed) : kExitFleetPartial;
    }
    if (o.json) {
        std::cout << json{{"op", "abort"}, {"request_id", cmd.request_id}, {"ok", rc == 0}, {"exit_code", rc}, {"aborted", aborted},
                          {"results", phase_json(rs)}}.dump() << "\n";
    } else {
        for (const auto & r : rs) {
            if (r.ok()) {
                if (!o.quiet) { std::cout << fmt::format("{}  abort: ok  {}\n", r.host, r.message()); }
            } else if (r.exit_code == kNotFound && r.http_status == 404) {
                if (!o.quiet) { std::cout << fmt::format("{}  abort: not running here\n", r.host); }
            } else {
                std::cerr << fmt::format("fdctl: {}  abort: FAILED (exit {})  {}\n", r.host, r.exit_code, r.message());
            }
        }
    }
    if (rc == kNotFound) { std::cerr << fmt::format("fdctl: fleet: no host runs a request '{}'\n", cmd.request_id); }
    if (rc == kExitFleetPartial) {
        std::cerr << fmt::format("fdctl: fleet: abort '{}': {} host(s) did not answer, it may still run there\n", cmd.request_id, failed.size());
    }
    return rc;
}

std::string normalize_host(std::string h) {
    while (!h.empty() && std::isspace(static_cast<unsigned char>(h.back()))) { h.pop_back(); }
    while (!h.empty() && std::isspace(static_cast<unsigned char>(h.front()))) { h.erase(h.begin()); }
    if (h.rfind("http://", 0) != 0 && h.rfind("https://", 0) != 0) { h = "http://" + h; }
    while (!h.empty() && h.back() == '/') { h.pop_back(); }
    const auto colon = h.rfind(':');
    if (colon == std::string::npos || colon < h.find("//") + 2 || colon + 1 >= h.size()) {
        throw fd::Error(fd::Errc::invalid_argument, fmt::format("fleet entry '{}' needs host:port", h));
    }
    return h;
}

}  // namespace

std::vector<std::string> fleet_hosts(const std::string & file, const std::string & csv) {
    std::vector<std::string> raw;
    if (!file.empty()) {
        std::ifstream in(file);
        if (!in) { throw fd::Error(fd::Errc::invalid_argument, fmt::format("cannot read --fleet file '{}'", file)); }
        for (std::string line; std::getline(in, line);) {
            if (const auto hash = line.find('#'); hash != std::string::npos) { line.resize(hash); }
            if (line.find_first_not_of(" \t\r") == std::string::npos) { continue; }
            raw.push_back(line);
        }
    }
    for (size_t start = 0; start < csv.size();) {
        const auto comma = csv.find(',', start);
        const std::string item = csv.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        if (!item.empty()) { raw.push_back(item); }
        start = comma == std::string::npos ? csv.size() : comma + 1;
    }
    std::vector<std::string> hosts;
    std::set<std::string> seen;
    for (const auto & r : raw) {
        const std::string h = normalize_host(r);
        if (!seen.insert(h).second) { throw fd::Error(fd::Errc::invalid_argument, fmt::format("fleet entry '{}' is listed twice", h)); }
        hosts.push_back(h);
    }
    if (hosts.empty()) { throw fd::Error(fd::Errc::invalid_argument, "the fleet is empty (--fleet FILE or --hosts h1:p1,h2:p2)"); }
    return hosts;
}

int run_fleet(const FleetOptions & o, const fd::shm::MailboxCommand & cmd) {
    if (cmd.op == "update_weights" && cmd.commit) { return fleet_update(o, o.hosts, cmd); }
    if (cmd.op == "abort" && !cmd.abort_all) { return fleet_abort(o, cmd); }
    const auto rs = fan_out(o, o.hosts, cmd);
    const int rc  = combined_exit(rs);
    const std::string op = cmd.op == "update_weights" ? "stage_weights" : cmd.op;  // a stage, not an update (its lines said update_weights)
    if (o.json) {
        std::cout << json{{"op", op}, {"ok", rc == 0}, {"exit_code", rc}, {"results", phase_json(rs)}}.dump() << "\n";
    } else {
        print_phase(o, op, rs);
    }
    if (rc != 0) {
        size_t n_ok = 0;
        for (const auto & r : rs) { n_ok += r.ok() ? 1 : 0; }
        std::cerr << fmt::format("fdctl: fleet: {} succeeded on {} of {} hosts\n", op, n_ok, rs.size());
    }
    return rc;
}

}  // namespace fdctl
