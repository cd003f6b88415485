// The CPU backend: kernels/cpu's ops on the backend's own thread pool, over host memory. The
// oracle every other backend is tested against; each method is the op the forward pass ran
// directly before the Backend seam (same calls, same arithmetic, bitwise the same results).
// The row-wise ops (embedding, rms_norm, rope, silu_mul, add, row copies, kv_store) run their
// kernel on contiguous ranges of rows spread over the pool once a call has enough work
// (for_rows): each row is still computed by the same single-row code, so the split never
// changes a result.
#include "fd/kernels/backend.h"
#include "fd/kernels/cpu_ops.h"
#include "fd/status.h"
#include "moe_experts.h"
#include "scratch.h"

#include <malloc.h>
#include <sys/mman.h>

#include <cerrno>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace fd::kernels {
namespace {

/// Calls below this many floats of work run on the caller alone (a hand-off costs ~1-2 us).
constexpr int64_t kParallelFloats = 16 << 10;
/// moe_experts: scratch floats per segment of the plan (64 MiB; at least one expert per segment).
constexpr int64_t kMoeScratchFloats = 16 << 20;

class CpuBackend final : public Backend {
public:
    CpuBackend(int32_t n_threads, ComputeType compute) : pool_(std::max(1, n_threads)), compute_(compute) {}

    const char * name() const override { return "cpu"; }
    ComputeType compute_type() const override { return compute_; }
    DeviceKind kind() const override { return DeviceKind::cpu; }
    bool host_visible() const override { return true; }
    ThreadPool * host_pool() override { return &pool_; }

    /// Buffers of 2 MiB or more (the step's activations at a prefill chunk: tens of MiB) are their
    /// own 2 MiB-aligned mapping advised MADV_HUGEPAGE, as the kernels' scratch (scratch.h): from
    /// malloc they were 4 KiB pages, and the first step that grew them took ~27k page faults on
    /// the 2-core guest (BF16 h512 model, 2,048-token steps; docs/benchmarks.md "Stop 42").
    void * alloc(int64_t bytes) override {
        if (bytes >= static_cast<int64_t>(detail::kHugePage)) {
            // 2 MiB-aligned start, 4 KiB-rounded length: the whole 2 MiB stretches get huge pages,
            // the tail keeps 4 KiB ones, so the memory held is what was asked (what a sleep counts).
            const size_t need  = (static_cast<size_t>(bytes) + 4095) / 4096 * 4096;
            void *       start = detail::map_huge_aligned(need);
            FD_CHECK(start != nullptr, "cpu backend: mapping {} bytes failed: {}", bytes, std::strerror(errno));
            const std::lock_guard<std::mutex> lock(mapped_mu_);
            mapped_.emplace(start, need);
            return start;
        }
        const size_t size = static_cast<size_t>(std::max<int64_t>(64, (bytes + 63) / 64 * 64));
        void * p = std::aligned_alloc(64, size);
        FD_CHECK(p != nullptr, "cpu backend: allocating {} bytes failed", bytes);
        return p;
    }
    void free(void * p) noexcept override {
        if (p == nullptr) { return; }
        {
            const std::lock_guard<std::mutex> lock(mapped_mu_);
            if (const auto it = mapped_.find(p); it != mapped_.end()) {
                munmap(p, it->second);
                mapped_.erase(it);
                return;
            }
        }
        std::free(p);
    }
    int64_t release_scratch() noexcept override {
        std::atomic<int64_t> bytes{0};
        try {
            pool_.on_each_thread([&] { bytes += detail::ThreadScratch::release_all(); });
        } catch (...) {  // (std::function's call cannot throw here; noexcept keeps the sleep path simple)
        }
        malloc_trim(0);  // the freed buffers and the activations' aligned_alloc blocks back to the OS, not kept in malloc's arenas
        return bytes.load();
    }
    void upload(void * dst, const void * src_host, int64_t bytes) override {
        std::memcpy(dst, src_host, static_cast<size_t>(bytes));
    }
    void download(void * dst_host, const void * src, int64_t bytes) override {
        std::memcpy(dst_host, src, static_cast<size_t>(bytes));
    }
    void copy(void * dst, const void * src, int64_t bytes) override { std::memcpy(dst, src, static_cast<size_t>(bytes)); }
    void synchronize() override {}
    MemInfo mem_info() override { return host_mem_info(); }

    void embedding(float * out, const void * table, WType ttype, const int32_t * tokens, int64_t n_tokens, int64_t n_embd,
                   int64_t vocab_begin, int64_t vocab_rows) override {
        for_rows(n_tokens, n_embd, 1, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) {
                float *       o  = out + t * n_embd;
                const int64_t id = tokens[t] - vocab_begin;
                if (id < 0 || id >= vocab_rows) {  // another rank's vocab row: it adds the embedding
                    std::fill_n(o, n_embd, 0.0f);
                } else if (ttype == WType::bf16) {
                    bf16_to_f32(o, static_cast<const uint16_t *>(table) + id * n_embd, n_embd);
                } else {
                    std::memcpy(o, static_cast<const float *>(table) + id * n_embd, sizeof(float) * n_embd);
                }
            }
        });
    }

    void linear(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
                int64_t n_out, int64_t n_in) override {
        if (compute_ == ComputeType::bf16) {
            kernels::linear_bf16(out, x, w, wtype, bias, n_rows, n_out, n_in, &pool_, isa_);
        } else {
            kernels::linear(out, x, w, wtype, bias, n_rows, n_out, n_in, &pool_);
        }
    }

    void rms_norm(float * out, const float * x, const float * weight, int64_t n_rows, int64_t n_embd,
                  float eps) override {
        for_rows(n_rows, n_embd, 1, [&](int64_t r0, int64_t r1) {
            kernels::rms_norm(out + r0 * n_embd, x + r0 * n_embd, weight, r1 - r0, n_embd, eps);
        });
    }

    void rope(float * x, const int32_t * positions, const float * cos_sin, int64_t n_tokens, int64_t n_heads,
              int64_t head_dim) override {
        const int64_t row = n_heads * head_dim;
        for_rows(n_tokens, row, 1, [&](int64_t t0, int64_t t1) {
            rope_rotate_half(x + t0 * row, positions + t0, cos_sin, t1 - t0, n_heads, head_dim);
        });
    }

    void silu_mul(float * out, const float * gate_up, int64_t n_rows, int64_t n_ff) override {
        // exp per element: ~8x the work of a copy per float.
        for_rows(n_rows, 8 * n_ff, 1, [&](int64_t r0, int64_t r1) {
            for (int64_t t = r0; t < r1; ++t) {
                kernels::silu_mul(out + t * n_ff, gate_up + t * 2 * n_ff, gate_up + t * 2 * n_ff + n_ff, n_ff);
            }
        });
    }

    void add(float * out, const float * x, int64_t n_elems) override {
        constexpr int64_t kSpan = 1024;  // "rows" of 4 KiB: chunks start on cache lines
        for_rows((n_elems + kSpan - 1) / kSpan, kSpan, 1, [&](int64_t r0, int64_t r1) {
            const int64_t e0 = r0 * kSpan, e1 = std::min(n_elems, r1 * kSpan);
            add_inplace(out + e0, x + e0, e1 - e0);
        });
    }

    void copy_rows(float * dst, int64_t dst_stride, const float * src, int64_t src_stride, int64_t n_rows,
                   int64_t n_cols) override {
        for_rows(n_rows, n_cols, 1, [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; ++r) {
                std::memcpy(dst + r * dst_stride, src + r * src_stride, sizeof(float) * n_cols);
            }
        });
    }

    void gather_rows(float * out, const float * x, const int32_t * rows, int64_t n_out_rows, int64_t n_cols) override {
        for_rows(n_out_rows, n_cols, 1, [&](int64_t r0, int64_t r1) {
            for (int64_t i = r0; i < r1; ++i) {
                std::memcpy(out + i * n_cols, x + static_cast<int64_t>(rows[i]) * n_cols, sizeof(float) * n_cols);
            }
        });
    }

    /// Backend::moe_experts' contract and bits, on the expert tiles (cpu/moe_experts.h): the
    /// plan a segment of experts at a time (the segment's pairs' scratch <= kMoeScratchFloats),
    /// each segment's outputs scatter-added in plan order by the same scale_add_rows as the
    /// per-expert loop (so out is bitwise that loop's, and EP's combine). --compute-dtype
    /// bfloat16 keeps the per-expert loop, whose linears are linear_bf16.
    void moe_experts(float * out, const float * x, const MoePlan & plan, const ExpertWeights * experts, int64_t n_rows,
                     int64_t n_embd, int64_t n_ff, float * work) override {
        if (compute_ == ComputeType::bf16) {
            Backend::moe_experts(out, x, plan, experts, n_rows, n_embd, n_ff, work);
            return;
        }
        std::fill(out, out + n_rows * n_embd, 0.0f);
        const int64_t per_pair = detail::moe_scratch_floats_per_pair(n_embd, n_ff) + n_embd;
        const int64_t cap      = std::max<int64_t>(1, kMoeScratchFloats / per_pair);
        thread_local detail::ScratchVec<float> ye;
        const int64_t n_used = static_cast<int64_t>(plan.experts.size());
        for (int64_t i0 = 0, i1; i0 < n_used; i0 = i1) {
            i1 = i0 + 1;  // at least one expert; then while the segment's pairs fit the cap
            while (i1 < n_used && plan.begin[i1 + 1] - plan.begin[i0] <= cap) { ++i1; }
            const int64_t b = plan.begin[i0], n = plan.begin[i1] - b;
            ye.resize(static_cast<size_t>(n * n_embd));
            detail::moe_expert_outputs(ye.data(), x, plan, i0, i1, experts, n_embd, n_ff, &pool_);
            scale_add_rows(out, ye.data(), plan.rows.data() + b, plan.weights.data() + b, n, n_embd);
        }
    }

    void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots, int64_t n_tokens) override {
        // Ranges of whole blocks' worth of tokens: a prefill's consecutive tokens share each
        // block's transposed-K lines, so (when the first starts a block) two threads never
        // write the same line.
        const int64_t row = static_cast<int64_t>(kv.n_kv_heads) * kv.head_dim;
        for_rows(n_tokens, 2 * row, kv.block_size, [&](int64_t t0, int64_t t1) {
            kernels::kv_store(kv, k_new + t0 * row, v_new + t0 * row, slots + t0, t1 - t0);
        });
    }

    void attention_paged(float * out, const float * q, const AttnQuery * queries, int64_t n_tokens, int64_t n_heads,
                         PagedKv kv, float scale) override {
        kernels::attention_paged(out, q, queries, n_tokens, n_heads, kv, scale, &pool_);
    }

    void log_softmax_rows(float * out, const float * x, int64_t n_rows, int64_t n) override {
        for_rows(n_rows, 8 * n, 1, [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; ++r) { log_softmax(out + r * n, x + r * n, n); }
        });
    }

    void argmax_rows(int64_t * out_host, const float * x, int64_t n_rows, int64_t n) override {
        for_rows(n_rows, n, 1, [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; ++r) { out_host[r] = argmax(x + r * n, n); }
        });
    }

private:
    /// fn(r0, r1) over contiguous ranges covering [0, n_rows), on the pool when the call has
    /// kParallelFloats of work (row_work floats per row) and more than one thread: about 4
    /// ranges per thread (claimed dynamically, so a thread that starts late takes fewer),
    /// each a multiple of `align` rows.
    template <typename Fn>
    void for_rows(int64_t n_rows, int64_t row_work, int64_t align, Fn && fn) {
        const int64_t nt = pool_.n_threads();
        if (nt == 1 || n_rows < 2 * align || n_rows * row_work < kParallelFloats) {
            if (n_rows > 0) { fn(int64_t{0}, n_rows); }
            return;
        }
        const int64_t per_min = std::max<int64_t>(align, (kParallelFloats / 4 + row_work - 1) / row_work);
        int64_t       per     = std::max(per_min, (n_rows + 4 * nt - 1) / (4 * nt));
        per = (per + align - 1) / align * align;
        const int64_t n_ranges = (n_rows + per - 1) / per;
        pool_.parallel_for(n_ranges, [&](int64_t i) { fn(i * per, std::min(n_rows, (i + 1) * per)); });
    }

    ThreadPool  pool_;
    ComputeType compute_;
    Bf16Isa     isa_ = bf16_best_isa();
    std::mutex                               mapped_mu_;
    std::unordered_map<void *, size_t>       mapped_;  ///< alloc's own mappings (start → bytes)
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int32_t n_threads, ComputeType compute) {
    if (n_threads < 1) { fail(Errc::invalid_argument, "the cpu backend needs at least 1 thread (got {})", n_threads); }
    return std::make_unique<CpuBackend>(n_threads, compute);
}

}  // namespace fd::kernels
