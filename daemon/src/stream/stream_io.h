// Internal to fd::stream: the two I/O halves of a weight stream — the CPU transport's socket
// (tcp_wire.cpp: listen, accept with a token, read frames with a deadline) and the staging dir
// the received bytes land in (staging_dir.cpp: one safetensors file per bucket, written with
// pwrite as the pieces arrive). The wire format is docs/weight_streams.md's.
#pragma once

#include "fd/file_io.h"
#include "fd/stream/landing.h"
#include "fd/stream/weight_stream.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fd::stream {

// ---- the transport seam: how a bucket's bytes arrive ----

/// Takes tensor `i`'s bytes [off, off + n) as they arrive: for each tensor in announced order,
/// its pieces in order, each at most kPieceBytes and a whole number of its elements. `p` [n] is
/// the receiver's host buffer, valid only during the call. It may throw (the receive stops).
using Sink = std::function<void(size_t i, int64_t off, const std::byte * p, size_t n)>;

/// A receiver's piece: small enough that the socket's copy into it, the sink's check of it and
/// the sink's write of it stay in the core's L2 cache (each byte goes to memory once, into the
/// staging file), a multiple of every dtype's size.
inline constexpr size_t kPieceBytes = size_t(256) << 10;

/// One trainer's connection. receive() runs on one thread at a time; interrupt() and
/// peer_closed() may be called from any other.
class Receiver {
public:
    virtual ~Receiver() = default;
    virtual const char * name() const = 0;  ///< "tcp" | "nccl"
    /// Receive `specs`, in order, handing every piece to `sink` (above); `packed`: the whole
    /// bucket as one transfer (tcp: one frame; nccl: one broadcast).
    /// Errors  timeout at `deadline`; source_unavailable when the trainer is gone or interrupt()
    ///         was called; invalid_argument when a tcp frame differs from its announcement; what
    ///         `sink` throws.
    virtual void receive(const std::vector<TensorSpec> & specs, bool packed, const Sink & sink, Clock::time_point deadline) = 0;
    /// True when the trainer is known gone (never blocks).
    virtual bool peer_closed() = 0;
    /// Make a receive() in progress (and every later one) fail at once.
    virtual void interrupt() = 0;
};

/// The CPU transport over an accepted, authenticated connection (tcp_wire.cpp).
std::unique_ptr<Receiver> make_tcp_receiver(UniqueFd conn);

/// The GPU transport (nccl_receiver.cpp): this process joins the trainer's NCCL group as rank
/// `rank` of `world_size` on CUDA device `device`, from the ncclUniqueId the trainer created
/// (`unique_id_hex`: 256 hex digits = its 128 bytes; no TCP store, no PyTorch). Tensors arrive
/// as ncclBroadcast from rank 0 (the trainer), one per tensor in announced order (packed: one
/// per bucket, the tensors back to back), into a device buffer, then are copied to host.
/// The group forms within `deadline` (non-blocking init, polled; aborted past it).
/// Errors  not_found in a build without CUDA; invalid_argument on a malformed id or ranks;
///         timeout; source_unavailable when NCCL reports an error (the group is aborted).
struct NcclGroup {
    std::string unique_id_hex;
    int32_t     rank = 1;
    int32_t     world_size = 2;
    int32_t     device = 0;
};
std::unique_ptr<Receiver> make_nccl_receiver(const NcclGroup & g, Clock::time_point deadline);

// ---- tcp_wire.cpp ----

/// "FDW1": every frame starts with it, then u32 LE header length, the header (a JSON object,
/// at most kMaxFrameHeaderBytes), then header["nbytes"] payload bytes (absent = 0).
inline constexpr char     kFrameMagic[4]       = {'F', 'D', 'W', '1'};
inline constexpr uint32_t kMaxFrameHeaderBytes = 1u << 20;

/// A listening TCP socket on `host` (any port the kernel picks), non-blocking.
/// Errors  invalid_argument when `host` does not resolve or cannot be bound.
UniqueFd tcp_listen(const std::string & host, int32_t * port_out);

/// Accept connections on `listener` until one sends the hello frame {"token": `token`}
/// (constant-time compare); others are closed. Errors  timeout at `deadline`.
UniqueFd tcp_accept_trainer(int listener, const std::string & token, Clock::time_point deadline);

/// Read exactly `n` bytes. `ended` (optional): set true, and nothing read, when the peer closed the
/// connection before the first byte (a clean end between frames); false otherwise.
/// Errors  timeout at `deadline` (naming `what`); source_unavailable when the peer closed the
///         connection (inside the `n` bytes, or at all without `ended`) or it failed.
void read_exact(int fd, void * dst, size_t n, Clock::time_point deadline, const std::string & what, bool * ended = nullptr);

/// Read one frame header (magic, length, JSON object). Errors  as read_exact; invalid_argument
/// on a bad magic, an oversized header or one that is not a JSON object.
nlohmann::json read_frame_header(int fd, Clock::time_point deadline, const std::string & what);

/// 32 random hex digits from /dev/urandom.
std::string random_token();

// ---- delta.cpp ----

/// Apply one delta to the base's copy of its tensor, after checking it: `payload` is the
/// delta's wire bytes — indices [n_indices] (int64 | int32 per s.index_bytes, little-endian, at
/// any alignment) then values [n_indices] of s.dtype; `dst` [s.numel()] of s.dtype, written at
/// those indices only, and only when every index and value is valid.
/// Errors  invalid_argument naming the tensor and position: an index outside [0, numel), or
///         not greater than the one before (unsorted or duplicated); invalid_checkpoint: a
///         non-finite value.
void apply_delta(const TensorSpec & s, const std::byte * payload, std::byte * dst);

/// Index of the first NaN/Inf among the `n` values of `dtype` at `p` (any alignment), or -1.
int64_t first_nonfinite(model::DType dtype, const std::byte * p, int64_t n);

/// Check one delta's received bytes where they lie (values finite, indices sorted, unique, in
/// [0, numel)): `payload` [s.nbytes] at any alignment, indices (s.index_bytes each) then values.
/// Errors  as apply_delta (naming the tensor and the position).
void check_delta_bytes(const TensorSpec & s, const std::byte * payload);

// ---- landing_delta.cpp: a delta landing's frames (fd/stream/landing.h, LandMode::delta) ----

/// Where a delta landing keeps its frames: `cap` bytes at `base`, `used` of them taken.
struct DeltaBuffer {
    std::byte * base = nullptr;
    int64_t     cap  = 0;
    int64_t     used = 0;
};

/// The most elements one delta frame for part `p` may carry: its rows' elements of the training
/// tensor (dim 0), or the whole training tensor's (dim 1: the rank keeps its columns).
int64_t max_delta_elements(const LandPart & p);

/// Buffer bytes a frame of `n` elements of part `p` takes (indices as received, then values; each
/// 8-byte aligned).
int64_t delta_frame_bytes(const LandPart & p, int64_t n, bool idx64);

/// Read one delta frame's payload (its header read: `n` elements, int64 indices when `idx64`)
/// from `fd` into `buf`, check it and turn it into the part's coordinates (uint32 element indices
/// into the part's range; a column part keeps only its columns, compacted in place).
/// Errors  invalid_argument naming the tensor and the position: n of 0 or more than the part takes,
///         an index outside the training tensor or this part's rows, or not greater than the one
///         before (unsorted or duplicated); invalid_checkpoint: a non-finite value (when
///         `check_finite`); read_exact's errors (naming the tensor).
LandedDelta::Frame read_delta_frame(int fd, const LandPart & p, int32_t part, uint64_t n, bool idx64, DeltaBuffer & buf,
                                    Clock::time_point deadline, bool check_finite);

// ---- staging_dir.cpp ----

/// One bucket's safetensors file (0600, O_EXCL | O_NOFOLLOW), written with pwrite as the bytes
/// arrive: the header at construction, then each tensor's pieces at their place. pwrite fills
/// fresh tmpfs pages as it allocates them (no zeroing pass, no page faults, no mapping), and a
/// full file system is ENOSPC here, never a SIGBUS. `recycled` (optional) names a file of the
/// replaced stream's dir, which nothing reads any more: it is renamed to `file` and cut to this
/// bucket's size, and the writes go over its pages, which need no allocation as far as they go.
/// (Not mapped: on this project's VMs a new mapping's first touch of each page costs ~5 us, five
/// times the socket's copy; pwrite writes through the kernel's own mapping. docs/benchmarks.md.)
class BucketFile {
public:
    /// Errors  internal when `file` cannot be created (or `recycled` renamed, opened or cut);
    ///         source_unavailable as write().
    BucketFile(const std::filesystem::path & file, const std::vector<TensorSpec> & specs, const std::filesystem::path & recycled = {});
    BucketFile(const BucketFile &) = delete;
    BucketFile & operator=(const BucketFile &) = delete;
    /// Write tensor `i`'s bytes [off, off + n) from `p`.
    /// Errors  source_unavailable (the staging file system is full or failing).
    void write(size_t i, int64_t off, const std::byte * p, size_t n);
    const std::filesystem::path & file() const { return file_; }
    /// Bytes of this file written into pages a previous stream had allocated (0 when fresh).
    int64_t recycled_bytes() const { return recycled_bytes_; }

private:
    std::filesystem::path file_;
    UniqueFd              fd_;
    std::vector<int64_t>  offsets_;  ///< each tensor's first byte in the file (after the header)
    int64_t               size_ = 0;  ///< the file's bytes (header and tensors)
    int64_t               recycled_bytes_ = 0;
};

/// A delta update's weights.fddelta (fd/weights/weight_delta.h's format: "FDDELTA1", u64 LE
/// header length, the JSON header, then per tensor its indices and values), written as the
/// buckets arrive: the header's room (`header_room` bytes) is reserved after the magic, each
/// bucket's checked bytes are appended after the previous ones (a delta tensor's wire bytes ARE
/// its file bytes: the indices as sent, int32 or int64, then the values), and seal() writes the
/// header, padded with spaces to its room. Every rank maps the sealed file.
class DeltaFile {
public:
    DeltaFile(const std::filesystem::path & file, int64_t header_room);
    DeltaFile(const DeltaFile &) = delete;
    DeltaFile & operator=(const DeltaFile &) = delete;
    /// Append `n` bytes at `p`. Errors  source_unavailable (the staging file system is full).
    void append(const std::byte * p, int64_t n);
    /// Write the header (a JSON object's text) into its room. Errors  internal when it does not fit.
    void seal(const std::string & header);
    const std::filesystem::path & path() const { return file_; }

private:
    std::filesystem::path file_;
    UniqueFd              fd_;
    int64_t               header_room_ = 0;
    int64_t               end_ = 0;         ///< bytes written (magic, length, header room, tensors)
};

/// A private staging dir: <root>/fdrollout-stream.<port>.<pid>.<n>.<random> (mkdtemp), mode 0700, removed (with
/// everything in it) on destruction unless keep() was called.
class StagingDir {
public:
    StagingDir(const std::filesystem::path & root, int32_t port);
    ~StagingDir();
    StagingDir(const StagingDir &) = delete;
    StagingDir & operator=(const StagingDir &) = delete;
    const std::filesystem::path & path() const { return path_; }
    /// The next bucket's file name (bucket-00001.safetensors, ...).
    std::filesystem::path next_bucket_file();
    /// Write model.safetensors.index.json mapping every name to its file (the file name only).
    void write_index(const std::map<std::string, std::string> & weight_map, int64_t total_bytes);
    void keep() { keep_ = true; }
    /// Rename the dir to `to` (same file system). Errors  internal.
    void move_to(const std::filesystem::path & to);
    /// Its bucket files (regular files named bucket-*.safetensors, in name order) with their
    /// sizes in bytes: what a later stream may recycle once this dir is replaced.
    std::vector<std::pair<std::filesystem::path, int64_t>> bucket_files() const;

private:
    std::filesystem::path path_;
    int32_t               n_buckets_ = 0;
    bool                  keep_ = false;
};

/// The name a staging dir `dir` (<root>/fdrollout-stream[-<any kind>].<port>.<pid>.<n>) takes as
/// `kind`: "retired" when a thread removes it (<root>/fdrollout-stream-retired.<port>.<pid>.<n>),
/// "spare" while its bucket files wait to be recycled (fdrollout-stream-spare.<port>.<pid>.<n>).
std::filesystem::path staging_name(const std::filesystem::path & dir, std::string_view kind);

/// The staging root: `root` when set, else /dev/shm when it is a writable dir, else the temp dir.
std::filesystem::path staging_root(const std::filesystem::path & root);

/// Remove <root>/fdrollout-stream.<port>.<pid>.*, fdrollout-stream-retired.<port>.<pid>.* and
/// fdrollout-stream-spare.<port>.<pid>.* dirs owned by this user whose pid is not alive (left by
/// a daemon that was killed). Never throws.
void remove_stale_dirs(const std::filesystem::path & root, int32_t port);

}  // namespace fd::stream
