// Content fingerprints of checkpoints (fd/weights/fingerprint.h).
#include "fd/weights/fingerprint.h"

#include "fd/file_io.h"
#include "fd/status.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <limits>
#include <map>
#include <vector>

namespace fd::weights {

std::string checkpoint_fingerprint(const model::TensorIndex & idx) {
    // Per file: where its first tensor's data starts (= the header's end: tensors tile the data area).
    std::map<std::filesystem::path, int64_t> first_data;
    for (const auto & [name, t] : idx.tensors) {
        auto [it, fresh] = first_data.try_emplace(t.file, t.offset_bytes);
        if (!fresh) { it->second = std::min(it->second, t.offset_bytes); }
    }
    if (first_data.empty()) { return {}; }
    store::Sha256 h;
    std::vector<char> header;
    for (const auto & [file, header_end] : first_data) {
        struct stat st {};
        const UniqueFd fd = open_regular(file, Errc::source_unavailable, &st);
        const int64_t n = std::clamp<int64_t>(header_end, 0, std::min<int64_t>(st.st_size, 100LL << 20));
        header.resize(static_cast<size_t>(n));
        model::pread_exact(fd.get(), header.data(), n, 0, file, "header");
        // The device and inode too: a file replaced by another (a writer's temp file renamed
        // over it, rsync -a, mv) is seen even when its mtime was preserved. Not the ctime: a
        // rename of the same file away and back moves it, and those bytes keep their label.
        const std::string line = fmt::format("{}\n{}\n{}.{:09d}\n{}:{}\n{}\n", file.filename().string(),
                                             static_cast<int64_t>(st.st_size), static_cast<int64_t>(st.st_mtim.tv_sec),
                                             static_cast<int64_t>(st.st_mtim.tv_nsec), static_cast<uint64_t>(st.st_dev),
                                             static_cast<uint64_t>(st.st_ino), n);
        h.update(line.data(), line.size());
        h.update(header.data(), header.size());
    }
    return h.hex();
}

std::string manifest_fingerprint(const store::Manifest & m) {
    store::Sha256 h;
    for (const auto & [name, f] : m.files) {
        const std::string line = fmt::format("{}\n{}\n{}\n", name, f.size, f.sha256);
        h.update(line.data(), line.size());
    }
    return h.hex();
}

std::string record_fingerprint(const std::string & name, uint64_t dev, uint64_t ino, uint64_t generation, uint64_t total_bytes,
                               const void * table, size_t table_bytes) {
    store::Sha256 h;
    const std::string line = fmt::format("ipc\n{}\n{}:{}\n{}\n{}\n", name, dev, ino, generation, total_bytes);
    h.update(line.data(), line.size());
    h.update(table, table_bytes);
    return h.hex();
}

std::string delta_fingerprint(const std::string & base_fp, const std::string & delta_id) {
    if (base_fp.empty()) { return {}; }
    store::Sha256 h;
    const std::string line = "delta\n" + base_fp + "\n" + delta_id + "\n";
    h.update(line.data(), line.size());
    return h.hex();
}

std::string combine_fingerprints(const std::vector<std::string> & per_rank) {
    if (per_rank.empty()) { return {}; }
    for (const auto & f : per_rank) {
        if (f.empty()) { return {}; }
    }
    if (per_rank.size() == 1) { return per_rank[0]; }
    store::Sha256 h;
    for (const auto & f : per_rank) {
        h.update(f.data(), f.size());
        h.update("\n", 1);
    }
    return h.hex();
}

std::string fingerprint_label(const std::string & fp) { return "fp-" + fp.substr(0, 16); }

std::string label_for(const KnownLabels & known, const std::string & candidate, const std::string & fp) {
    if (fp.empty()) { return candidate; }
    const auto it = known.find(candidate);
    return it == known.end() || it->second == fp ? candidate : fingerprint_label(fp);
}

std::string label_of_unnamed(const KnownLabels & known, const std::string & serving, const std::string & fp) {
    if (const auto it = known.find(serving); it != known.end() && it->second == fp) { return serving; }
    for (const auto & [label, f] : known) {
        if (f == fp) { return label; }
    }
    return fingerprint_label(fp);
}

std::string label_after_reload(const KnownLabels & known, const std::string & serving, const std::optional<std::string> & fetched_version,
                               const std::string & fp) {
    if (const auto it = known.find(serving); !fp.empty() && it != known.end() && it->second == fp) { return serving; }
    if (!fetched_version && !fp.empty()) { return label_of_unnamed(known, serving, fp); }
    return label_for(known, fetched_version.value_or(serving), fp);
}

}  // namespace fd::weights
