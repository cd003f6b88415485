#include "fd/file_io.h"
#include "fd/model/safetensors.h"

#include "fd/kernels/ops.h"
#include "fd/status.h"

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <set>

namespace fd::model {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr int64_t kMaxHeaderBytes = 100 << 20;


void pread_all(int fd, void * dst, int64_t n, int64_t off, const fs::path & file, const std::string & what) {
    pread_exact(fd, dst, n, off, file, what);
}

void add_entry(const fs::path & file, const std::string & name, const json & v, int64_t data_start, int64_t data_size,
               TensorIndex & idx);

/// Parse one safetensors header and add its tensors to `idx`.
void read_header(const fs::path & file, TensorIndex & idx) {
    const UniqueFd f = open_read(file, Errc::invalid_checkpoint);
    const int64_t file_size = static_cast<int64_t>(fs::file_size(file));
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
    for (const auto & [name, v] : h.items()) {
        if (name == "__metadata__") { continue; }
        try {
            add_entry(file, name, v, data_start, data_size, idx);
        } catch (const json::exception & e) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' has a malformed header entry: {}", file.string(), name, e.what());
        }
    }
}

/// One header entry → TensorInfo (throws json::exception on wrong types).
void add_entry(const fs::path & file, const std::string & name, const json & v, int64_t data_start, int64_t data_size,
               TensorIndex & idx) {
    {
        TensorInfo t;
        t.name = name;
        t.file = file;
        const std::string dt = v.value("dtype", "");
        if (dt == "F32") { t.dtype = DType::f32; }
        else if (dt == "BF16") { t.dtype = DType::bf16; }
        else if (dt == "F16") { t.dtype = DType::f16; }
        else { fail(Errc::invalid_checkpoint, "{}: tensor '{}' has unsupported dtype '{}' (F32, BF16, F16)", file.string(), name, dt); }
        const auto & shape = v.at("shape");
        const auto & offs  = v.at("data_offsets");
        if (!shape.is_array() || !offs.is_array() || offs.size() != 2 || shape.size() > 8) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' has a malformed header entry", file.string(), name);
        }
        for (const auto & d : shape) { t.shape.push_back(d.get<int64_t>()); }
        const int64_t begin = offs[0].get<int64_t>(), end = offs[1].get<int64_t>();
        if (begin < 0 || end < begin || end > data_size) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' data [{}, {}) lies outside the {} data bytes (file truncated?)",
                 file.string(), name, begin, end, data_size);
        }
        if (end - begin != t.numel() * dtype_size(t.dtype)) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' has {} bytes but shape x dtype needs {}", file.string(),
                 name, end - begin, t.numel() * dtype_size(t.dtype));
        }
        t.offset_bytes = data_start + begin;
        t.size_bytes   = end - begin;
        if (auto prev = idx.tensors.find(name); prev != idx.tensors.end()) {
            fail(Errc::invalid_checkpoint, "{}: tensor '{}' is also in {}", file.string(), name, prev->second.file.string());
        }
        idx.total_bytes += t.size_bytes;
        idx.tensors[name] = std::move(t);
    }
}

}  // namespace

int64_t dtype_size(DType d) { return d == DType::f32 ? 4 : 2; }

const char * dtype_name(DType d) {
    switch (d) {
        case DType::f32: return "F32";
        case DType::bf16: return "BF16";
        case DType::f16: return "F16";
    }
    return "?";
}

int64_t TensorInfo::numel() const {
    int64_t n = 1;
    for (int64_t d : shape) { n *= d; }
    return n;
}

TensorIndex read_tensor_index(const fs::path & dir) {
    TensorIndex idx;
    idx.source = dir;
    const auto index_file = dir / "model.safetensors.index.json";
    if (fs::exists(index_file)) {
        json j;
        try {
            std::ifstream in(index_file);
            j = json::parse(in);
        } catch (const json::exception & e) {
            fail(Errc::invalid_checkpoint, "{}: not valid JSON: {}", index_file.string(), e.what());
        }
        if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
            fail(Errc::invalid_checkpoint, "{}: missing 'weight_map'", index_file.string());
        }
        std::set<std::string> shards;
        for (const auto & [name, file] : j["weight_map"].items()) { shards.insert(file.get<std::string>()); }
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
    if (fs::exists(dir / "model.safetensors")) {
        idx.source = dir / "model.safetensors";
        read_header(dir / "model.safetensors", idx);
        return idx;
    }
    std::vector<fs::path> files;
    if (fs::is_directory(dir)) {
        for (const auto & e : fs::directory_iterator(dir)) {
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

TensorIndex read_tensor_files(const std::filesystem::path & source, const std::vector<std::filesystem::path> & files) {
    TensorIndex idx;
    idx.source = source;
    for (const auto & f : files) { read_header(f, idx); }
    return idx;
}

void read_tensor_raw(const TensorInfo & t, void * dst) {
    const UniqueFd f = open_read(t.file, Errc::invalid_checkpoint);
    pread_all(f.get(), dst, t.size_bytes, t.offset_bytes, t.file, "tensor '" + t.name + "'");
}

void convert_to_f32(DType dtype, const void * src, float * dst, int64_t numel) {
    switch (dtype) {
        case DType::f32: std::memcpy(dst, src, sizeof(float) * numel); break;
        case DType::bf16: kernels::bf16_to_f32(dst, static_cast<const uint16_t *>(src), numel); break;
        case DType::f16: kernels::f16_to_f32(dst, static_cast<const uint16_t *>(src), numel); break;
    }
}

void read_tensor_f32(const TensorInfo & t, float * dst) {
    if (t.dtype == DType::f32) {
        read_tensor_raw(t, dst);
        return;
    }
    std::vector<uint16_t> raw(static_cast<size_t>(t.numel()));
    read_tensor_raw(t, raw.data());
    convert_to_f32(t.dtype, raw.data(), dst, t.numel());
}

}  // namespace fd::model
