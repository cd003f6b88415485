// The trainer's side of a landing (fd/stream/landing.h) for the landing tests: connect and say
// hello, send a frame. Test helpers only (tests/unit/stream/test_landing*.cpp).
#pragma once

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace {

/// A connected trainer socket that said hello with `token`.
int connect_to(int port, const std::string & token) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family      = AF_INET;
    a.sin_port        = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0);
    const std::string body = "{\"token\": \"" + token + "\"}";
    std::string f = "FDW1";
    for (int i = 0; i < 4; ++i) { f += static_cast<char>((body.size() >> (8 * i)) & 0xff); }
    f += body;
    REQUIRE(::send(fd, f.data(), f.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(f.size()));
    return fd;
}

void send_frame(int fd, uint64_t off, const void * p, uint64_t n) {
    unsigned char h[16];
    for (int i = 0; i < 8; ++i) {
        h[i]     = static_cast<unsigned char>(off >> (8 * i));
        h[8 + i] = static_cast<unsigned char>(n >> (8 * i));
    }
    ::send(fd, h, sizeof h, MSG_NOSIGNAL);
    ::send(fd, p, n, MSG_NOSIGNAL);
}

}  // namespace
