// fd/checkpoint/safetensors.h — reading safetensors checkpoints (single file or sharded).
//
// Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
// data_offsets: [begin, end)}} (offsets relative to the data section), then the data.
// Sharded checkpoints add model.safetensors.index.json {"weight_map": {name: file}}.
// Spec: huggingface/safetensors README ("Format").
#pragma once

#include "fd/dtype.h"

#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace fd::model {

/// The checkpoint's element type is the one fd::DType (fd/dtype.h). Deprecated alias, kept while
/// branches written before the merge still spell it model::DType; new code writes fd::DType.
using DType = fd::DType;
using fd::dtype_name;  ///< "F32" | "BF16" | "F16"
using fd::dtype_size;  ///< bytes per element (4 or 2)

struct TensorInfo {
    std::string           name;
    fd::DType         dtype = fd::DType::f32;
    std::vector<int64_t>  shape;          ///< outermost first, as stored
    std::filesystem::path file;
    int64_t               offset_bytes = 0;  ///< absolute offset of the data in `file`
    int64_t               size_bytes   = 0;
    /// Identity of `file` when its header was read (fstat st_dev / st_ino; 0 = not recorded).
    /// Readers of the data check that the file they open is still this one.
    uint64_t              file_dev = 0;
    uint64_t              file_ino = 0;
    /// The data is a CUDA IPC allocation, not in `file` (the ipc source on a CUDA rank):
    /// `cuda_ipc_handle` is its cudaIpcMemHandle_t and offset_bytes the offset into it.
    /// fill_weights copies it device to device (or to host where it must widen).
    bool                  on_cuda_ipc = false;
    std::array<uint8_t, 64> cuda_ipc_handle{};

    int64_t numel() const;
};

/// Every tensor of a checkpoint directory, by name.
struct TensorIndex {
    std::filesystem::path             source;  ///< the file (single-file checkpoint) or directory read
    std::map<std::string, TensorInfo> tensors;
    int64_t                           total_bytes = 0;
};

/// Read the headers of `dir`/model.safetensors.index.json's shards, or of `dir`/model.safetensors,
/// or of all `dir`/*.safetensors except ipc_snapshot files (model_state.*).
/// Errors   fd::Error{invalid_checkpoint} naming the file (and tensor): no safetensors file,
///          not a regular file (a FIFO or device: refused without blocking; symlinks to regular
///          files, as in Hugging Face caches, are followed), truncated file, bad header JSON,
///          unsupported dtype, a shape whose byte size overflows 64 bits, data_offsets not equal to
///          shape × dtype size, or not tiling the data area (the safetensors rule: sorted by
///          offset they start at 0, are contiguous, never overlap, and end at the file's end),
///          a tensor listed in the index but absent from its shard.
TensorIndex read_tensor_index(const std::filesystem::path & dir);

/// Read exactly `n` bytes at byte offset `off` of the open file `fd` (retries short reads).
/// Errors   fd::Error{invalid_checkpoint} naming `file` and `what` on EOF or an I/O error.
void pread_exact(int fd, void * dst, int64_t n, int64_t off, const std::filesystem::path & file, const std::string & what);

/// Read `n_rows` strided rows in few calls: row i's `row_bytes` bytes at byte offset
/// `off + i * stride` of `fd` go to dst + i * row_bytes (dst [n_rows][row_bytes]); the
/// `stride - row_bytes` bytes between rows are read into `gap` [stride - row_bytes] and dropped.
/// One preadv per 512 rows (IOV_MAX = 1024 segments): a column slice of a row-major tensor (a
/// tensor-parallel rank's columns) costs a few calls instead of one pread per row, at the price
/// of reading the other columns too (callers bound the gap); stride == row_bytes is one pread.
/// Short reads are resumed.
/// Errors   as pread_exact.
void pread_rows_exact(int fd, std::byte * dst, int64_t n_rows, int64_t row_bytes, int64_t off, int64_t stride, std::byte * gap,
                      const std::filesystem::path & file, const std::string & what);

/// Read the headers of exactly `files` (in order) into one index (source = `source`).
/// Errors   as read_tensor_index; a tensor name in two files is an error.
TensorIndex read_tensor_files(const std::filesystem::path & source, const std::vector<std::filesystem::path> & files);

/// Read one tensor's raw bytes as stored.   Shapes  dst [size_bytes] bytes written.
/// Errors   fd::Error{invalid_checkpoint} naming file and tensor on a short read.
void read_tensor_raw(const TensorInfo & t, void * dst);

/// Convert `numel` values stored as `dtype` to f32.   Shapes  dst [numel], src [numel] of dtype.
void convert_to_f32(fd::DType dtype, const void * src, float * dst, int64_t numel);

/// Read one tensor and convert it to f32.
/// Shapes   dst [numel] written.
/// Errors   fd::Error{invalid_checkpoint} naming file and tensor on a short read.
void read_tensor_f32(const TensorInfo & t, float * dst);

}  // namespace fd::model
