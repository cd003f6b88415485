// fd/file_io.h: opening files without ever blocking (open_regular, read_small_file) — a FIFO or
// a device where a checkpoint file should be is refused at once, a symlink to a regular file
// (Hugging Face cache layout) is followed.
#include "fd/file_io.h"
#include "fd/status.h"
#include "../test_util.h"

#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>

namespace fs = std::filesystem;
using fd::Errc;
using fd::test::TempDir;

namespace {

/// The fd::Error `fn` throws (CHECK fails if none).
template <typename Fn>
fd::Error error_of(Fn && fn) {
    try {
        fn();
    } catch (const fd::Error & e) {
        return e;
    }
    FAIL("no fd::Error thrown");
    return fd::Error(Errc::ok, "");
}

void write(const fs::path & p, const std::string & text) { std::ofstream(p, std::ios::binary) << text; }

}  // namespace

TEST_SUITE("file_io") {

TEST_CASE("open_regular opens regular files and symlinks to them, and refuses a FIFO at once without blocking") {
    TempDir d;
    write(d.path / "blob", "abc");
    fs::create_directories(d.path / "snapshots" / "rev");
    fs::create_symlink("../../blob", d.path / "snapshots" / "rev" / "model.safetensors");  // relative, as HF writes
    struct stat st{};
    const auto f = fd::open_regular(d.path / "snapshots" / "rev" / "model.safetensors", Errc::invalid_checkpoint, &st);
    CHECK(f.valid());
    CHECK(st.st_size == 3);

    const auto fifo = d.path / "model.safetensors";
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    const auto t0 = std::chrono::steady_clock::now();
    const auto e = error_of([&] { fd::open_regular(fifo, Errc::invalid_checkpoint); });
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
    CHECK(e.code() == Errc::invalid_checkpoint);
    CHECK(std::string(e.what()).find(fifo.string()) != std::string::npos);
    CHECK(std::string(e.what()).find("FIFO") != std::string::npos);
    // a symlink to the FIFO: followed, then refused the same way
    fs::create_symlink(fifo, d.path / "link");
    CHECK(std::string(error_of([&] { fd::open_regular(d.path / "link", Errc::invalid_checkpoint); }).what()).find("FIFO") != std::string::npos);
}

TEST_CASE("open_regular refuses /dev/zero, a directory and a missing file with the caller's code") {
    TempDir d;
    auto e = error_of([] { fd::open_regular("/dev/zero", Errc::invalid_checkpoint); });
    CHECK(e.code() == Errc::invalid_checkpoint);
    CHECK(std::string(e.what()).find("character device") != std::string::npos);
    e = error_of([&] { fd::open_regular(d.path, Errc::source_unavailable); });
    CHECK(e.code() == Errc::source_unavailable);
    CHECK(std::string(e.what()).find("directory") != std::string::npos);
    e = error_of([&] { fd::open_regular(d.path / "none", Errc::invalid_checkpoint); });
    CHECK(std::string(e.what()).find("cannot open") != std::string::npos);
}

TEST_CASE("read_small_file reads a file, returns nullopt when absent, refuses FIFOs, devices and oversized files") {
    TempDir d;
    write(d.path / "version.yaml", "step: 42\n");
    CHECK(fd::read_small_file(d.path / "version.yaml", 100, Errc::invalid_checkpoint).value() == "step: 42\n");
    CHECK_FALSE(fd::read_small_file(d.path / "absent", 100, Errc::invalid_checkpoint).has_value());
    const auto e = error_of([&] { fd::read_small_file(d.path / "version.yaml", 4, Errc::invalid_checkpoint); });
    CHECK(std::string(e.what()).find("9 bytes") != std::string::npos);
    REQUIRE(::mkfifo((d.path / "fifo").c_str(), 0600) == 0);
    CHECK(error_of([&] { fd::read_small_file(d.path / "fifo", 100, Errc::invalid_checkpoint); }).code() == Errc::invalid_checkpoint);
    fs::create_symlink("/dev/zero", d.path / "config.json");
    CHECK(std::string(error_of([&] { fd::read_small_file(d.path / "config.json", 100, Errc::invalid_checkpoint); }).what())
              .find("character device") != std::string::npos);
}

}  // TEST_SUITE
