// fd/publish/store_writer.h — the trainer side of the `rsync` strategy: add one version of a
// Hugging Face checkpoint to a versioned store (layout and manifest: fd/checkpoint/store.h,
// docs/weight_sources.md "Publishing"). Used by `fdctl publish --strategy rsync`; a trainer
// written in C++ links fd_publish and calls it directly. Library fd_publish (no engine).
//
// Steps, each crash-safe:
//   1. copy every checkpoint file of `from` (store::is_checkpoint_file) into
//      STORE/.tmp-V-<pid>/, hashing while copying (one read per file, files in parallel),
//      fsync each file;
//   2. write manifest.json (sizes, SHA-256 of files and of every tensor's raw bytes), fsync it
//      and the dir;
//   3. rename the dir to STORE/V (never over an existing V), fsync STORE;
//   4. write STORE/latest.tmp-<pid> with "V\n", fsync, rename it to STORE/latest, fsync STORE.
// A publisher killed anywhere leaves STORE/V absent or complete and `latest` old or new; the
// next publish removes .tmp-* left by dead pids.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace fd::publish {

/// What one publish wrote.
struct PublishedVersion {
    std::string           version;
    std::filesystem::path store;        ///< absolute
    int64_t               bytes   = 0;  ///< sum of the published files' sizes
    size_t                files   = 0;  ///< files listed in the manifest
    size_t                tensors = 0;  ///< tensors listed in the manifest
};

/// Publish checkpoint dir `from` as `version` of the store `store` (created if missing).
/// Errors  fd::Error{invalid_argument}: empty store or version, a version not matching
///         [A-Za-z0-9._-]{1,128} or reserved by the layout (latest, .tmp-*, latest.tmp-*), a
///         version already in the store; not_found: `from` is not a directory;
///         invalid_checkpoint: `from` holds no files / no safetensors tensors, or an unreadable
///         one; source_unavailable: the store cannot be written. Nothing is left behind on error.
PublishedVersion publish_to_store(const std::filesystem::path & from, const std::filesystem::path & store,
                                  const std::string & version);

}  // namespace fd::publish
