// fd/weights/fingerprint.h — content fingerprints that keep the version label naming the bytes
// served (docs/weight_sources.md, "The version label names the bytes served").
//
// A wakeup re-reads its source; when the source's files changed since the label was set and no
// new version names them, the label must change. The engine compares the fingerprint of what it
// loads with the one recorded when the label was set. Sources fill FetchedCheckpoint::fingerprint:
//   normal, ipc_snapshot, rsync's --model fallback: checkpoint_fingerprint (stat + headers)
//   rsync store versions (immutable, published once):  manifest_fingerprint (the files' SHA-256)
//   ipc: record_fingerprint (the record's object, seqlock generation and entry table)
#pragma once

#include "fd/checkpoint/safetensors.h"
#include "fd/checkpoint/store.h"

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fd::weights {

/// Fingerprint of the files `idx` reads: SHA-256 (64 lowercase hex) over, for every distinct
/// file in path order, its file name, size (bytes), modification time (ns), device and inode,
/// and the bytes before its first tensor's data (the safetensors length prefix and JSON header:
/// every tensor's name, dtype, shape and offsets). A file replaced by another (temp + rename,
/// rsync, mv) is seen even with its mtime preserved; missed: a write in place into the same
/// inode that keeps size and header and restores the mtime (touch -r). Reads a few KiB per file, never the tensor data (cost measured in
/// docs/benchmarks.md). "" for an index without files.
/// Errors  fd::Error{source_unavailable} naming the file when it cannot be opened or read.
std::string checkpoint_fingerprint(const model::TensorIndex & idx);

/// Fingerprint of a store version: SHA-256 (64 hex) over every manifest file's name, size and
/// SHA-256 (the version's content, whatever the staged copy's inode or mtime).
std::string manifest_fingerprint(const store::Manifest & m);

/// Fingerprint of an ipc weight record as fetched: SHA-256 (64 hex) over its name, device and
/// inode, seqlock generation (even: a finished publish), total bytes and its tensor entry table
/// (`table_bytes` bytes at `table`: every tensor's name, dtype, shape, offset, CUDA IPC handle).
/// Every publish bumps the generation or makes a new object, so a record published again under
/// the same version gets another fingerprint (and the label a fingerprint label), while a wakeup
/// re-reading the unchanged record gets the same one. Errors: none.
std::string record_fingerprint(const std::string & name, uint64_t dev, uint64_t ino, uint64_t generation, uint64_t total_bytes,
                               const void * table, size_t table_bytes);

/// Fingerprint of weights made by applying a delta to weights fingerprinted `base_fp`: SHA-256
/// (64 hex) over `base_fp` and `delta_id` (what identifies the delta: for an ipc delta record its
/// device, inode, generation and size). "" when `base_fp` is "" (the base's bytes are not
/// fingerprinted). Errors: none.
std::string delta_fingerprint(const std::string & base_fp, const std::string & delta_id);

/// Several ranks' fingerprints as one, in rank order: the single one for one rank, else the
/// SHA-256 of them joined; "" when any is "" (some rank's source cannot say).
std::string combine_fingerprints(const std::vector<std::string> & per_rank);

/// The label of bytes that no version names: "fp-" + the first 16 hex digits of `fp`
/// (matches the version syntax [A-Za-z0-9._-]{1,128}).
std::string fingerprint_label(const std::string & fp);

/// The fingerprint of the bytes each label named in this process (label -> fingerprint).
using KnownLabels = std::map<std::string, std::string>;

/// The label for bytes fingerprinted `fp` that their source (or the serving label, when the
/// source names none) calls `candidate`: `candidate` unless it is known to name other bytes
/// (`known` holds another fingerprint for it); then fingerprint_label(fp). A `fp` of "" (the
/// source cannot fingerprint, ipc) keeps `candidate`. Examples: a wakeup re-reading files that
/// changed under an unchanged version.yaml gets "fp-…"; a re-read of the same files, or a new
/// version.yaml step, keeps or takes the version.
std::string label_for(const KnownLabels & known, const std::string & candidate, const std::string & fp);

/// The label for bytes fingerprinted `fp` that nothing names (no version given, none in the
/// source): `serving` when it named exactly these bytes, else another label that did (the first
/// in label order), else fingerprint_label(fp). Errors: none; `fp` must not be "".
std::string label_of_unnamed(const KnownLabels & known, const std::string & serving, const std::string & fp);

/// The label after a reload (wakeup) loaded bytes fingerprinted `fp` while `serving` was the
/// label: `serving` when it named exactly these bytes (unchanged files keep their label, whatever
/// version.yaml now says); when the source names no version, label_of_unnamed (bytes served
/// before under a label get it back); else label_for(known, the source's version, fp).
std::string label_after_reload(const KnownLabels & known, const std::string & serving, const std::optional<std::string> & fetched_version,
                               const std::string & fp);

}  // namespace fd::weights
