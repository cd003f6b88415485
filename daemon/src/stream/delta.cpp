// Delta (sparse) tensors of a weight stream: `(indices, values)` against a named base version,
// applied to a copy of the base's tensor in the staging dir (fd/stream/weight_stream.h). The
// result is byte for byte the tensor a full stream of the same weights stages, so the commit
// (every rank loading its shard: rows/columns split, q/k/v and gate/up fused) is the same path
// and a delta update stays all-or-nothing.
#include "stream_io.h"

#include "fd/kernels/ops.h"

#include <algorithm>
#include <cstring>

namespace fd::stream {

int64_t TensorSpec::numel() const {
    int64_t n = 1;
    for (const int64_t d : shape) { n *= d; }
    return n;
}

int64_t TensorSpec::full_nbytes() const { return numel() * model::dtype_size(dtype); }

int32_t parse_index_dtype_name(const std::string & s, const std::string & what) {
    const std::string n = s.rfind("torch.", 0) == 0 ? s.substr(6) : s;
    if (n == "I64" || n == "int64" || n == "long") { return 8; }
    if (n == "I32" || n == "int32" || n == "int") { return 4; }
    throw Error(Errc::invalid_argument, fmt::format("{}: index dtype '{}' is not one of I64, I32 (or int64, int32)", what, s), "deltas");
}

namespace {

template <class Index>
void check_indices(const TensorSpec & s, const Index * idx) {
    const int64_t numel = s.numel();
    int64_t prev = -1;
    for (int64_t i = 0; i < s.n_indices; ++i) {
        const int64_t v = static_cast<int64_t>(idx[i]);
        if (v < 0 || v >= numel) {
            fail(Errc::invalid_argument, "tensor '{}': delta index {} (at position {}) is outside [0, {}) (flat element indices into the "
                                         "HF tensor {}); nothing was applied", s.name, v, i, numel, nlohmann::json(s.shape).dump());
        }
        if (v <= prev) {
            fail(Errc::invalid_argument, "tensor '{}': delta indices must be sorted and unique; index {} at position {} follows {}; nothing "
                                         "was applied", s.name, v, i, prev);
        }
        prev = v;
    }
}

int64_t first_nonfinite(model::DType dtype, const std::byte * p, int64_t n) {
    switch (dtype) {
        case model::DType::f32: return kernels::find_nonfinite_f32(reinterpret_cast<const float *>(p), n);
        case model::DType::bf16: return kernels::find_nonfinite_bf16(reinterpret_cast<const uint16_t *>(p), n);
        case model::DType::f16: return kernels::find_nonfinite_f16(reinterpret_cast<const uint16_t *>(p), n);
    }
    return -1;
}

template <class Index, class Elem>
void scatter(const Index * idx, const std::byte * values, int64_t n, std::byte * dst) {
    Elem * out = reinterpret_cast<Elem *>(dst);
    for (int64_t i = 0; i < n; ++i) {
        Elem v;
        std::memcpy(&v, values + i * static_cast<int64_t>(sizeof(Elem)), sizeof(Elem));
        out[idx[i]] = v;
    }
}

template <class Index>
void apply_with(const TensorSpec & s, const std::byte * payload, std::byte * dst) {
    // The payload is a frame's bytes at any alignment: copy the indices out before reading them.
    std::vector<Index> idx(static_cast<size_t>(s.n_indices));
    std::memcpy(idx.data(), payload, idx.size() * sizeof(Index));
    check_indices(s, idx.data());
    const std::byte * values = payload + s.n_indices * static_cast<int64_t>(sizeof(Index));
    if (model::dtype_size(s.dtype) == 4) {
        scatter<Index, uint32_t>(idx.data(), values, s.n_indices, dst);
    } else {
        scatter<Index, uint16_t>(idx.data(), values, s.n_indices, dst);
    }
}

}  // namespace

void check_delta(const TensorSpec & s, std::vector<std::byte> & wire, std::vector<int64_t> & indices, std::vector<std::byte> & values) {
    FD_CHECK(s.is_delta() && (s.index_bytes == 4 || s.index_bytes == 8) && static_cast<int64_t>(wire.size()) == s.nbytes,
             "check_delta takes a delta spec and its wire bytes");
    const int64_t ib = s.n_indices * s.index_bytes;
    if (const int64_t bad = first_nonfinite(s.dtype, wire.data() + ib, s.n_indices); bad >= 0) {
        fail(Errc::invalid_checkpoint, "tensor '{}': delta value {} (of {}) is non-finite (NaN or Inf); nothing was applied", s.name, bad,
             s.n_indices);
    }
    indices.resize(static_cast<size_t>(s.n_indices));
    // Widen and check in one pass; the indices sit at the start of the vector's (aligned) storage.
    int64_t * out = indices.data();
    const int64_t n = s.n_indices;
    bool increasing = true;  // strictly, pairwise: then the first and the last bound the range
    if (s.index_bytes == 8) {
        std::memcpy(out, wire.data(), static_cast<size_t>(ib));
        for (int64_t i = 1; i < n; ++i) { increasing &= out[i] > out[i - 1]; }
    } else {
        const auto * i32 = reinterpret_cast<const int32_t *>(wire.data());
        if (n > 0) { out[0] = i32[0]; }
        for (int64_t i = 1; i < n; ++i) {
            out[i] = i32[i];
            increasing &= i32[i] > i32[i - 1];
        }
    }
    if (!increasing || (n > 0 && (out[0] < 0 || out[n - 1] >= s.numel()))) { check_indices(s, out); }  // throws naming the position
    std::memmove(wire.data(), wire.data() + ib, static_cast<size_t>(s.nbytes - ib));
    wire.resize(static_cast<size_t>(s.nbytes - ib));
    values = std::move(wire);
    wire   = {};
}

void apply_delta(const TensorSpec & s, const std::byte * payload, std::byte * dst) {
    FD_CHECK(s.is_delta() && (s.index_bytes == 4 || s.index_bytes == 8), "apply_delta takes a delta spec");
    const std::byte * values = payload + s.n_indices * s.index_bytes;
    if (const int64_t bad = first_nonfinite(s.dtype, values, s.n_indices); bad >= 0) {
        fail(Errc::invalid_checkpoint, "tensor '{}': delta value {} (of {}) is non-finite (NaN or Inf); nothing was applied", s.name, bad,
             s.n_indices);
    }
    if (s.index_bytes == 8) {
        apply_with<int64_t>(s, payload, dst);
    } else {
        apply_with<int32_t>(s, payload, dst);
    }
}

}  // namespace fd::stream
