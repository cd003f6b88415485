// Internal to fd::stream: the two I/O halves of a weight stream — the CPU transport's socket
// (tcp_wire.cpp: listen, accept with a token, read frames with a deadline) and the staging dir
// the received bytes land in (staging_dir.cpp: one safetensors file per bucket, written in
// place through a shared mapping). The wire format is docs/weight_streams.md's.
#pragma once

#include "fd/file_io.h"
#include "fd/stream/weight_stream.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

namespace fd::stream {

// ---- tcp_wire.cpp ----

/// "FDW1": every frame starts with it, then u32 LE header length, the header (a JSON object,
/// at most kMaxFrameHeaderBytes), then header["nbytes"] payload bytes (absent = 0).
inline constexpr char     kFrameMagic[4]       = {'F', 'D', 'W', '1'};
inline constexpr uint32_t kMaxFrameHeaderBytes = 1u << 20;

/// A listening TCP socket on `host` (any port the kernel picks), non-blocking.
/// Errors  invalid_argument when `host` does not resolve or cannot be bound.
UniqueFd tcp_listen(const std::string & host, int32_t * port_out);

/// Accept connections on `listener` until one sends the hello frame {"token": `token`}
/// (constant-time compare); others are closed. Errors  timeout at `deadline`.
UniqueFd tcp_accept_trainer(int listener, const std::string & token, Clock::time_point deadline);

/// Read exactly `n` bytes. Errors  timeout at `deadline` (naming `what`); source_unavailable
/// when the peer closed the connection or it failed.
void read_exact(int fd, void * dst, size_t n, Clock::time_point deadline, const std::string & what);

/// Read one frame header (magic, length, JSON object). Errors  as read_exact; invalid_argument
/// on a bad magic, an oversized header or one that is not a JSON object.
nlohmann::json read_frame_header(int fd, Clock::time_point deadline, const std::string & what);

/// True when the peer closed (or reset) the connection; never blocks.
bool peer_closed(int fd);

/// 32 random hex digits from /dev/urandom.
std::string random_token();

// ---- staging_dir.cpp ----

/// One bucket's safetensors file, mapped for writing: the header is written, each tensor's
/// bytes go to data(i) ([specs[i].nbytes] bytes). Unmapped on destruction.
class BucketFile {
public:
    BucketFile(const std::filesystem::path & file, const std::vector<TensorSpec> & specs);
    ~BucketFile();
    BucketFile(const BucketFile &) = delete;
    BucketFile & operator=(const BucketFile &) = delete;
    std::byte * data(size_t i) const { return base_ + offsets_[i]; }
    const std::filesystem::path & file() const { return file_; }

private:
    std::filesystem::path file_;
    std::byte *           map_ = nullptr;
    size_t                map_bytes_ = 0;
    std::byte *           base_ = nullptr;    ///< the data section
    std::vector<int64_t>  offsets_;
};

/// A private staging dir: <root>/fdrollout-stream.<port>.<pid>.<n>, mode 0700, removed (with
/// everything in it) on destruction unless keep() was called.
class StagingDir {
public:
    StagingDir(const std::filesystem::path & root, int32_t port);
    ~StagingDir();
    StagingDir(const StagingDir &) = delete;
    StagingDir & operator=(const StagingDir &) = delete;
    const std::filesystem::path & path() const { return path_; }
    /// The next bucket's file name (bucket-00001.safetensors, ...).
    std::filesystem::path next_bucket_file();
    /// Write model.safetensors.index.json mapping every name to its file (the file name only).
    void write_index(const std::map<std::string, std::string> & weight_map, int64_t total_bytes);
    void keep() { keep_ = true; }

private:
    std::filesystem::path path_;
    int32_t               n_buckets_ = 0;
    bool                  keep_ = false;
};

/// The staging root: `root` when set, else /dev/shm when it is a writable dir, else the temp dir.
std::filesystem::path staging_root(const std::filesystem::path & root);

/// Remove <root>/fdrollout-stream.<port>.<pid>.* dirs owned by this user whose pid is not alive
/// (left by a daemon that was killed). Never throws.
void remove_stale_dirs(const std::filesystem::path & root, int32_t port);

}  // namespace fd::stream
