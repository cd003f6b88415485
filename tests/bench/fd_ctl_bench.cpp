// fd_ctl_bench — control round trip of fdctl's two transports against a real fdrollout:
// is-paused and pause+resume over the shm mailbox and over V1 HTTP, measured with the client
// library in-process and as whole `fdctl` invocations (process start-up included).
// Prints one JSON object; targets (issue #4): shm p50 <= 0.2 ms, V1 p50 <= 1 ms, fdctl <= 10 ms.
#include "fd/shm/control_client.h"

#include <CLI/CLI.hpp>
#include <httplib.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

extern char ** environ;

namespace {

using nlohmann::json;
using clock_type = std::chrono::steady_clock;

json percentiles_ms(std::vector<double> us) {
    std::sort(us.begin(), us.end());
    auto at = [&](double q) { return us[std::min(us.size() - 1, static_cast<size_t>(q * static_cast<double>(us.size())))] / 1000.0; };
    return {{"p50_ms", at(0.50)}, {"p99_ms", at(0.99)}, {"n", us.size()}};
}

json time_calls(int n, const std::function<void()> & fn) {
    for (int i = 0; i < std::min(n, 20); ++i) { fn(); }  // warm-up
    std::vector<double> us;
    for (int i = 0; i < n; ++i) {
        const auto t0 = clock_type::now();
        fn();
        us.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
    }
    return percentiles_ms(us);
}

pid_t spawn(const std::vector<std::string> & args, bool quiet) {
    std::vector<char *> argv;
    for (const auto & a : args) { argv.push_back(const_cast<char *>(a.c_str())); }
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    if (quiet) {
        posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
        posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    }
    pid_t pid = 0;
    if (posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ) != 0) { pid = -1; }
    posix_spawn_file_actions_destroy(&fa);
    return pid;
}

int run(const std::vector<std::string> & args) {
    const pid_t pid = spawn(args, true);
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

int main(int argc, char ** argv) {
    CLI::App app{"fd_ctl_bench: control round trip, shm vs V1, in-process and whole fdctl"};
    std::string bin_dir = FD_BINARY_DIR, model = FD_SOURCE_DIR "/models/stories260K";
    int port = 18790, n = 500, n_proc = 100;
    app.add_option("--bin-dir", bin_dir, "Where fdrollout and fdctl are");
    app.add_option("--model", model);
    app.add_option("--port", port);
    app.add_option("--calls", n, "In-process calls per measurement");
    app.add_option("--fdctl-calls", n_proc, "Whole fdctl invocations per measurement");
    CLI11_PARSE(app, argc, argv);

    const pid_t daemon = spawn({bin_dir + "/fdrollout", "--model", model, "--port", std::to_string(port), "--dynamic-load-weight",
                                "--log-level", "warn", "--threads", "1"}, true);
    httplib::Client http("127.0.0.1", port);
    http.set_keep_alive(true);
    http.set_tcp_nodelay(true);
    for (int i = 0; i < 300; ++i) {
        if (auto r = http.Get("/health"); r && r->status == 200) { break; }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    json out = {{"daemon", {{"model", model}, {"port", port}}}};
    try {
        auto block = fd::shm::MappedBlock::open(port);
        auto shm_call = [&](const char * op) {
            const auto r = fd::shm::mailbox_call(*block, {op, "", std::nullopt, false}, 5000);
            if (r.http_status != 200) { throw std::runtime_error(r.body); }
        };
        auto v1_call = [&](const char * method, const char * path) {
            auto r = std::string(method) == "GET" ? http.Get(path) : http.Post(path, "", "application/json");
            if (!r || r->status != 200) { throw std::runtime_error(std::string("V1 call failed: ") + path); }
        };
        json shm = {{"is_paused", time_calls(n, [&] { shm_call("is_paused"); })},
                    {"pause_resume", time_calls(n, [&] { shm_call("pause"); shm_call("resume"); })}};
        json v1 = {{"is_paused", time_calls(n, [&] { v1_call("GET", "/v1/is_paused"); })},
                   {"pause_resume", time_calls(n, [&] { v1_call("POST", "/v1/pause"); v1_call("POST", "/v1/resume"); })}};
        const std::string fdctl = bin_dir + "/fdctl";
        const std::string p = std::to_string(port);
        json whole = {
            {"shm_is_paused", time_calls(n_proc, [&] { run({fdctl, "--port", p, "--transport", "shm", "is-paused"}); })},
            {"v1_is_paused", time_calls(n_proc, [&] { run({fdctl, "--port", p, "--transport", "v1", "is-paused"}); })},
            {"shm_pause_resume", time_calls(n_proc, [&] {
                 run({fdctl, "--port", p, "--transport", "shm", "pause"});
                 run({fdctl, "--port", p, "--transport", "shm", "resume"});
             })},
        };
        const double shm_p50 = shm["is_paused"]["p50_ms"], v1_p50 = v1["is_paused"]["p50_ms"];
        const double fdctl_p50 = whole["shm_is_paused"]["p50_ms"];
        out["shm_in_process"] = shm;
        out["v1_in_process"]  = v1;
        out["fdctl_process"]  = whole;
        out["targets"] = {{"shm_p50_ms_max", 0.2}, {"shm_p50_ms", shm_p50}, {"shm_met", shm_p50 <= 0.2},
                          {"v1_p50_ms_max", 1.0}, {"v1_p50_ms", v1_p50}, {"v1_met", v1_p50 <= 1.0},
                          {"fdctl_p50_ms_max", 10.0}, {"fdctl_p50_ms", fdctl_p50}, {"fdctl_met", fdctl_p50 <= 10.0}};
    } catch (const std::exception & e) {
        out["error"] = e.what();
    }
    kill(daemon, SIGTERM);
    waitpid(daemon, nullptr, 0);
    std::printf("%s\n", out.dump(1).c_str());
    return out.contains("error") ? 1 : 0;
}
