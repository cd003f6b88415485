// tests/unit/test_util.h — helpers shared by the doctest units.
#pragma once

#include "fd/status.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

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

/// `n` floats uniform in [lo, hi) from `rng` (the kernel tests' random inputs).
inline std::vector<float> random_vec(std::mt19937 & rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto & x : v) { x = d(rng); }
    return v;
}

/// Bitwise equality of `n` floats (batch invariance is bitwise, not within a tolerance).
inline bool bits_equal(const float * a, const float * b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }
inline bool bits_equal(const std::vector<float> & a, const std::vector<float> & b) {
    return a.size() == b.size() && bits_equal(a.data(), b.data(), a.size());
}

/// The error code `fn` throws (fd::Error), or Errc::ok when it returns; `what` (optional) gets
/// the error's message.
inline Errc error_of(const std::function<void()> & fn, std::string * what = nullptr) {
    try {
        fn();
    } catch (const fd::Error & e) {
        if (what) { *what = e.what(); }
        return e.code();
    }
    return Errc::ok;
}

#ifdef FD_SOURCE_DIR
/// A random checkpoint at `out` from scripts/make_random_checkpoint.py (the e2e tests' generator);
/// `args`: its flags (e.g. "--preset tiny-qwen2 --seed 3"). Errors  std::runtime_error if it fails.
inline void make_random_checkpoint(const std::filesystem::path & out, const std::string & args) {
    // FD_PYTHON (the CTest environment of the GPU tests: a prebuilt bundle's python3 on a machine
    // without Debian's) or Debian's python3.
    const char *      py  = std::getenv("FD_PYTHON");
    const std::string cmd = std::string(py != nullptr && *py != '\0' ? py : "/usr/bin/python3") +
                            " " FD_SOURCE_DIR "/scripts/make_random_checkpoint.py --tokenizer-from '' --out '" +
                            out.string() + "' " + args + " > /dev/null";
    if (std::system(cmd.c_str()) != 0) { throw std::runtime_error("make_random_checkpoint.py failed: " + cmd); }
}
#endif

}  // namespace fd::test
