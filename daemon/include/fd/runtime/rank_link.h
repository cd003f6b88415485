// fd/runtime/rank_link.h — the link between the daemon and one rank process (the step link of
// the multi-process executor).
//
// Two channels, both created by the daemon before it spawns the rank and inherited by it only
// (a rank on another host, --nnodes > 1, has a TCP connection instead and no region: see below):
//   - a SOCK_SEQPACKET socketpair carrying fixed-size LinkMsg records: one request, one reply,
//     in order. It is the wake-up (a blocking read, no spinning) and the liveness signal: a dead
//     rank's end closes and the daemon's read returns at once. While a rank works on a request
//     it also sends `beat` records (from a thread of its own, every --rank-heartbeat-s / 10, all
//     before its reply, none while idle), each carrying the seconds since its main loop last
//     progressed: no beat for --rank-heartbeat-s is a stopped rank (or an unreachable node), a
//     beat at or over --rank-stuck-s a stuck one; both fail it (fd/runtime/mp_executor.h).
//   - tensor-parallel over shared memory (--dist-backend shm): each comm-group generation's
//     segment is a memfd too, passed to the rank as SCM_RIGHTS ancillary data on the link (with
//     the config blob at start-up, with the comm_connect request on a rebuild): nothing named,
//     nothing left in /dev/shm, not even by a daemon killed with SIGKILL.
//   - one shared region (a memfd: it has no name, so no other local user can open or forge it;
//     only holders of the fd map it) holding the step batch the daemon writes and the logits
//     rank 0 writes back. It grows (never shrinks) when a step needs more; the request carries
//     its size and the rank re-maps when it changed. Steady-state steps allocate nothing.
//
// Region layout (offsets in bytes, each array 64-byte aligned, computed by step_layout()):
//   RegionHeader
//   tokens      [n_tokens]  i32
//   positions   [n_tokens]  i32
//   slots       [n_tokens]  i64
//   q_table     [n_tokens]  i32   offset of the token's block table in `tables`
//   q_ctx       [n_tokens]  i32   context length the token attends to
//   logits_rows [n_logits]  i32
//   tables      [n_tables]  i32   block ids, one run per sequence
//   logits      [n_logits, vocab] f32   (written by rank 0)
//   routes      [n_tokens, route_cols] i32  (R3: written by rank 0 when the step wants its routes;
//               route_cols = model::route_cols, 0 = none)
// A remote rank's link is a TCP stream (fd/runtime/node_join.h): the same LinkMsg records, read
// whole; the config is length-prefixed; a forward request carries the step's arrays inline (the
// region's bytes up to `logits`, LinkMsg::bytes of them) right after it, read into a buffer that
// only grows. Rank 0 is always on node 0, so logits never cross TCP.
// A swap_kv request uses the same region (between steps) for its block lists:
//   RegionHeader, then out [n_swap_out] BlockCopy, then in [n_swap_in] BlockCopy (64-byte aligned);
//   the last n_swap_bg of out are the background copies (Executor::swap_kv's `bg`)
// A draft_mtp request (--speculative-config method "mtp", after a step's logits were read) uses it
// for the MTP draft batch and rank 0's drafts (daemon/src/runtime/draft_wire.h); a rank on another
// node gets the batch inline (LinkMsg::bytes), as a step's arrays.
// Single-threaded on each side (the engine thread; the rank's main thread).
#pragma once

#include "fd/model/worker.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <sys/types.h>
#include <utility>
#include <type_traits>
#include <vector>

namespace fd::runtime {

enum class LinkOp : uint32_t {
    config = 1,        ///< daemon → rank: JSON config follows in the same message's tail (first message)
    ready,             ///< rank → daemon: worker built, group connected
    forward,
    rank_call,         ///< a row of the rank-call table (fd/runtime/rank_call.h): rank_op, its fields; reply: the RankReport
    comm_connect,
    comm_disconnect,
    shutdown,
    swap_kv,           ///< run the KV block copies listed in the region (n_swap_out, n_swap_in)
    probe,             ///< the link's own cost: region_bytes > 0 → decode the step in the region; no model run
    beat,              ///< rank → daemon, unasked: the rank's heartbeat while it works on request `seq` (below)
    draft_mtp,         ///< run Worker::draft_mtp on the draft batch in the region; rank 0 writes the drafts after it
};

/// Reply status besides an Errc: the step was dropped because `abandon` turned true.
inline constexpr int32_t kLinkAbandoned = -1;

/// One request or reply (fixed size: the socket never carries anything else after config).
struct LinkMsg {
    uint32_t op     = 0;          ///< LinkOp
    int32_t  status = 0;          ///< reply: 0 ok, an Errc value, or kLinkAbandoned
    uint64_t seq    = 0;          ///< request number; the reply echoes it
    uint64_t region_bytes = 0;    ///< forward: current size of the shared region
    int64_t  generation = 0;      ///< comm_connect: the group's generation
    int32_t  rank = 0;            ///< reply: the answering rank
    uint8_t  verify_checksum = 0, wakeup = 0, has_version = 0, has_reply_version = 0;
    uint8_t  checksum_verified = 0, comm_connected = 0, pad_[2] = {};
    int64_t  bytes = 0, freed_bytes = -1, rss_bytes = 0, weight_bytes = 0, kv_bytes = 0;
    double   fetch_s = 0.0, stage_s = 0.0, commit_s = 0.0;
    char     version[136] = {};          ///< request: asked-for version; reply: the version fetched
    char     serving_version[136] = {};  ///< request: the version now served
    char     serving_source_version[136] = {};  ///< request (wakeup): the source's own version of it ("" = serving_version)
    char     text[512] = {};             ///< reply: error message (truncated)
    int64_t  n_swap_out = 0, n_swap_in = 0;  ///< swap_kv: block copies in the region
    int64_t  n_swap_bg = 0;                  ///< swap_kv: how many of the out list's LAST copies run in the background
    // Every control reply (not forward's) of a CUDA rank: its device and memory now (RankDevice).
    int32_t  device_id = -1;                 ///< reply: the rank's CUDA device; -1: a CPU rank (no fields below)
    int32_t  pad2_ = 0;
    int64_t  device_free_bytes = 0, device_total_bytes = 0;  ///< cudaMemGetInfo
    int64_t  held_bytes[4] = {};             ///< the rank allocator's bytes by memory::Tag
    int64_t  device_freed_bytes = -1;        ///< release reply: growth of device_free_bytes across the release
    int64_t  nccl_comms_live = 0, nccl_comms_created = 0;  ///< the rank process's nccl_comm_counts()
    char     fingerprint[72] = {};           ///< stage/reload reply: the fetched checkpoint's fingerprint (64 hex or "")
    char     weight_dir[1024] = {};          ///< stage request: FetchRequest::weight_dir ("" = the source)
    uint8_t  weight_dir_owned = 1;
    uint8_t  tag = 0;                        ///< rank_call request: RankRequest::tag (memory::Tag)
    uint8_t  pad3_[2] = {};
    uint32_t rank_op = 0;                    ///< rank_call request: RankOp
    /// rank_call reply: bytes of RankReport::detail that follow the reply (send_payload; at most
    /// kRankDetailMaxBytes), 0: none.
    int64_t  detail_bytes = 0;
    double   since_progress_s = 0.0;         ///< beat: seconds since the rank's main loop last progressed (fd/liveness.h)
    int64_t  mtp_cache_bytes = 0;            ///< every reply: bytes of the rank's MTP cache (Worker::mtp_cache_bytes; 0: none or released)
    double   timeout_s = 0.0;                ///< rank_call request: RankRequest::timeout_s
};
static_assert(std::is_trivially_copyable_v<LinkMsg>);

/// Copy `s` into a fixed field, truncated, NUL-terminated.
template <size_t N>
void set_field(char (&dst)[N], const std::string & s) {
    const size_t n = std::min(s.size(), N - 1);
    std::memcpy(dst, s.data(), n);
    dst[n] = '\0';
}

struct RegionHeader {
    std::atomic<bool> abandon{false};  ///< set by the daemon while rank 0 computes: drop the step
    int32_t n_tokens = 0, n_logits = 0, n_tables = 0, vocab = 0;
    int32_t route_cols = 0;  ///< > 0: the step wants its routed experts (StepBatch::want_routes), this many per token
};

/// Byte offsets of one step's arrays in the region.
struct StepLayout {
    int64_t tokens = 0, positions = 0, slots = 0, q_table = 0, q_ctx = 0, logits_rows = 0, tables = 0, logits = 0, routes = 0;
    int64_t total_bytes = 0;
};
StepLayout step_layout(int64_t n_tokens, int64_t n_logits, int64_t n_tables, int64_t vocab, int64_t route_cols = 0);

/// Block-table entries `b` needs in the region (one run per sequence, ceil(max n_ctx / block_size)).
int64_t step_tables(const model::StepBatch & b, int32_t block_size);

/// Write `b` into `region` (of `region_bytes`); returns the bytes the step needs. Writes nothing
/// and returns more than region_bytes when it does not fit (grow the region and call again).
/// `route_cols` (model::route_cols of the served model) sizes the routes array when b.want_routes.
int64_t step_encode(void * region, int64_t region_bytes, const model::StepBatch & b, int32_t block_size, int32_t vocab,
                    int32_t route_cols = 0);

/// Rebuild the batch from `region` into `b` (its vectors reused); queries point into the region.
void step_decode(const void * region, model::StepBatch & b);

/// Rank 0's logits in the region. Shapes  [n_logits, vocab] f32.
float * step_logits(void * region);
/// The step's routes array in `region` ([n_tokens, route_cols] i32); nullptr when route_cols is 0.
int32_t * step_routes(void * region);

/// Write a swap_kv request's block lists into `region`; returns the bytes they need (writes
/// nothing and returns more than region_bytes when they do not fit).
int64_t swap_encode(void * region, int64_t region_bytes, const kv::BlockCopy * out, int64_t n_out, const kv::BlockCopy * in,
                    int64_t n_in);
/// The lists swap_encode wrote: [0] out, [1] in.
std::pair<const kv::BlockCopy *, const kv::BlockCopy *> swap_lists(const void * region, int64_t n_out);

/// The most bytes that may follow one request inline on a stream link (a rank on another node:
/// LinkMsg::bytes of a forward or probe step's arrays, or of swap_kv's block lists). A rank
/// refuses a larger length before it allocates anything, and the daemon never sends one. 256 MiB
/// is ~100x the arrays of a 32k-token step of 256 sequences with 2048-block tables each (~3 MiB)
/// and the lists of 8M block copies; the bound is what a peer can make a rank allocate.
inline constexpr int64_t kInlineMaxBytes = int64_t{256} << 20;

/// Check that `n` bytes of a step received inline hold what their header says: non-negative
/// counts whose arrays (step_layout up to the logits, which never travel) fit in `n`.
/// Errors  fd::Error{invalid_argument} naming the counts and `n`.
void check_inline_step(const void * data, int64_t n);

/// Check that `n` bytes received inline hold swap_kv's lists of n_out + n_in block copies.
/// Errors  fd::Error{invalid_argument} naming the counts and `n`.
void check_inline_swap(int64_t n, int64_t n_out, int64_t n_in);

/// The daemon's or the rank's end of a SOCK_SEQPACKET link.
class LinkSocket {
public:
    LinkSocket() = default;
    /// Takes `fd`; a SOCK_STREAM socket (TCP) makes this a stream link.
    explicit LinkSocket(int fd);
    ~LinkSocket();
    LinkSocket(LinkSocket && o) noexcept;
    LinkSocket & operator=(LinkSocket && o) noexcept;

    int fd() const { return fd_; }
    bool open() const { return fd_ >= 0; }
    bool stream() const { return stream_; }
    void close();

    /// Send one message (EPIPE etc. → false: the peer is gone). `pass_fd` >= 0: a copy of that
    /// descriptor travels with the record (SCM_RIGHTS; seqpacket links only: a stream link
    /// refuses it and returns false); the receiver collects it with take_fd().
    enum class Recv { ok, closed, timeout };
    bool send(const LinkMsg & m, int pass_fd = -1);
    /// A heartbeat: a seqpacket link never blocks (a full buffer drops the beat: the daemon is not
    /// reading); a stream link sends whole, bounded by the socket's send timeout.
    bool send_beat(const LinkMsg & m);
    /// Send `n` raw bytes (a stream link: all of them, in order; a seqpacket link: one record).
    bool send_bytes(const void * data, size_t n, int pass_fd = -1);
    /// Send `n` bytes that the peer reads with recv_payload(n) (a seqpacket link: records of at
    /// most kPayloadChunk bytes; a stream link: the bytes in order).
    static constexpr size_t kPayloadChunk = 64 << 10;
    bool send_payload(const void * data, size_t n);
    /// Read the `n` bytes send_payload sent, until `deadline` (a seqpacket record of another size:
    /// closed, the link is out of step).
    Recv recv_payload(void * data, size_t n, std::chrono::steady_clock::time_point deadline);
    /// Send one configuration blob (a stream link prefixes its length, u32).
    bool send_blob(const void * data, size_t n, int pass_fd = -1);
    /// The descriptor that came with the last record received (close-on-exec; the caller owns it),
    /// or -1. A record received later replaces (and closes) one not taken.
    int take_fd();
    /// Stream links: read exactly `n` bytes until `deadline`.
    Recv recv_exact(void * data, size_t n, std::chrono::steady_clock::time_point deadline);
    /// Wait until `deadline` for one message. `poll_slice` > 0: wake at least that often and call
    /// `on_slice` (the daemon checks the engine's abandon flag there).
    Recv recv(LinkMsg & m, std::chrono::steady_clock::time_point deadline,
              std::chrono::milliseconds poll_slice = std::chrono::milliseconds(0), const std::function<void()> & on_slice = {});
    /// Seqpacket links: read one message that poll() reported readable, without waiting
    /// (timeout: nothing there after all).
    Recv try_recv(LinkMsg & m);
    /// Receive one blob of any size up to `cap` bytes (send_blob's; blocking). Returns bytes, 0 on close.
    int64_t recv_bytes(void * data, size_t cap);
    /// True when the peer has closed its end (or sent something unasked); never blocks. For a
    /// link that must be silent (a parked join before its configuration).
    bool peer_closed() const;
    /// True when the peer has closed its end (or the socket failed); never blocks. Records
    /// waiting to be read do not count: a survivor's late reply or a beat after a call gave up
    /// on it (MpExecutor::gather's survivor grace) is no sign of a dead rank.
    bool hung_up() const;

private:
    /// One seqpacket record into `data` (at most `cap` bytes), keeping a passed descriptor.
    ssize_t recv_record(void * data, size_t cap, int flags);
    int  fd_ = -1;
    bool stream_ = false;
    int  received_fd_ = -1;
};

/// A rank on a stream link: receive the m.bytes that follow request `m` into `buf` (grown, never
/// shrunk; 8-byte aligned) until `deadline`. Returns as LinkSocket::recv_exact.
/// Errors  fd::Error{invalid_argument} when m.bytes is negative or above kInlineMaxBytes: nothing
///         is read or allocated, and the link is out of step from there (the caller closes it).
LinkSocket::Recv recv_inline(LinkSocket & link, const LinkMsg & m, std::vector<int64_t> & buf,
                             std::chrono::steady_clock::time_point deadline);

/// Start `binary --fd-rank-process 3 <4|-1> <this pid>` with `link_fd` as its fd 3 and
/// `region_fd` (or none: -1) as fd 4, default signal dispositions and an empty signal mask.
/// Returns the pid. Errors  fd::Error{rank_failed} when the kernel refuses.
pid_t spawn_rank_process(const std::string & binary, int link_fd, int region_fd);

/// A socketpair for one rank: [0] the daemon's end, [1] the rank's (both close-on-exec).
/// Errors  fd::Error{internal} when the kernel refuses.
std::pair<LinkSocket, LinkSocket> make_link_pair();

/// A shared region: a memfd of `bytes`, mapped read-write. Owned by the daemon; the rank maps the
/// same fd. Errors  fd::Error{internal} when the kernel refuses.
class SharedRegion {
public:
    SharedRegion() = default;
    ~SharedRegion();
    SharedRegion(const SharedRegion &) = delete;
    SharedRegion & operator=(const SharedRegion &) = delete;

    /// Daemon: a new memfd of `bytes` (close-on-exec; spawn hands a copy to the rank).
    void create(int64_t bytes);
    /// Rank: map the inherited `fd` with its current size.
    void attach(int fd);
    /// Daemon: grow to at least `bytes` (ftruncate + re-map). Rank: re-map to the fd's size.
    void resize(int64_t bytes);
    void remap();

    void * data() const { return data_; }
    int64_t bytes() const { return bytes_; }
    int fd() const { return fd_; }

private:
    void map(int64_t bytes);
    int     fd_ = -1;
    void *  data_ = nullptr;
    int64_t bytes_ = 0;
};

}  // namespace fd::runtime
