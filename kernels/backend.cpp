// The backend factory and device queries: the one place that knows which backends this build has.
#include "fd/kernels/backend.h"

#include "fd/status.h"

#if FD_WITH_CUDA
#include "fd/kernels/cuda_backend.h"
#endif

#include <algorithm>
#include <cstddef>
#include <fstream>
#include <sstream>
#include <vector>

namespace fd::kernels {

const char * device_kind_name(DeviceKind kind) {
    switch (kind) {
    case DeviceKind::cpu: return "cpu";
    case DeviceKind::cuda: return "cuda";
    }
    return "?";
}

MemInfo host_mem_info() {
    std::ifstream in("/proc/meminfo");
    std::string   line;
    MemInfo       m;
    while (std::getline(in, line)) {
        std::istringstream ss(line);
        std::string        key;
        int64_t            kib = 0;
        ss >> key >> kib;
        if (key == "MemAvailable:") { m.free_bytes = kib * 1024; }
        if (key == "MemTotal:") { m.total_bytes = kib * 1024; }
    }
    return m;
}

bool device_available(DeviceKind kind, int32_t device_id, std::string * why) {
    switch (kind) {
    case DeviceKind::cpu: return true;
    case DeviceKind::cuda:
#if FD_WITH_CUDA
        return cuda_device_available(device_id, why);
#else
        (void)device_id;
        if (why) { *why = "this build has no CUDA backend (configure with a CUDA toolkit and FD_WITH_CUDA=ON)"; }
        return false;
#endif
    }
    if (why) { *why = "unknown device kind"; }
    return false;
}

int32_t device_count(DeviceKind kind) {
    if (kind == DeviceKind::cpu) { return 1; }
#if FD_WITH_CUDA
    return cuda_device_count();
#else
    return 0;
#endif
}

MemInfo device_mem_info(DeviceKind kind, int32_t device_id) {
    std::string why;
    if (!device_available(kind, device_id, &why)) { fail(Errc::invalid_argument, "--device {}: {}", device_kind_name(kind), why); }
#if FD_WITH_CUDA
    if (kind == DeviceKind::cuda) { return cuda_mem_info(device_id); }
#endif
    return host_mem_info();
}

void Backend::scale_add_rows(float * out, const float * y, const int32_t * rows, const float * scales, int64_t n, int64_t n_cols) {
    if (host_visible()) {
        for (int64_t i = 0; i < n; ++i) {
            float *       o = out + static_cast<int64_t>(rows[i]) * n_cols;
            const float * v = y + i * n_cols;
            const float   s = scales[i];
            for (int64_t c = 0; c < n_cols; ++c) {
                const float prod = s * v[c];
                o[c] += prod;
            }
        }
        return;
    }
    std::vector<float> o(static_cast<size_t>(n_cols)), v(static_cast<size_t>(n_cols));
    const int64_t row_bytes = n_cols * static_cast<int64_t>(sizeof(float));
    for (int64_t i = 0; i < n; ++i) {
        float * dst = out + static_cast<int64_t>(rows[i]) * n_cols;
        download(o.data(), dst, row_bytes);
        download(v.data(), y + i * n_cols, row_bytes);
        for (int64_t c = 0; c < n_cols; ++c) {
            const float prod = scales[i] * v[static_cast<size_t>(c)];
            o[static_cast<size_t>(c)] += prod;
        }
        upload(dst, o.data(), row_bytes);
    }
}

void Backend::moe_experts(float * out, const float * x, const MoePlan & plan, const ExpertWeights * experts, int64_t n_rows,
                          int64_t n_embd, int64_t n_ff, float * work) {
    const int64_t m_max = plan.max_rows;
    float * xe  = work;                     // [m, n_embd]    the group's rows of x
    float * gu  = xe + m_max * n_embd;      // [m, 2 * n_ff]  gate | up
    float * act = gu + m_max * 2 * n_ff;    // [m, n_ff]      silu(gate) * up
    float * ye  = act + m_max * n_ff;       // [m, n_embd]    the expert's output
    if (host_visible()) {
        std::fill(out, out + n_rows * n_embd, 0.0f);
    } else {
        const std::vector<float> zeros(static_cast<size_t>(n_rows * n_embd), 0.0f);
        upload(out, zeros.data(), n_rows * n_embd * static_cast<int64_t>(sizeof(float)));
    }
    for (size_t i = 0; i < plan.experts.size(); ++i) {
        const ExpertWeights & w    = experts[plan.experts[i]];
        const int64_t         b    = plan.begin[i], m = plan.begin[i + 1] - b;
        const int32_t *       rows = plan.rows.data() + b;
        gather_rows(xe, x, rows, m, n_embd);
        linear(gu, xe, w.gate_up, w.gate_up_type, nullptr, m, 2 * n_ff, n_embd);
        silu_mul(act, gu, m, n_ff);
        linear(ye, act, w.down, w.down_type, nullptr, m, n_embd, n_ff);
        scale_add_rows(out, ye, rows, plan.weights.data() + b, m, n_embd);
    }
}

const char * backend_op_name(BackendOp op) {
    switch (op) {
        case BackendOp::embedding: return "embedding";
        case BackendOp::linear: return "linear";
        case BackendOp::moe_experts: return "moe_experts";
        case BackendOp::rms_norm: return "rms_norm";
        case BackendOp::rope: return "rope";
        case BackendOp::silu_mul: return "silu_mul";
        case BackendOp::add: return "add";
        case BackendOp::copy_rows: return "copy_rows";
        case BackendOp::gather_rows: return "gather_rows";
        case BackendOp::kv_store: return "kv_store";
        case BackendOp::attention_paged: return "attention_paged";
        case BackendOp::scale_add_rows: return "scale_add_rows";
        case BackendOp::log_softmax_rows: return "log_softmax_rows";
        case BackendOp::argmax_rows: return "argmax_rows";
        case BackendOp::find_nonfinite: return "find_nonfinite";
        case BackendOp::graph_capture: return "graph_capture";
    }
    return "?";
}

bool Backend::supports(BackendOp op, fd::DType dtype) const {
    switch (op) {
        case BackendOp::embedding:
        case BackendOp::linear:
        case BackendOp::moe_experts: return dtype == fd::DType::f32 || dtype == fd::DType::bf16;
        case BackendOp::find_nonfinite: return true;
        case BackendOp::graph_capture: return supports_graphs();
        case BackendOp::rms_norm:
        case BackendOp::rope:
        case BackendOp::silu_mul:
        case BackendOp::add:
        case BackendOp::copy_rows:
        case BackendOp::gather_rows:
        case BackendOp::kv_store:
        case BackendOp::attention_paged:
        case BackendOp::scale_add_rows:
        case BackendOp::log_softmax_rows:
        case BackendOp::argmax_rows: return dtype == fd::DType::f32;
    }
    return false;
}

int64_t Backend::find_nonfinite(const void * p, fd::DType t, int64_t n) {
    const int64_t es = t == fd::DType::f32 ? 4 : 2, per = (int64_t{256} << 10) / es;
    std::vector<std::byte> host(static_cast<size_t>(std::min(per, std::max<int64_t>(n, 1)) * es));
    for (int64_t e = 0; e < n; e += per) {
        const int64_t m = std::min(per, n - e);
        download(host.data(), static_cast<const std::byte *>(p) + e * es, m * es);
        int64_t bad = -1;
        switch (t) {
        case fd::DType::f32: bad = find_nonfinite_f32(reinterpret_cast<const float *>(host.data()), m); break;
        case fd::DType::bf16: bad = find_nonfinite_bf16(reinterpret_cast<const uint16_t *>(host.data()), m); break;
        case fd::DType::f16: bad = find_nonfinite_f16(reinterpret_cast<const uint16_t *>(host.data()), m); break;
        }
        if (bad >= 0) { return e + bad; }
    }
    return -1;
}

void Backend::begin_capture() { fail(Errc::internal, "the {} backend has no graph capture", name()); }
int32_t Backend::end_capture() { fail(Errc::internal, "the {} backend has no graph capture", name()); }
void Backend::replay(int32_t id) { fail(Errc::internal, "the {} backend has no graph {} to replay", name(), id); }

const char * compute_type_name(ComputeType t) { return t == ComputeType::bf16 ? "bfloat16" : "float32"; }

ComputeType parse_compute_type(const std::string & name) {
    if (name == "float32" || name == "fp32" || name == "float") { return ComputeType::f32; }
    if (name == "bfloat16" || name == "bf16") { return ComputeType::bf16; }
    fail(Errc::invalid_argument, "--compute-dtype '{}' is not one of float32, bfloat16", name);
}

std::unique_ptr<Backend> make_backend(const BackendConfig & cfg) {
    switch (cfg.kind) {
    case DeviceKind::cpu: return make_cpu_backend(cfg.n_threads, cfg.compute);
    case DeviceKind::cuda:
        if (cfg.compute != ComputeType::f32) {
            fail(Errc::invalid_argument, "--compute-dtype {} runs on the cpu backend only; --device cuda computes in float32",
                 compute_type_name(cfg.compute));
        }
#if FD_WITH_CUDA
        return make_cuda_backend(cfg.device_id, cfg.n_threads, cfg.batch_invariant);
#else
        break;
#endif
    }
    fail(Errc::invalid_argument, "backend '{}' is not compiled into this build", device_kind_name(cfg.kind));
}

}  // namespace fd::kernels
