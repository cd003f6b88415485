// The CUDA Backend (see fd/kernels/cuda_backend.h): one stream, the cuda_ops kernels, host index
// arrays staged through pinned buffers, CUDA graphs of fixed steps (capture / replay).
#include "fd/kernels/cuda_backend.h"

#include "cublas_gemm.h"
#include "fd/kernels/cuda_ops.h"
#include "fd/kernels/thread_pool.h"
#include "fd/status.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <unordered_map>
#include <vector>

namespace fd::kernels {

namespace {

void check(cudaError_t e, const char * what) {
    if (e != cudaSuccess) { fail(Errc::internal, "CUDA backend: {}: {}", what, cudaGetErrorString(e)); }
}

/// A device buffer for one kind of host index array, with its pinned staging twin.
struct IndexBuf {
    void *       dev        = nullptr;
    void *       pinned     = nullptr;
    int64_t      cap        = 0;
    bool         pending    = false;    // a copy from `pinned` may still be in flight
    const void * step_host  = nullptr;  // the begin_step() array now on the device (nullptr: none)
    int64_t      step_bytes = 0;
};

enum Slot { kTokens, kPositions, kSlots, kTables, kTableRow, kNctx, kRows, kSlotCount };

/// The fixed index buffers of graph steps (Backend::reserve_graph_steps): one device allocation
/// and its pinned twin, same layout, arrays sized for max_rows:
///   slots int64 [max_rows] | tokens | positions | n_ctx | table_row int32 [max_rows] |
///   tables int32 [max_rows, max_blocks]   (row i: token i's block table; table_row[i] = i)
/// begin_step(fixed) fills the pinned copy and uploads it with two async copies (the head, then
/// the used width of the tables, 2D); `copied` marks when the pinned copy may be rewritten.
struct FixedStep {
    std::byte *  dev        = nullptr;
    std::byte *  pinned     = nullptr;
    int64_t      max_rows   = 0;
    int32_t      max_blocks = 0;
    int32_t      block_size = 0;
    int64_t      head_bytes = 0;  // bytes before the tables
    cudaEvent_t  copied     = nullptr;
    bool         pending    = false;  // an upload from `pinned` may still be reading it
    // The step now on the device (active: begin_step had fixed = true).
    bool              active    = false;
    const void *      tokens    = nullptr;
    const void *      positions = nullptr;
    const void *      slots     = nullptr;
    const AttnQuery * queries   = nullptr;
    int64_t           n         = 0;

    int64_t * slots_at(std::byte * base) const { return reinterpret_cast<int64_t *>(base); }
    int32_t * i32_at(std::byte * base, int k) const {  // k: 0 tokens, 1 positions, 2 n_ctx, 3 table_row, 4 tables
        return reinterpret_cast<int32_t *>(base + 8 * max_rows) + k * max_rows;
    }
};

class CudaBackend final : public Backend {
public:
    CudaBackend(int32_t device, int32_t n_host_threads, bool batch_invariant)
        : device_(device), batch_invariant_(batch_invariant), pool_(std::max(1, n_host_threads)) {
        check(cudaSetDevice(device), "cudaSetDevice");
        check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    }
    ~CudaBackend() override {
        abort_capture();
        cudaStreamSynchronize(stream_);
        for (cudaGraphExec_t g : graphs_) { cudaGraphExecDestroy(g); }
        cudaFree(fixed_.dev);
        cudaFreeHost(fixed_.pinned);
        if (fixed_.copied) { cudaEventDestroy(fixed_.copied); }
        for (IndexBuf & b : idx_) {
            cudaFree(b.dev);
            cudaFreeHost(b.pinned);
        }
        cudaFree(best_);
        cudaFree(first_);
        if (copy_stream_) {
            cudaStreamSynchronize(copy_stream_);
            cudaStreamDestroy(copy_stream_);
        }
        for (const Fence & f : fences_) { cudaEventDestroy(f.event); }
        for (cudaEvent_t e : spare_events_) { cudaEventDestroy(e); }
        cudaStreamDestroy(stream_);
    }

    const char * name() const override { return "cuda"; }
    DeviceKind   kind() const override { return DeviceKind::cuda; }
    void *       native_stream() override { return stream_; }
    bool         host_visible() const override { return false; }
    ThreadPool * host_pool() override { return &pool_; }

    void * alloc(int64_t bytes) override {
        void * p = nullptr;
        const cudaError_t e = cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1)));
        if (e != cudaSuccess) { fail(Errc::internal, "CUDA backend: cudaMalloc of {} bytes: {}", bytes, cudaGetErrorString(e)); }
        return p;
    }
    void free(void * p) noexcept override {
        if (p) { cudaFree(p); }
    }
    void upload(void * dst, const void * src_host, int64_t bytes) override {
        current();
        check(cudaMemcpyAsync(dst, src_host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_), "upload");
        check(cudaStreamSynchronize(stream_), "upload");  // the host buffer may be reused on return
    }
    void download(void * dst_host, const void * src, int64_t bytes) override {
        current();
        check(cudaMemcpyAsync(dst_host, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, stream_), "download");
        check(cudaStreamSynchronize(stream_), "download");
    }
    void copy(void * dst, const void * src, int64_t bytes) override {
        check(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream_), "copy");
    }
    void synchronize() override { check(cudaStreamSynchronize(stream_), "a device op failed"); }
    MemInfo mem_info() override { return cuda_mem_info(device_); }
    void * alloc_pinned_host(int64_t bytes) override {
        current();
        void * p = nullptr;
        const cudaError_t e = cudaHostAlloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1)), cudaHostAllocDefault);
        if (e != cudaSuccess) { fail(Errc::internal, "CUDA backend: cudaHostAlloc of {} bytes: {}", bytes, cudaGetErrorString(e)); }
        return p;
    }
    void free_pinned_host(void * p) noexcept override {
        if (p) { cudaFreeHost(p); }
    }
    // The copy queue (the host KV tier's block copies): a second stream, ordered against the op
    // stream by events in both directions; fences are events recorded on it, oldest first.
    bool copy_queue() const override { return true; }
    void copy_queue_after_ops() override {
        current();
        ensure_copy_stream();
        cudaEvent_t e = event();
        check(cudaEventRecord(e, stream_), "copy queue: cudaEventRecord (op stream)");
        check(cudaStreamWaitEvent(copy_stream_, e, 0), "copy queue: cudaStreamWaitEvent");
        spare_events_.push_back(e);  // reusable once recorded again: waits already captured it
    }
    void download_async(void * dst_host, const void * src, int64_t bytes) override {
        current();
        ensure_copy_stream();
        check(cudaMemcpyAsync(dst_host, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, copy_stream_), "download_async");
    }
    void upload_async(void * dst, const void * src_host, int64_t bytes) override {
        current();
        ensure_copy_stream();
        check(cudaMemcpyAsync(dst, src_host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, copy_stream_), "upload_async");
    }
    uint64_t copy_queue_fence() override {
        current();
        ensure_copy_stream();
        cudaEvent_t e = event();
        check(cudaEventRecord(e, copy_stream_), "copy queue: cudaEventRecord (copy stream)");
        fences_.push_back({++last_fence_, e});
        return last_fence_;
    }
    bool copy_queue_done(uint64_t fence) override {
        while (!fences_.empty() && fences_.front().id <= fence) {
            const cudaError_t q = cudaEventQuery(fences_.front().event);
            if (q == cudaErrorNotReady) { return false; }
            check(q, "a KV block copy on the copy stream failed");
            spare_events_.push_back(fences_.front().event);
            fences_.pop_front();
        }
        return true;
    }
    void ops_after_copies(uint64_t fence) override {
        for (const Fence & f : fences_) {
            if (f.id == fence) { check(cudaStreamWaitEvent(stream_, f.event, 0), "op stream: cudaStreamWaitEvent (copy fence)"); }
        }
    }
    int64_t find_nonfinite(const void * p, fd::DType t, int64_t n) override {
        current();
        if (!first_) { check(cudaMalloc(reinterpret_cast<void **>(&first_), sizeof(unsigned long long)), "cudaMalloc (first_nonfinite)"); }
        const unsigned long long none = ~0ULL;
        unsigned long long       got  = none;
        check(cudaMemcpyAsync(first_, &none, sizeof none, cudaMemcpyHostToDevice, stream_), "find_nonfinite");
        cuda::first_nonfinite(first_, p, static_cast<int>(t), n, stream_);
        check(cudaMemcpyAsync(&got, first_, sizeof got, cudaMemcpyDeviceToHost, stream_), "find_nonfinite");
        check(cudaStreamSynchronize(stream_), "find_nonfinite");
        return got == none ? -1 : static_cast<int64_t>(got);
    }

    // --- graphs ---

    bool supports_graphs() const override { return true; }

    void reserve_graph_steps(int64_t max_rows, int32_t max_blocks, int32_t block_size) override {
        current();
        if (max_rows <= fixed_.max_rows && max_blocks <= fixed_.max_blocks && block_size == fixed_.block_size) { return; }
        FD_CHECK(graphs_.empty() && !capturing_, "reserve_graph_steps after a graph was captured (its buffers would move)");
        FD_CHECK(max_rows > 0 && max_blocks > 0 && block_size > 0, "reserve_graph_steps({}, {}, {})", max_rows, max_blocks, block_size);
        check(cudaStreamSynchronize(stream_), "reserve_graph_steps");
        cudaFree(fixed_.dev);
        cudaFreeHost(fixed_.pinned);
        fixed_.dev = fixed_.pinned = nullptr;
        fixed_.max_rows   = max_rows;
        fixed_.max_blocks = max_blocks;
        fixed_.block_size = block_size;
        fixed_.head_bytes = max_rows * (8 + 4 * 4);
        const int64_t bytes = fixed_.head_bytes + max_rows * max_blocks * 4;
        check(cudaMalloc(reinterpret_cast<void **>(&fixed_.dev), static_cast<size_t>(bytes)), "cudaMalloc (graph step indices)");
        check(cudaMallocHost(reinterpret_cast<void **>(&fixed_.pinned), static_cast<size_t>(bytes)), "cudaMallocHost (graph step indices)");
        std::memset(fixed_.pinned, 0, static_cast<size_t>(bytes));
        int32_t * row = fixed_.i32_at(fixed_.pinned, 3);
        for (int64_t i = 0; i < max_rows; ++i) { row[i] = static_cast<int32_t>(i); }
        check(cudaMemcpyAsync(fixed_.dev, fixed_.pinned, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_),
              "graph step indices upload");
        check(cudaStreamSynchronize(stream_), "graph step indices upload");
        if (!fixed_.copied) { check(cudaEventCreateWithFlags(&fixed_.copied, cudaEventDisableTiming), "cudaEventCreate"); }
        fixed_.pending = false;
    }

    void begin_capture() override {
        current();
        FD_CHECK(!capturing_, "begin_capture while capturing");
        check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
        capturing_ = true;
    }

    int32_t end_capture() override {
        FD_CHECK(capturing_, "end_capture without begin_capture");
        capturing_ = false;
        cudaGraph_t g = nullptr;
        check(cudaStreamEndCapture(stream_, &g), "cudaStreamEndCapture (an op in the capture was not capturable)");
        cudaGraphExec_t exec = nullptr;
        const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
        cudaGraphDestroy(g);
        check(e, "cudaGraphInstantiate");
        graphs_.push_back(exec);
        ++n_captured_;
        return static_cast<int32_t>(graphs_.size() - 1);
    }

    void abort_capture() noexcept override {
        if (!capturing_) { return; }
        capturing_ = false;
        cudaGraph_t g = nullptr;
        if (cudaStreamEndCapture(stream_, &g) == cudaSuccess && g) { cudaGraphDestroy(g); }
        (void)cudaGetLastError();  // a failed capture's error is not the next op's
    }

    void replay(int32_t id) override {
        FD_CHECK(id >= 0 && id < static_cast<int32_t>(graphs_.size()), "replay of graph {} ({} captured)", id, graphs_.size());
        check(cudaGraphLaunch(graphs_[static_cast<size_t>(id)], stream_), "cudaGraphLaunch");
    }

    void drop_graphs() noexcept override {
        abort_capture();
        cudaStreamSynchronize(stream_);
        for (cudaGraphExec_t g : graphs_) { cudaGraphExecDestroy(g); }
        graphs_.clear();
    }

    int64_t release_graph_steps() noexcept override {
        drop_graphs();
        const int64_t bytes = fixed_.dev ? fixed_.head_bytes + fixed_.max_rows * fixed_.max_blocks * 4 : 0;
        if (fixed_.pending && fixed_.copied) { cudaEventSynchronize(fixed_.copied); }
        cudaFree(fixed_.dev);
        cudaFreeHost(fixed_.pinned);
        fixed_.dev = fixed_.pinned = nullptr;
        fixed_.max_rows = fixed_.max_blocks = fixed_.block_size = 0;  // reserve_graph_steps allocates again
        fixed_.pending = fixed_.active = false;
        cudaDeviceGraphMemTrim(device_);  // memory the driver keeps for graphs goes back too
        (void)cudaGetLastError();
        return 2 * bytes;  // the device buffer and its pinned twin
    }

    int64_t graphs_captured() const override { return n_captured_; }

    void begin_step(const StepIndex & step) override {
        for (IndexBuf & b : idx_) { b.step_host = nullptr; }
        attn_queries_ = nullptr;
        fixed_.active = false;
        if (step.fixed) {
            begin_fixed_step(step);
            return;
        }
        const int64_t n = step.n_tokens;
        if (n <= 0) { return; }
        if (step.tokens) { stage(kTokens, step.tokens, n * 4, true); }
        if (step.positions) { stage(kPositions, step.positions, n * 4, true); }
        if (step.slots) { stage(kSlots, step.slots, n * 8, true); }
        step_queries_ = step.queries;
        step_n_       = n;
    }

    void embedding(float * out, const void * table, WType ttype, const int32_t * tokens, int64_t n_tokens, int64_t n_embd,
                   int64_t vocab_begin, int64_t vocab_rows) override {
        const auto * ids = static_cast<const int32_t *>(stage(kTokens, tokens, n_tokens * 4, false));
        cuda::embedding(out, ids, table, ttype, n_tokens, n_embd, vocab_begin, vocab_rows, stream_);
    }
    void linear(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows, int64_t n_out,
                int64_t n_in) override {
        // --no-batch-invariant: cuBLAS's heuristic SGEMM for f32 weights without bias.
        if (!batch_invariant_ && wtype == WType::f32 && bias == nullptr &&
            gemm_.sgemm(out, x, static_cast<const float *>(w), n_rows, n_out, n_in, stream_)) {
            return;
        }
        cuda::linear(out, x, w, wtype, bias, n_rows, n_out, n_in, stream_);
    }
    void rms_norm(float * out, const float * x, const float * weight, int64_t n_rows, int64_t n_embd, float eps) override {
        cuda::rms_norm(out, x, weight, n_rows, n_embd, eps, stream_);
    }
    void rope(float * x, const int32_t * positions, const float * cos_sin, int64_t n_tokens, int64_t n_heads,
              int64_t head_dim) override {
        const auto * pos = static_cast<const int32_t *>(stage(kPositions, positions, n_tokens * 4, false));
        cuda::rope_rotate_half(x, pos, cos_sin, n_tokens, n_heads, head_dim, stream_);
    }
    void silu_mul(float * out, const float * gate_up, int64_t n_rows, int64_t n_ff) override {
        cuda::silu_mul_rows(out, gate_up, n_rows, n_ff, stream_);
    }
    void add(float * out, const float * x, int64_t n_elems) override { cuda::add_inplace(out, x, n_elems, stream_); }
    void copy_rows(float * dst, int64_t dst_stride, const float * src, int64_t src_stride, int64_t n_rows,
                   int64_t n_cols) override {
        if (n_rows <= 0 || n_cols <= 0) { return; }
        check(cudaMemcpy2DAsync(dst, sizeof(float) * dst_stride, src, sizeof(float) * src_stride, sizeof(float) * n_cols,
                                static_cast<size_t>(n_rows), cudaMemcpyDeviceToDevice, stream_),
              "copy_rows");
    }
    void gather_rows(float * out, const float * x, const int32_t * rows, int64_t n_out_rows, int64_t n_cols) override {
        if (n_out_rows <= 0) { return; }
        const auto * r = static_cast<const int32_t *>(stage(kRows, rows, n_out_rows * 4, false));
        cuda::gather_rows(out, x, r, n_out_rows, n_cols, stream_);
    }
    void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots, int64_t n_tokens) override {
        const auto * s = static_cast<const int64_t *>(stage(kSlots, slots, n_tokens * 8, false));
        cuda::kv_store(kv, k_new, v_new, s, n_tokens, stream_);
    }
    void attention_paged(float * out, const float * q, const AttnQuery * queries, int64_t n_tokens, int64_t n_heads, PagedKv kv,
                         float scale) override {
        if (n_tokens <= 0) { return; }
        if (fixed_.active && queries == fixed_.queries && n_tokens == fixed_.n && kv.block_size == fixed_.block_size) {
            const cuda::AttnBatch fb{fixed_.i32_at(fixed_.dev, 4), fixed_.max_blocks, fixed_.i32_at(fixed_.dev, 3),
                                     fixed_.i32_at(fixed_.dev, 2)};
            cuda::attention_paged(out, q, fb, n_tokens, n_heads, kv, scale, stream_);
            return;
        }
        // The step's queries are flattened once (every layer shares them); others every call.
        const bool cached = queries == attn_queries_ && n_tokens == attn_n_ && kv.block_size == attn_bs_;
        if (!cached) { build_attn(queries, n_tokens, kv.block_size, queries == step_queries_ && n_tokens == step_n_); }
        cuda::attention_paged(out, q, attn_, n_tokens, n_heads, kv, scale, stream_);
    }
    void log_softmax_rows(float * out, const float * x, int64_t n_rows, int64_t n) override {
        cuda::log_softmax_argmax(out, nullptr, x, n_rows, n, stream_);
    }
    void argmax_rows(int64_t * out_host, const float * x, int64_t n_rows, int64_t n) override {
        if (n_rows <= 0) { return; }
        FD_CHECK(!capturing_, "argmax_rows (a download) during graph capture");
        if (n_rows > best_cap_) {
            check(cudaStreamSynchronize(stream_), "argmax_rows");
            cudaFree(best_);
            best_ = static_cast<int64_t *>(alloc(n_rows * 8));
            best_cap_ = n_rows;
        }
        cuda::log_softmax_argmax(nullptr, best_, x, n_rows, n, stream_);
        download(out_host, best_, n_rows * 8);
    }

private:
    /// Make this backend's device current on the calling thread (host-pool threads upload weights).
    void current() const {
        int cur = -1;
        if (cudaGetDevice(&cur) != cudaSuccess || cur != device_) { check(cudaSetDevice(device_), "cudaSetDevice"); }
    }

    /// The device copy of `bytes` of host memory `host` in slot `s`. A step's array (step = true,
    /// or already staged by begin_step) is copied once and reused; anything else each call.
    const void * stage(Slot s, const void * host, int64_t bytes, bool step) {
        if (fixed_.active) {
            if (s == kTokens && host == fixed_.tokens) { return fixed_.i32_at(fixed_.dev, 0); }
            if (s == kPositions && host == fixed_.positions) { return fixed_.i32_at(fixed_.dev, 1); }
            if (s == kSlots && host == fixed_.slots) { return fixed_.slots_at(fixed_.dev); }
        }
        if (capturing_) {  // a host copy inside a graph would replay stale host memory
            fail(Errc::internal, "CUDA backend: an index array that is not the fixed step's, during graph capture");
        }
        IndexBuf & b = idx_[s];
        if (bytes <= 0) { return b.dev; }  // nothing to read (the op enqueues nothing)
        if (!step && host == b.step_host && bytes == b.step_bytes) { return b.dev; }
        if (bytes > b.cap) {
            check(cudaStreamSynchronize(stream_), "index staging");
            cudaFree(b.dev);
            cudaFreeHost(b.pinned);
            b.dev = b.pinned = nullptr;
            b.cap = 0;
            const int64_t cap = std::max<int64_t>(bytes, 4096) * 2;
            check(cudaMalloc(&b.dev, static_cast<size_t>(cap)), "cudaMalloc (index staging)");
            check(cudaMallocHost(&b.pinned, static_cast<size_t>(cap)), "cudaMallocHost (index staging)");
            b.cap     = cap;
            b.pending = false;
        }
        if (b.pending) { check(cudaStreamSynchronize(stream_), "index staging"); }  // the pinned buffer is in use
        std::memcpy(b.pinned, host, static_cast<size_t>(bytes));
        check(cudaMemcpyAsync(b.dev, b.pinned, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_), "index upload");
        b.pending    = true;
        b.step_host  = step ? host : nullptr;
        b.step_bytes = step ? bytes : 0;
        return b.dev;
    }

    /// A fixed step (graph steps): the arrays into the pinned twin of the fixed buffers, then two
    /// async uploads (head; tables 2D, the widest row's used entries). Outside any capture.
    void begin_fixed_step(const StepIndex & step) {
        const int64_t n = step.n_tokens;
        FD_CHECK(!capturing_, "begin_step during graph capture (the uploads must precede the replay)");
        FD_CHECK(fixed_.dev != nullptr, "a fixed step before reserve_graph_steps");
        FD_CHECK(n >= 1 && n <= fixed_.max_rows, "a fixed step of {} rows (reserved {})", n, fixed_.max_rows);
        current();
        if (fixed_.pending) { check(cudaEventSynchronize(fixed_.copied), "graph step indices (previous upload)"); }
        std::byte * h = fixed_.pinned;
        std::memcpy(fixed_.i32_at(h, 0), step.tokens, static_cast<size_t>(n) * 4);
        std::memcpy(fixed_.i32_at(h, 1), step.positions, static_cast<size_t>(n) * 4);
        std::memcpy(fixed_.slots_at(h), step.slots, static_cast<size_t>(n) * 8);
        int32_t * n_ctx  = fixed_.i32_at(h, 2);
        int32_t * tables = fixed_.i32_at(h, 4);
        const int32_t bs = fixed_.block_size;
        int32_t width = 1;
        for (int64_t i = 0; i < n; ++i) {
            const int32_t c  = step.queries[i].n_ctx;
            const int32_t nb = (c + bs - 1) / bs;
            FD_CHECK(c >= 1 && nb <= fixed_.max_blocks, "a fixed step's query {} attends {} tokens (at most {} x {})", i, c,
                     fixed_.max_blocks, bs);
            n_ctx[i] = c;
            std::memcpy(tables + i * fixed_.max_blocks, step.queries[i].block_table, static_cast<size_t>(nb) * 4);
            width = std::max(width, nb);
        }
        check(cudaMemcpyAsync(fixed_.dev, h, static_cast<size_t>(fixed_.head_bytes), cudaMemcpyHostToDevice, stream_),
              "graph step indices upload");
        const size_t pitch = static_cast<size_t>(fixed_.max_blocks) * 4;
        check(cudaMemcpy2DAsync(fixed_.i32_at(fixed_.dev, 4), pitch, tables, pitch, static_cast<size_t>(width) * 4,
                                static_cast<size_t>(n), cudaMemcpyHostToDevice, stream_),
              "graph step block tables upload");
        check(cudaEventRecord(fixed_.copied, stream_), "cudaEventRecord (graph step indices)");
        fixed_.pending   = true;
        fixed_.active    = true;
        fixed_.tokens    = step.tokens;
        fixed_.positions = step.positions;
        fixed_.slots     = step.slots;
        fixed_.queries   = step.queries;
        fixed_.n         = n;
    }

    /// Flattens the queries' block tables ([n_tables, max_blocks], one row per distinct table)
    /// and uploads them with each query's table row and n_ctx.
    void build_attn(const AttnQuery * queries, int64_t n, int32_t block_size, bool step) {
        std::unordered_map<const int32_t *, int32_t> row_of;
        std::vector<const int32_t *>                 tables;
        std::vector<int32_t>                         n_blocks;
        table_row_.resize(static_cast<size_t>(n));
        n_ctx_.resize(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
            const auto [it, fresh] = row_of.emplace(queries[i].block_table, static_cast<int32_t>(tables.size()));
            if (fresh) {
                tables.push_back(queries[i].block_table);
                n_blocks.push_back(0);
            }
            const int32_t nb = (queries[i].n_ctx + block_size - 1) / block_size;
            n_blocks[it->second] = std::max(n_blocks[it->second], nb);
            table_row_[i]        = it->second;
            n_ctx_[i]            = queries[i].n_ctx;
        }
        const int32_t max_blocks = std::max(1, *std::max_element(n_blocks.begin(), n_blocks.end()));
        flat_.assign(tables.size() * static_cast<size_t>(max_blocks), 0);
        for (size_t t = 0; t < tables.size(); ++t) {
            std::copy(tables[t], tables[t] + n_blocks[t], flat_.begin() + static_cast<int64_t>(t) * max_blocks);
        }
        attn_.block_tables = static_cast<const int32_t *>(stage(kTables, flat_.data(), static_cast<int64_t>(flat_.size()) * 4, false));
        attn_.max_blocks   = max_blocks;
        attn_.table_row    = static_cast<const int32_t *>(stage(kTableRow, table_row_.data(), n * 4, false));
        attn_.n_ctx        = static_cast<const int32_t *>(stage(kNctx, n_ctx_.data(), n * 4, false));
        attn_queries_      = step ? queries : nullptr;
        attn_n_            = n;
        attn_bs_           = block_size;
    }

    void ensure_copy_stream() {
        if (!copy_stream_) { check(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags (copy stream)"); }
    }
    /// An event without timing (a spare one when there is).
    cudaEvent_t event() {
        if (!spare_events_.empty()) {
            cudaEvent_t e = spare_events_.back();
            spare_events_.pop_back();
            return e;
        }
        cudaEvent_t e = nullptr;
        check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
        return e;
    }
    struct Fence {
        uint64_t    id = 0;
        cudaEvent_t event = nullptr;
    };

    int32_t           device_ = 0;
    bool              batch_invariant_ = true;  // false: --no-batch-invariant (cuBLAS SGEMM for f32 weights)
    cuda::HeuristicGemm gemm_;
    ThreadPool        pool_;
    cudaStream_t      stream_ = nullptr;
    cudaStream_t      copy_stream_ = nullptr;  // the copy queue (created on first use)
    std::deque<Fence> fences_;                 // recorded on copy_stream_, oldest first
    std::vector<cudaEvent_t> spare_events_;
    uint64_t          last_fence_ = 0;
    IndexBuf          idx_[kSlotCount];
    const AttnQuery * step_queries_ = nullptr;
    int64_t           step_n_       = 0;
    cuda::AttnBatch   attn_;
    const AttnQuery * attn_queries_ = nullptr;  // the step's queries attn_ holds (nullptr: none)
    int64_t           attn_n_       = 0;
    int32_t           attn_bs_      = 0;
    std::vector<int32_t> flat_, table_row_, n_ctx_;
    FixedStep         fixed_;                   // graph steps' index buffers
    std::vector<cudaGraphExec_t> graphs_;       // by id (end_capture)
    bool              capturing_   = false;
    int64_t           n_captured_  = 0;
    unsigned long long * first_ = nullptr;  // find_nonfinite's result
    int64_t *         best_     = nullptr;
    int64_t           best_cap_ = 0;
};

}  // namespace

bool cuda_device_available(int32_t device_id, std::string * why) {
    int               n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        if (why) { *why = std::string("no CUDA device visible (") + (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") + ")"; }
        return false;
    }
    if (device_id < 0 || device_id >= n) {
        if (why) { *why = "CUDA device " + std::to_string(device_id) + " is not visible (" + std::to_string(n) + " devices)"; }
        return false;
    }
    return true;
}

int32_t cuda_device_count() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

MemInfo cuda_mem_info(int32_t device_id) {
    check(cudaSetDevice(device_id), "cudaSetDevice");
    size_t free_b = 0, total_b = 0;
    check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    return {static_cast<int64_t>(free_b), static_cast<int64_t>(total_b)};
}

std::unique_ptr<Backend> make_cuda_backend(int32_t device_id, int32_t n_host_threads, bool batch_invariant) {
    std::string why;
    if (!cuda_device_available(device_id, &why)) { fail(Errc::invalid_argument, "--device cuda: {}", why); }
    return std::make_unique<CudaBackend>(device_id, n_host_threads, batch_invariant);
}

}  // namespace fd::kernels
