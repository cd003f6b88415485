// fd/checkpoint/store.h — the versioned weight store of the `rsync` strategy (docs/weight_sources.md):
// manifest.json (per-file size and SHA-256, per-tensor SHA-256 of the raw bytes), hashing, and
// checking a pulled version against its manifest. Shared by the rsync source (fd_core) and by
// `fdctl publish --strategy rsync`.
//
// Store layout:
//   <store>/latest              one line: the newest complete version
//   <store>/<version>/          HF checkpoint + manifest.json (written last, before the rename)
//   <store>/.tmp-<version>-<pid>/  a publish in progress (readers ignore it)
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace fd::weights::store {

inline constexpr std::string_view kFormat       = "fdrollout-store/1";
inline constexpr std::string_view kManifestName = "manifest.json";
inline constexpr std::string_view kLatestName   = "latest";

struct FileEntry {
    int64_t     size = 0;    ///< bytes
    std::string sha256;      ///< lowercase hex, 64 chars
};

struct TensorEntry {
    std::string file;        ///< file name inside the version dir
    std::string sha256;      ///< of the tensor's raw bytes as stored
};

struct Manifest {
    std::string                        version;
    std::map<std::string, FileEntry>   files;    ///< every file of the version except manifest.json
    std::map<std::string, TensorEntry> tensors;  ///< every tensor of every *.safetensors file
    /// A delta version (docs/weight_sources.md, "Delta versions"): its weights.fddelta changes
    /// the store's `base_version`, whose manifest_fingerprint is `base_fingerprint` (64 hex).
    /// Both "" for a full version.
    std::string                        base_version;
    std::string                        base_fingerprint;
};

/// The file of a delta version holding its changes (fd/weights/weight_delta.h format).
inline constexpr std::string_view kDeltaFileName = "weights.fddelta";

/// Incremental SHA-256 (OpenSSL EVP).
class Sha256 {
public:
    Sha256();
    ~Sha256();
    Sha256(Sha256 &&) noexcept;
    Sha256 & operator=(Sha256 &&) noexcept;
    void update(const void * data, size_t n);
    /// Lowercase hex digest; the object is spent afterwards.
    std::string hex();

private:
    struct Ctx;
    std::unique_ptr<Ctx> ctx_;
};

/// SHA-256 of `n` bytes, lowercase hex.
std::string sha256_hex(const void * data, size_t n);

/// A byte range of a file: [offset, offset + size).
struct Range {
    int64_t offset = 0;
    int64_t size   = 0;
};

struct FileDigest {
    int64_t                  size = 0;   ///< bytes read
    std::string              sha256;     ///< of the whole file
    std::vector<std::string> ranges;     ///< one hex digest per requested range, same order
};

/// Read `file` once, sequentially, hashing the whole file and every range of `ranges` (ranges
/// may be in any order; each must lie inside the file). When `copy_to` is set, every byte is
/// also written to that new file (created exclusively, mode 0644, fsync'd before returning).
/// Errors  invalid_checkpoint naming `file` (cannot open/read, range outside the file);
///         source_unavailable naming `copy_to` (cannot create/write/fsync).
FileDigest digest_file(const std::filesystem::path & file, const std::vector<Range> & ranges,
                       const std::filesystem::path & copy_to = {});

/// True for the file names a checkpoint version is made of — what `fdctl publish` copies and a
/// manifest lists: config.json, generation_config.json, *.safetensors,
/// *.safetensors.index.json, version.yaml and the tokenizer files (tokenizer.json,
/// tokenizer.model, tokenizer_config.json, special_tokens_map.json, added_tokens.json,
/// vocab.json, vocab.txt, merges.txt, chat_template.jinja, chat_template.json). Anything else a
/// training dir holds (README.md, LICENSE, reference outputs, optimizer state) is not published.
bool is_checkpoint_file(std::string_view name);

/// The manifest of the checkpoint files in `dir` (regular files for which is_checkpoint_file):
/// sizes, file hashes and the hash of every tensor of every *.safetensors file. When `copy_to`
/// is set, each file is copied there while it is hashed (one read per file).
/// Errors  invalid_checkpoint (unreadable file, bad safetensors header, a tensor in two files);
///         source_unavailable (cannot write under `copy_to`).
Manifest build_manifest(const std::filesystem::path & dir, const std::string & version,
                        const std::filesystem::path & copy_to = {});

/// Parse `dir`/manifest.json (a delta version's "base_version" and "base_fingerprint" too: both
/// or neither, a valid version and 64 lowercase hex digits, and weights.fddelta listed).
/// Errors  invalid_checkpoint naming the file: missing, not JSON, wrong format, bad fields.
Manifest read_manifest(const std::filesystem::path & dir);

/// Write `m` as `dir`/manifest.json and fsync it.   Errors  source_unavailable.
void write_manifest(const std::filesystem::path & dir, const Manifest & m);

/// Check the pulled version in `dir` against `m` (the caller checks `m.version`): every listed
/// file is present with its size and nothing unlisted is there (always); with `verify_checksum`
/// also the SHA-256 of every file and of every tensor, and that every tensor of every
/// *.safetensors file is listed under that file (one read per file, files in parallel).
/// Errors  invalid_checkpoint naming the file (missing, unlisted, size differs, bad header);
///         checksum_mismatch naming the file or tensor.
void check_against_manifest(const std::filesystem::path & dir, const Manifest & m, bool verify_checksum);

/// Remove the entries of `dir` named `<prefix>...-<pid>` whose process no longer runs (a
/// publisher or a pull that was killed). Entries of live processes, ours included, stay.
/// Returns how many were removed; errors are ignored (best effort).
int remove_stale_temps(const std::filesystem::path & dir, std::string_view prefix);

/// fsync a directory (makes renames inside it durable).   Errors  source_unavailable.
void fsync_dir(const std::filesystem::path & dir);

}  // namespace fd::weights::store
