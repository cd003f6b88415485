// fd/model/worker.h — one tensor-parallel rank: owns its shard of the weights, its KV pool and
// the forward pass.
//
// Rank r of T (WorkerConfig rank / tp_size) holds the slices fd/model/weights.h's layout gives it
// (plan_layout: q|k|v and gate|up by heads / rows, o_proj and down_proj by columns, embed_tokens
// and lm_head by vocab rows, norms whole). Its forward pass runs the same ops on those slices
// and meets the other ranks through the Comm:
//   embedding   vocab parallel: a token outside the rank's vocab rows embeds as zeros, then
//               all_reduce_sum (exact: every other rank adds zeros)
//   o_proj, down_proj   row parallel: partial sums, then all_reduce_sum before the residual add
//   lm_head     column parallel: each rank's [n_logits, vocab/T] gathered to rank 0
// With tp_size 1 (comm nullptr or world 1) none of this runs: today's path, same speed.
// A Worker is used by one thread only (the engine thread, or the rank process's step loop).
//
// The forward pass (daemon/src/model/forward.cpp) runs every op through the rank's Backend
// (WorkerConfig::device; CPU: kernels/cpu on a pool of n_threads). Weights, the update staging
// copy and the KV pool are regions of the tagged allocator (fd/memory/allocator.h) of the same
// device: sleeping a tag is releasing its region, waking it reacquiring it.
//
// KV pool layout (per layer, one kv_cache region for all layers), this rank's heads only:
//   k [n_layers][n_blocks, n_kv_heads / tp_size, head_dim, block_size]  f32 (transposed per block)
//   v [n_layers][n_blocks, block_size, n_kv_heads / tp_size, head_dim]  f32
// Host swap pool (--swap-space; the kv_swap region), one block after another, this rank's heads,
// each block copied whole (layout-agnostic):
//   [n_swap_blocks][n_layers][k | v][block_size * n_kv_heads / tp_size * head_dim]  kv_dtype
// followed in each block, with MTP drafts, by the MTP cache's [k | v][block_size * kv_dim / tp] f32.
#pragma once

#include "fd/arena.h"
#include "fd/kernels/backend.h"
#include "fd/kv/block_copy.h"
#include "fd/model/kv_copier.h"
#include "fd/memory/allocator.h"
#include "fd/checkpoint/model_config.h"
#include "fd/model/weights.h"
#include "fd/stream/landing.h"
#include "fd/weights/delta_pieces.h"
#include "fd/weights/rank_delta.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fd::comm {
class Comm;
}

namespace fd::stream { class Landing; }

namespace fd::model {

/// One forward step over a flat batch of tokens from any number of sequences.
struct StepBatch {
    std::vector<int32_t>            tokens;       ///< [n_tokens] input ids
    std::vector<int32_t>            positions;    ///< [n_tokens] position of each token in its sequence
    std::vector<int64_t>            slots;        ///< [n_tokens] KV slot each token writes
    std::vector<kernels::AttnQuery> queries;      ///< [n_tokens] context each token attends to (incl. itself)
    std::vector<int32_t>            logits_rows;  ///< [n_logits] token rows whose logits are wanted
    /// Record every token's routed experts (R3, --enable-return-routed-experts): rank 0 keeps
    /// them for Worker::step_routes(). MoE models only; false costs nothing.
    bool                            want_routes = false;

    void clear() { tokens.clear(); positions.clear(); slots.clear(); queries.clear(); logits_rows.clear(); want_routes = false; }
    int64_t n_tokens() const { return static_cast<int64_t>(tokens.size()); }
};

/// The MTP draft work of one step (--speculative-config method "mtp"; mtp_forward.cpp), run
/// right after the forward() whose hidden states it reads. MTP layer 0 (vLLM mimo_mtp.py) at
/// position p reads the target's final-normed hidden state h_p and the embedding of token p + 1
/// and predicts token p + 2; its K/V go to the MTP cache at the target's slot of p.
///   catch-up rows: every position of the step whose next token is known and kept (prompt rows,
///                  the decode row, accepted draft rows): the MTP cache follows the sequence;
///   chains:        for a sequence about to decode, its last catch-up row gives draft 1 (argmax
///                  of the shared lm_head); draft j + 1 comes from the layer run again at the next
///                  position on (its own output, draft j) — vLLM's reuse of one MTP layer for k.
/// A chain position past the sequence's KV blocks writes into worker-private scratch blocks
/// (WorkerConfig::mtp_scratch_blocks) that the next step's catch-up overwrites in real ones.
struct DraftBatch {
    std::vector<int32_t>            hidden_rows;  ///< [n] row of the last forward whose hidden state feeds row i
    std::vector<int32_t>            tokens;       ///< [n] token at position + 1 (its embedding)
    std::vector<int32_t>            positions;    ///< [n]
    std::vector<int64_t>            slots;        ///< [n] the position's KV slot (MTP cache: same block ids)
    std::vector<kernels::AttnQuery> queries;      ///< [n] context in the MTP cache (incl. itself)
    struct Chain {
        int32_t         row = 0;                  ///< catch-up row giving draft 1
        int32_t         k   = 0;                  ///< drafts wanted, >= 1
        const int32_t * block_table = nullptr;    ///< the sequence's KV blocks
        int32_t         n_table_blocks = 0;
    };
    std::vector<Chain>              chains;

    void clear() { hidden_rows.clear(); tokens.clear(); positions.clear(); slots.clear(); queries.clear(); chains.clear(); }
};

/// Columns of one token's routed experts (R3): one run of top_k expert ids per sparse MoE
/// layer, in layer order (dense layers from mlp_only_layers / decoder_sparse_step have none):
/// n_moe_layers * top_k; 0 on a dense model.
int32_t route_cols(const ModelConfig & cfg);

struct WorkerConfig {
    int32_t rank       = 0;    ///< this rank, in [0, tp_size)
    int32_t tp_size    = 1;    ///< tensor-parallel ranks (must divide heads, kv heads, intermediate, vocab)
    /// Expert-parallel size (--enable-expert-parallel: tp_size; 1 = TP-MoE). > 1: this rank holds
    /// experts [r*E/ep, (r+1)*E/ep) whole (fd/model/moe_ep.h); needs a MoE model with ep | E.
    int32_t ep_size    = 1;
    kernels::DeviceKind device = kernels::DeviceKind::cpu;  ///< the backend the forward pass runs on
    int32_t device_id  = 0;    ///< CUDA: the device ordinal this rank uses
    /// CUDA: false = --no-batch-invariant (see kernels::BackendConfig); CPU: no effect.
    bool    batch_invariant = true;
    /// The linears' arithmetic (--compute-dtype; kernels::BackendConfig::compute). CPU only.
    kernels::ComputeType compute = kernels::ComputeType::f32;
    /// > 0: size every activation buffer for a step of this many tokens (and as many logits rows)
    /// at construction, so forward() never reallocates them and their addresses never change
    /// (what captured CUDA graphs need: --use-cudagraph sets it to --max-num-batched-tokens).
    /// A larger step still works (the buffers grow, addresses move). 0 = grow on demand.
    int64_t reserve_tokens = 0;
    /// > 0 (--use-cudagraph on cuda: --max-num-seqs): decode steps of up to this many rows run
    /// as CUDA graphs, one per batch-size bucket (fd/model/graph_plan.h), all captured at
    /// construction (as vLLM does) and replayed with each step's indices uploaded first; the
    /// activation buffers are reserved for max(reserve_tokens, this), the KV pool gets one more
    /// block (the padding rows' scratch slot), and commit_staged() copies staging into the
    /// weights instead of swapping regions, so every captured address stays valid across
    /// sleep/wakeup and update_weights. tp_size > 1 and MoE models ignore it (the collectives
    /// and the host-side routing are not captured). TEST ONLY on a backend without graphs (CPU): the same padded steps run eagerly.
    int32_t graph_max_batch = 0;
    /// TEST ONLY: run the device-memory paths on a host-visible backend (CPU): weights filled
    /// through bounce buffers and upload(), norms uploaded, logits downloaded. Results must be
    /// bitwise those of the direct path. The daemon sets it from the environment FD_TEST_STAGED_FILL=1.
    bool    test_device_paths = false;
    int32_t n_threads  = 1;    ///< CPU threads for the kernels (per rank)
    int32_t block_size = 16;   ///< tokens per KV block
    int64_t n_blocks   = 0;    ///< KV blocks to allocate
    int64_t n_swap_blocks = 0; ///< host swap pool blocks (--swap-space); 0 = none
    /// --kv-cache-dtype: the element type of the KV pool and of the host swap pool (the same
    /// bytes per block, so swaps and tier copies are byte copies): f32, or bf16 (half the bytes
    /// per token; K/V rounded to nearest even when stored, widened exactly when attention reads).
    kernels::WType kv_dtype = kernels::WType::f32;
    int32_t max_model_len = 0; ///< positions the RoPE table covers
    /// Keep update_weights' staging region resident between updates (the previous weights' region
    /// becomes the next staging area): updates then copy at memory bandwidth, at the cost of a
    /// second copy of the weights in RSS while awake. false: map it per update, unmap after.
    bool    keep_update_staging = true;
    /// > 0 (--speculative-config method "mtp"): the model's MTP layer 0 drafts (draft_mtp):
    /// forward() keeps every row's final-normed hidden state and the MTP cache (Tag::mtp_cache,
    /// one layer's K/V over n_blocks + mtp_scratch_blocks blocks) is mapped. 0 = off.
    int32_t mtp_draft_tokens = 0;
    /// Scratch blocks for draft chains that run past a sequence's blocks (max_num_seqs *
    /// (ceil(k / block_size) + 1) covers every chain of a step).
    int64_t mtp_scratch_blocks = 0;
    /// Refuse weights holding NaN/Inf at load, wakeup and update (checked during the copy).
    bool    check_finite_weights = true;
    /// > 0: a weight fill (load, wakeup, update) reads no new piece after this many seconds and
    /// fails with timeout (a hung file system); 0 = no limit.
    double  io_timeout_s = 0.0;
    /// TEST ONLY (the rank process sets it under FD_TEST_PAUSE_AT=ep_dispatch:<rank>:<file>):
    /// called on an expert-parallel rank before each MoE layer's dispatch, so a test can kill the
    /// rank while its peers wait in the combine's all-gather. Empty: nothing.
    std::function<void()> test_ep_dispatch_hook;
};

class Worker {
public:
    /// Load rank wcfg.rank's shard of the weights of `cfg` from `idx` and allocate its KV pool.
    /// `idx` is either a full Hugging Face checkpoint (only this rank's slices are read; column
    /// slices row by row) or this rank's own state dict in inference names (an ipc_snapshot
    /// tp<rank> file, an ipc record: RolloutModel::state_dict(rank) shapes).
    /// `comm` (not owned; must outlive the Worker) joins the ranks' collectives; required when
    /// tp_size > 1 (connected before the first forward, world_size == tp_size, rank == rank);
    /// nullptr at tp_size 1.
    /// Errors  fd::Error{invalid_argument} when tp_size < 1, rank is outside [0, tp_size), the
    ///         comm does not match, or tp_size does not divide num_attention_heads,
    ///         num_key_value_heads, intermediate_size or vocab_size (the message names it);
    ///         fd::Error{invalid_checkpoint} from loading (incl. a NaN/Inf weight, named).
    Worker(const ModelConfig & cfg, const TensorIndex & idx, const WorkerConfig & wcfg, comm::Comm * comm = nullptr);
    ~Worker();
    Worker(const Worker &) = delete;
    Worker & operator=(const Worker &) = delete;

    /// Run the model on `batch`; rank 0 writes the logits of batch.logits_rows. Every rank must
    /// call it with the same batch (the collectives pair up step by step).
    /// Shapes  logits [n_logits, vocab] f32, written on rank 0 (full vocab, gathered); other
    ///         ranks leave it untouched (may be nullptr).
    /// Requires every token's slot and attention context to be valid KV blocks.
    /// `abandon` (optional) is checked before each layer: once it reads true the step is dropped
    /// and forward returns false (logits unset; the KV it wrote is rewritten identically when the
    /// step is redone). This bounds how long a control command waits for the step in flight.
    /// With tp_size > 1 every rank must see the same abandon decision (the executor's job),
    /// else the collectives mismatch and fail with rank_failed.
    /// Errors  fd::Error{rank_failed} from the Comm (a peer died or hung).
    bool forward(const StepBatch & batch, float * logits, const std::atomic<bool> * abandon = nullptr);
    /// The routed experts of the last forward() (every rank routes identically; the executor
    /// reads rank 0's). Shapes  [n_tokens, n_moe_layers, top_k] int32 logical expert ids, each
    /// token's top_k in the router's order (descending probability, the lower id first among
    /// equals: kernels::moe_route); route_cols(config()) per token. nullptr when that batch did
    /// not set want_routes or the model is dense. Valid until the next forward().
    const int32_t * step_routes() const { return moe_host_.record ? moe_host_.routes.data() : nullptr; }

    /// Run the MTP work of `db` after forward() (see DraftBatch): write the catch-up rows' MTP
    /// cache, then each chain's k drafts (greedy) into `drafts`, chain after chain.
    /// Shapes  drafts [sum of chains' k] token ids (resized).
    /// Errors  fd::Error{internal} when MTP is off (WorkerConfig::mtp_draft_tokens 0), a row is
    ///         outside the last forward, or the MTP cache is released.
    void draft_mtp(const DraftBatch & db, std::vector<int32_t> & drafts);
    /// Bytes of the MTP cache (0 when off or released).
    int64_t mtp_cache_bytes() const { return alloc_->held_bytes(memory::Tag::mtp_cache); }

    const ModelConfig & config() const { return cfg_; }
    int32_t rank() const { return wcfg_.rank; }
    int32_t tp_size() const { return wcfg_.tp_size; }
    int32_t device_id() const { return wcfg_.device_id; }  ///< CUDA: the device ordinal this rank runs on
    /// Bytes of the live weights (0 while released).
    int64_t weight_bytes() const;
    /// Bytes of the resident staging region (0 unless keep_update_staging and an update ran).
    int64_t staging_bytes() const { return alloc_->held_bytes(memory::Tag::staging); }
    /// The rollout's tensors (inference names, shapes, dtypes, arena offsets, HF parts).
    const WeightLayout & layout() const { return layout_; }
    int64_t kv_bytes() const { return alloc_->held_bytes(memory::Tag::kv_cache); }
    /// True when weights and KV are written and read only through the backend (a device
    /// backend, or test_device_paths).
    bool device_memory() const { return device_mem_; }
    /// Bytes of the activation buffers now (constant across forward() calls once
    /// reserve_tokens covers the steps).
    int64_t scratch_bytes() const;
    /// The rank's backend and tagged allocator (e.g. for the kv_swap tier).
    kernels::Backend & backend() { return *backend_; }
    memory::Allocator & allocator() { return *alloc_; }

    // --- weight control (engine thread, generation paused) ---

    /// Sleep one tag: weight = the weight and staging regions, and with graphs off the step's
    /// activation buffers and kernel scratch (forward() must not run until reload_weights()
    /// succeeds), kv_cache = the KV pool (block contents lost), staging / kv_swap = that region
    /// alone (a staged copy is dropped first; swapped-out KV is lost). Returns the bytes handed
    /// back.
    int64_t release(memory::Tag tag);
    /// Reacquire (and pre-fault) the KV pool's region, and the swap pool's if released, same
    /// geometry (and, with the host allocator, same addresses), zeroed. No-op for what is resident.
    void acquire_kv();

    // --- host swap pool (engine thread; generation between steps) ---

    /// Copy every layer's K and V of device block c.src into host block c.dst, for each c in
    /// order (with MTP drafts, the MTP cache's K and V of the block too: swap_block_bytes).
    /// Block ids must lie in [0, n_blocks) / [0, n_swap_blocks).
    /// Errors  fd::Error{internal} on an id out of range or a released pool (nothing copied).
    void swap_out(const kv::BlockCopy * copies, int64_t n);
    /// Copy host block c.src into device block c.dst (every layer's K and V), for each c in order.
    /// Errors  as swap_out.
    void swap_in(const kv::BlockCopy * copies, int64_t n);
    /// As swap_out, but in the background (fd/model/kv_copier.h: the CUDA copy stream, or the
    /// CPU copy thread): returns once started. Until wait_copies() returned, the caller writes
    /// none of the device blocks read and reads none of the host blocks written (forward() may
    /// run meanwhile: it writes only blocks its batch holds). swap_out, swap_in and release
    /// wait for these copies first.
    /// Errors  as swap_out (nothing started).
    void swap_out_background(const kv::BlockCopy * copies, int64_t n);
    /// Wait until every background copy landed: at most WorkerConfig::io_timeout_s (300 s when 0).
    /// Errors  fd::Error{timeout} naming the batches still in flight (they still land later).
    void wait_copies();
    /// Background copy batches started and not yet landed (0 without a swap pool).
    int64_t copies_in_flight() { return copier_ ? copier_->n_in_flight() : 0; }
    int64_t swap_bytes() const { return alloc_->held_bytes(memory::Tag::kv_swap); }
    /// Load weights into the reacquired region (after release_weights): parallel reads over the pool.
    /// Validates names, shapes and the dtypes first loaded.
    /// Errors  invalid_checkpoint; on failure the weights stay released.
    /// `verify_copied` (optional) runs after the copy and may throw to fail the reload.
    void reload_weights(const TensorIndex & idx, const std::function<void()> & verify_copied = {});

    // Two-phase update (the executor stages on every rank, then commits on every rank, or drops
    // everywhere): nothing live changes before commit_staged().

    /// Phase 1: validate `idx` (names, shapes, dtypes as first loaded) and read every tensor into
    /// the staging region (parallel reads over the pool). Returns the bytes staged. Replaces a
    /// copy staged before and not committed.
    /// Errors  invalid_checkpoint (nothing staged; the live weights keep serving bit-exactly).
    /// `verify_copied` (optional) runs once the staging region is filled; if it throws, the staged
    /// copy is dropped and the error propagates.
    int64_t stage_weights(const TensorIndex & idx, const std::function<void()> & verify_copied = {});
    /// Phase 1 ahead of time, one weight-stream bucket at a time (issue 25: each bucket is
    /// copied while the trainer sends the next, so the finish is mostly the commit). `idx`: the
    /// tensors of one bucket file (HF names; a fused tensor's parts may come in different
    /// buckets), validated as stage_weights validates them, read into the staging region. A
    /// bucket of another directory than the previous call's starts a new copy. stage_weights of
    /// an index whose every tensor was staged this way from the same directory, file (device,
    /// inode), offset and size only validates and marks the copy staged; any other index stages
    /// in full (so a rank that missed a bucket, or restarted, just copies everything).
    /// Nothing live changes. Returns the bytes staged.
    /// Errors  invalid_checkpoint (a name, shape or dtype unlike the layout; a non-finite value):
    ///         the buckets staged so far are forgotten.
    int64_t stage_bucket(const TensorIndex & idx);
    /// Phase 1 by landing (issue 25, fd/stream/landing.h): listen on `host` and start a receiver
    /// thread that writes a trainer's frames straight into the staging region, each part of
    /// layout() once (the trainer sends each rank its own shard; nothing passes through the
    /// daemon or a file). Forward steps go on meanwhile (they never read staging). Anything that
    /// writes, swaps or releases the staging region stops the landing first. Returns
    /// {"rank", "host", "port", "token", "timeout_s", "parts": [[hf_name, offset, nbytes, dtype,
    /// dim, src0, n, hf_shape], ...]} as JSON text. The receiver gives up `timeout_s` from now.
    /// Errors  wrong_state when the weights are device memory (a CUDA rank: land through the
    ///         daemon) or released; invalid_argument when `host` cannot be bound.
    std::string land_open(const std::string & host, double timeout_s);
    /// A delta landing (issue 25; fd/stream/landing.h LandMode::delta): listen as land_open does,
    /// for sparse changes against the live weights, received into this rank's delta buffer
    /// (reserved once, at most delta_buffer_bytes of the parts, kept across updates). Forward steps
    /// go on meanwhile: nothing touches the live weights until land_close. The answer adds
    /// "mode": "delta". Errors  as land_open.
    std::string land_delta_open(const std::string & host, double timeout_s);
    /// Wait (at most `timeout_s`) until every part landed, then mark the copy staged (commit_staged
    /// makes it live). Returns the bytes landed (the parts' sum). Errors  wrong_state (no landing
    /// open); the receiver's error or timeout (Landing::wait): the landing is stopped and nothing
    /// is staged.
    /// A delta landing: wait for its end frame, then write its values in place, keeping the old
    /// ones (the undo log undo_weight_delta uses), between forward steps; returns the elements
    /// written. Errors  as above; a failure part way puts back what this rank wrote.
    int64_t land_close(double timeout_s);
    /// Stop a landing in progress (its partial bytes stay in staging, never live). No-op without one.
    void stop_landing() noexcept;
    /// Write the live weights to `file` as a safetensors file in inference names (this rank's
    /// shards, memory dtypes; the ipc_snapshot form model_state.tp<rank>.safetensors that
    /// reload_weights reads back), with publish::write_safetensors (atomically, mode 0600): the
    /// wakeup source of landed weights, which no other file holds. Returns the bytes written.
    /// Errors  wrong_state (device memory, or the weights released); invalid_argument on a write
    ///         error (nothing left behind).
    int64_t write_snapshot(const std::filesystem::path & file) const;
    /// Phase 2: the staged region goes live (a pointer swap); the previous one becomes the next
    /// update's staging area (or is unmapped with keep_update_staging = false). Cannot fail.
    /// With graph steps (graph_max_batch) the staged bytes are COPIED into the weight region
    /// instead (backend copy, device to device; the weights keep their addresses, so captured
    /// graphs replay the new weights) and staging stays the staging area.
    /// Requires  has_staged().
    void commit_staged();
    /// Forget the staged copy (unmapped unless keep_update_staging). No-op when none.
    void drop_staged();
    bool has_staged() const { return staged_; }

    // In-place sparse update (a delta's commit; fd/weights/weight_delta.h).

    /// Write this rank's share of an rsync or ipc delta (weights::write_rank_share: the bytes of
    /// weights::split_delta with this rank's layout plan: runs of shard elements, values already in
    /// the shard's dtype) into the live weights in place. Everything is checked first (the split's
    /// rank / tp / ep are this rank's; every tensor is in the layout with its dtype and shard
    /// shape; every run inside the shard): nothing is written otherwise. The old bytes of the same
    /// runs are kept (the undo log; `d` is kept as its addresses) until undo_weight_delta(),
    /// forget_weight_delta() or the next apply. Returns the elements written. The bytes equal what
    /// stage_weights of the same full weights gives (the split maps indices as the loader does).
    /// Errors  invalid_checkpoint naming the tensor (nothing written); on a failure while
    ///         writing (a device copy), what was written is put back first.
    int64_t apply_rank_delta(weights::RankDelta && d);
    /// Write this rank's part of a delta in training (HF) names straight from the delta file
    /// every rank shares (a delta stream's weights.fddelta, read by read_hf_delta): the
    /// rank plans its pieces with its own layout (weights::plan_delta_pieces: shapes and dtypes
    /// checked before anything is written) and writes each in place, its indices checked as it
    /// goes (a bad one stops the apply and puts back what was written). The old values go to an
    /// undo buffer kept across updates (its pages are reused: no fresh memory per update) and
    /// `d` is kept until undo_weight_delta(), forget_weight_delta() or the next apply.
    /// Returns the elements written; the bytes equal apply_rank_delta(split_delta(...)) and
    /// what stage_weights of the same full weights gives.
    /// Errors  invalid_checkpoint naming the tensor (what was written is put back first).
    int64_t apply_hf_delta(std::shared_ptr<const weights::MappedWeightDelta> d);
    /// The delta file `file` (a delta stream's weights.fddelta) for apply_hf_delta: read into this
    /// worker's delta buffer (weights::read_weight_delta_into: grown, kept across updates,
    /// released with the weights) when it is at most a quarter of this rank's weight bytes (a 5 %
    /// f32 delta at tp=2 is a fifth); a larger one (dense tensors in the stream: near a full update) is
    /// mapped instead (weights::map_weight_delta), so that no rank keeps a copy that large, and the
    /// buffer is released. Forgets the undo log first (it may point into the buffer).
    /// Errors  as read_weight_delta_into / map_weight_delta.
    std::shared_ptr<const weights::MappedWeightDelta> read_hf_delta(const std::filesystem::path & file);
    /// Put back the values the last apply_rank_delta or apply_hf_delta overwrote and forget them
    /// (no-op without an undo log). Errors  only a device copy failure.
    void undo_weight_delta();
    /// Forget the undo log (the delta it is for stays applied). The rank op runs it before
    /// reading a new delta, so that an undo after a failed read never reverts an older delta.
    /// Keeps the plan's storage (its capacity) for the next delta's plan.
    void forget_weight_delta();
    // --- CUDA graphs (WorkerConfig::graph_max_batch) ---

    /// The batch-size buckets graph steps pad to (empty when graphs are off).
    const std::vector<int32_t> & graph_buckets() const;
    /// Graphs captured so far, recaptures included (a capture counter: replays after sleep/wakeup
    /// or update_weights must not raise it).
    int64_t graph_captures() const;
    /// Forward steps that ran as a graph step (replayed; on a backend without graphs: padded).
    int64_t graph_steps() const;
    /// Sleep tag `cuda_graph` (engine thread, generation paused): destroy the captured graphs and
    /// free what only graph steps need held: the fixed index buffers (Backend::
    /// release_graph_steps) and the activation buffers reserved for --max-num-batched-tokens
    /// (reserve_scratch). Nothing to restore explicitly: the next forward() reserves the
    /// buffers again and each bucket's graph is captured again at its first step (the address
    /// check in GraphState::forward). Returns the bytes handed back; 0 on a backend without graphs
    /// (CPU, whose padded TEST steps keep their buffers) or with graphs off.
    int64_t release_graphs();

    /// Bytes of one KV block across all layers (K and V) on one rank of `tp_size`, elements of
    /// `kv_dtype` (4 bytes f32, 2 bytes bf16): 2 * n_layers * block_size * kv_dim / tp * elem bytes.
    static int64_t kv_block_bytes(const ModelConfig & cfg, int32_t block_size, int32_t tp_size = 1,
                                  kernels::WType kv_dtype = kernels::WType::f32);
    /// Bytes of one block of the MTP cache (--speculative-config method "mtp") on one rank of
    /// `tp_size`: the draft layer's K and V, always f32: 2 * block_size * kv_dim / tp * 4. The KV
    /// budget (--kv-cache-bytes) pays kv_block_bytes + this per block, plus this per scratch block.
    static int64_t mtp_block_bytes(const ModelConfig & cfg, int32_t block_size, int32_t tp_size = 1);
    /// Bytes of one block of the host swap pool (--swap-space): the target's K and V of every
    /// layer (kv_block_bytes), then, with MTP drafts (`mtp`), the MTP cache's K and V of the
    /// block (mtp_block_bytes), so a swapped-out sequence's draft KV comes back with it.
    static int64_t swap_block_bytes(const ModelConfig & cfg, int32_t block_size, int32_t tp_size, kernels::WType kv_dtype,
                                    bool mtp);

private:
    int64_t release_weights();  ///< release(weight); with graphs off, release_activations() too
    /// Free the step's activation buffers (s_) and the backend's kernel scratch
    /// (Backend::release_scratch); the next forward() grows them again. Returns the bytes.
    int64_t release_activations();
    std::array<kernels::ScratchBuffer *, 20> activation_buffers();  ///< every buffer of s_
    int64_t release_kv();       ///< release(kv_cache)
    int64_t release_swap();     ///< release(kv_swap)
    kernels::PagedKv layer_kv(int il);

    void map_kv_pool(bool fresh);
    void map_mtp_cache(bool fresh);
    /// The MTP layer over `n` rows: input hidden `hin` [n, hidden] (final-normed) and tokens,
    /// writing every row's K/V at its slot; out [n_out, hidden] = final_layernorm(block(...)) of
    /// the rows `out_rows` [n_out] (indices into the n rows; n_out < 0 = all n, in order). The other
    /// rows stop after their K/V (no attention, o_proj or MLP): a catch-up row only feeds the MTP
    /// cache. Each output row is bitwise the same whichever rows run beside it (batch-invariant ops).
    void mtp_layer(const float * hin, const int32_t * tokens, const int32_t * positions, const int64_t * slots,
                   const kernels::AttnQuery * queries, int64_t n, float * out, const int32_t * out_rows = nullptr,
                   int64_t n_out = -1);
    /// Greedy token of each of `n` rows of `hid` [n, hidden] through the shared lm_head.
    void mtp_argmax(const float * hid, int64_t n, int32_t * tokens);
    void map_swap_pool(bool fresh);
    /// Bytes of one block in one layer's K (or V) pool (block_size * kv_dim / tp elements of kv_dtype).
    int64_t block_bytes() const {
        return static_cast<int64_t>(wcfg_.block_size) * (cfg_.kv_dim() / wcfg_.tp_size) * kernels::kv_elem_bytes(wcfg_.kv_dtype);
    }
    /// Bytes of one block of the MTP cache's K (or V): block_size * kv_dim / tp f32 (0 without MTP drafts).
    int64_t mtp_half_block_bytes() const {
        return wcfg_.mtp_draft_tokens > 0 ? mtp_block_bytes(cfg_, wcfg_.block_size, wcfg_.tp_size) / 2 : 0;
    }
    /// Bytes of one host swap pool block (swap_block_bytes).
    int64_t host_block_bytes() const { return 2 * cfg_.n_layers * block_bytes() + 2 * mtp_half_block_bytes(); }
    void check_copies(const kv::BlockCopy * copies, int64_t n, bool out) const;
    /// The tag's region, at least `bytes`: reacquired (same addresses) when big enough, else
    /// mapped anew. Resident on return.
    std::byte * region(memory::Tag tag, int64_t bytes, bool populate);
    /// Give `tag` a region for the layout (pre-faulted if asked) and fill it from `idx`.
    void fill_region(memory::Tag tag, const TensorIndex & idx, bool populate) { fill_region(tag, idx, populate, layout_); }
    /// The same for the tensors (and parts) `layout` names, a subset of layout_ at its offsets.
    void fill_region(memory::Tag tag, const TensorIndex & idx, bool populate, const WeightLayout & layout);
    /// Point w_ at the weight region (norms uploaded to small_ on a device).
    void bind();
    /// Grow every activation buffer to a step of n_tokens tokens and n_logits logits rows.
    void reserve_scratch(int64_t n_tokens, int64_t n_logits);

    /// The model from the embedding to the LM head on `b` (index arrays as begin_step got them),
    /// rank 0's logits of b.logits_rows into `out` (backend memory, [n_logits, vocab]). False
    /// when `abandon` fired. Issues ops only (no host sync): what a graph captures.
    bool run_model(const StepBatch & b, float * out, const std::atomic<bool> * abandon);
    /// Graph steps are on (graph_max_batch > 0, tp_size 1, a dense model, no MTP drafts).
    bool graphs_on() const { return g_ != nullptr; }
    /// After release_graphs(): reserve the activation and fixed index buffers again (forward()).
    void restore_graph_memory();

    /// The forward pass's activations, backend memory, grown to the largest batch seen.
    struct Scratch {
        kernels::ScratchBuffer x, xn, qkv, q, k, v, att, ff, gate, rows, logits;
        kernels::ScratchBuffer part, gathered;  ///< tp > 1: this rank's logits, rank 0's gathered [T, n_logits, vocab/T]
        /// Sparse MoE layers (moe_forward.cpp): router logits [n, n_experts], the block's output
        /// [n, hidden], the grouped experts' work buffer, the shared expert's gate|up, activation,
        /// output and gate logit.
        kernels::ScratchBuffer moe_logits, moe_out, moe_work, shared_gu, shared_act, shared_y, shared_g;
        /// MTP (mtp_draft_tokens > 0): every row's final-normed hidden state of the last forward
        /// [n_last, hidden]; the MTP layer's input rows, concat [n, 2*hidden], output, and the
        /// chains' current hidden rows and logits.
        kernels::ScratchBuffer hidden, mtp_in, mtp_cat, mtp_out, mtp_cur, mtp_logits;
    };
    /// Host-side routing state of the MoE layers (reused across steps).
    struct MoeHost {
        std::vector<float>   logits;   ///< [n, n_experts] router logits downloaded
        std::vector<int32_t> ids;      ///< [n, top_k] chosen experts
        std::vector<float>   weights;  ///< [n, top_k] their routing weights
        std::vector<float>   shared_scale;  ///< [n] sigmoid(shared_expert_gate(x))
        std::vector<int32_t> identity;      ///< [n] 0, 1, ..., n - 1
        bool                 record = false;  ///< this step's batch wants its routes (StepBatch::want_routes)
        std::vector<int32_t> routes;          ///< [n, n_moe_layers, top_k] the step's routes when `record`
    };
    /// A sparse MoE block on this rank's expert slices: out [n, hidden] = this rank's partial sum
    /// of the routed experts (and the gated shared expert); the caller all-reduces.
    void moe_mlp(int il, const float * xn, float * out, int64_t n);
    /// Expert parallel: at least `floats` f32 of the ep_buffer region (mapped, grown or brought
    /// back after a release here; backend memory).
    float * ep_buffer(int64_t floats);

    ModelConfig                           cfg_;
    WorkerConfig                          wcfg_;
    comm::Comm *                       comm_ = nullptr;   ///< nullptr at tp_size 1
    WeightLayout                          layout_;    ///< planned from the first checkpoint
    std::unique_ptr<kernels::Backend>     backend_;   ///< the ops (CPU: owns the --threads pool)
    std::unique_ptr<memory::Allocator>    alloc_;     ///< weight, staging, kv_cache and kv_swap regions
    bool                                  staged_ = false;   ///< the staging region holds a validated copy
    /// What stage_bucket put in the staging region (cleared by anything that writes, swaps or
    /// releases that region): the buckets' directory and each staged tensor as read.
    struct BucketStaging {
        std::filesystem::path             dir;
        std::map<std::string, TensorInfo> tensors;
    };
    BucketStaging                         buckets_;
    std::unique_ptr<stream::Landing>      land_;      ///< a landing in progress (land_open .. land_close / stop_landing)
    /// True when every tensor of `idx` (and no other) was staged by stage_bucket as `idx` reads it.
    bool staged_by_buckets(const TensorIndex & idx) const;
    struct DeltaUndo {
        weights::RankDelta                  delta;      ///< the applied runs (their addresses); a tensor of one-element runs
                                                        ///< (no lens) holds the OLD values in its `values` once written (swapped in place)
        std::vector<std::vector<std::byte>> old;        ///< per tensor of `delta` with lens: the runs' old bytes, back to back
        size_t                              n_done = 0; ///< tensors of `delta` written
        // apply_hf_delta's log: the pieces written (their old values in delta_old_), the delta they index
        std::shared_ptr<const weights::MappedWeightDelta> hf;
        std::vector<weights::DeltaPiece>                  pieces;
        size_t                                            pieces_done = 0;
        // land_close's log of a delta landing: its frames (values swapped: the old ones), their parts
        stream::LandedDelta                               landed;
        std::vector<stream::LandPart>                     landed_parts;
        size_t                                            landed_done = 0;
    };
    Arena                                 land_delta_buf_{"landed delta"};
    void    check_landable() const;  ///< host weights, resident (land_open, land_delta_open)
    /// Write a delta landing's frames in place (their values become the old ones: the undo log).
    int64_t apply_landed_delta(stream::LandedDelta d, std::vector<stream::LandPart> parts);  ///< a delta landing's frames (grown, never shrunk)
    std::unique_ptr<std::byte[]>          delta_old_;        ///< apply_hf_delta's undo buffer (grown, never shrunk)
    int64_t                               delta_old_bytes_ = 0;
    Arena                                 delta_file_{"delta file"};  ///< read_hf_delta's copy of the delta file (grown, never shrunk)
    DeltaUndo                             delta_undo_;       ///< apply_rank_delta's old values
    bool                                  device_mem_ = false;  ///< see device_memory()
    ModelWeights                          w_;
    std::vector<std::byte *>              k_pool_, v_pool_;  ///< per layer, in the kv_cache region (kv_dtype elements)
    float *                               mtp_k_ = nullptr, * mtp_v_ = nullptr;  ///< MTP cache (one layer, always f32), in mtp_cache
    int64_t                               n_hidden_rows_ = 0;  ///< rows of s_.hidden (the last forward)
    std::vector<float>                    mtp_host_logits_;    ///< device_mem_: downloaded [n, vocab]
    kernels::ScratchBuffer                rope_;             ///< [max_model_len, head_dim] backend memory
    kernels::ScratchBuffer                small_;            ///< device_mem_: the f32 norms and biases
    Scratch                               s_;
    MoeHost                               moe_host_;
    /// The background tier copies (a swap pool only); declared after backend_ and alloc_, so
    /// destroyed first: it waits for copies that read and write their memory.
    std::unique_ptr<KvCopier>             copier_;

    /// The CUDA-graph steps (buckets, captured graph ids, the padded step, the addresses the
    /// graphs hold) and their capture / replay: private to the model module
    /// (daemon/src/model/worker_graphs.{h,cpp}); null when graph steps are off. Declared last, so
    /// destroyed first.
    struct GraphState;
    std::unique_ptr<GraphState> g_;
};

}  // namespace fd::model
