// fd/comm/tcp_store.h — the rendezvous key-value store of a rank group (torchrun's TCPStore
// role; Debian's Gloo ships only file, hash and Redis stores).
//
// The master (node 0's daemon, at --master-addr:--master-port) runs a TcpStoreServer; every
// rank's TcpStoreClient sets its connection details under a key and waits for its peers'.
// Protocol (one TCP connection per client, little-endian): request = op u8 ('S' set, 'G' get)
// + key length u32 + key + (set: value length u32 + value); answer = status u8 ('O' ok,
// 'F' found + value length u32 + value, 'M' missing). Values are at most 1 MiB.
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

class TcpStoreServer {
public:
    /// Listen on host:port (port 0 = any; see port()).
    /// Errors  fd::Error{invalid_argument} naming the address when it cannot be bound (e.g. the
    ///         master port is in use).
    TcpStoreServer(const std::string & host, int port);
    ~TcpStoreServer();
    int port() const { return port_; }

private:
    void serve();

    int                                       listen_fd_ = -1;
    int                                       port_      = 0;
    std::atomic<bool>                         stop_{false};
    std::mutex                                mu_;
    std::map<std::string, std::vector<char>>  data_;
    std::thread                               thread_;
};

class TcpStoreClient final : public gloo::rendezvous::Store {
public:
    /// Connect to the server, retrying until `timeout` (the master may start later).
    /// Errors  fd::Error{rank_failed} naming host:port when no server answers in time.
    TcpStoreClient(const std::string & host, int port, std::chrono::milliseconds timeout);
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
