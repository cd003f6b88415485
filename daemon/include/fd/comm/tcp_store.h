// fd/comm/tcp_store.h — the rendezvous key-value store of a rank group (torchrun's TCPStore
// role; Debian's Gloo ships only file, hash and Redis stores).
//
// The master (node 0's daemon, at --master-addr:--master-port) runs a TcpStoreServer; every
// rank's TcpStoreClient sets its connection details under a key and waits for its peers'.
// Protocol (one TCP connection per client, little-endian): request = op u8 ('S' set, 'G' get,
// 'A' authenticate) + key length u32 + key (for 'A': the token) + (set: value length u32 +
// value); answer = status u8 ('O' ok, 'F' found + value length u32 + value, 'M' missing).
// Values are at most 1 MiB. A server with a token answers nothing until a connection's first
// request is 'A' with that token (compared in constant time) and drops it otherwise: another
// local user who reaches the port can neither read nor replace a rank's address. The daemon
// makes a random token per executor and hands it to its ranks inside RankSpawn (the rank link:
// a socketpair, or the token-checked join connection of a remote node).
// The server never blocks on one client: each connection's bytes are buffered until a whole
// request is in (a client that sends half a request and stops holds up only itself); one not
// authenticated within 2 s is dropped; answers are sent with a 1 s send timeout.
#pragma once

#include <gloo/rendezvous/store.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fd::comm {

/// A store token: 128 bits from std::random_device as 32 hex digits.
std::string new_store_token();

class TcpStoreServer {
public:
    /// Listen on host:port (port 0 = any; see port()). `token`: what every client must send
    /// first ('A'); empty = no authentication (tests).
    /// Errors  fd::Error{invalid_argument} naming the address when it cannot be bound (e.g. the
    ///         master port is in use).
    TcpStoreServer(const std::string & host, int port, std::string token = {});
    ~TcpStoreServer();
    int port() const { return port_; }

private:
    void serve();

    int                                       listen_fd_ = -1;
    int                                       port_      = 0;
    std::string                               token_;
    std::atomic<bool>                         stop_{false};
    std::mutex                                mu_;
    std::map<std::string, std::vector<char>>  data_;
    std::thread                               thread_;
};

class TcpStoreClient final : public gloo::rendezvous::Store {
public:
    /// Connect to the server, retrying until `timeout` (the master may start later), and send
    /// `token` first when it is not empty.
    /// Errors  fd::Error{rank_failed} naming host:port when no server answers in time or the
    ///         server refuses the token.
    TcpStoreClient(const std::string & host, int port, std::chrono::milliseconds timeout, const std::string & token = {});
    ~TcpStoreClient() override;

    void set(const std::string & key, const std::vector<char> & data) override;
    /// Waits (the client's timeout) for the key. Errors  fd::Error{rank_failed} naming the key.
    std::vector<char> get(const std::string & key) override;
    void wait(const std::vector<std::string> & keys) override { wait(keys, timeout_); }
    /// Errors  fd::Error{rank_failed} naming the keys still missing at the deadline.
    void wait(const std::vector<std::string> & keys, const std::chrono::milliseconds & timeout) override;

private:
    bool try_get(const std::string & key, std::vector<char> * out);

    int                       fd_ = -1;
    std::string               where_;
    std::chrono::milliseconds timeout_;
    std::mutex                mu_;
};

}  // namespace fd::comm
