#include "transport.h"

#include "fd/status.h"

#include <httplib.h>

#include <cmath>

namespace fdctl {
namespace {

class ShmTransport final : public Transport {
public:
    ShmTransport(int port, double timeout_s)
        : block_(fd::shm::MappedBlock::open(port)), timeout_ms_(static_cast<int64_t>(std::ceil(timeout_s * 1000))) {
        if (!fd::shm::daemon_alive(*block_)) {
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
    V1Transport(const std::string & url, const std::string & api_key, double timeout_s) : url_(url), cli_(url) {
        if (!cli_.is_valid()) { fd::fail(fd::Errc::invalid_argument, "--url '{}' is not a valid http:// URL", url); }
        const auto secs = static_cast<time_t>(timeout_s);
        const auto usecs = static_cast<time_t>((timeout_s - static_cast<double>(secs)) * 1e6);
        cli_.set_connection_timeout(1, 0);
        cli_.set_tcp_nodelay(true);
        cli_.set_read_timeout(secs, usecs);
        cli_.set_write_timeout(secs, usecs);
        if (!api_key.empty()) { cli_.set_bearer_token_auth(api_key); }
    }

    Reply call(const fd::shm::MailboxCommand & cmd) override {
        httplib::Result res{nullptr, httplib::Error::Unknown};
        const std::string & op = cmd.op;
        if (op == "status") {
            res = cli_.Get("/health");
        } else if (op == "is_paused") {
            res = cli_.Get("/v1/is_paused");
        } else if (op == "clear_load_weight" || op == "update_model_weight") {
            res = cli_.Get("/" + op);
        } else if (op == "sleep" || op == "wakeup") {
            res = cli_.Post("/v1/" + op + "?tags=" + cmd.tags, "", "application/json");  // normalized by fdctl: [a-z_,]
        } else if (op == "update_weights") {
            std::string body = "{\"verify_checksum\": " + std::string(cmd.verify_checksum ? "true" : "false");
            if (cmd.version) { body += ", \"version\": \"" + *cmd.version + "\""; }  // syntax checked: no quotes
            if (!cmd.commit) { body += ", \"commit\": false"; }
            res = cli_.Post("/v1/update_weights", body + "}", "application/json");
        } else if (op == "commit_weights") {
            res = cli_.Post("/v1/commit_weights", cmd.version ? "{\"version\": \"" + *cmd.version + "\"}" : std::string("{}"), "application/json");
        } else {
            res = cli_.Post("/v1/" + op, "", "application/json");
        }
        if (!res) {
            const auto err = res.error();
            if (err == httplib::Error::Read) {
                fd::fail(fd::Errc::timeout, "no answer from {} within --timeout (or the daemon died while answering)", url_);
            }
            fd::fail(fd::Errc::unreachable, "cannot reach fdrollout at {}: {}", url_,
                     err == httplib::Error::Connection ? "connection refused (is the daemon running on that port?)" : httplib::to_string(err));
        }
        return {res->status, res->body};
    }

private:
    std::string     url_;
    httplib::Client cli_;
};

}  // namespace

std::unique_ptr<Transport> make_shm_transport(int port, double timeout_s) { return std::make_unique<ShmTransport>(port, timeout_s); }

std::unique_ptr<Transport> make_v1_transport(const std::string & url, const std::string & api_key, double timeout_s) {
    return std::make_unique<V1Transport>(url, api_key, timeout_s);
}

}  // namespace fdctl
