// fd/publish/safetensors_write.h — writing safetensors files (trainer-side publishers:
// fdctl publish --strategy ipc_snapshot). Format: see fd/checkpoint/safetensors.h. Library fd_publish.
#pragma once

#include "fd/checkpoint/safetensors.h"

#include <cstddef>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace fd::publish {

using fd::DType;

/// One tensor to write with write_safetensors.
struct SafetensorsEntry {
    std::string          name;
    fd::DType            dtype = fd::DType::f32;
    std::vector<int64_t> shape;
};

/// Write a safetensors file atomically: `path`.tmp (8-byte LE header length, JSON header
/// {name: {dtype, shape, data_offsets}} padded with spaces so the data starts 8-byte aligned,
/// then the tensors back to back in `entries` order), fsync, rename to `path`. `fill(i, dst)`
/// writes entry i's [numel x dtype] bytes into dst. `mode`: the file's permission bits.
/// Returns the data bytes written.
/// Errors  fd::Error{invalid_argument} naming the file when it cannot be written (the .tmp
///         file is removed); whatever `fill` throws (likewise).
int64_t write_safetensors(const std::filesystem::path & path, const std::vector<SafetensorsEntry> & entries,
                          const std::function<void(size_t, std::byte *)> & fill, int mode = 0644);

}  // namespace fd::publish
