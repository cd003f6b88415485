// Where a weight stream's bytes land: a private dir of safetensors files (one per bucket) that
// the update_weights {weight_dir} path then stages on every rank. The files are written with
// pwrite from the receiver's cache-sized piece buffer, so each byte reaches memory once: in the
// file's page, allocated and filled by the same write, or a page of a recycled file (the
// replaced stream's) written over.
#include "stream_io.h"
#include "fd/process.h"

#include "fd/log.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

namespace fd::stream {

namespace fs = std::filesystem;

namespace {

/// pwrite all `n` bytes of `p` at `off` of `fd` (retries short writes and EINTR).
/// Errors  source_unavailable naming `file` (a full staging file system: ENOSPC).
void pwrite_all(int fd, const std::byte * p, int64_t n, int64_t off, const fs::path & file) {
    while (n > 0) {
        const ssize_t w = ::pwrite(fd, p, static_cast<size_t>(n), static_cast<off_t>(off));
        if (w < 0 && errno == EINTR) { continue; }
        if (w <= 0) {
            fail(Errc::source_unavailable, "weight stream: cannot write {}: {} (is the staging file system full?)", file.string(),
                 std::strerror(errno));
        }
        p += w;
        n -= w;
        off += w;
    }
}

UniqueFd create_private(const fs::path & file) {
    UniqueFd f(::open(file.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!f.valid()) { fail(Errc::internal, "weight stream: cannot create {}: {}", file.string(), std::strerror(errno)); }
    return f;
}

}  // namespace

BucketFile::BucketFile(const fs::path & file, const std::vector<TensorSpec> & specs, const fs::path & recycled) : file_(file) {
    // safetensors: u64 LE header length, the JSON header (padded with spaces to 8 bytes), data.
    nlohmann::json h = nlohmann::json::object();
    int64_t off = 0;
    for (const auto & s : specs) {
        h[s.name] = {{"dtype", model::dtype_name(s.dtype)}, {"shape", s.shape}, {"data_offsets", {off, off + s.nbytes}}};
        offsets_.push_back(off);
        off += s.nbytes;
    }
    std::string text = h.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const uint64_t n = text.size();
    std::string head(8, '\0');
    for (int i = 0; i < 8; ++i) { head[i] = static_cast<char>((n >> (8 * i)) & 0xff); }
    head += text;
    for (auto & o : offsets_) { o += static_cast<int64_t>(head.size()); }
    size_ = static_cast<int64_t>(head.size()) + off;
    if (recycled.empty()) {
        fd_ = create_private(file);
    } else {
        // Our own 0700 dirs on both sides: nobody else can swap the file between these calls.
        if (::rename(recycled.c_str(), file.c_str()) != 0) {
            fail(Errc::internal, "weight stream: cannot move {} to {}: {}", recycled.string(), file.string(), std::strerror(errno));
        }
        fd_ = UniqueFd(::open(file.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
        struct stat st{};
        if (!fd_.valid() || ::fstat(fd_.get(), &st) != 0 || !S_ISREG(st.st_mode) || ::ftruncate(fd_.get(), size_) != 0) {
            fail(Errc::internal, "weight stream: cannot reuse {}: {}", file.string(), std::strerror(errno));
        }
        recycled_bytes_ = std::min<int64_t>(st.st_size, size_);
    }
    pwrite_all(fd_.get(), reinterpret_cast<const std::byte *>(head.data()), static_cast<int64_t>(head.size()), 0, file_);
}

void BucketFile::write(size_t i, int64_t off, const std::byte * p, size_t n) {
    pwrite_all(fd_.get(), p, static_cast<int64_t>(n), offsets_[i] + off, file_);
}

DeltaFile::DeltaFile(const fs::path & file, int64_t header_room) : file_(file), fd_(create_private(file)), header_room_(header_room) {
    static constexpr char kMagic[8] = {'F', 'D', 'D', 'E', 'L', 'T', 'A', '1'};
    const uint64_t len = static_cast<uint64_t>(header_room);
    std::string head(16 + static_cast<size_t>(header_room), ' ');
    std::memcpy(head.data(), kMagic, 8);
    std::memcpy(head.data() + 8, &len, 8);
    head[16] = '{';  // a valid (empty) object until seal() writes the header
    head[17] = '}';
    pwrite_all(fd_.get(), reinterpret_cast<const std::byte *>(head.data()), static_cast<int64_t>(head.size()), 0, file_);
    end_ = static_cast<int64_t>(head.size());
}

void DeltaFile::append(const std::byte * p, int64_t n) {
    pwrite_all(fd_.get(), p, n, end_, file_);
    end_ += n;
}

void DeltaFile::seal(const std::string & header) {
    if (static_cast<int64_t>(header.size()) > header_room_) {
        fail(Errc::internal, "weight stream: the delta header ({} B) outgrew its room ({} B) in {}", header.size(), header_room_, file_.string());
    }
    std::string text = header;
    text.resize(static_cast<size_t>(header_room_), ' ');  // JSON allows the trailing spaces
    if (::pwrite(fd_.get(), text.data(), text.size(), 16) != static_cast<ssize_t>(text.size()) || ::ftruncate(fd_.get(), end_) != 0) {
        fail(Errc::source_unavailable, "weight stream: cannot write the header of {}: {}", file_.string(), std::strerror(errno));
    }
}

namespace {

std::atomic<int32_t> g_dir_counter{0};

}  // namespace

StagingDir::StagingDir(const fs::path & root, int32_t port) {
    // mkdtemp's random suffix: another local user cannot take the name first (a predictable
    // name let one block every stream by creating the next hundred).
    std::string name = (root / fmt::format("fdrollout-stream.{}.{}.{}.XXXXXX", port, ::getpid(), g_dir_counter.fetch_add(1))).string();
    if (::mkdtemp(name.data()) == nullptr) {
        fail(Errc::source_unavailable, "weight stream: cannot create a staging dir under {}: {}", root.string(), std::strerror(errno));
    }
    path_ = name;
}

StagingDir::~StagingDir() {
    if (keep_) { return; }
    std::error_code ec;
    fs::remove_all(path_, ec);
    if (ec) { log::get("stream")->warn("cannot remove the staging dir {}: {}", path_.string(), ec.message()); }
}

std::vector<std::pair<fs::path, int64_t>> StagingDir::bucket_files() const {
    std::vector<std::pair<fs::path, int64_t>> out;
    std::error_code ec;
    for (const auto & e : fs::directory_iterator(path_, ec)) {
        const std::string name = e.path().filename().string();
        struct stat st{};
        if (name.rfind("bucket-", 0) != 0 || ::lstat(e.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) { continue; }
        out.emplace_back(e.path(), static_cast<int64_t>(st.st_size));
    }
    std::sort(out.begin(), out.end());
    return out;
}

fs::path StagingDir::next_bucket_file() { return path_ / fmt::format("bucket-{:05d}.safetensors", ++n_buckets_); }

void StagingDir::write_index(const std::map<std::string, std::string> & weight_map, int64_t total_bytes) {
    const nlohmann::json j{{"metadata", {{"total_size", total_bytes}, {"format", "fdrollout-weight-stream"}}}, {"weight_map", weight_map}};
    const fs::path file = path_ / "model.safetensors.index.json";
    UniqueFd f(::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!f.valid()) { fail(Errc::internal, "weight stream: cannot create {}: {}", file.string(), std::strerror(errno)); }
    const std::string text = j.dump();
    write_all(f.get(), text.data(), static_cast<int64_t>(text.size()), file, Errc::internal);
}

fs::path staging_root(const fs::path & root) {
    if (!root.empty()) { return root; }
    if (::access("/dev/shm", W_OK | X_OK) == 0 && fs::is_directory("/dev/shm")) { return "/dev/shm"; }
    return fs::temp_directory_path();
}

fs::path staging_name(const fs::path & dir, std::string_view kind) {
    static constexpr std::string_view kStem = "fdrollout-stream";
    const std::string name = dir.filename().string();
    const size_t dot       = name.rfind(kStem, 0) == 0 ? name.find('.', kStem.size()) : std::string::npos;
    return dir.parent_path() / fmt::format("{}-{}.{}", kStem, kind, dot == std::string::npos ? name : name.substr(dot + 1));
}

void StagingDir::move_to(const fs::path & to) {
    if (::rename(path_.c_str(), to.c_str()) != 0) {
        fail(Errc::internal, "weight stream: cannot rename {} to {}: {}", path_.string(), to.string(), std::strerror(errno));
    }
    path_ = to;
}

void remove_stale_dirs(const fs::path & root, int32_t port) {
    std::error_code ec;
    const std::string prefixes[] = {fmt::format("fdrollout-stream.{}.", port), fmt::format("fdrollout-stream-retired.{}.", port),
                                    fmt::format("fdrollout-stream-spare.{}.", port)};
    for (const auto & e : fs::directory_iterator(root, ec)) {
        const std::string name = e.path().filename().string();
        for (const std::string & prefix : prefixes) {
            if (name.rfind(prefix, 0) != 0) { continue; }
            struct stat st{};
            if (::lstat(e.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) { continue; }
            const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
            if (pid == ::getpid() || pid_alive(pid)) { continue; }
            std::error_code rm;
            fs::remove_all(e.path(), rm);
            if (!rm) { log::get("stream")->info("removed {} (left by a daemon that is gone)", e.path().string()); }
        }
    }
}

}  // namespace fd::stream
