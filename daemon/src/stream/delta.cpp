// Delta (sparse) tensors of a weight stream: `(indices, values)` against a named base version.
// check_delta_bytes checks a delta's received bytes where they lie (they are then appended to the
// update's weights.fddelta as they are, which every rank maps and splits at the commit);
// apply_delta scatters a delta into a copy of its tensor (the reference the unit tests hold the
// checks to). A non-finite check at any alignment (first_nonfinite).
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

int64_t first_nonfinite_aligned(model::DType dtype, const std::byte * p, int64_t n) {
    switch (dtype) {
        case model::DType::f32: return kernels::find_nonfinite_f32(reinterpret_cast<const float *>(p), n);
        case model::DType::bf16: return kernels::find_nonfinite_bf16(reinterpret_cast<const uint16_t *>(p), n);
        case model::DType::f16: return kernels::find_nonfinite_f16(reinterpret_cast<const uint16_t *>(p), n);
    }
    return -1;
}

}  // namespace

int64_t first_nonfinite(model::DType dtype, const std::byte * p, int64_t n) {
    const int64_t es = model::dtype_size(dtype);
    if (reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(es) == 0) { return first_nonfinite_aligned(dtype, p, n); }
    // Values at an odd address (a delta file's tensors lie back to back): checked from an aligned copy, a block at a time.
    alignas(64) std::byte block[16384];
    const int64_t per = static_cast<int64_t>(sizeof block) / es;
    for (int64_t at = 0; at < n; at += per) {
        const int64_t k = std::min(per, n - at);
        std::memcpy(block, p + at * es, static_cast<size_t>(k * es));
        if (const int64_t bad = first_nonfinite_aligned(dtype, block, k); bad >= 0) { return at + bad; }
    }
    return -1;
}

namespace {

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

void check_delta_bytes(const TensorSpec & s, const std::byte * payload) {
    FD_CHECK(s.is_delta() && (s.index_bytes == 4 || s.index_bytes == 8), "check_delta_bytes takes a delta spec");
    const int64_t n = s.n_indices, ib = n * s.index_bytes;
    if (const int64_t bad = first_nonfinite(s.dtype, payload + ib, n); bad >= 0) {
        fail(Errc::invalid_checkpoint, "tensor '{}': delta value {} (of {}) is non-finite (NaN or Inf); nothing was applied", s.name, bad, n);
    }
    // Strictly increasing pairwise, then the first and the last bound the range (one pass, in place).
    bool increasing = true;
    int64_t first = 0, last = 0;
    auto scan = [&]<class Index>(Index) {
        Index prev = 0, v = 0;
        for (int64_t i = 0; i < n; ++i) {
            std::memcpy(&v, payload + sizeof(Index) * i, sizeof(Index));
            increasing &= i == 0 || v > prev;
            prev = v;
            if (i == 0) { first = v; }
        }
        last = prev;
    };
    if (s.index_bytes == 4) {
        scan(int32_t{});
    } else {
        scan(int64_t{});
    }
    if (!increasing || (n > 0 && (first < 0 || last >= s.numel()))) {  // the slow path names the position
        std::vector<int64_t> idx(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
            if (s.index_bytes == 4) {
                int32_t v;
                std::memcpy(&v, payload + 4 * i, 4);
                idx[static_cast<size_t>(i)] = v;
            } else {
                std::memcpy(&idx[static_cast<size_t>(i)], payload + 8 * i, 8);
            }
        }
        check_indices(s, idx.data());  // throws
    }
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
