// tests/unit/model/checkpoint_files.h — writing test checkpoint files (a safetensors file from raw
// tensors, a text file) and expecting an invalid_checkpoint error naming what is wrong; shared by
// test_safetensors_reading.cpp and test_checkpoint_loading.cpp.
#pragma once

#include "fd/status.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fs = std::filesystem;
using fd::Errc;
using nlohmann::json;

namespace {

struct RawTensor {
    std::string          name;
    std::string          dtype;
    std::vector<int64_t> shape;
    std::string          bytes;                     ///< raw little-endian data
    std::optional<std::pair<int64_t, int64_t>> offsets = std::nullopt;  ///< override data_offsets
};

template <typename T>
std::string bytes_of(const std::vector<T> & v) {
    return std::string(reinterpret_cast<const char *>(v.data()), v.size() * sizeof(T));
}

/// Write a safetensors file; returns its size.
int64_t write_safetensors(const fs::path & file, const std::vector<RawTensor> & tensors, bool metadata = true) {
    json h = json::object();
    if (metadata) { h["__metadata__"] = {{"format", "pt"}}; }
    std::string data;
    for (const auto & t : tensors) {
        const int64_t begin = static_cast<int64_t>(data.size());
        data += t.bytes;
        const auto offs = t.offsets.value_or(std::make_pair(begin, static_cast<int64_t>(data.size())));
        h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offs.first, offs.second}}};
    }
    const std::string header = h.dump();
    const uint64_t n = header.size();
    std::ofstream out(file, std::ios::binary);
    out.write(reinterpret_cast<const char *>(&n), 8);
    out << header << data;
    return static_cast<int64_t>(8 + header.size() + data.size());
}

void write_text(const fs::path & file, const std::string & text) {
    std::ofstream out(file, std::ios::binary);
    out << text;
}

/// Run `fn`, expect fd::Error{invalid_checkpoint} whose message contains every needle.
template <typename Fn>
void expect_invalid(Fn && fn, const std::vector<std::string> & needles) {
    bool thrown = false;
    try {
        fn();
    } catch (const fd::Error & e) {
        thrown = true;
        CHECK(e.code() == Errc::invalid_checkpoint);
        const std::string msg = e.what();
        for (const auto & n : needles) {
            CAPTURE(msg);
            CHECK_MESSAGE(msg.find(n) != std::string::npos, "message lacks '" << n << "'");
        }
    }
    CHECK_MESSAGE(thrown, "no fd::Error was thrown");
}

}  // namespace
