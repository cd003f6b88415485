#include "fd/weights/weight_source.h"

#include "fd/checkpoint/model_config.h"
#include "fd/file_io.h"
#include "fd/status.h"
#include "fd/trust.h"
#include "fd/weights/fingerprint.h"

#include <algorithm>

namespace fd::weights {

std::string_view to_string(LoadStrategy s) {
    switch (s) {
        case LoadStrategy::normal: return "normal";
        case LoadStrategy::ipc_snapshot: return "ipc_snapshot";
        case LoadStrategy::ipc: return "ipc";
        case LoadStrategy::rsync: return "rsync";
    }
    return "?";
}

LoadStrategy parse_load_strategy(std::string_view s) {
    for (auto st : {LoadStrategy::normal, LoadStrategy::ipc_snapshot, LoadStrategy::ipc, LoadStrategy::rsync}) {
        if (to_string(st) == s) { return st; }
    }
    fail(Errc::invalid_argument, "unknown --load-strategy '{}' (normal, ipc_snapshot, ipc, rsync)", s);
}

StoreCopy WeightSource::copy_version(const std::string & version, const std::string &, bool) {
    fail(Errc::wrong_state, "version '{}': the {} source holds no store versions to copy (rsync does)", version, to_string(strategy()));
}

namespace {

class NormalSource final : public WeightSource {
public:
    explicit NormalSource(std::filesystem::path dir) : dir_(std::move(dir)) {}
    LoadStrategy strategy() const override { return LoadStrategy::normal; }

    FetchedCheckpoint fetch(const FetchRequest &) override {
        if (!std::filesystem::is_directory(dir_)) {
            fail(Errc::source_unavailable, "model dir {} is not reachable; restore it and retry", dir_.string());
        }
        FetchedCheckpoint out;
        out.index      = model::read_tensor_index(dir_);
        out.config_dir = dir_;
        out.version     = model::read_version_step(dir_);
        out.fingerprint = checkpoint_fingerprint(out.index);
        return out;
    }

private:
    std::filesystem::path dir_;
};

/// Another local user must not choose what this daemon serves (SPEC §8.6): the directory (so
/// nobody else can add or replace a file in it) and every file read (those that exist).
void check_owned(const std::filesystem::path & dir, std::vector<std::filesystem::path> files) {
    check_trusted_path(dir.string(), Trust::owned);
    std::sort(files.begin(), files.end());
    files.erase(std::unique(files.begin(), files.end()), files.end());
    for (const auto & f : files) {
        if (!std::filesystem::exists(f)) { continue; }
        const UniqueFd fd = open_regular(f, Errc::invalid_checkpoint);
        check_trusted(fd.get(), f.string(), Trust::owned);
    }
}

}  // namespace

model::TensorIndex read_owned_files(const std::filesystem::path & dir, const std::vector<std::filesystem::path> & files) {
    check_owned(dir, files);
    return model::read_tensor_files(files.size() == 1 ? files[0] : dir, files);
}

FetchedCheckpoint fetch_checkpoint_dir(const std::filesystem::path & dir, bool owned) {
    if (!std::filesystem::is_directory(dir)) {
        fail(Errc::source_unavailable, "weight dir {} is not a reachable directory; write the checkpoint there and retry", dir.string());
    }
    if (owned) { check_trusted_path(dir.string(), Trust::owned); }  // before a byte is read from it
    FetchedCheckpoint out;
    out.index      = model::read_tensor_index(dir);
    out.config_dir = dir;
    if (owned) {
        std::vector<std::filesystem::path> files;
        for (const auto & [name, t] : out.index.tensors) { files.push_back(t.file); }
        files.push_back(dir / "model.safetensors.index.json");
        check_owned(dir, std::move(files));
    }
    out.version     = model::read_version_step(dir);
    out.fingerprint = checkpoint_fingerprint(out.index);
    return out;
}

std::unique_ptr<WeightSource> make_normal_source(std::filesystem::path model_dir) {
    return std::make_unique<NormalSource>(std::move(model_dir));
}

std::unique_ptr<WeightSource> make_weight_source(const SourceConfig & cfg) {
    switch (cfg.strategy) {
        case LoadStrategy::normal: return make_normal_source(cfg.model_dir);
        case LoadStrategy::ipc_snapshot: return make_ipc_snapshot_source(cfg.model_dir);
        case LoadStrategy::ipc: return make_ipc_source(cfg.port, cfg.tp);
        case LoadStrategy::rsync: return make_rsync_source(cfg.model_dir, cfg.rsync_config, cfg.port);
    }
    fail(Errc::internal, "unknown load strategy");
}

}  // namespace fd::weights
