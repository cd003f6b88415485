// tests/unit/test_util.h — helpers shared by the doctest units.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <random>
#include <string>
#include <system_error>

namespace fd::test {

/// A fresh directory under the system temp dir, removed with everything in it on destruction.
struct TempDir {
    std::filesystem::path path;
    explicit TempDir(const std::string & prefix = "fd_unit_") {
        static std::atomic<int> counter{0};
        std::random_device rd;
        path = std::filesystem::temp_directory_path() /
               (prefix + std::to_string(::getpid()) + "_" + std::to_string(counter++) + "_" + std::to_string(rd()));
        std::filesystem::create_directories(path);
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
    }
    TempDir(const TempDir &) = delete;
    TempDir & operator=(const TempDir &) = delete;
};

}  // namespace fd::test
