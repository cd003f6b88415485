// The `ipc_snapshot` load strategy (docs/weight_sources.md): snapshot files in inference names
// written by the trainer into --model, for rank r:
//   model_state.tp{r}.part{N}.safetensors   (all parts, ascending integer N)
//   else model_state.tp{r}.safetensors
//   else the full checkpoint (HF names, as `normal`) — only when no rank has a snapshot file:
//   one rank's file missing while another's exists is not_found (never a mix of versions).
// Publishers write every file as *.tmp and rename it, so only complete files are ever listed.
#include "fd/weights/weight_source.h"

#include "fd/checkpoint/model_config.h"
#include "fd/file_io.h"
#include "fd/status.h"
#include "fd/trust.h"
#include "fd/weights/fingerprint.h"

#include <algorithm>
#include <charconv>

namespace fd::weights {
namespace {

namespace fs = std::filesystem;

/// N of "model_state.tp{rank}.part{N}.safetensors", or -1 when `name` is not such a part.
int64_t part_number(const std::string & name, const std::string & prefix) {
    const std::string suffix = ".safetensors";
    if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
        return -1;
    }
    const char * b = name.data() + prefix.size();
    const char * e = name.data() + name.size() - suffix.size();
    int64_t n = -1;
    const auto [p, ec] = std::from_chars(b, e, n);
    return ec == std::errc{} && p == e && n >= 0 ? n : -1;
}

/// A snapshot file: a regular file (never blocks) of this user, not writable by others. The
/// header read that follows records its st_dev/st_ino, so the bytes later copied come from the
/// very file checked here. Errors  invalid_checkpoint (not a regular file), forbidden.
void check_snapshot_file(const fs::path & p) {
    const UniqueFd f = open_regular(p, Errc::invalid_checkpoint);
    check_trusted(f.get(), p.string(), Trust::owned);
}

class IpcSnapshotSource final : public WeightSource {
public:
    explicit IpcSnapshotSource(fs::path dir) : dir_(std::move(dir)) {}
    LoadStrategy strategy() const override { return LoadStrategy::ipc_snapshot; }

    FetchedCheckpoint fetch(const FetchRequest & req) override {
        if (!fs::is_directory(dir_)) {
            fail(Errc::source_unavailable, "model dir {} is not reachable; restore it and retry", dir_.string());
        }
        const std::string stem = "model_state.tp" + std::to_string(req.rank);
        // The trainer's snapshot files decide what this daemon serves: the directory and every
        // model_state file must be this user's and not writable by others (SPEC §8.6).
        check_trusted_path(dir_.string(), Trust::owned);
        std::vector<std::pair<int64_t, fs::path>> parts;
        std::error_code ec;
        for (const auto & e : fs::directory_iterator(dir_, ec)) {
            const int64_t n = part_number(e.path().filename().string(), stem + ".part");
            if (n >= 0) { parts.emplace_back(n, e.path()); }
        }
        if (ec) { fail(Errc::source_unavailable, "cannot list {}: {}; retry", dir_.string(), ec.message()); }
        FetchedCheckpoint out;
        out.config_dir = dir_;
        if (!parts.empty()) {
            std::sort(parts.begin(), parts.end());
            for (size_t i = 1; i < parts.size(); ++i) {
                if (parts[i].first == parts[i - 1].first) {
                    fail(Errc::invalid_checkpoint, "{} and {} are the same part {}; remove one", parts[i - 1].second.string(),
                         parts[i].second.string(), parts[i].first);
                }
            }
            std::vector<fs::path> files;
            for (auto & [n, p] : parts) {
                check_snapshot_file(p);
                files.push_back(std::move(p));
            }
            out.index = model::read_tensor_files(dir_, files);
        } else if (const fs::path single = ipc_snapshot_file(dir_, req.rank); fs::exists(single)) {
            check_snapshot_file(single);
            out.index = model::read_tensor_files(single, {single});
        } else if (const auto other = any_snapshot_file(); !other.empty()) {
            // Another rank has a snapshot and this one none: falling back to the full checkpoint
            // would serve a mix of two versions across the ranks.
            fail(Errc::not_found, "{}: no {}.safetensors (nor parts) for rank {}, but {} exists; publish every rank "
                                  "(fdctl publish --strategy ipc_snapshot --tp N); nothing applied",
                 dir_.string(), stem, req.rank, other);
        } else {
            out.index = model::read_tensor_index(dir_);
        }
        out.version     = req.version ? req.version : model::read_version_step(dir_);
        out.fingerprint = checkpoint_fingerprint(out.index);
        return out;
    }

private:
    /// The name of some rank's snapshot file (model_state.tp*.safetensors, parts included) in the
    /// dir, or "" when there is none.
    std::string any_snapshot_file() const {
        std::error_code ec;
        for (const auto & e : fs::directory_iterator(dir_, ec)) {
            const std::string name = e.path().filename().string();
            if (name.rfind("model_state.tp", 0) == 0 && name.ends_with(".safetensors")) { return name; }
        }
        return {};
    }

    fs::path dir_;
};

}  // namespace

fs::path ipc_snapshot_file(const fs::path & dir, int32_t rank) { return dir / ("model_state.tp" + std::to_string(rank) + ".safetensors"); }

std::unique_ptr<WeightSource> make_ipc_snapshot_source(std::filesystem::path model_dir) {
    return std::make_unique<IpcSnapshotSource>(std::move(model_dir));
}

}  // namespace fd::weights
