// cli/transport.h — how fdctl reaches the daemon: the shm mailbox or the V1 HTTP API. Both send
// the same MailboxCommand and get back exactly the V1 route's (status, body).
#pragma once

#include "fd/shm/control_client.h"

#include <memory>
#include <string>

namespace fdctl {

struct Reply {
    int         http_status = 0;
    std::string body;
};

class Transport {
public:
    virtual ~Transport() = default;
    /// Errors  fd::Error{unreachable} (no daemon), {timeout}.
    virtual Reply call(const fd::shm::MailboxCommand & cmd) = 0;
};

/// How the error of a call that never reached the daemon (no connection: nothing was sent) begins;
/// a fleet update does not drop a staged copy there (cli/fleet.cpp).
inline constexpr const char * kNeverReached = "cannot reach fdrollout at ";

/// The shared-memory control block of `port`.
std::unique_ptr<Transport> make_shm_transport(int port, double timeout_s);

/// HTTP to `url` (e.g. http://127.0.0.1:8000), optional bearer `api_key`.
std::unique_ptr<Transport> make_v1_transport(const std::string & url, const std::string & api_key, double timeout_s);

}  // namespace fdctl
