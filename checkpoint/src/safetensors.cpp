#include "fd/file_io.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/checkpoint/layout.h"
#include "fd/checkpoint/stored_names.h"

#include "fd/half.h"
#include "fd/status.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>

namespace fd::model {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr int64_t kMaxHeaderBytes = 100 << 20;


void pread_all(int fd, void * dst, int64_t n, int64_t off, const fs::path & file, const std::string & what) {
    pread_exact(fd, dst, n, off, file, what);
}

/// One header entry → TensorInfo, its shape, dtype and byte size checked (numel × dtype size
/// computed without overflow and equal to the data_offsets span).
/// Errors  invalid_checkpoint naming file and tensor; json::exception on wrong JSON types.
TensorInfo parse_entry(const fs::path & file, const std::string & name, const json & v) {
    TensorInfo t;
    t.name = name;
    t.file = file;
    if (!v.is_object()) { fail(Errc::invalid_checkpoint, "{}: tensor '{}' has a malformed header entry (not an object)", file.string(), name); }
    const std::string dt = v.value("dtype", "");
    if (dt == "F32") { t.dtype = fd::DType::f32; }
    else if (dt == "BF16") { t.dtype = fd::DType::bf16; }
    else if (dt == "F16") { t.dtype = fd::DType::f16; }
    else { fail(Errc::invalid_checkpoint, "{}: tensor '{}' has unsupported dtype '{}' (F32, BF16, F16)", file.string(), name, dt); }
    const auto & shape = v.at("shape");
    const auto & offs  = v.at("data_offsets");
    if (!shape.is_array() || !offs.is_array() || offs.size() != 2 || shape.size() > 8) {
        fail(Errc::invalid_checkpoint, "{}: tensor '{}' has a malformed header entry (shape: a list of <= 8 dims, "
                                       "data_offsets: [begin, end])", file.string(), name);
    }
    // A non-negative integer that fits int64_t, else nullopt.
    auto as_size = [](const json & x) -> std::optional<int64_t> {
        if (x.is_number_unsigned()) {
            const uint64_t u = x.get<uint64_t>();
            return u <= static_cast<uint64_t>(INT64_MAX) ? std::optional<int64_t>(static_cast<int64_t>(u)) : std::nullopt;
        }
        if (x.is_number_integer() && x.get<int64_t>() >= 0) { return x.get<int64_t>(); }
        return std::nullopt;
    };
    int64_t bytes = dtype_size(t.dtype);
    for (const auto & d : shape) {
        const auto dim = as_size(d);
        if (!dim) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' has shape {}: dimension {} is not a non-negative 64-bit integer",
                 file.string(), name, shape.dump(), d.dump());
        }
        if (__builtin_mul_overflow(bytes, *dim, &bytes)) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' has shape {} whose byte size overflows 64 bits", file.string(), name, shape.dump());
        }
        t.shape.push_back(*dim);
    }
    const auto begin = as_size(offs[0]), end = as_size(offs[1]);
    if (!begin || !end) {
        fail(Errc::invalid_checkpoint, "{}: tensor '{}' has data_offsets {}, not two non-negative 64-bit integers", file.string(), name, offs.dump());
    }
    if (*end < *begin) {
        fail(Errc::invalid_checkpoint, "{}: tensor '{}' has data_offsets [{}, {}) that end before they begin", file.string(), name, *begin, *end);
    }
    if (*end - *begin != bytes) {
        fail(Errc::invalid_checkpoint, "{}: tensor '{}' has {} bytes in data_offsets [{}, {}) but shape {} x {} needs {}", file.string(),
             name, *end - *begin, *begin, *end, shape.dump(), dt, bytes);
    }
    t.offset_bytes = *begin;  // relative to the data area until read_header places it
    t.size_bytes   = bytes;
    return t;
}

/// The safetensors rule for the data area: the tensors' [begin, end) ranges, sorted, start at
/// 0, follow each other without gap or overlap and end exactly at the data area's size
/// (huggingface/safetensors: "the byte buffer needs to be entirely indexed, and cannot contain
/// holes"). Errors  invalid_checkpoint naming the file and the offending tensor(s).
void check_data_layout(const fs::path & file, std::vector<TensorInfo> & ts, int64_t data_size) {
    std::sort(ts.begin(), ts.end(), [](const TensorInfo & a, const TensorInfo & b) {
        return a.offset_bytes != b.offset_bytes ? a.offset_bytes < b.offset_bytes : a.size_bytes < b.size_bytes;
    });
    int64_t pos = 0;
    const TensorInfo * prev = nullptr;
    for (const TensorInfo & t : ts) {
        const int64_t begin = t.offset_bytes, end = t.offset_bytes + t.size_bytes;
        if (end > data_size) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' data [{}, {}) lies outside the {} data bytes (file truncated?)",
                 file.string(), t.name, begin, end, data_size);
        }
        if (begin < pos) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' data [{}, {}) overlaps tensor '{}' (which ends at {})", file.string(), t.name,
                 begin, end, prev ? prev->name : std::string("?"), pos);
        }
        if (begin > pos) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' data starts at {} but the previous data ends at {}{}: the data area has a "
                                           "hole (safetensors requires contiguous data_offsets starting at 0)",
                 file.string(), t.name, begin, pos, prev ? " (tensor '" + prev->name + "')" : std::string(" (the data area's start)"));
        }
        pos  = end;
        prev = &t;
    }
    if (pos != data_size) {
        fail(Errc::invalid_checkpoint, "{}: the tensors cover {} of the {} data bytes{}: {} trailing bytes belong to no tensor",
             file.string(), pos, data_size, prev ? " (last: '" + prev->name + "')" : std::string(), data_size - pos);
    }
}

/// Parse one safetensors header, check it (entries and data layout), add its tensors to `idx`.
void read_header(const fs::path & file, TensorIndex & idx) {
    struct stat st{};
    const UniqueFd f = open_regular(file, Errc::invalid_checkpoint, &st);
    const int64_t file_size = static_cast<int64_t>(st.st_size);
    if (file_size < 8) { fail(Errc::invalid_checkpoint, "{}: truncated (only {} bytes)", file.string(), file_size); }
    uint64_t n_header = 0;
    pread_all(f.get(), &n_header, 8, 0, file, "header length");
    if (n_header > static_cast<uint64_t>(std::min(kMaxHeaderBytes, file_size - 8))) {
        fail(Errc::invalid_checkpoint, "{}: header length {} exceeds the file (truncated or not safetensors)", file.string(), n_header);
    }
    std::string text(n_header, '\0');
    pread_all(f.get(), text.data(), static_cast<int64_t>(n_header), 8, file, "header");
    json h;
    try {
        h = json::parse(text);
    } catch (const json::exception & e) {
        fail(Errc::invalid_checkpoint, "{}: header is not valid JSON: {}", file.string(), e.what());
    }
    if (!h.is_object()) { fail(Errc::invalid_checkpoint, "{}: header is not a JSON object", file.string()); }
    const int64_t data_start = 8 + static_cast<int64_t>(n_header);
    const int64_t data_size  = file_size - data_start;
    std::vector<TensorInfo> ts;
    for (const auto & [name, v] : h.items()) {
        if (name == "__metadata__") { continue; }
        try {
            ts.push_back(parse_entry(file, name, v));
        } catch (const json::exception &) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' has a malformed header entry (dtype: a string, shape: a list of "
                                           "integers, data_offsets: two integers)", file.string(), name);
        }
    }
    check_data_layout(file, ts, data_size);
    for (TensorInfo & t : ts) {
        t.offset_bytes += data_start;
        t.file_dev = static_cast<uint64_t>(st.st_dev);
        t.file_ino = static_cast<uint64_t>(st.st_ino);
        if (auto prev = idx.tensors.find(t.name); prev != idx.tensors.end()) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}'{} is also in {}", file.string(), t.name, expert_of(t.name),
                 prev->second.file.string());
        }
        idx.total_bytes += t.size_bytes;
        std::string name = t.name;
        idx.tensors.emplace(std::move(name), std::move(t));
    }
}

}  // namespace

int64_t TensorInfo::numel() const {
    int64_t n = 1;
    for (int64_t d : shape) { n *= d; }
    return n;
}

namespace {

/// fs::exists without its throw: a path whose status cannot be read (a symlink loop, no
/// permission) is an invalid checkpoint naming it, not an internal error.
bool present(const fs::path & p) {
    std::error_code ec;
    const bool yes = fs::exists(p, ec);
    if (ec) { fail(Errc::invalid_checkpoint, "{}: {}", p.string(), ec.message()); }
    return yes;
}

TensorIndex read_headers(const fs::path & dir) {
    TensorIndex idx;
    idx.source = dir;
    const auto index_file = dir / "model.safetensors.index.json";
    if (present(index_file)) {
        json j;
        try {
            j = json::parse(read_small_file(index_file, kMaxHeaderBytes, Errc::invalid_checkpoint).value_or("{}"));
        } catch (const json::exception & e) {
            fail(Errc::invalid_checkpoint, "{}: not valid JSON: {}", index_file.string(), e.what());
        }
        if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
            fail(Errc::invalid_checkpoint, "{}: missing 'weight_map'", index_file.string());
        }
        std::set<std::string> shards;
        for (const auto & [name, file] : j["weight_map"].items()) {
            if (!file.is_string()) {
                fail(Errc::invalid_checkpoint, "{}: weight_map['{}'] must be a file name string", index_file.string(), name);
            }
            shards.insert(file.get<std::string>());
        }
        for (const auto & s : shards) {
            if (s.find('/') != std::string::npos || s == ".." ) {
                fail(Errc::invalid_checkpoint, "{}: shard name '{}' must be a plain file name", index_file.string(), s);
            }
            read_header(dir / s, idx);
        }
        for (const auto & [name, file] : j["weight_map"].items()) {
            auto it = idx.tensors.find(name);
            if (it == idx.tensors.end() || it->second.file.filename() != file.get<std::string>()) {
                fail(Errc::invalid_checkpoint, "{}: tensor '{}' is listed in {} but missing from that shard",
                     (dir / file.get<std::string>()).string(), name, index_file.filename().string());
            }
        }
        return idx;
    }
    if (present(dir / "model.safetensors")) {
        idx.source = dir / "model.safetensors";
        read_header(dir / "model.safetensors", idx);
        return idx;
    }
    std::vector<fs::path> files;
    std::error_code ec;
    if (fs::is_directory(dir, ec)) {
        for (const auto & e : fs::directory_iterator(dir, ec)) {
            // model_state.tp*.safetensors are ipc_snapshot files (inference names), not the checkpoint.
            if (e.path().extension() == ".safetensors" && e.path().filename().string().rfind("model_state.", 0) != 0) {
                files.push_back(e.path());
            }
        }
    }
    if (files.empty()) { fail(Errc::invalid_checkpoint, "{}: no *.safetensors file found", dir.string()); }
    std::sort(files.begin(), files.end());
    for (const auto & f : files) { read_header(f, idx); }
    return idx;
}

}  // namespace

TensorIndex read_tensor_index(const fs::path & dir) {
    TensorIndex idx = read_headers(dir);
    split_stacked_experts(idx);  // MoE exports that stack their experts: per-expert views
    return idx;
}

TensorIndex read_tensor_index_as_stored(const fs::path & dir) { return read_headers(dir); }

void pread_exact(int fd, void * dst, int64_t n, int64_t off, const std::filesystem::path & file, const std::string & what) {
    auto * p = static_cast<char *>(dst);
    while (n > 0) {
        const ssize_t r = ::pread(fd, p, static_cast<size_t>(n), off);
        if (r < 0 && errno == EINTR) { continue; }
        if (r < 0) { fail(Errc::invalid_checkpoint, "{}: read error on {}: {}", file.string(), what, std::strerror(errno)); }
        if (r == 0) { fail(Errc::invalid_checkpoint, "{}: short read of {} (file truncated?)", file.string(), what); }
        p += r; n -= r; off += r;
    }
}

void pread_rows_exact(int fd, std::byte * dst, int64_t n_rows, int64_t row_bytes, int64_t off, int64_t stride, std::byte * gap,
                      const std::filesystem::path & file, const std::string & what) {
    FD_CHECK(stride >= row_bytes && row_bytes > 0, "pread_rows_exact: stride {} < row {}", stride, row_bytes);
    const int64_t gap_bytes = stride - row_bytes;
    if (gap_bytes == 0) {  // the rows are contiguous in the file and in dst
        pread_exact(fd, dst, n_rows * row_bytes, off, file, what);
        return;
    }
    constexpr int64_t kRowsPerCall = 512;  // two segments a row: within Linux's IOV_MAX (1024)
    std::array<iovec, 2 * kRowsPerCall> iov{};
    while (n_rows > 0) {
        const int64_t k = std::min(n_rows, kRowsPerCall);
        int n_iov = 0;
        for (int64_t i = 0; i < k; ++i) {
            iov[n_iov++] = {dst + i * row_bytes, static_cast<size_t>(row_bytes)};
            if (i + 1 < k && gap_bytes > 0) { iov[n_iov++] = {gap, static_cast<size_t>(gap_bytes)}; }
        }
        const int64_t want = k * row_bytes + (k - 1) * gap_bytes;
        const ssize_t r    = ::preadv(fd, iov.data(), n_iov, static_cast<off_t>(off));
        if (r < 0 && errno == EINTR) { continue; }
        if (r < 0) { fail(Errc::invalid_checkpoint, "{}: read error on {}: {}", file.string(), what, std::strerror(errno)); }
        if (r == 0) { fail(Errc::invalid_checkpoint, "{}: short read of {} (file truncated?)", file.string(), what); }
        int64_t done = k;
        if (r < want) {  // resume: finish the row the read stopped in, then go on from the next
            done             = r / stride;
            const int64_t in = r - done * stride;  // bytes of row `done` (then of its gap) that arrived
            if (in < row_bytes) { pread_exact(fd, dst + done * row_bytes + in, row_bytes - in, off + done * stride + in, file, what); }
            ++done;
        }
        n_rows -= done;
        dst += done * row_bytes;
        off += done * stride;
    }
}

TensorIndex read_tensor_files(const std::filesystem::path & source, const std::vector<std::filesystem::path> & files) {
    TensorIndex idx;
    idx.source = source;
    for (const auto & f : files) { read_header(f, idx); }
    split_stacked_experts(idx);
    return idx;
}

void read_tensor_raw(const TensorInfo & t, void * dst) {
    const UniqueFd f = open_regular(t.file, Errc::invalid_checkpoint);
    pread_all(f.get(), dst, t.size_bytes, t.offset_bytes, t.file, "tensor '" + t.name + "'");
}

void convert_to_f32(fd::DType dtype, const void * src, float * dst, int64_t numel) {
    switch (dtype) {
        case fd::DType::f32: std::memcpy(dst, src, sizeof(float) * numel); break;
        case fd::DType::bf16: {
            const auto * h = static_cast<const uint16_t *>(src);
            for (int64_t i = 0; i < numel; ++i) { dst[i] = bf16_to_float(h[i]); }
            break;
        }
        case fd::DType::f16: {
            const auto * h = static_cast<const uint16_t *>(src);
            for (int64_t i = 0; i < numel; ++i) { dst[i] = f16_to_float(h[i]); }
            break;
        }
    }
}

void read_tensor_f32(const TensorInfo & t, float * dst) {
    if (t.dtype == fd::DType::f32) {
        read_tensor_raw(t, dst);
        return;
    }
    std::vector<uint16_t> raw(static_cast<size_t>(t.numel()));
    read_tensor_raw(t, raw.data());
    convert_to_f32(t.dtype, raw.data(), dst, t.numel());
}

}  // namespace fd::model
