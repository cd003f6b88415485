#include "transport.h"

#include "fd/process.h"
#include "fd/status.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace fdctl {
namespace {

class ShmTransport final : public Transport {
public:
    ShmTransport(int port, double timeout_s)
        : block_(fd::shm::MappedBlock::open(port)), timeout_ms_(static_cast<int64_t>(std::ceil(timeout_s * 1000))) {
        // A dead pid is "gone"; a live one with a stale heartbeat (SIGSTOP, a stall) is not:
        // mailbox_call then times out (exit 7) and withdraws the command.
        if (!fd::pid_alive(block_->pid.load(), block_->pid_start_ticks.load())) {
            fd::fail(fd::Errc::unreachable, "the fdrollout (pid {}) that owned port {} is gone (stale control block)", block_->pid.load(), port);
        }
    }
    Reply call(const fd::shm::MailboxCommand & cmd) override {
        const auto r = fd::shm::mailbox_call(*block_, cmd, timeout_ms_);
        return {r.http_status, r.body};
    }

private:
    fd::shm::MappedBlock block_;
    int64_t              timeout_ms_;
};

class V1Transport final : public Transport {
public:
    V1Transport(const std::string & url, const std::string & api_key, double timeout_s) : url_(url), cli_(url), timeout_s_(timeout_s) {
        if (!cli_.is_valid()) { fd::fail(fd::Errc::invalid_argument, "--url '{}' is not a valid http:// URL", url); }
        // The daemon withdraws a command it has not started by X-Request-Deadline (sent with every
        // call) and answers 504 at once; the read waits kAnswerGraceS longer for that answer or
        // for a command that started just before the deadline.
        cli_.set_connection_timeout(1, 0);
        cli_.set_tcp_nodelay(true);
        if (!api_key.empty()) { cli_.set_bearer_token_auth(api_key); }
    }

    Reply call(const fd::shm::MailboxCommand & cmd) override {
        // cpp-httplib's read timeout restarts with every byte: a peer that answers one byte a
        // second would hold fdctl forever. A watchdog shuts the socket at timeout + grace, so the
        // whole call is bounded, however the peer drips.
        // GET /health (status, each poll of `wait`) is answered at once, never queued behind a
        // command: no grace, so `wait --timeout 2` against a stopped daemon ends near 2 s (a probe:
        // 7.4 s, "not paused after 2 s").
        grace_s_ = cmd.op == "status" ? kStatusGraceS : kAnswerGraceS;
        const double read_s = timeout_s_ + grace_s_;
        const auto secs = static_cast<time_t>(read_s);
        const auto usecs = static_cast<time_t>((read_s - static_cast<double>(secs)) * 1e6);
        cli_.set_read_timeout(secs, usecs);
        cli_.set_write_timeout(secs, usecs);
        std::mutex              mu;
        std::condition_variable cv;
        bool                    done = false, expired = false;
        // A second past the read timeout: a peer that sends nothing meets the read timeout (whose
        // message says what a stopped daemon does with the command); the watchdog is for one that drips.
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::duration<double>(read_s + kWatchdogAfterReadS);
        std::thread watchdog([&] {
            std::unique_lock lk(mu);
            if (!cv.wait_until(lk, std::chrono::time_point_cast<std::chrono::steady_clock::duration>(give_up), [&] { return done; })) {
                expired = true;
                cli_.stop();
            }
        });
        auto stop_watchdog = [&] {
            {
                std::lock_guard lk(mu);
                done = true;
            }
            cv.notify_all();
            watchdog.join();
        };
        auto expired_error = [&] {
            fd::fail(fd::Errc::timeout, "no complete answer from {} within --timeout + {} s (it kept the connection open without "
                                        "finishing its answer): not a healthy fdrollout, or a stalled one", url_, grace_s_ + kWatchdogAfterReadS);
        };
        Reply reply;
        try {
            reply = request(cmd);
        } catch (...) {
            stop_watchdog();
            if (expired) { expired_error(); }
            throw;
        }
        stop_watchdog();
        if (expired) { expired_error(); }
        // A 2xx whose body is not JSON is not an fdrollout answer (a proxy's page, another service):
        // never a success that a fleet would commit on.
        if (reply.http_status >= 200 && reply.http_status < 300 && !reply.body.empty() && !nlohmann::json::accept(reply.body)) {
            fd::fail(fd::Errc::unreachable, "{} answered HTTP {} with a body that is not JSON ({:.60}): not an fdrollout daemon at that "
                                            "URL?", url_, reply.http_status, reply.body);
        }
        const bool health = cmd.op == "status" && is_health_body(reply.body);
        // /health answers 503 with its usual body while the daemon drains (or is degraded), for
        // load balancers; the shm mailbox answers that status 200: both give the state, exit 0.
        if (health && reply.http_status == 503) { reply.http_status = 200; }
        // A 2xx JSON body without the fields fdrollout always sends (`200 {}` from another
        // service) is no success either.
        if (reply.http_status >= 200 && reply.http_status < 300 && !(cmd.op == "status" ? health : is_fdrollout_answer(cmd.op, reply.body))) {
            fd::fail(fd::Errc::unreachable, "{} answered HTTP {} with JSON that is not an fdrollout {} answer ({:.60}): not an fdrollout "
                                            "daemon at that URL?", url_, reply.http_status, cmd.op, reply.body);
        }
        return reply;
    }

private:
    /// GET /health's body: the state and the fields every fdrollout sends with it.
    static bool is_health_body(const std::string & body) {
        const auto j = nlohmann::json::parse(body, nullptr, false);
        return j.is_object() && j.contains("state") && j["state"].is_string() && j.contains("is_paused") && j["is_paused"].is_boolean() &&
               j.contains("weight_version");
    }

    /// A 2xx control answer in fdrollout's shape (control::render_v1): {"status": "success",
    /// "result": {...}}, is_paused's top-level {"is_paused"} too, or a legacy route's {"msg"}.
    static bool is_fdrollout_answer(const std::string & op, const std::string & body) {
        const auto j = nlohmann::json::parse(body, nullptr, false);
        if (!j.is_object()) { return false; }
        if (op == "is_paused") { return j.contains("is_paused") && j["is_paused"].is_boolean(); }
        if ((op == "clear_load_weight" || op == "update_model_weight") && j.contains("msg") && j["msg"].is_string()) { return true; }
        return j.contains("status") && j["status"] == "success" && j.contains("result") && j["result"].is_object();
    }

    Reply request(const fd::shm::MailboxCommand & cmd) {
        httplib::Result res{nullptr, httplib::Error::Unknown};
        const auto sent = std::chrono::steady_clock::now();
        const std::string & op = cmd.op;
        const double deadline = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count() + timeout_s_;
        const httplib::Headers h = {{"X-Request-Deadline", fmt::format("{:.3f}", deadline)}};
        if (op == "status") {
            res = cli_.Get("/health", h);
        } else if (op == "is_paused") {
            res = cli_.Get("/v1/is_paused", h);
        } else if (op == "clear_load_weight" || op == "update_model_weight") {
            res = cli_.Get("/" + op, h);
        } else if (op == "sleep" || op == "wakeup") {
            res = cli_.Post("/v1/" + op + "?tags=" + cmd.tags, h, "", "application/json");  // normalized by fdctl: [a-z_,]
        } else if (op == "update_weights") {
            std::string body = "{\"verify_checksum\": " + std::string(cmd.verify_checksum ? "true" : "false");
            if (cmd.version) { body += ", \"version\": \"" + *cmd.version + "\""; }  // syntax checked: no quotes
            if (!cmd.commit) { body += ", \"commit\": false"; }
            res = cli_.Post("/v1/update_weights", h, body + "}", "application/json");
        } else if (op == "flush_cache") {
            res = cli_.Post(cmd.mode == "device" ? "/v1/flush_cache?keep_host_tier=true" : "/v1/flush_cache", h, "", "application/json");
        } else if (op == "pause" && !cmd.mode.empty()) {
            res = cli_.Post("/v1/pause?mode=" + cmd.mode, h, "", "application/json");  // checked by fdctl: abort|wait|keep
        } else if (op == "abort") {
            const nlohmann::json body = cmd.abort_all ? nlohmann::json{{"abort_all", true}} : nlohmann::json{{"request_id", cmd.request_id}};
            res = cli_.Post("/v1/abort", h, body.dump(), "application/json");
        } else if (op == "commit_weights") {
            res = cli_.Post("/v1/commit_weights", h, cmd.version ? "{\"version\": \"" + *cmd.version + "\"}" : std::string("{}"), "application/json");
        } else {
            res = cli_.Post("/v1/" + op, h, "", "application/json");
        }
        if (!res) {
            const auto err = res.error();
            // The read timeout fires at --timeout + grace; a read that fails well before it is the
            // peer closing the connection (the daemon died or was killed while answering).
            const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count();
            if (err == httplib::Error::Read && waited_s < timeout_s_ + grace_s_ - std::min(1.0, grace_s_)) {
                fd::fail(fd::Errc::unreachable, "{} closed the connection after {:.2f} s without answering {}: the daemon died (or was "
                                                "killed) while the call was in flight{}", url_, waited_s, op,
                         op == "status" || op == "is_paused" ? std::string()
                                                             : "; if the command had started, its outcome is unknown (check fdctl "
                                                               "status once a daemon answers)");
            }
            if (err == httplib::Error::Read) {
                fd::fail(fd::Errc::timeout, "no answer from {} within --timeout + {} s: the daemon is stopped or stalled (a command it "
                                            "had not started by the deadline is withdrawn when it resumes: nothing changes), or it "
                                            "died while answering, or it is still running a command it started just before the "
                                            "deadline (check fdctl status)", url_, grace_s_);
            }
            fd::fail(fd::Errc::unreachable, "{}{}: {}", kNeverReached, url_,
                     err == httplib::Error::Connection ? "connection refused (is the daemon running on that port?)" : httplib::to_string(err));
        }
        return {res->status, res->body};
    }

    static constexpr double kAnswerGraceS       = 5.0;  // a control command: the daemon's 504 at its deadline, or one started just before
    static constexpr double kStatusGraceS       = 0.5;  // GET /health
    static constexpr double kWatchdogAfterReadS = 1.0;
    double                  grace_s_            = kAnswerGraceS;
    std::string     url_;
    httplib::Client cli_;
    double          timeout_s_;
};

}  // namespace

std::unique_ptr<Transport> make_shm_transport(int port, double timeout_s) { return std::make_unique<ShmTransport>(port, timeout_s); }

std::unique_ptr<Transport> make_v1_transport(const std::string & url, const std::string & api_key, double timeout_s) {
    return std::make_unique<V1Transport>(url, api_key, timeout_s);
}

}  // namespace fdctl
