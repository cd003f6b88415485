// fd/comm/comm.h — collectives between the tensor-parallel ranks (ARCHITECTURE.md seam 2).
//
// Ranks all-reduce (sum) the partial outputs of the row-parallel linears (o_proj, down_proj)
// through a Comm. Implementations: NullComm (tp=1: nothing to reduce), GlooComm (CPU, Gloo's
// TCP transport), ShmComm (CPU, ranks on one host: a shared-memory segment), NcclComm (CUDA
// builds; device pointers). A Comm can be torn down and rebuilt (`--shutdown-comm-group-if-
// worker-idle`: sleep closes its sockets / unmaps its segment, wakeup reconnects), each build a
// new "generation" of the group, rendezvousing through a TcpStore the master hosts (Gloo, NCCL)
// or a memfd segment the daemon creates per generation and hands to its ranks (shm).
//
// Determinism (Gloo): all_reduce_sum gathers every rank's buffer and each rank sums element i
// in rank order 0, 1, ..., T-1, so the result is bitwise the same on every rank and does not
// depend on the buffer's length or on where element i sits in it (a ring all-reduce's chunking
// would make the order depend on the batch for T > 2); batch invariance holds within one tp
// size. NCCL's all-reduce makes no such promise (ring/tree chunking depends on the length), so
// outputs at tp > 1 over nccl match tp = 1 within f32 rounding, not bitwise.
//
// On a device backend (CUDA) the data pointers are device memory. NcclComm enqueues every
// collective on the backend's stream (use_backend), in op order and without a host wait; Gloo and
// shm run on host memory, so on a device backend they are wrapped in make_staged_comm, which
// copies through pinned host buffers (Backend::download / upload) around each collective: the
// path of ranks that share a device (NCCL refuses two ranks on one device) and of --nnodes > 1.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace fd::kernels {
class Backend;
}

namespace fd::comm {

class TcpStoreClient;

class Comm {
public:
    virtual ~Comm() = default;
    virtual const char * name() const = 0;   ///< "null" | "gloo" | "shm" | "nccl"
    virtual int32_t rank() const = 0;
    virtual int32_t world_size() const = 0;
    /// True while the group's connections are up (between connect() and disconnect()).
    virtual bool connected() const = 0;

    /// Join the group: rendezvous under `generation` (a fresh number per rebuild) and connect to
    /// every other rank. Errors  fd::Error{rank_failed} naming the ranks that did not join within
    /// the comm's timeout; fd::Error{invalid_argument} when the local address cannot be bound.
    virtual void connect(int64_t generation) = 0;
    /// Close every connection of the group (sockets released). Idempotent.
    virtual void disconnect() = 0;

    /// In place: data[i] = sum over ranks of data[i] on that rank.
    /// Shapes  data [n] f32 (host memory for gloo, device memory for nccl).
    /// Errors  fd::Error{rank_failed} when a peer is gone or silent past the timeout.
    virtual void all_reduce_sum(float * data, int64_t n) = 0;
    /// Rank 0 receives every rank's `send`, stacked in rank order.
    /// Shapes  send [n] f32 on every rank; recv [world_size, n] f32 on rank 0 (not touched on
    ///         the others, may be nullptr there). Host memory for gloo, device memory for nccl.
    /// Errors  as all_reduce_sum.
    virtual void gather(const float * send, int64_t n, float * recv) = 0;
    /// Every rank receives every rank's `send`, stacked in rank order: expert parallelism's
    /// combine (fd/model/moe_ep.h). Bytes are copied, never summed, so the result is bitwise the
    /// same on every rank and for every backend.
    /// Shapes  send [n] f32 on every rank (the same n everywhere); recv [world_size, n] f32 on
    ///         every rank. Host memory for gloo / shm, device memory for nccl.
    /// Errors  as all_reduce_sum; fd::Error{internal} from a Comm that does not implement it.
    virtual void all_gather(const float * send, int64_t n, float * recv);
    /// Every rank reaches this point. Errors  as all_reduce_sum.
    virtual void barrier() = 0;
    /// The backend whose memory the collectives' pointers are (the rank's Worker's; it outlives
    /// this Comm's use). NcclComm issues on its native_stream(); a staged comm copies through
    /// host buffers when its memory is not host-visible; the host comms ignore it. Kept across
    /// connect()/disconnect(). Default: ignored.
    virtual void use_backend(kernels::Backend * backend) { (void)backend; }
};

/// tp=1: rank 0 of 1, every collective a no-op, always connected.
std::unique_ptr<Comm> make_null_comm();

struct GlooCommConfig {
    int32_t     rank       = 0;
    int32_t     world_size = 1;
    std::string bind_host  = "127.0.0.1";  ///< this rank's address for Gloo's TCP pairs (this node's)
    std::string store_host = "127.0.0.1";  ///< --master-addr: where the TcpStore listens
    int32_t     store_port = 0;            ///< --master-port
    std::string store_token;               ///< what the store asks of every client (TcpStoreServer); empty = none
    double      timeout_s  = 30.0;         ///< rendezvous and per-collective limit
};

/// Gloo over TCP. Not connected until connect().
std::unique_ptr<Comm> make_gloo_comm(const GlooCommConfig & cfg);

/// Ranks on one host: an all-reduce through a shared-memory segment (ShmComm).
/// Segment of generation g: an anonymous memfd (no name: nothing in /dev/shm, nothing another
/// process can open, nothing a killed daemon can leave behind) that the daemon creates per
/// generation (ShmCommSegment: 0600, sized, header written, then sealed against resizing) and
/// hands to each local rank process over its link (SCM_RIGHTS, fd/runtime/rank_link.h). A rank
/// maps it only when it is this user's 0600 memfd, sealed, of the expected size, with the magic,
/// world size, slot size and generation it expects. Layout: a header, one 64-byte line per rank
/// with its arrival counter, then two sets (alternating by call) of `world_size` slots of
/// kShmCommSlotFloats f32 each.
/// Every collective call k: each rank copies its (chunk of the) input into its slot of set k % 2,
/// publishes k in its counter (release), waits until every counter reached k (spin, then a futex
/// wait, bounded by timeout_s), then reads. Arriving at call k means a rank has finished reading
/// call k-1, so the alternate set is free again: one wait per call. all_reduce_sum sums element i
/// in rank order 0, 1, ..., T-1 starting from rank 0's value, exactly as GlooComm does, so results
/// are bitwise the same as Gloo's on every rank. Inputs longer than a slot run in slot-sized
/// chunks (element-wise: the order per element is unchanged).
struct ShmCommConfig {
    int32_t     rank        = 0;
    int32_t     world_size  = 1;
    /// connect(generation) calls it for that generation's segment: a descriptor ShmComm takes
    /// over (and closes once mapped), or -1 when none arrived (→ rank_failed).
    std::function<int(int64_t generation)> segment_fd;
    double      timeout_s   = 30.0;    ///< per-collective limit (a peer not arriving → rank_failed)
    /// Test hook (empty in the daemon): called with the peer's rank each time a wait has seen
    /// that peer not yet arrived and is about to check whether its process exited.
    std::function<void(int32_t peer)> before_exit_check;
};
/// f32 elements per rank slot (1 MiB).
inline constexpr int64_t kShmCommSlotFloats = int64_t{1} << 18;
/// Bytes of a segment for `world_size` ranks.
int64_t shm_comm_segment_bytes(int32_t world_size);

/// Not connected until connect(generation), which maps the segment cfg.segment_fd(generation)
/// hands over (Errors  rank_failed when there is none, or it is not this user's sealed 0600
/// memfd of the expected size, magic, world size and generation); disconnect() unmaps it.
std::unique_ptr<Comm> make_shm_comm(const ShmCommConfig & cfg);

/// The daemon's side of a ShmComm generation: a fresh memfd segment (zeroed, 0600, header
/// written, sealed against shrinking and growing). Hand fd() to each rank; the memory goes when
/// the last mapping and descriptor do. Errors  fd::Error{internal} when the kernel refuses.
class ShmCommSegment {
public:
    ShmCommSegment() = default;
    ShmCommSegment(int32_t world_size, int64_t generation);
    ~ShmCommSegment();
    ShmCommSegment(ShmCommSegment && o) noexcept;
    ShmCommSegment & operator=(ShmCommSegment && o) noexcept;
    /// The memfd (close-on-exec), or -1 for an empty holder.
    int fd() const { return fd_; }
    /// Close the daemon's descriptor (ranks' mappings stay valid). Idempotent.
    void close();

private:
    int fd_ = -1;
};

/// NCCL (CUDA builds only: throws fd::Error{invalid_argument} otherwise) on CUDA device `device`
/// (one rank per device: NCCL refuses two ranks of a group on one device, "Duplicate GPU").
/// connect(g): rank 0 takes a fresh ncclUniqueId and publishes it in the TcpStore under
/// "gen<g>/nccl_id" (bind_host unused); the others read it there (cfg.timeout_s), then
/// ncclCommInitRank. disconnect(): ncclCommDestroy. Collectives take device pointers and are
/// enqueued on the stream of use_backend()'s backend without a host wait (before use_backend:
/// the legacy default stream, synchronized); barrier() waits for its stream.
/// Errors  rank_failed on any NCCL error (the message carries ncclGetErrorString) or an id that
/// did not arrive within cfg.timeout_s; invalid_argument when the device cannot be used.
std::unique_ptr<Comm> make_nccl_comm(const GlooCommConfig & cfg, int32_t device);

/// NCCL communicators of this process: alive now and created since start (both 0 in a build
/// without CUDA). Tests prove that sleep destroys the group and wakeup builds a new one.
struct NcclCommCounts {
    int64_t live  = 0;
    int64_t inits = 0;
};
NcclCommCounts nccl_comm_counts();

/// A host comm (gloo, shm) for ranks whose backend memory is device memory: every collective
/// downloads its input into a pinned host buffer (Backend::download, which waits for the ops
/// before it), runs `host`'s collective there and uploads the result (Backend::upload, which
/// waits for the copy), so sums are `host`'s, bitwise. With a host-visible backend (CPU) it is
/// `host` itself, unless `always_stage` (the FD_TEST_STAGED_FILL test hook: the copies then go
/// through the CPU backend's download/upload, proving the staging on a machine without a GPU).
/// name(), connect() and disconnect() are `host`'s. Buffers grow to the largest collective and
/// are freed with the comm.
std::unique_ptr<Comm> make_staged_comm(std::unique_ptr<Comm> host, bool always_stage = false);

}  // namespace fd::comm
