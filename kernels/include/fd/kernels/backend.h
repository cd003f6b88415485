// fd/kernels/backend.h — where the forward pass runs: a Backend owns the compute resources of one
// device (CPU: its thread pool; CUDA: a stream and cuBLAS handles) and runs every op the forward
// pass needs on memory it owns.
//
// Conventions (as in fd/kernels/ops.h, whose types WType, PagedKv and AttnQuery are used here)
// - Shapes are written [d0, d1, ...] OUTERMOST FIRST (row-major), with named dimensions; counts
//   and strides are in elements, sizes in bytes. Mutated arguments come first.
// - Tensor pointers (float *, weights, KV pools) are BACKEND MEMORY: from alloc(), from an
//   fd::memory::Allocator region of the same device, or written with upload(). On the CPU backend
//   that is ordinary host memory (host_visible() is true).
// - Index arguments (token ids, positions, KV slots, attention queries and the block tables they
//   point to, row ids) are HOST memory, read while the op is issued. A device backend may upload
//   them once per step in begin_step() and use that copy in the step's ops.
// - Ops are issued in order on one stream; a device backend may run them asynchronously. Host
//   reads of backend memory go through download() (which waits), or follow synchronize().
// - Every op computes each output row with the same sequence of floating-point operations
//   whatever the number of rows, the other rows' contents or the thread count (batch
//   invariance); a backend's results are tested against the CPU backend's (the oracle).
// - Inputs are validated by the caller (the forward pass), never inside ops: a bad shape or
//   index is undefined behaviour, not an error. Errors listed are the ones an op may raise.
// - One thread uses a Backend at a time.
#pragma once

#include "fd/kernels/moe.h"
#include "fd/kernels/ops.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace fd::kernels {

class ThreadPool;

/// The kind of memory and compute a backend drives.
enum class DeviceKind : uint8_t { cpu = 0, cuda = 1 };

/// "cpu" / "cuda".
const char * device_kind_name(DeviceKind kind);

/// Memory of a backend's device, bytes: free now and total (CUDA: cudaMemGetInfo; CPU: host
/// memory from /proc/meminfo, MemAvailable and MemTotal).
struct MemInfo {
    int64_t free_bytes  = 0;
    int64_t total_bytes = 0;
};

/// How a checkpoint stores floats (the weights' dtypes before any widening). Deprecated alias of
/// the one fd::DType (fd/dtype.h); new code writes fd::DType.
using StoredType = fd::DType;

/// The operations a backend runs, for Backend::supports (ggml's supports_op): one per Backend
/// method that computes, and graph_capture for the CUDA-graph calls. The CPU backend is the
/// oracle: it runs every op, and another backend's op is tested against it.
enum class BackendOp : uint8_t {
    embedding,         ///< dtype: the table's (f32, bf16)
    linear,            ///< dtype: the weight's (f32, bf16)
    moe_experts,       ///< dtype: the experts' weights' (f32, bf16)
    rms_norm,          ///< the rest compute on f32 activations: dtype f32
    rope,
    silu_mul,
    add,
    copy_rows,
    gather_rows,
    kv_store,
    attention_paged,
    scale_add_rows,
    log_softmax_rows,
    argmax_rows,
    find_nonfinite,    ///< dtype: the scanned memory's (f32, bf16, f16)
    graph_capture,     ///< begin_capture / end_capture / replay (any dtype)
};
inline constexpr int kBackendOpCount = static_cast<int>(BackendOp::graph_capture) + 1;

/// "embedding", "linear", ... (the enumerator's name).
const char * backend_op_name(BackendOp op);

/// The arithmetic of the linear layers (--compute-dtype; vLLM / SGLang name dtypes so).
///   f32:  x and widened weights multiplied and summed in f32 (kernels::linear) — the default.
///   bf16: x rounded to bf16, bf16 weights (f32 weights rounded as read), exact products summed
///         in f32 (kernels::linear_bf16) — a trainer's bf16 autocast matmul with f32 outputs.
enum class ComputeType : uint8_t { f32 = 0, bf16 = 1 };

/// "float32" / "bfloat16" (the flag's values).
const char * compute_type_name(ComputeType t);
/// The flag's value → ComputeType ("float32" | "bfloat16"; also "fp32", "bf16").
/// Errors  fd::Error{invalid_argument} naming the choices for anything else.
ComputeType parse_compute_type(const std::string & name);

/// The index arrays of one forward step (host memory, valid until the step's last op is issued).
struct StepIndex {
    const int32_t *   tokens    = nullptr;  ///< [n_tokens] input ids
    const int32_t *   positions = nullptr;  ///< [n_tokens] position of each token in its sequence
    const int64_t *   slots     = nullptr;  ///< [n_tokens] KV slot each token writes
    const AttnQuery * queries   = nullptr;  ///< [n_tokens] context each token attends to
    int64_t           n_tokens  = 0;
    /// A graph step (see "CUDA graphs" in Backend): the arrays go to the FIXED device buffers of
    /// reserve_graph_steps() (one block-table row per token), and every op of the step that gets
    /// these same pointers reads them there. n_tokens <= its max_rows; every n_ctx <= its
    /// max_blocks * block_size. The CPU backend ignores it.
    bool              fixed     = false;
};

/// One expert's SwiGLU MLP (backend memory), as the dense MLP's: gate_up [2 * n_ff, n_embd]
/// rows gate | up, down [n_embd, n_ff].
struct ExpertWeights {
    const void * gate_up = nullptr;
    WType        gate_up_type = WType::f32;
    const void * down = nullptr;
    WType        down_type = WType::f32;
};

class Backend {
public:
    virtual ~Backend() = default;

    /// "cpu", "cuda" (for logs and /health).
    virtual const char * name() const = 0;
    /// The linears' arithmetic this backend was built with (BackendConfig::compute).
    virtual ComputeType compute_type() const { return ComputeType::f32; }
    /// Whether this backend runs `op` on tensors of `dtype` (ggml's supports_op): the forward
    /// pass and the loader ask it instead of testing the device kind or the build, so a kernel
    /// added to one backend needs no #if. The default is the CPU oracle's table, which every
    /// backend implements today (a backend's own kernels, or the base class's host loops):
    /// embedding / linear / moe_experts on f32 and bf16 weights (F16 checkpoints are widened to
    /// f32 at load), find_nonfinite on all three dtypes, every other op on f32, graph_capture
    /// when supports_graphs(). A backend that lacks a kernel (or adds a dtype) overrides it.
    virtual bool supports(BackendOp op, fd::DType dtype) const;
    virtual DeviceKind kind() const = 0;
    /// True when backend memory is host memory the caller may read and write directly (CPU).
    virtual bool host_visible() const = 0;
    /// Host threads for host-side work around the ops (parallel checkpoint reads). The CPU
    /// backend's op pool (`--threads`); never nullptr.
    virtual ThreadPool * host_pool() = 0;

    // --- memory ---------------------------------------------------------------------------

    /// `bytes` of backend memory, 64-byte aligned, contents undefined (scratch buffers).
    /// Errors  fd::Error{internal} when the device is out of memory.
    virtual void * alloc(int64_t bytes) = 0;
    /// Give back memory from alloc(); nullptr is a no-op.
    virtual void free(void * p) noexcept = 0;
    /// Copy `bytes` from host memory to backend memory (the host buffer may be reused on return).
    virtual void upload(void * dst, const void * src_host, int64_t bytes) = 0;
    /// Copy `bytes` from backend memory to host memory; waits for earlier ops first.
    virtual void download(void * dst_host, const void * src, int64_t bytes) = 0;
    /// Copy `bytes` within backend memory (regions must not overlap).
    virtual void copy(void * dst, const void * src, int64_t bytes) = 0;
    /// Wait until every op issued so far has finished.
    /// Errors  fd::Error{internal} when a device op failed (the message names it).
    virtual void synchronize() = 0;
    /// Free and total bytes of the device's memory now (see MemInfo).
    /// Errors  fd::Error{internal} when the device cannot be queried.
    virtual MemInfo mem_info() = 0;
    /// The device stream every op is issued on (CUDA: its cudaStream_t), or nullptr where ops run
    /// synchronously on the host (CPU). Collectives on backend memory (NcclComm) are enqueued on it
    /// so that they run in op order without a host wait.
    virtual void * native_stream() { return nullptr; }
    /// `bytes` of page-locked host memory for staging copies to and from the device (CUDA:
    /// cudaHostAlloc), or nullptr where the backend has none (CPU): the caller then uses ordinary
    /// host memory. Free with free_pinned_host().
    virtual void * alloc_pinned_host(int64_t bytes) { (void)bytes; return nullptr; }
    /// Give back memory from alloc_pinned_host(); nullptr is a no-op.
    virtual void free_pinned_host(void * p) noexcept { (void)p; }

    // --- the copy queue: block copies between backend memory and host memory beside the ops ---
    // (the host KV tier's transfers, fd/model/kv_copier.h). A device backend runs them on a
    // stream of their own, ordered against the op stream by events; the CPU backend has none
    // (copy_queue() is false) and the caller copies on a host thread of its own.

    /// True when the backend has a copy queue (CUDA: a second stream).
    virtual bool copy_queue() const { return false; }
    /// Order the copies issued next after every op issued so far (CUDA: an event recorded on
    /// the op stream that the copy stream waits for; no host wait).
    virtual void copy_queue_after_ops() {}
    /// Issue a copy of `bytes` from backend memory to host memory (`dst_host` page-locked for a
    /// real overlap) on the copy queue; returns at once. Default: download() (synchronous).
    virtual void download_async(void * dst_host, const void * src, int64_t bytes) { download(dst_host, src, bytes); }
    /// Issue a copy of `bytes` from host memory to backend memory on the copy queue; the host
    /// bytes must stay put until the copy's fence passed. Default: upload() (synchronous).
    virtual void upload_async(void * dst, const void * src_host, int64_t bytes) { upload(dst, src_host, bytes); }
    /// A fence after every copy issued so far (CUDA: an event recorded on the copy stream);
    /// 0 where copies are synchronous.
    virtual uint64_t copy_queue_fence() { return 0; }
    /// Whether the copies before `fence` have finished; never waits.
    /// Errors  fd::Error{internal} when a copy failed.
    virtual bool copy_queue_done(uint64_t fence) { (void)fence; return true; }
    /// Ops issued from now on run after the copies before `fence` (CUDA: cudaStreamWaitEvent on
    /// the op stream; no host wait).
    virtual void ops_after_copies(uint64_t fence) { (void)fence; }
    /// Index of the first NaN or Inf among the `n` values of type `t` at `p` (backend memory),
    /// or -1; waits for earlier ops. The check of weights that reach the device without a host
    /// copy (CUDA IPC, device to device). Default: download() in 256 KiB pieces and scan on the
    /// host; CUDA: a device kernel on the stored bits.
    virtual int64_t find_nonfinite(const void * p, fd::DType t, int64_t n);

    // --- CUDA graphs (decode steps captured once per batch-size bucket; fd/model/worker.h) ---
    //
    // A graph records the ops issued between begin_capture() and end_capture() on the backend's
    // stream with every pointer and size as it was then; replay() runs them again. So a captured
    // step must read its index arrays from fixed buffers (StepIndex::fixed, uploaded by
    // begin_step() BEFORE replay, outside the graph), and every tensor it touches must keep its
    // address for as long as the graph is replayed. Nothing inside a capture may allocate,
    // synchronize or copy from the host.

    /// True when the calls below work (CUDA). CPU: false (they fail with Errc::internal).
    /// Callers ask supports(BackendOp::graph_capture, ...), which reads it.
    virtual bool supports_graphs() const { return false; }
    /// Allocate the fixed index buffers of graph steps: up to `max_rows` rows, block tables of up
    /// to `max_blocks` entries of `block_size` tokens. Once, before the first fixed step.
    /// Errors  fd::Error{internal} when out of device memory.
    virtual void reserve_graph_steps(int64_t max_rows, int32_t max_blocks, int32_t block_size) {
        (void)max_rows; (void)max_blocks; (void)block_size;
    }
    /// Start recording the ops issued from now on into a graph (CUDA: cudaStreamBeginCapture,
    /// thread-local mode) instead of running them.
    virtual void begin_capture();
    /// Stop recording and instantiate the graph; returns its id for replay().
    /// Errors  fd::Error{internal} when capture or instantiation failed (e.g. an op synchronized).
    virtual int32_t end_capture();
    /// Stop a capture after an error (the partial graph is dropped). No-op when not capturing.
    virtual void abort_capture() noexcept {}
    /// Run graph `id` on the stream (asynchronous, like any op).
    virtual void replay(int32_t id);
    /// Destroy every graph (waits for the stream first).
    virtual void drop_graphs() noexcept {}
    /// drop_graphs(), then free the fixed index buffers of reserve_graph_steps() (device and
    /// pinned host) and let the driver return the graphs' memory (the `cuda_graph` sleep tag).
    /// The next fixed step needs reserve_graph_steps() again. Returns the bytes of the buffers
    /// freed (device + pinned host; what the graph objects held shows only in the device's free
    /// memory). Default (no graphs): 0.
    virtual int64_t release_graph_steps() noexcept { drop_graphs(); return 0; }
    /// Free the kernels' own per-thread scratch (CPU: every pool thread's and the caller's
    /// thread_local buffers, kernels/cpu/scratch.h; then malloc_trim). Called when the weights
    /// sleep (no kernel runs until they are back); the next kernel call grows it again.
    /// Returns the bytes the buffers held. Default (nothing of its own): 0.
    virtual int64_t release_scratch() noexcept { return 0; }
    /// Graphs instantiated so far (a counter: drop_graphs() does not reset it).
    virtual int64_t graphs_captured() const { return 0; }

    // --- forward-pass ops -----------------------------------------------------------------

    /// Called once per forward step before its ops with the step's index arrays (the same
    /// pointers the ops then receive). CPU: nothing to do. A device backend uploads them here.
    virtual void begin_step(const StepIndex & step) { (void)step; }

    /// Embedding gather over this rank's vocab rows [vocab_begin, vocab_begin + vocab_rows):
    ///   out[t, :] = table[tokens[t] - vocab_begin, :] widened to f32, or zeros when tokens[t]
    ///   is outside that range (another tensor-parallel rank adds its row).
    /// Shapes  out [n_tokens, n_embd] f32 written;  table [vocab_rows, n_embd] `ttype`;
    ///         tokens [n_tokens] host, each in [0, vocab).
    virtual void embedding(float * out, const void * table, WType ttype, const int32_t * tokens, int64_t n_tokens,
                           int64_t n_embd, int64_t vocab_begin, int64_t vocab_rows) = 0;

    /// out = x · Wᵀ (+ bias), the contract of kernels::linear (fixed reduction order per output).
    /// Shapes  out [n_rows, n_out] f32 written;  x [n_rows, n_in] f32;  w [n_out, n_in] `wtype`;
    ///         bias [n_out] f32 or nullptr.  out must not alias x.
    virtual void linear(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
                        int64_t n_out, int64_t n_in) = 0;

    /// out[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * weight[:]   (kernels::rms_norm)
    /// Shapes  out [n_rows, n_embd] f32 written, may alias x;  x [n_rows, n_embd];  weight [n_embd].
    virtual void rms_norm(float * out, const float * x, const float * weight, int64_t n_rows, int64_t n_embd,
                          float eps) = 0;

    /// RoPE, HF rotate_half convention, in place (kernels::rope_rotate_half).
    /// Shapes  x [n_tokens, n_heads, head_dim] f32 modified;  positions [n_tokens] host (each
    ///         < n_pos);  cos_sin [n_pos, head_dim] f32 from kernels::rope_table*, uploaded.
    virtual void rope(float * x, const int32_t * positions, const float * cos_sin, int64_t n_tokens, int64_t n_heads,
                      int64_t head_dim) = 0;

    /// SwiGLU over rows holding gate | up:  out[t, j] = silu(gate_up[t, j]) * gate_up[t, n_ff + j].
    /// Shapes  out [n_rows, n_ff] f32 written;  gate_up [n_rows, 2 * n_ff] f32 (no aliasing).
    virtual void silu_mul(float * out, const float * gate_up, int64_t n_rows, int64_t n_ff) = 0;

    /// Residual add: out[i] += x[i].   Shapes  out, x [n_elems] f32.
    virtual void add(float * out, const float * x, int64_t n_elems) = 0;

    /// Strided row copy: dst[r, 0:n_cols] = src[r, 0:n_cols] for r < n_rows (splitting q|k|v).
    /// Shapes  dst [n_rows, dst_stride] f32;  src [n_rows, src_stride] f32 (no aliasing).
    virtual void copy_rows(float * dst, int64_t dst_stride, const float * src, int64_t src_stride, int64_t n_rows,
                           int64_t n_cols) = 0;

    /// Row gather: out[i, :] = x[rows[i], :].
    /// Shapes  out [n_out_rows, n_cols] f32 written;  x [n_rows_x, n_cols] f32;  rows [n_out_rows] host.
    virtual void gather_rows(float * out, const float * x, const int32_t * rows, int64_t n_out_rows, int64_t n_cols) = 0;

    /// Store each token's K and V at its slot (kernels::kv_store).
    /// Shapes  kv pool as fd::kernels::PagedKv (K [n_blocks, n_kv_heads, head_dim, block_size],
    ///         V [n_blocks, block_size, n_kv_heads, head_dim]) of kv.dtype, f32 or bf16 (rounded to
    ///         nearest even; --kv-cache-dtype), backend memory;
    ///         k_new, v_new [n_tokens, n_kv_heads, head_dim] f32;  slots [n_tokens] host.
    virtual void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots,
                          int64_t n_tokens) = 0;

    /// Causal GQA attention over the paged pool (kernels::attention_paged: fixed reduction order).
    /// Shapes  out [n_tokens, n_heads, head_dim] f32 written;  q [n_tokens, n_heads, head_dim] f32;
    ///         queries [n_tokens] host (block tables host).  scale: usually 1/sqrt(head_dim).
    ///         kv f32 or bf16 (kv.dtype; bf16 widened exactly to f32 as it is read).
    virtual void attention_paged(float * out, const float * q, const AttnQuery * queries, int64_t n_tokens,
                                 int64_t n_heads, PagedKv kv, float scale) = 0;

    /// Scaled scatter-add: out[rows[i], :] += scales[i] * y[i, :] for i = 0, 1, ..., n - 1 in
    /// order (transformers' `expert(x) * w` then index_add_; the same operations for every row).
    /// Shapes  out [*, n_cols] f32 modified;  y [n, n_cols] f32;  rows [n], scales [n] host.
    /// Default: a host loop (backend memory host-visible), else per-row download / upload.
    virtual void scale_add_rows(float * out, const float * y, const int32_t * rows, const float * scales, int64_t n,
                                int64_t n_cols);

    /// The routed experts of a sparse MoE block, grouped by expert (fd/kernels/moe.h):
    ///   out[t, :] = Σ over t's experts e in ascending id of  w(t, e) · down_e(silu(gate_e x_t) * up_e x_t)
    /// For each expert of `plan` (only those: the others' weights are never read) its tokens'
    /// rows of x are gathered, run through that expert's two linears (the dense MLP's ops, so
    /// each row's arithmetic does not depend on the group size) and scatter-added, scaled, to
    /// out. A row's result depends only on its own route: bitwise batch invariant.
    /// Shapes  out [n_rows, n_embd] f32 written (zeroed first);  x [n_rows, n_embd] f32;
    ///         experts [n_experts] host array;  work: moe_work_floats(plan.max_rows, ...) floats
    ///         of backend memory.
    virtual void moe_experts(float * out, const float * x, const MoePlan & plan, const ExpertWeights * experts, int64_t n_rows,
                             int64_t n_embd, int64_t n_ff, float * work);
    /// Floats of moe_experts' work buffer for groups of up to `max_rows` tokens.
    static int64_t moe_work_floats(int64_t max_rows, int64_t n_embd, int64_t n_ff) {
        return max_rows * (2 * n_embd + 3 * n_ff);
    }

    /// Row-wise log-softmax (kernels::log_softmax per row).
    /// Shapes  out [n_rows, n] f32 written, may alias x;  x [n_rows, n] f32.
    virtual void log_softmax_rows(float * out, const float * x, int64_t n_rows, int64_t n) = 0;

    /// Row-wise argmax, lowest index on ties (kernels::argmax per row); waits for the result.
    /// Shapes  out_host [n_rows] host written;  x [n_rows, n] f32, n >= 1.
    virtual void argmax_rows(int64_t * out_host, const float * x, int64_t n_rows, int64_t n) = 0;
};

/// Options a backend is built with.
struct BackendConfig {
    DeviceKind kind      = DeviceKind::cpu;
    int32_t    n_threads = 1;   ///< CPU: threads for the ops (>= 1; the caller is one of them)
    int32_t    device_id = 0;   ///< CUDA: the device ordinal
    /// CUDA: false = --no-batch-invariant, linear may use cuBLAS's heuristic GEMM (a row's result
    /// may then depend on the batch's row count). CPU: ignored (its kernels are always invariant).
    bool       batch_invariant = true;
    /// The linears' arithmetic (ComputeType). CPU: bf16 runs kernels::linear_bf16 (AVX512_BF16
    /// when the CPU has it, else the portable path: the same bits). CUDA: f32 only.
    ComputeType compute = ComputeType::f32;
};

/// True when a backend of `kind` can be built on device `device_id` in this build (CPU: always);
/// otherwise false and `why` (optional) says why, e.g. "no CUDA device visible (...)".
bool device_available(DeviceKind kind, int32_t device_id, std::string * why);

/// Devices of `kind` this process sees (CPU: 1; CUDA: cudaGetDeviceCount, 0 on any error or
/// in a build without CUDA).
int32_t device_count(DeviceKind kind);

/// Free and total memory of device `device_id` of `kind` (CPU: host memory, /proc/meminfo).
/// Errors  fd::Error{invalid_argument} when that kind is not compiled in or the device is absent.
MemInfo device_mem_info(DeviceKind kind, int32_t device_id);

/// Host memory from /proc/meminfo: MemAvailable and MemTotal (0, 0 when unreadable).
MemInfo host_mem_info();

/// The CPU backend: kernels/cpu's ops on its own thread pool of `n_threads` (>= 1), its linears
/// in `compute` arithmetic.
std::unique_ptr<Backend> make_cpu_backend(int32_t n_threads, ComputeType compute = ComputeType::f32);

/// The backend `cfg` asks for.
/// Errors  fd::Error{invalid_argument} when that kind is not compiled into this build or the
///         device is absent (the message names it); n_threads < 1.
std::unique_ptr<Backend> make_backend(const BackendConfig & cfg);

/// Scratch memory from a backend that grows to the largest size asked (contents are not kept
/// across a growth). Move-only; frees on destruction. The Backend must outlive it.
class ScratchBuffer {
public:
    ScratchBuffer() = default;
    explicit ScratchBuffer(Backend * backend) : backend_(backend) {}
    ~ScratchBuffer() { reset(); }
    ScratchBuffer(const ScratchBuffer &) = delete;
    ScratchBuffer & operator=(const ScratchBuffer &) = delete;
    ScratchBuffer(ScratchBuffer && o) noexcept { *this = static_cast<ScratchBuffer &&>(o); }
    ScratchBuffer & operator=(ScratchBuffer && o) noexcept {
        if (this != &o) {
            reset();
            backend_ = o.backend_;
            data_    = o.data_;
            bytes_   = o.bytes_;
            o.data_  = nullptr;
            o.bytes_ = 0;
        }
        return *this;
    }

    /// At least `n` floats of backend memory (reallocated, contents lost, only when growing).
    float * floats(int64_t n) {
        const int64_t need = n * static_cast<int64_t>(sizeof(float));
        if (need > bytes_) {
            reset();
            data_  = backend_->alloc(need);
            bytes_ = need;
        }
        return static_cast<float *>(data_);
    }
    float * data() const { return static_cast<float *>(data_); }
    int64_t capacity_bytes() const { return bytes_; }
    void reset() noexcept {
        if (data_ && backend_) { backend_->free(data_); }
        data_  = nullptr;
        bytes_ = 0;
    }

private:
    Backend * backend_ = nullptr;
    void *    data_    = nullptr;
    int64_t   bytes_   = 0;
};

}  // namespace fd::kernels
