// fdctl publish --strategy rsync: add one version to a versioned store, atomically
// (docs/weight_sources.md, "Publishing"). Steps, each crash-safe:
//   1. copy every regular file of --from into STORE/.tmp-V-<pid>/, hashing while copying
//      (one read per file, files in parallel), fsync each file;
//   2. write manifest.json (sizes, SHA-256 of files and of every tensor's raw bytes), fsync it
//      and the dir;
//   3. rename the dir to STORE/V (never over an existing V), fsync STORE;
//   4. write STORE/latest.tmp-<pid> with "V\n", fsync, rename it to STORE/latest, fsync STORE.
// A publisher killed anywhere leaves STORE/V absent or complete and `latest` old or new; the
// next publish removes .tmp-* left by dead pids.
#include "offline.h"

#include "fd/file_io.h"
#include "fd/shm/names.h"
#include "fd/status.h"
#include "fd/weights/store.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>

namespace fdctl {
namespace {

namespace fs = std::filesystem;
namespace store = fd::weights::store;

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
            fd::fail(fd::Errc::invalid_argument, "version '{}' already exists in the store ({}); publish a new version", version, to.string());
        }
        fd::fail(fd::Errc::source_unavailable, "cannot rename {} to {}: {}", from.string(), to.string(), std::strerror(errno));
    }
#endif
    if (fs::exists(to)) { fd::fail(fd::Errc::invalid_argument, "version '{}' already exists in the store ({}); publish a new version", version, to.string()); }
    if (::rename(from.c_str(), to.c_str()) != 0) {
        if (errno == EEXIST || errno == ENOTEMPTY) {
            fd::fail(fd::Errc::invalid_argument, "version '{}' already exists in the store ({}); publish a new version", version, to.string());
        }
        fd::fail(fd::Errc::source_unavailable, "cannot rename {} to {}: {}", from.string(), to.string(), std::strerror(errno));
    }
}

}  // namespace

int publish_rsync(const PublishOptions & o) {
    const auto t0 = std::chrono::steady_clock::now();
    if (o.store.empty()) { fd::fail(fd::Errc::invalid_argument, "publish --strategy rsync needs --store DIR (the versioned store)"); }
    if (o.version.empty()) { fd::fail(fd::Errc::invalid_argument, "publish --strategy rsync needs --version V"); }
    if (!fd::shm::is_valid_version(o.version)) {
        fd::fail(fd::Errc::invalid_argument, "--version '{}' must match [A-Za-z0-9._-]{{1,128}} and not be '.' or '..'", o.version);
    }
    if (o.version == store::kLatestName || o.version.rfind(".tmp-", 0) == 0 || o.version.rfind("latest.tmp-", 0) == 0) {
        fd::fail(fd::Errc::invalid_argument, "--version '{}' is reserved in the store layout; pick another name", o.version);
    }
    const fs::path from = o.from;
    if (!fs::is_directory(from)) { fd::fail(fd::Errc::not_found, "--from {} is not a checkpoint directory", o.from); }
    const fs::path root = fs::absolute(o.store);
    std::error_code ec;
    fs::create_directories(root, ec);
    if (ec) { fd::fail(fd::Errc::source_unavailable, "cannot create the store {}: {}", root.string(), ec.message()); }
    store::remove_stale_temps(root, ".tmp-");
    store::remove_stale_temps(root, "latest.tmp-");
    const fs::path dest = root / o.version;
    if (fs::exists(dest)) { fd::fail(fd::Errc::invalid_argument, "version '{}' already exists in the store ({}); publish a new version", o.version, dest.string()); }

    // 1-2. copy + hash into the temporary dir, then the manifest (last).
    TempGuard tmp{root / fmt::format(".tmp-{}-{}", o.version, ::getpid())};
    fs::remove_all(tmp.path, ec);
    if (!fs::create_directory(tmp.path, ec)) { fd::fail(fd::Errc::source_unavailable, "cannot create {}: {}", tmp.path.string(), ec.message()); }
    const store::Manifest m = store::build_manifest(from, o.version, tmp.path);
    if (m.files.empty()) { fd::fail(fd::Errc::invalid_checkpoint, "--from {} holds no files", o.from); }
    if (m.tensors.empty()) { fd::fail(fd::Errc::invalid_checkpoint, "--from {} holds no *.safetensors tensors", o.from); }
    store::write_manifest(tmp.path, m);
    store::fsync_dir(tmp.path);

    // 3. the version appears complete, by rename.
    rename_noreplace(tmp.path, dest, o.version);
    tmp.path.clear();
    store::fsync_dir(root);

    // 4. latest, by rename.
    TempGuard latest_tmp{root / fmt::format("latest.tmp-{}", ::getpid())};
    fd::write_file_synced(latest_tmp.path, o.version + "\n", fd::Errc::source_unavailable);
    if (::rename(latest_tmp.path.c_str(), (root / store::kLatestName).c_str()) != 0) {
        fd::fail(fd::Errc::source_unavailable, "cannot rename {} to {}/latest: {}", latest_tmp.path.string(), root.string(), std::strerror(errno));
    }
    latest_tmp.path.clear();
    store::fsync_dir(root);

    int64_t bytes = 0;
    for (const auto & [name, f] : m.files) { bytes += f.size; }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (o.json) {
        std::cout << nlohmann::json{{"version", o.version}, {"store", root.string()}, {"bytes", bytes},
                                    {"files", m.files.size()}, {"tensors", m.tensors.size()}, {"seconds", secs}}.dump()
                  << "\n";
    } else if (!o.quiet) {
        std::cout << fmt::format("published version {} to {}: {} files, {} tensors, {} bytes in {:.3f} s", o.version, root.string(),
                                 m.files.size(), m.tensors.size(), bytes, secs)
                  << "\n";
    }
    return 0;
}

}  // namespace fdctl
