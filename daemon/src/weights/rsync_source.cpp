// The `rsync` load strategy (docs/weight_sources.md, section `rsync`): pull `<source>/<V>/` from
// a versioned store with the real rsync program into `<staging_dir>/.incoming-V-<pid>`, rename
// it to `<staging_dir>/V`, check it against its manifest.json and hand its tensor index to the
// engine. The staged dir lives exactly as long as FetchedCheckpoint::hold: it is removed after
// the apply and on every failure path.
//
// Tensor-parallel ranks (one process each) share one pull per version: every rank's source
// takes `<staging_dir>/.pull.lock` (flock, exclusive, bounded wait) around its pull, and holds
// `<staging_dir>/.hold-V` shared while its FetchedCheckpoint lives. The first rank finds no
// other holder and pulls (a `V` dir found then is a leftover of a killed daemon: replaced);
// the others find it held and share the checked dir. The last holder to let go removes it.
#include "fd/weights/weight_source.h"

#include "fd/log.h"
#include "fd/checkpoint/model_config.h"
#include "fd/progress.h"
#include "fd/shm/names.h"
#include "fd/file_io.h"
#include "fd/status.h"
#include "fd/trust.h"
#include "fd/checkpoint/store.h"
#include "fd/weights/fingerprint.h"
#include "rsync_process.h"

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

namespace fd::weights {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct RsyncConfig {
    std::string              source;             ///< rsync://host:port/module[/path] | host:path | local path
    fs::path                 staging_dir;
    double                   timeout_s = 300.0;  ///< one pull, rsync --timeout and a hard kill
    std::string              rsync     = "rsync";
    std::vector<std::string> args;               ///< extra rsync arguments, before source and destination
    bool                     daemon = false;     ///< source is rsync://
    bool                     local  = false;     ///< source is a local path
    bool                     link   = true;      ///< local source: hard-link the pulled files from the store when trusted (--link-dest)
};

RsyncConfig parse_config(const std::string & text, int port) {
    auto bad = [](const char * field, const std::string & why) -> Error {
        return Error(Errc::invalid_argument, fmt::format("--rsync-config: \"{}\" {}", field, why), field);
    };
    json j;
    try {
        j = json::parse(text);
    } catch (const json::exception & e) {
        fail(Errc::invalid_argument, "--rsync-config is not valid JSON ({}); expected {{\"source\": ..., \"staging_dir\": ...}}", e.what());
    }
    if (!j.is_object()) { fail(Errc::invalid_argument, "--rsync-config must be a JSON object {{\"source\": ..., \"staging_dir\": ...}}"); }
    for (const auto & [key, v] : j.items()) {
        if (key != "source" && key != "staging_dir" && key != "timeout_s" && key != "rsync" && key != "args" && key != "link") {
            throw Error(Errc::invalid_argument,
                        fmt::format("--rsync-config: unknown field \"{}\" (source, staging_dir, timeout_s, rsync, args, link)", key), key);
        }
    }
    RsyncConfig c;
    if (!j.contains("source") || !j["source"].is_string() || j["source"].get<std::string>().empty()) {
        throw bad("source", "is required: rsync://host:port/module[/path], host:path or a local path");
    }
    c.source = j["source"].get<std::string>();
    while (c.source.size() > 1 && c.source.back() == '/') { c.source.pop_back(); }
    const auto colon = c.source.find(':');
    const auto slash = c.source.find('/');
    c.daemon = c.source.rfind("rsync://", 0) == 0;
    c.local  = !c.daemon && (colon == std::string::npos || (slash != std::string::npos && slash < colon));
    if (c.daemon && c.source.find('/', 8) == std::string::npos) { throw bad("source", "must name a module: rsync://host[:port]/module[/path]"); }
    if (c.local) { c.source = fs::absolute(c.source).lexically_normal().string(); }
    if (j.contains("staging_dir")) {
        if (!j["staging_dir"].is_string() || j["staging_dir"].get<std::string>().empty()) { throw bad("staging_dir", "must be a non-empty path"); }
        c.staging_dir = fs::absolute(j["staging_dir"].get<std::string>());
    } else {
        const char * tmp = std::getenv("TMPDIR");
        c.staging_dir = fs::path(tmp && *tmp ? tmp : "/tmp") / fmt::format("fdrollout-staging-{}", port > 0 ? port : static_cast<int>(::getpid()));
    }
    if (j.contains("timeout_s")) {
        if (!j["timeout_s"].is_number() || !(j["timeout_s"].get<double>() > 0) || j["timeout_s"].get<double>() > 86400) {
            throw bad("timeout_s", "must be a number of seconds in (0, 86400]");
        }
        c.timeout_s = j["timeout_s"].get<double>();
    }
    if (j.contains("rsync")) {
        if (!j["rsync"].is_string() || j["rsync"].get<std::string>().empty()) { throw bad("rsync", "must be the rsync program (name or path)"); }
        c.rsync = j["rsync"].get<std::string>();
    }
    if (j.contains("link")) {
        if (!j["link"].is_boolean()) { throw bad("link", "must be true or false"); }
        c.link = j["link"].get<bool>();
    }
    if (j.contains("args")) {
        if (!j["args"].is_array()) { throw bad("args", "must be an array of strings"); }
        for (const auto & a : j["args"]) {
            if (!a.is_string()) { throw bad("args", "must be an array of strings"); }
            c.args.push_back(a.get<std::string>());
        }
    }
    return c;
}

/// Can the pull of the local store's version dir `dir` hard-link its files instead of copying
/// them? Only when every entry is a regular file owned by this user and writable by nobody else:
/// a link shares the inode, so a file another user may write would change under the daemon
/// after the manifest check (a private copy cannot). Anything else (another owner, a group- or
/// world-writable file, a subdir, a symlink): copy.
bool linkable(const fs::path & dir) {
    std::error_code ec;
    fs::directory_iterator it(dir, ec);
    if (ec) { return false; }
    for (const auto & e : it) {
        struct stat st{};
        if (::lstat(e.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode) || !is_trusted(st, Trust::owned)) { return false; }
    }
    return true;
}

/// A staged directory, removed (recursively) when the last reference goes.
struct StagedDir {
    fs::path path;
    explicit StagedDir(fs::path p) : path(std::move(p)) {}
    StagedDir(const StagedDir &) = delete;
    StagedDir & operator=(const StagedDir &) = delete;
    ~StagedDir() {
        if (path.empty()) { return; }
        std::error_code ec;
        fs::remove_all(path, ec);
        if (ec) { log::get("weights")->warn("cannot remove staged dir {}: {}", path.string(), ec.message()); }
    }
};

/// flock(2) `op` (LOCK_EX / LOCK_SH) on `fd`, retried without blocking until `timeout_s`.
/// Errors  timeout naming `what` (another process holds it that long).
void flock_within(int fd, int op, double timeout_s, const fs::path & what) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
    while (::flock(fd, op | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK && errno != EINTR) { fail(Errc::source_unavailable, "cannot lock {}: {}", what.string(), std::strerror(errno)); }
        if (Clock::now() >= deadline) {
            fail(Errc::timeout, "{} is still locked by another process after {:.0f} s (another rank's pull?); retry", what.string(), timeout_s);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

/// An open lock file; its flock goes with the fd.
UniqueFd open_lock_file(const fs::path & file) {
    UniqueFd f(::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!f.valid()) { fail(Errc::source_unavailable, "cannot open the lock file {}: {}", file.string(), std::strerror(errno)); }
    return f;
}

/// Seconds since the epoch (CLOCK_REALTIME): comparable across the processes of one host.
double wall_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

/// The pull lock file records the last failed pull, "V<TAB>errc<TAB>wall time<TAB>message", so
/// the ranks that waited for that pull fail with its error instead of pulling again (a hung
/// source would otherwise cost every rank its own timeout, one after the other).
void record_failed_pull(int lock_fd, const std::string & v, const Error & e) {
    const std::string line = fmt::format("{}\t{}\t{:.6f}\t{}", v, static_cast<int>(e.code()), wall_now(), e.what());
    if (::ftruncate(lock_fd, 0) == 0) { [[maybe_unused]] const auto n = ::pwrite(lock_fd, line.data(), line.size(), 0); }
}

/// Throw the failure `lock_fd` records for `v` when it happened after `since` (wall_now()).
void rethrow_failed_pull(int lock_fd, const std::string & v, double since) {
    char buf[4096];
    const ssize_t n = ::pread(lock_fd, buf, sizeof(buf) - 1, 0);
    if (n <= 0) { return; }
    const std::string text(buf, static_cast<size_t>(n));
    const auto t1 = text.find('\t'), t2 = text.find('\t', t1 + 1), t3 = text.find('\t', t2 + 1);
    if (t3 == std::string::npos || text.substr(0, t1) != v) { return; }
    try {
        const int    code = std::stoi(text.substr(t1 + 1, t2 - t1 - 1));
        const double when = std::stod(text.substr(t2 + 1, t3 - t2 - 1));
        if (when < since || code <= 0) { return; }
        throw Error(static_cast<Errc>(code), text.substr(t3 + 1) + " (another rank's pull of this version, just now)");
    } catch (const std::logic_error &) {  // a malformed record: pull as usual
    }
}

/// Version `V` staged in `<staging>/V`, shared by the rank processes that hold `<staging>/.hold-V`
/// (flock shared); the holder that lets go last (an exclusive flock succeeds) removes the dir and
/// the hold file, under `<staging>/.pull.lock` so no rank is deciding to share it meanwhile.
class SharedStagedDir {
public:
    SharedStagedDir(fs::path staging, const std::string & v, double lock_timeout_s)
        : staging_(std::move(staging)), dir_(staging_ / v), hold_file_(staging_ / (".hold-" + v)), lock_timeout_s_(lock_timeout_s),
          hold_(open_lock_file(hold_file_)) {}
    SharedStagedDir(const SharedStagedDir &) = delete;
    SharedStagedDir & operator=(const SharedStagedDir &) = delete;
    ~SharedStagedDir() {
        if (!hold_.valid()) { return; }
        ::flock(hold_.get(), LOCK_UN);
        try {
            const UniqueFd pull = open_lock_file(staging_ / ".pull.lock");
            flock_within(pull.get(), LOCK_EX, lock_timeout_s_, staging_ / ".pull.lock");
            if (::flock(hold_.get(), LOCK_EX | LOCK_NB) == 0) { remove_locked(); }
        } catch (const std::exception & e) {
            log::get("weights")->warn("staged dir {} left in place ({}); the next pull replaces it", dir_.string(), e.what());
        }
    }

    const fs::path & dir() const { return dir_; }
    /// Caller holds .pull.lock. True: no other rank holds the dir (this one now holds it alone).
    bool try_hold_alone() { return ::flock(hold_.get(), LOCK_EX | LOCK_NB) == 0; }
    /// Caller holds .pull.lock: hold the dir shared (after a pull, or to share another rank's).
    void hold_shared() { flock_within(hold_.get(), LOCK_SH, lock_timeout_s_, hold_file_); }
    /// Caller holds .pull.lock (a failed pull or share): let go now; remove the dir when no
    /// other rank holds it.
    void release_locked() {
        if (!hold_.valid()) { return; }
        ::flock(hold_.get(), LOCK_UN);
        if (::flock(hold_.get(), LOCK_EX | LOCK_NB) == 0) {
            remove_locked();
        } else {
            hold_ = UniqueFd();
        }
    }

private:
    /// Caller holds .pull.lock and this holds the dir alone: remove it and the hold file.
    void remove_locked() {
        std::error_code ec;
        fs::remove_all(dir_, ec);
        if (ec) { log::get("weights")->warn("cannot remove staged dir {}: {}", dir_.string(), ec.message()); }
        ::unlink(hold_file_.c_str());
        hold_ = UniqueFd();
    }

    fs::path staging_, dir_, hold_file_;
    double   lock_timeout_s_;
    UniqueFd hold_;
};

class RsyncSource final : public WeightSource {
public:
    RsyncSource(fs::path model_dir, RsyncConfig cfg) : model_dir_(std::move(model_dir)), cfg_(std::move(cfg)) {
        log::get("weights")->info("rsync source {} (staging {}, timeout {} s)", cfg_.source, cfg_.staging_dir.string(), cfg_.timeout_s);
    }
    LoadStrategy strategy() const override { return LoadStrategy::rsync; }

    FetchedCheckpoint fetch(const FetchRequest & req) override {
        if (req.wakeup) {
            // Re-pull the store version served (its own name: the label may be an fp- label); the
            // --model checkpoint when the store lacks it.
            const std::string & v = req.serving_source_version.empty() ? req.serving_version : req.serving_source_version;
            if (shm::is_valid_version(v)) {
                try {
                    return pull(v, req.verify_checksum);  // checked again when they were at the update
                } catch (const Error & e) {
                    if (e.code() != Errc::not_found) { throw; }
                    log::get("weights")->info("wakeup: {}; reloading --model {}", e.what(), model_dir_.string());
                }
            }
            if (!fs::is_directory(model_dir_)) {
                fail(Errc::source_unavailable, "model dir {} is not reachable; restore it and retry", model_dir_.string());
            }
            FetchedCheckpoint out;
            out.index       = model::read_tensor_index(model_dir_);
            out.config_dir  = model_dir_;
            out.version     = model::read_version_step(model_dir_);
            out.fingerprint = checkpoint_fingerprint(out.index);
            return out;
        }
        const std::string v = req.version ? *req.version : resolve_version();
        return pull(v, req.verify_checksum);
    }

private:
    /// Version omitted: version.yaml `step` in --model, else the store's `latest`.
    std::string resolve_version() {
        if (auto step = model::read_version_step(model_dir_)) { return *step; }
        prepare_staging();
        const fs::path tmp = cfg_.staging_dir / fmt::format(".incoming-latest-{}", ::getpid());
        StagedDir      guard(tmp);
        try {
            run_rsync(location(std::string(store::kLatestName)), tmp.string());
        } catch (const Error & e) {
            if (e.code() != Errc::not_found) { throw; }
            fail(Errc::not_found, "the store {} has no '{}' and --model has no version.yaml 'step'; pass {{\"version\": \"...\"}} ({})",
                 cfg_.source, store::kLatestName, e.what());
        }
        std::string line = read_small_file(tmp, 4096, Errc::invalid_checkpoint).value_or("");
        line = line.substr(0, line.find('\n'));
        while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) { line.pop_back(); }
        if (!shm::is_valid_version(line)) {
            fail(Errc::invalid_checkpoint, "{}/{} holds '{}', not a version ([A-Za-z0-9._-]{{1,128}})", cfg_.source, store::kLatestName, line);
        }
        return line;
    }

    /// Pull version `v` (once for all ranks sharing the staging dir), check it against its
    /// manifest and index it.
    FetchedCheckpoint pull(const std::string & v, bool verify_checksum) {
        if (!shm::is_valid_version(v)) {
            throw Error(Errc::invalid_argument, fmt::format("version '{}' must match [A-Za-z0-9._-]{{1,128}} and not start with '.'", v), "version");
        }
        prepare_staging();
        const double   lock_timeout_s = cfg_.timeout_s + 30.0;  // another rank's whole pull and check
        const fs::path pull_lock_file = cfg_.staging_dir / ".pull.lock";
        const UniqueFd pull_lock      = open_lock_file(pull_lock_file);
        const double   waited_since   = wall_now();
        flock_within(pull_lock.get(), LOCK_EX, lock_timeout_s, pull_lock_file);
        auto staged = std::make_shared<SharedStagedDir>(cfg_.staging_dir, v, lock_timeout_s);
        const fs::path & final_dir = staged->dir();
        FetchedCheckpoint out;
        if (!staged->try_hold_alone()) {
            // Another rank of this daemon pulled and checked V and still holds it: share it.
            try {
                staged->hold_shared();
                const store::Manifest m = store::read_manifest(final_dir);
                refuse_delta(m);
                store::check_against_manifest(final_dir, m, false);  // sizes and names: no second read of the data
                out.index             = model::read_tensor_index(final_dir);
            out.config_dir        = final_dir;
                out.config_dir        = final_dir;
                out.version           = v;
                out.fingerprint       = manifest_fingerprint(m);
                out.checksum_verified = verify_checksum;  // the pulling rank checked with the same request
                out.hold              = staged;
            } catch (...) {
                staged->release_locked();
                throw;
            }
            log::get("weights")->info("sharing {} pulled by another rank ({} bytes)", v, out.index.total_bytes);
            return out;
        }
        try {
            rethrow_failed_pull(pull_lock.get(), v, waited_since);
        } catch (...) {
            staged->release_locked();
            throw;
        }
        try {
            StagedDir incoming(cfg_.staging_dir / fmt::format(".incoming-{}-{}", v, ::getpid()));
            std::error_code ec;
            fs::remove_all(incoming.path, ec);
            if (!fs::create_directory(incoming.path, ec) || ec) {
                fail(Errc::source_unavailable, "staging dir {} is not writable ({}); fix \"staging_dir\" in --rsync-config", cfg_.staging_dir.string(),
                     ec ? ec.message() : "exists");
            }
            const auto t0 = Clock::now();
            // A local store on this host: hard-link the version's files (rsync falls back to a
            // copy across filesystems), so N daemons fed by one store hold one copy on disk and
            // in the page cache instead of N, and the pull writes nothing.
            const fs::path store_dir = cfg_.local ? fs::absolute(fs::path(location(v)), ec) : fs::path();
            const bool     link      = cfg_.local && cfg_.link && !ec && linkable(store_dir);
            {
                ProgressPhase transfer("transfer", 0);
                run_rsync(location(v) + "/", incoming.path.string() + "/", true, link ? store_dir.string() : std::string());
            }
            const double transfer_s = std::chrono::duration<double>(Clock::now() - t0).count();
            fs::remove_all(final_dir, ec);  // a leftover of a killed daemon (nobody holds it)
            if (::rename(incoming.path.c_str(), final_dir.c_str()) != 0) {
                fail(Errc::source_unavailable, "cannot rename {} to {}: {}", incoming.path.string(), final_dir.string(), std::strerror(errno));
            }
            incoming.path.clear();
            const store::Manifest m = store::read_manifest(final_dir);
            if (m.version != v) {
                fail(Errc::invalid_checkpoint, "{}/{}: says version '{}', the store dir is '{}'; republish it", final_dir.string(), store::kManifestName, m.version, v);
            }
            refuse_delta(m);
            const auto t1 = Clock::now();
            store::check_against_manifest(final_dir, m, verify_checksum);
            out.index             = model::read_tensor_index(final_dir);
            out.config_dir        = final_dir;
            out.version           = v;
            out.fingerprint       = manifest_fingerprint(m);
            out.checksum_verified = verify_checksum;
            out.transfer_s        = transfer_s;
            staged->hold_shared();  // EX → SH: other ranks may share it from now on
            out.hold              = staged;
            [[maybe_unused]] const int t = ::ftruncate(pull_lock.get(), 0);  // no failure to pass on
            log::get("weights")->info("pulled {} ({} bytes, {}) in {:.3f} s, checked{} in {:.3f} s", v, out.index.total_bytes,
                                      link ? "hard-linked from the local store" : "copied", transfer_s, verify_checksum ? " with checksums" : "",
                                      std::chrono::duration<double>(Clock::now() - t1).count());
        } catch (const Error & e) {
            record_failed_pull(pull_lock.get(), v, e);
            staged->release_locked();  // we hold .pull.lock and V alone: removed
            throw;
        } catch (...) {
            staged->release_locked();
            throw;
        }
        return out;
    }

    /// A delta version is applied in place by the engine (Engine::update_from_store_delta), never
    /// loaded as a checkpoint. Errors  wrong_state naming both versions.
    static void refuse_delta(const store::Manifest & m) {
        if (m.base_version.empty()) { return; }
        fail(Errc::wrong_state, "version '{}' {} '{}': update_weights applies it in place while '{}' is served; "
                                "it cannot be loaded on its own (wakeup, start-up): update to a full version", m.version, kStoreDeltaRefusal,
                                m.base_version, m.base_version);
    }

    /// A new empty dir `<staging>/.incoming-<what>-<pid>` (removed with the returned hold; a dead
    /// daemon's is removed by the next prepare_staging).
    std::shared_ptr<StagedDir> private_dir(const std::string & what) {
        prepare_staging();
        auto dir = std::make_shared<StagedDir>(cfg_.staging_dir / fmt::format(".incoming-{}-{}", what, ::getpid()));
        std::error_code ec;
        fs::remove_all(dir->path, ec);
        if (!fs::create_directory(dir->path, ec) || ec) {
            fail(Errc::source_unavailable, "staging dir {} is not writable ({}); fix \"staging_dir\" in --rsync-config", cfg_.staging_dir.string(),
                 ec ? ec.message() : "exists");
        }
        return dir;
    }

public:
    std::optional<StoreDelta> fetch_delta(const std::optional<std::string> & version) override {
        const std::string v = version ? *version : resolve_version();
        if (!shm::is_valid_version(v)) { return std::nullopt; }  // the ranks' pull says why
        auto dir = private_dir("delta-" + v);
        {
            // One rsync run: called once a rank found V to be a delta, so the whole (small) dir.
            ProgressPhase transfer("transfer", 0);
            run_rsync(location(v) + "/", dir->path.string() + "/", true);
        }
        const store::Manifest m = store::read_manifest(dir->path);
        if (m.base_version.empty()) { return std::nullopt; }  // a full version after all: the ranks pull it
        if (m.version != v) {
            fail(Errc::invalid_checkpoint, "{}/{}: says version '{}', the store dir is '{}'; republish it", location(v), store::kManifestName,
                 m.version, v);
        }
        store::check_against_manifest(dir->path, m, /*verify_checksum=*/true);  // small: always every byte
        StoreDelta d;
        d.version          = v;
        d.base_version     = m.base_version;
        d.base_fingerprint = m.base_fingerprint;
        d.fingerprint      = manifest_fingerprint(m);
        d.delta_file       = dir->path / std::string(store::kDeltaFileName);
        d.hold             = dir;
        log::get("weights")->info("pulled delta version {} on {} ({} bytes)", v, m.base_version, m.files.at(std::string(store::kDeltaFileName)).size);
        return d;
    }

    StoreCopy copy_version(const std::string & v, const std::string & fingerprint, bool verify_checksum) override {
        auto dir = private_dir(fmt::format("serving{}", ++n_copies_));
        const auto t0 = Clock::now();
        {
            ProgressPhase transfer("transfer", 0);
            run_rsync(location(v) + "/", dir->path.string() + "/", true);  // a copy, never --link-dest: it is written in place
        }
        const store::Manifest m = store::read_manifest(dir->path);
        if (m.version != v) {
            fail(Errc::invalid_checkpoint, "{}/{}: says version '{}', the store dir is '{}'; republish it", location(v), store::kManifestName, m.version, v);
        }
        if (!m.base_version.empty()) {
            fail(Errc::wrong_state, "the delta's base '{}' is itself a delta on '{}' and this daemon holds no copy of its bytes; "
                                    "update to a full version first", v, m.base_version);
        }
        if (manifest_fingerprint(m) != fingerprint) {
            fail(Errc::wrong_state, "the store's '{}' is not the version the delta was made against (its base_fingerprint differs); "
                                    "republish the delta against the store's '{}'", v, v);
        }
        store::check_against_manifest(dir->path, m, verify_checksum);
        // What names these bytes from now on is the engine's label, not the base's version.yaml.
        std::error_code ec;
        fs::remove(dir->path / "version.yaml", ec);
        log::get("weights")->info("copied {} ({} files) into {} in {:.3f} s as the serving dir of its deltas", v, m.files.size(),
                                  dir->path.string(), std::chrono::duration<double>(Clock::now() - t0).count());
        return StoreCopy{dir->path, dir};
    }

private:
    /// `<source>/<name>` in rsync's syntax.
    std::string location(const std::string & name) const { return cfg_.source == "/" ? "/" + name : cfg_.source + "/" + name; }

    void prepare_staging() {
        std::error_code ec;
        // Parents as usual; the staging dir itself mode 0700 when we create it (the default lives
        // in the world-writable $TMPDIR, where another user could create it first).
        fs::create_directories(cfg_.staging_dir.parent_path(), ec);
        if (!ec && ::mkdir(cfg_.staging_dir.c_str(), 0700) != 0 && errno != EEXIST) { ec = std::error_code(errno, std::generic_category()); }
        if (ec || ::access(cfg_.staging_dir.c_str(), W_OK | X_OK) != 0) {
            fail(Errc::source_unavailable, "staging dir {} is not writable ({}); fix \"staging_dir\" in --rsync-config", cfg_.staging_dir.string(),
                 ec ? ec.message() : std::strerror(errno));
        }
        // What is staged there is applied: the dir must be this user's and not writable by others.
        {
            const UniqueFd d(::open(cfg_.staging_dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
            if (!d.valid()) {
                fail(Errc::forbidden, "staging dir {} cannot be opened as a directory ({}): a symlink or not a directory; "
                                      "fix \"staging_dir\" in --rsync-config", cfg_.staging_dir.string(), std::strerror(errno));
            }
            check_trusted(d.get(), cfg_.staging_dir.string(), Trust::owned);
        }
        store::remove_stale_temps(cfg_.staging_dir, ".incoming-");
        if (cfg_.local && !fs::is_directory(cfg_.source)) {
            fail(Errc::source_unavailable, "the store {} is not reachable (not a directory); restore it and retry", cfg_.source);
        }
    }

    /// rsync `src` to `dst`. Errors  not_found (no such version/file or module),
    /// source_unavailable (daemon down, refused, timeout, any other rsync failure).
    /// `progress`: report bytes through Progress::current() (--info=progress2). `link_dest`: an
    /// absolute local dir whose identical files rsync hard-links instead of copying ("" = none).
    void run_rsync(const std::string & src, const std::string & dst, bool progress = false, const std::string & link_dest = "") {
        const auto secs = std::to_string(static_cast<int64_t>(std::ceil(cfg_.timeout_s)));
        std::vector<std::string> argv = {cfg_.rsync, "-rt", "--timeout=" + secs};
        if (progress) {
            argv.push_back("--info=progress2");
            argv.push_back("--no-inc-recursive");  // the percentage covers every file from the start
        }
        if (cfg_.daemon) { argv.push_back("--contimeout=" + secs); }
        if (!link_dest.empty()) { argv.push_back("--link-dest=" + link_dest); }
        argv.insert(argv.end(), cfg_.args.begin(), cfg_.args.end());
        argv.push_back(src);
        argv.push_back(dst);
        const ProcessResult r = run_process(argv, cfg_.timeout_s, progress);
        if (r.exit_code == 0) { return; }
        if (r.timed_out) {
            fail(Errc::source_unavailable, "rsync {} did not finish within timeout_s = {} s (killed); check the store host and network", src, cfg_.timeout_s);
        }
        const std::string out = oneline(r.output);
        std::string lower = out;
        std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
        const bool missing = lower.find("unknown module") != std::string::npos ||
                             ((r.exit_code == 23 || r.exit_code == 24) &&
                              (lower.find("no such file or directory") != std::string::npos || lower.find("not a directory") != std::string::npos) &&
                              (lower.find("link_stat") != std::string::npos || lower.find("change_dir") != std::string::npos));
        if (missing) { fail(Errc::not_found, "{} is not in the store (rsync exit {}: {}); publish it first", src, r.exit_code, out); }
        fail(Errc::source_unavailable, "rsync {} failed (exit {}): {}; is the store reachable?", src, r.exit_code, out);
    }

    fs::path    model_dir_;
    RsyncConfig cfg_;
    int         n_copies_ = 0;  ///< copy_version dirs made (their names)
};

}  // namespace

std::unique_ptr<WeightSource> make_rsync_source(std::filesystem::path model_dir, const std::string & config_json, int port) {
    return std::make_unique<RsyncSource>(std::move(model_dir), parse_config(config_json, port));
}

}  // namespace fd::weights
