// The CPU backend: kernels/cpu's ops on the backend's own thread pool, over host memory. The
// oracle every other backend is tested against; each method is the op the forward pass ran
// directly before the Backend seam (same calls, same arithmetic, bitwise the same results).
#include "fd/kernels/backend.h"
#include "fd/kernels/cpu_ops.h"
#include "fd/status.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace fd::kernels {
namespace {

class CpuBackend final : public Backend {
public:
    explicit CpuBackend(int32_t n_threads) : pool_(std::max(1, n_threads)) {}

    const char * name() const override { return "cpu"; }
    DeviceKind kind() const override { return DeviceKind::cpu; }
    bool host_visible() const override { return true; }
    ThreadPool * host_pool() override { return &pool_; }

    void * alloc(int64_t bytes) override {
        const size_t size = static_cast<size_t>(std::max<int64_t>(64, (bytes + 63) / 64 * 64));
        void * p = std::aligned_alloc(64, size);
        FD_CHECK(p != nullptr, "cpu backend: allocating {} bytes failed", bytes);
        return p;
    }
    void free(void * p) noexcept override { std::free(p); }
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
        for (int64_t t = 0; t < n_tokens; ++t) {
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
    }

    void linear(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
                int64_t n_out, int64_t n_in) override {
        kernels::linear(out, x, w, wtype, bias, n_rows, n_out, n_in, &pool_);
    }

    void rms_norm(float * out, const float * x, const float * weight, int64_t n_rows, int64_t n_embd,
                  float eps) override {
        kernels::rms_norm(out, x, weight, n_rows, n_embd, eps);
    }

    void rope(float * x, const int32_t * positions, const float * cos_sin, int64_t n_tokens, int64_t n_heads,
              int64_t head_dim) override {
        rope_rotate_half(x, positions, cos_sin, n_tokens, n_heads, head_dim);
    }

    void silu_mul(float * out, const float * gate_up, int64_t n_rows, int64_t n_ff) override {
        for (int64_t t = 0; t < n_rows; ++t) {
            kernels::silu_mul(out + t * n_ff, gate_up + t * 2 * n_ff, gate_up + t * 2 * n_ff + n_ff, n_ff);
        }
    }

    void add(float * out, const float * x, int64_t n_elems) override { add_inplace(out, x, n_elems); }

    void copy_rows(float * dst, int64_t dst_stride, const float * src, int64_t src_stride, int64_t n_rows,
                   int64_t n_cols) override {
        for (int64_t r = 0; r < n_rows; ++r) {
            std::memcpy(dst + r * dst_stride, src + r * src_stride, sizeof(float) * n_cols);
        }
    }

    void gather_rows(float * out, const float * x, const int32_t * rows, int64_t n_out_rows, int64_t n_cols) override {
        for (int64_t i = 0; i < n_out_rows; ++i) {
            std::memcpy(out + i * n_cols, x + static_cast<int64_t>(rows[i]) * n_cols, sizeof(float) * n_cols);
        }
    }

    void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots, int64_t n_tokens) override {
        kernels::kv_store(kv, k_new, v_new, slots, n_tokens);
    }

    void attention_paged(float * out, const float * q, const AttnQuery * queries, int64_t n_tokens, int64_t n_heads,
                         PagedKv kv, float scale) override {
        kernels::attention_paged(out, q, queries, n_tokens, n_heads, kv, scale, &pool_);
    }

    void log_softmax_rows(float * out, const float * x, int64_t n_rows, int64_t n) override {
        for (int64_t r = 0; r < n_rows; ++r) { log_softmax(out + r * n, x + r * n, n); }
    }

    void argmax_rows(int64_t * out_host, const float * x, int64_t n_rows, int64_t n) override {
        for (int64_t r = 0; r < n_rows; ++r) { out_host[r] = argmax(x + r * n, n); }
    }

private:
    ThreadPool pool_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int32_t n_threads) {
    if (n_threads < 1) { fail(Errc::invalid_argument, "the cpu backend needs at least 1 thread (got {})", n_threads); }
    return std::make_unique<CpuBackend>(n_threads);
}

}  // namespace fd::kernels
