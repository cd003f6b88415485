#include "fd/file_io.h"
#include "fd/checkpoint/store.h"

#include "fd/checkpoint/safetensors.h"
#include "fd/progress.h"
#include "fd/status.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <exception>
#include <csignal>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <thread>

namespace fd::weights::store {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kChunkBytes = 8 << 20;
constexpr int     kMaxThreads = 8;

bool is_hex64(const std::string & s) {
    return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

/// A manifest file name must stay inside the version dir.
bool is_plain_name(const std::string & s) {
    return !s.empty() && s != "." && s != ".." && s.find('/') == std::string::npos && s.find('\0') == std::string::npos;
}

bool is_safetensors(const std::string & name) {
    return name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0;
}

/// Run fn(i) for i in [0, n) on up to kMaxThreads threads; rethrows the first error (by index).
void parallel_for(size_t n, const std::function<void(size_t)> & fn) {
    if (n <= 1) {
        for (size_t i = 0; i < n; ++i) { fn(i); }
        return;
    }
    std::vector<std::exception_ptr> errors(n);
    std::atomic<size_t>              next{0};
    const size_t n_threads = std::min<size_t>({n, static_cast<size_t>(kMaxThreads), std::max(1u, std::thread::hardware_concurrency())});
    std::vector<std::thread> pool;
    for (size_t t = 0; t < n_threads; ++t) {
        pool.emplace_back([&] {
            for (size_t i = next++; i < n; i = next++) {
                try {
                    fn(i);
                } catch (...) {
                    errors[i] = std::current_exception();
                }
            }
        });
    }
    for (auto & th : pool) { th.join(); }
    for (auto & e : errors) {
        if (e) { std::rethrow_exception(e); }
    }
}

/// The checkpoint files of `dir` (is_checkpoint_file), sorted by name. Each must be a regular
/// file after following symlinks (Hugging Face cache snapshots link into blobs/): a dangling or
/// looping link, a FIFO or a device under a checkpoint name is an error naming it, never left
/// out (a version without its generation_config.json serves other stop ids).
/// Errors  invalid_checkpoint naming the file.
std::vector<std::string> checkpoint_files(const fs::path & dir) {
    std::vector<std::string> names;
    for (const auto & e : fs::directory_iterator(dir)) {
        const std::string name = e.path().filename().string();
        if (!is_checkpoint_file(name)) { continue; }
        std::error_code ec;
        const fs::file_status st = fs::status(e.path(), ec);  // follows links
        if (ec || !fs::is_regular_file(st)) {
            fail(Errc::invalid_checkpoint, "{}: a checkpoint file that is not a regular file ({}); nothing was published", e.path().string(),
                 ec ? ec.message() : fs::exists(st) ? "a FIFO, device, socket or directory" : "a dangling symlink");
        }
        names.push_back(name);
    }
    std::sort(names.begin(), names.end());
    return names;
}

}  // namespace

bool is_checkpoint_file(std::string_view name) {
    static constexpr std::string_view kNames[] = {
        "config.json",        "generation_config.json", "version.yaml",  "tokenizer.json",     "tokenizer.model",
        "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
        "merges.txt",         "chat_template.jinja",    "chat_template.json"};
    for (const auto n : kNames) {
        if (name == n) { return true; }
    }
    return name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json");
}

// ---- SHA-256 ---------------------------------------------------------------------------------

struct Sha256::Ctx {
    EVP_MD_CTX * md = nullptr;
    ~Ctx() { EVP_MD_CTX_free(md); }
};

Sha256::Sha256() : ctx_(std::make_unique<Ctx>()) {
    ctx_->md = EVP_MD_CTX_new();
    FD_CHECK(ctx_->md && EVP_DigestInit_ex(ctx_->md, EVP_sha256(), nullptr) == 1, "EVP SHA-256 init failed");
}
Sha256::~Sha256() = default;
Sha256::Sha256(Sha256 &&) noexcept = default;
Sha256 & Sha256::operator=(Sha256 &&) noexcept = default;

void Sha256::update(const void * data, size_t n) {
    FD_CHECK(EVP_DigestUpdate(ctx_->md, data, n) == 1, "EVP SHA-256 update failed");
}

std::string Sha256::hex() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int  len = 0;
    FD_CHECK(EVP_DigestFinal_ex(ctx_->md, md, &len) == 1 && len == 32, "EVP SHA-256 final failed");
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string out(2 * len, '0');
    for (unsigned i = 0; i < len; ++i) {
        out[2 * i]     = kDigits[md[i] >> 4];
        out[2 * i + 1] = kDigits[md[i] & 15];
    }
    return out;
}

std::string sha256_hex(const void * data, size_t n) {
    Sha256 h;
    h.update(data, n);
    return h.hex();
}

// ---- hashing files ---------------------------------------------------------------------------

FileDigest digest_file(const fs::path & file, const std::vector<Range> & ranges, const fs::path & copy_to) {
    struct stat src{};
    const UniqueFd in = open_regular(file, Errc::invalid_checkpoint, &src);
    const int64_t size = static_cast<int64_t>(::lseek(in.get(), 0, SEEK_END));
    if (size < 0 || ::lseek(in.get(), 0, SEEK_SET) != 0) { fail(Errc::invalid_checkpoint, "{}: cannot seek: {}", file.string(), std::strerror(errno)); }
    ::posix_fadvise(in.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
    for (const auto & r : ranges) {
        if (r.offset < 0 || r.size < 0 || r.offset + r.size > size) {
            fail(Errc::invalid_checkpoint, "{}: byte range [{}, {}) lies outside the file ({} bytes)", file.string(), r.offset, r.offset + r.size, size);
        }
    }
    UniqueFd out;
    if (!copy_to.empty()) {
        // Never more readable than its source (a link to a file only the publisher may read must not
        // land world-readable in the store): 0644 at most, the source's read bits otherwise.
        const mode_t mode = static_cast<mode_t>(src.st_mode & 0644) | S_IRUSR | S_IWUSR;
        out.reset(::open(copy_to.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode));
        if (!out.valid()) { fail(Errc::source_unavailable, "{}: cannot create: {}", copy_to.string(), std::strerror(errno)); }
        if (::fchmod(out.get(), mode) != 0) { fail(Errc::source_unavailable, "{}: cannot set its mode: {}", copy_to.string(), std::strerror(errno)); }
    }
    // Ranges by start offset; `first` skips those that ended before the current chunk.
    std::vector<size_t> order(ranges.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranges[a].offset < ranges[b].offset; });
    std::vector<Sha256> range_h(ranges.size());
    Sha256              whole;
    std::vector<char>   buf(static_cast<size_t>(std::min<int64_t>(kChunkBytes, std::max<int64_t>(size, 1))));
    size_t  first = 0;
    int64_t pos   = 0;
    while (pos < size) {
        const ssize_t n = ::read(in.get(), buf.data(), static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(buf.size()), size - pos)));
        if (n < 0 && errno == EINTR) { continue; }
        if (n < 0) { fail(Errc::invalid_checkpoint, "{}: read failed at byte {}: {}", file.string(), pos, std::strerror(errno)); }
        if (n == 0) { fail(Errc::invalid_checkpoint, "{}: shrank to {} bytes while being read", file.string(), pos); }
        Progress::current().add_done(n);  // /health progress while a version is verified
        const int64_t end = pos + n;
        whole.update(buf.data(), static_cast<size_t>(n));
        if (out.valid()) { write_all(out.get(), buf.data(), n, copy_to, Errc::source_unavailable); }
        while (first < order.size() && ranges[order[first]].offset + ranges[order[first]].size <= pos) { ++first; }
        for (size_t k = first; k < order.size() && ranges[order[k]].offset < end; ++k) {
            const Range & r  = ranges[order[k]];
            const int64_t lo = std::max(pos, r.offset);
            const int64_t hi = std::min(end, r.offset + r.size);
            if (hi > lo) { range_h[order[k]].update(buf.data() + (lo - pos), static_cast<size_t>(hi - lo)); }
        }
        pos = end;
    }
    if (out.valid() && ::fsync(out.get()) != 0) { fail(Errc::source_unavailable, "{}: fsync failed: {}", copy_to.string(), std::strerror(errno)); }
    FileDigest d;
    d.size   = size;
    d.sha256 = whole.hex();
    d.ranges.reserve(ranges.size());
    for (auto & h : range_h) { d.ranges.push_back(h.hex()); }
    return d;
}

Manifest build_manifest(const fs::path & dir, const std::string & version, const fs::path & copy_to) {
    const auto names = checkpoint_files(dir);
    struct Out {
        FileDigest              digest;
        std::vector<std::string> tensor_names;
    };
    std::vector<Out> outs(names.size());
    parallel_for(names.size(), [&](size_t i) {
        const fs::path file = dir / names[i];
        std::vector<Range> ranges;
        if (is_safetensors(names[i])) {
            const auto idx = model::read_tensor_files(dir, {file});
            for (const auto & [name, t] : idx.tensors) {
                outs[i].tensor_names.push_back(name);
                ranges.push_back({t.offset_bytes, t.size_bytes});
            }
        }
        outs[i].digest = digest_file(file, ranges, copy_to.empty() ? fs::path{} : copy_to / names[i]);
    });
    Manifest m;
    m.version = version;
    for (size_t i = 0; i < names.size(); ++i) {
        m.files[names[i]] = {outs[i].digest.size, outs[i].digest.sha256};
        for (size_t k = 0; k < outs[i].tensor_names.size(); ++k) {
            const auto & tn = outs[i].tensor_names[k];
            if (m.tensors.count(tn)) { fail(Errc::invalid_checkpoint, "{}: tensor '{}' is in both {} and {}", dir.string(), tn, m.tensors[tn].file, names[i]); }
            m.tensors[tn] = {names[i], outs[i].digest.ranges[k]};
        }
    }
    return m;
}

// ---- manifest.json ---------------------------------------------------------------------------

Manifest read_manifest(const fs::path & dir) {
    const fs::path file = dir / kManifestName;
    const auto text = read_small_file(file, 64 << 20, Errc::invalid_checkpoint);
    if (!text) { fail(Errc::invalid_checkpoint, "{}: missing; a store version must be published with its manifest (fdctl publish --strategy rsync)", file.string()); }
    json j;
    try {
        j = json::parse(*text);
    } catch (const json::exception & e) {
        fail(Errc::invalid_checkpoint, "{}: not valid JSON: {}", file.string(), e.what());
    }
    auto bad = [&](const std::string & what) { fail(Errc::invalid_checkpoint, "{}: {}", file.string(), what); };
    if (!j.is_object() || j.value("format", "") != kFormat) { bad(fmt::format("\"format\" must be \"{}\"", kFormat)); }
    if (!j.contains("version") || !j["version"].is_string()) { bad("\"version\" must be a string"); }
    if (!j.contains("files") || !j["files"].is_object()) { bad("\"files\" must be an object"); }
    Manifest m;
    m.version = j["version"].get<std::string>();
    for (const auto & [name, v] : j["files"].items()) {
        if (!is_plain_name(name) || name == kManifestName) { bad(fmt::format("file name '{}' is not a plain file name", name)); }
        if (!v.is_object() || !v.contains("size") || !v["size"].is_number_integer() || v["size"].get<int64_t>() < 0 ||
            !v.contains("sha256") || !v["sha256"].is_string() || !is_hex64(v["sha256"].get<std::string>())) {
            bad(fmt::format("files[\"{}\"] needs {{\"size\": bytes, \"sha256\": 64 lowercase hex digits}}", name));
        }
        m.files[name] = {v["size"].get<int64_t>(), v["sha256"].get<std::string>()};
    }
    if (j.contains("tensors")) {
        if (!j["tensors"].is_object()) { bad("\"tensors\" must be an object"); }
        for (const auto & [name, v] : j["tensors"].items()) {
            if (!v.is_object() || !v.contains("file") || !v["file"].is_string() || !v.contains("sha256") ||
                !v["sha256"].is_string() || !is_hex64(v["sha256"].get<std::string>())) {
                bad(fmt::format("tensors[\"{}\"] needs {{\"file\": name, \"sha256\": 64 lowercase hex digits}}", name));
            }
            const std::string f = v["file"].get<std::string>();
            if (!m.files.count(f)) { bad(fmt::format("tensors[\"{}\"] names file '{}', which is not in \"files\"", name, f)); }
            m.tensors[name] = {f, v["sha256"].get<std::string>()};
        }
    }
    if (j.contains("base_version") || j.contains("base_fingerprint")) {
        if (!j.contains("base_version") || !j["base_version"].is_string() || !j.contains("base_fingerprint") ||
            !j["base_fingerprint"].is_string() || !is_hex64(j["base_fingerprint"].get<std::string>())) {
            bad("a delta version needs \"base_version\" (a version) and \"base_fingerprint\" (64 lowercase hex digits)");
        }
        m.base_version     = j["base_version"].get<std::string>();
        m.base_fingerprint = j["base_fingerprint"].get<std::string>();
        const auto & b = m.base_version;
        const bool valid = !b.empty() && b.size() <= 128 && b != "." && b != ".." &&
                           std::all_of(b.begin(), b.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-'; });
        if (!valid || b == m.version) { bad(fmt::format("\"base_version\" '{}' must be another version ([A-Za-z0-9._-]{{1,128}})", b)); }
        if (!m.files.count(std::string(kDeltaFileName))) { bad(fmt::format("a delta version must list {} in \"files\"", kDeltaFileName)); }
    }
    return m;
}

void write_manifest(const fs::path & dir, const Manifest & m) {
    json files = json::object(), tensors = json::object();
    for (const auto & [name, f] : m.files) { files[name] = {{"size", f.size}, {"sha256", f.sha256}}; }
    for (const auto & [name, t] : m.tensors) { tensors[name] = {{"file", t.file}, {"sha256", t.sha256}}; }
    json j = {{"format", kFormat}, {"version", m.version}, {"files", files}, {"tensors", tensors}};
    if (!m.base_version.empty()) {
        j["base_version"]     = m.base_version;
        j["base_fingerprint"] = m.base_fingerprint;
    }
    const std::string text = j.dump(1) + "\n";
    const fs::path file = dir / kManifestName;
    write_file_synced(file, text, Errc::source_unavailable);
}

int remove_stale_temps(const fs::path & dir, std::string_view prefix) {
    int             removed = 0;
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
        const std::string name = it->path().filename().string();
        const auto        dash = name.rfind('-');
        if (name.rfind(prefix, 0) != 0 || dash == std::string::npos || dash + 1 >= name.size()) { continue; }
        const std::string digits = name.substr(dash + 1);
        if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }) || digits.size() > 9) { continue; }
        const pid_t pid = static_cast<pid_t>(std::stol(digits));
        if (pid <= 0 || pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) { continue; }
        std::error_code rm_ec;
        fs::remove_all(it->path(), rm_ec);
        removed += rm_ec ? 0 : 1;
    }
    return removed;
}

void fsync_dir(const fs::path & dir) {
    const UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!d.valid() || ::fsync(d.get()) != 0) { fail(Errc::source_unavailable, "{}: cannot fsync the directory: {}", dir.string(), std::strerror(errno)); }
}

// ---- checking a pulled version ---------------------------------------------------------------

void check_against_manifest(const fs::path & dir, const Manifest & m, bool verify_checksum) {
    for (const auto & e : fs::directory_iterator(dir)) {
        const std::string name = e.path().filename().string();
        if (name == kManifestName) { continue; }
        if (!e.is_regular_file()) { fail(Errc::invalid_checkpoint, "{}: not a regular file; a store version holds only files", e.path().string()); }
        if (!m.files.count(name)) { fail(Errc::invalid_checkpoint, "{}: not listed in {}; republish the version", e.path().string(), kManifestName); }
    }
    for (const auto & [name, f] : m.files) {
        const fs::path file = dir / name;
        std::error_code ec;
        const auto size = fs::file_size(file, ec);
        if (ec) { fail(Errc::invalid_checkpoint, "{}: listed in {} but missing: {}", file.string(), kManifestName, ec.message()); }
        if (static_cast<int64_t>(size) != f.size) {
            fail(Errc::invalid_checkpoint, "{}: {} bytes, the manifest says {}; the store copy is damaged, republish it", file.string(), size, f.size);
        }
    }
    if (!verify_checksum) { return; }
    std::vector<std::string> names;
    int64_t total_bytes = 0;
    for (const auto & [name, f] : m.files) {
        names.push_back(name);
        total_bytes += f.size;
    }
    ProgressPhase progress("verify", total_bytes);  // digest_file adds the bytes it hashes
    std::vector<std::vector<std::string>> found(names.size());  // tensor names per file
    parallel_for(names.size(), [&](size_t i) {
        const std::string & name = names[i];
        const fs::path      file = dir / name;
        const FileEntry &   want = m.files.at(name);
        auto whole_file_mismatch = [&](const std::string & got) {
            fail(Errc::checksum_mismatch, "{}: SHA-256 {} differs from the manifest's {}; the store copy is corrupt, republish the version",
                 file.string(), got, want.sha256);
        };
        std::vector<std::pair<std::string, Range>> tensors;
        if (is_safetensors(name)) {
            model::TensorIndex idx;
            try {
                idx = model::read_tensor_files(dir, {file});
            } catch (const Error &) {
                // A damaged header: say checksum_mismatch when the bytes differ from the manifest.
                const auto d = digest_file(file, {});
                if (d.sha256 != want.sha256) { whole_file_mismatch(d.sha256); }
                throw;
            }
            for (const auto & [tn, t] : idx.tensors) {
                tensors.push_back({tn, {t.offset_bytes, t.size_bytes}});
                found[i].push_back(tn);
            }
        }
        std::vector<Range> ranges;
        for (const auto & [tn, r] : tensors) { ranges.push_back(r); }
        const FileDigest d = digest_file(file, ranges);
        if (d.sha256 != want.sha256) { whole_file_mismatch(d.sha256); }
        for (size_t k = 0; k < tensors.size(); ++k) {
            const auto & tn = tensors[k].first;
            const auto   it = m.tensors.find(tn);
            if (it == m.tensors.end() || it->second.file != name) {
                fail(Errc::checksum_mismatch, "{}: tensor '{}' has no checksum for this file in the manifest", file.string(), tn);
            }
            if (it->second.sha256 != d.ranges[k]) {
                fail(Errc::checksum_mismatch, "{}: tensor '{}' SHA-256 {} differs from the manifest's {}", file.string(), tn, d.ranges[k], it->second.sha256);
            }
        }
    });
    // Every tensor the manifest lists must be where it says.
    std::map<std::string, std::string> where;
    for (size_t i = 0; i < names.size(); ++i) {
        for (const auto & tn : found[i]) { where[tn] = names[i]; }
    }
    for (const auto & [tn, t] : m.tensors) {
        const auto it = where.find(tn);
        if (it == where.end() || it->second != t.file) {
            fail(Errc::checksum_mismatch, "{}: the manifest lists tensor '{}' but the file does not hold it", (dir / t.file).string(), tn);
        }
    }
}

}  // namespace fd::weights::store
