// The store writer (fd/publish/store_writer.h): one version added to an rsync store, atomically.
#include "fd/publish/store_writer.h"

#include "fd/file_io.h"
#include "fd/shm/names.h"
#include "fd/status.h"
#include "fd/checkpoint/store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace fd::publish {
namespace {

namespace fs = std::filesystem;
namespace st = fd::weights::store;

/// Removes a temporary path unless released (every failure path of the publish).
struct TempGuard {
    fs::path path;
    ~TempGuard() {
        if (path.empty()) { return; }
        std::error_code ec;
        fs::remove_all(path, ec);
    }
};

/// rename(2) that never replaces an existing `to` (renameat2 RENAME_NOREPLACE where the kernel
/// has it; a directory rename onto a non-empty directory fails anyway).
void rename_noreplace(const fs::path & from, const fs::path & to, const std::string & version) {
#ifdef SYS_renameat2
    if (::syscall(SYS_renameat2, AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), 1u /* RENAME_NOREPLACE */) == 0) { return; }
    if (errno != ENOSYS && errno != EINVAL) {
        if (errno == EEXIST || errno == ENOTEMPTY) {
            fail(Errc::invalid_argument, "version '{}' already exists in the store ({}); publish a new version", version, to.string());
        }
        fail(Errc::source_unavailable, "cannot rename {} to {}: {}", from.string(), to.string(), std::strerror(errno));
    }
#endif
    if (fs::exists(to)) { fail(Errc::invalid_argument, "version '{}' already exists in the store ({}); publish a new version", version, to.string()); }
    if (::rename(from.c_str(), to.c_str()) != 0) {
        if (errno == EEXIST || errno == ENOTEMPTY) {
            fail(Errc::invalid_argument, "version '{}' already exists in the store ({}); publish a new version", version, to.string());
        }
        fail(Errc::source_unavailable, "cannot rename {} to {}: {}", from.string(), to.string(), std::strerror(errno));
    }
}

}  // namespace

PublishedVersion publish_to_store(const fs::path & from, const fs::path & store, const std::string & version) {
    if (store.empty()) { fail(Errc::invalid_argument, "publishing to a store needs the store dir"); }
    if (version.empty()) { fail(Errc::invalid_argument, "publishing to a store needs a version"); }
    if (!fd::shm::is_valid_version(version)) {
        fail(Errc::invalid_argument, "version '{}' must match [A-Za-z0-9._-]{{1,128}} and not start with '.'", version);
    }
    if (version == st::kLatestName || version.rfind(".tmp-", 0) == 0 || version.rfind("latest.tmp-", 0) == 0) {
        fail(Errc::invalid_argument, "version '{}' is reserved in the store layout; pick another name", version);
    }
    if (!fs::is_directory(from)) { fail(Errc::not_found, "{} is not a checkpoint directory", from.string()); }
    {  // a version no rollout could load never becomes `latest`: at least its config.json is a JSON object
        const auto text = read_small_file(from / "config.json", 16 << 20, Errc::invalid_checkpoint);
        if (!text) { fail(Errc::invalid_checkpoint, "{}: no config.json; a Hugging Face checkpoint needs one; nothing was published", from.string()); }
        const auto cfg = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
        if (!cfg.is_object()) {
            fail(Errc::invalid_checkpoint, "{}/config.json is not a JSON object; nothing was published", from.string());
        }
    }
    const fs::path root = fs::absolute(store);
    std::error_code ec;
    fs::create_directories(root, ec);
    if (ec) { fail(Errc::source_unavailable, "cannot create the store {}: {}", root.string(), ec.message()); }
    {  // a store any local user may write is one anybody could forge a version or `latest` in
        struct stat rs{};
        if (::stat(root.c_str(), &rs) != 0 || !S_ISDIR(rs.st_mode)) {  // a link to the store dir is fine
            fail(Errc::source_unavailable, "the store {} is not a directory", root.string());
        }
        if ((rs.st_mode & S_IWOTH) != 0) {
            fail(Errc::forbidden, "the store {} is writable by every user (mode {:04o}): anyone could forge a version or 'latest' in it; "
                                  "chmod o-w it; nothing was published", root.string(), rs.st_mode & 07777);
        }
    }
    st::remove_stale_temps(root, ".tmp-");
    st::remove_stale_temps(root, "latest.tmp-");
    const fs::path dest = root / version;
    if (fs::exists(dest)) { fail(Errc::invalid_argument, "version '{}' already exists in the store ({}); publish a new version", version, dest.string()); }

    // 1-2. copy + hash into the temporary dir, then the manifest (last).
    TempGuard tmp{root / fmt::format(".tmp-{}-{}", version, ::getpid())};
    fs::remove_all(tmp.path, ec);
    if (!fs::create_directory(tmp.path, ec)) { fail(Errc::source_unavailable, "cannot create {}: {}", tmp.path.string(), ec.message()); }
    const st::Manifest m = st::build_manifest(from, version, tmp.path);
    if (m.files.empty()) { fail(Errc::invalid_checkpoint, "{} holds no files", from.string()); }
    if (m.tensors.empty()) { fail(Errc::invalid_checkpoint, "{} holds no *.safetensors tensors", from.string()); }
    st::write_manifest(tmp.path, m);
    st::fsync_dir(tmp.path);

    // 3. the version appears complete, by rename.
    rename_noreplace(tmp.path, dest, version);
    tmp.path.clear();
    st::fsync_dir(root);

    // 4. latest, by rename.
    TempGuard latest_tmp{root / fmt::format("latest.tmp-{}", ::getpid())};
    write_file_synced(latest_tmp.path, version + "\n", Errc::source_unavailable);
    if (::rename(latest_tmp.path.c_str(), (root / st::kLatestName).c_str()) != 0) {
        fail(Errc::source_unavailable, "cannot rename {} to {}/latest: {}", latest_tmp.path.string(), root.string(), std::strerror(errno));
    }
    latest_tmp.path.clear();
    st::fsync_dir(root);

    PublishedVersion out{version, root, 0, m.files.size(), m.tensors.size()};
    for (const auto & [name, f] : m.files) { out.bytes += f.size; }
    return out;
}

}  // namespace fd::publish
